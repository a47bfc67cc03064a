"""The continuous-batching engine model of one instance, driven by hand."""

from __future__ import annotations

import itertools
import math

import pytest

from hexgen_flow.cluster import Cluster, InstanceSpec
from hexgen_flow.runtime import CallTicket, QueryRun
from hexgen_flow.sim.engine import BatchingEngineModel
from hexgen_flow.workload import LLMCall, Query, Workflow

REVISE = LLMCall("revise", 5963, 79)
CANDIDATE = LLMCall("generate_candidate", 11748, 678)
SHORT = LLMCall("evaluate", 961, 22)


def _spec(gpu: str = "A100", **overrides: int) -> InstanceSpec:
    return Cluster.build([{"gpu": gpu, **overrides}], gpu).instances[0]


class _Tickets:
    """Makes tickets of one-stage queries with increasing release order."""

    def __init__(self) -> None:
        self._seq = itertools.count()

    def __call__(self, call: LLMCall, released_s: float = 0.0) -> CallTicket:
        seq = next(self._seq)
        query = Query(f"q{seq}", Workflow.chain([(call,)]))
        run = QueryRun(query, seq, arrival_s=released_s, slo_s=100.0)
        return CallTicket(seq, run, 0, call, released_s, deadline_s=released_s + 100.0)


def _drain(engine: BatchingEngineModel) -> list[CallTicket]:
    """Advance from event to event until idle; the finished tickets in finishing order."""
    done: list[CallTicket] = []
    for _ in range(100):
        t = engine.next_event_s()
        if math.isinf(t):
            return done
        done.extend(engine.advance(t))
    raise AssertionError("engine never went idle")


def test_single_call_alone_takes_exactly_prefill_plus_decode() -> None:
    spec = _spec()
    engine = BatchingEngineModel(spec)
    prefill, decode = spec.latency.split(REVISE.input_tokens, REVISE.output_tokens)
    assert prefill > 0 and decode > 0
    ticket = _Tickets()(REVISE, released_s=5.0)
    assert engine.fits(ticket)
    engine.admit(ticket, 5.0)
    assert ticket.admitted_s == 5.0
    assert engine.running == 1
    assert engine.kv_used == REVISE.input_tokens + REVISE.output_tokens
    # First event: the prefill is done; nothing finishes yet.
    assert engine.next_event_s() == pytest.approx(5.0 + prefill, rel=1e-12)
    assert engine.advance(engine.next_event_s()) == []
    # Halfway through the decode nothing finishes either.
    assert engine.advance(5.0 + prefill + decode / 2) == []
    assert ticket.finished_s is None
    end = engine.next_event_s()
    assert end == pytest.approx(5.0 + prefill + decode, rel=1e-12)
    assert engine.advance(end) == [ticket]
    assert ticket.finished_s == end
    # Alone, the call takes its single-request latency.
    assert end - 5.0 == pytest.approx(spec.latency.single_s(5963, 79), rel=1e-12)
    assert (engine.running, engine.kv_used) == (0, 0)
    assert math.isinf(engine.next_event_s())


def test_two_calls_admitted_together_prefill_serially_then_decode_slower() -> None:
    spec = _spec()
    engine = BatchingEngineModel(spec)
    make = _Tickets()
    a, b = make(REVISE), make(REVISE)
    prefill, decode = spec.latency.split(REVISE.input_tokens, REVISE.output_tokens)
    engine.admit(a, 0.0)
    engine.admit(b, 0.0)
    # Both prefills back to back before any decoding.
    assert engine.next_event_s() == pytest.approx(2 * prefill, rel=1e-12)
    done = _drain(engine)
    assert done == [a, b]  # equal calls finish together, in release order
    s2 = spec.latency.slowdown(2)
    assert s2 > 1
    for t in (a, b):
        assert t.finished_s == pytest.approx(2 * prefill + decode * s2, rel=1e-9)
    # Batching costs each call time compared with running alone.
    assert a.finished_s is not None and a.finished_s > prefill + decode


def test_two_different_calls_share_the_batch_until_the_shorter_one_ends() -> None:
    spec = _spec("L40S")
    engine = BatchingEngineModel(spec)
    make = _Tickets()
    long, short = make(CANDIDATE), make(SHORT)
    pl, dl = spec.latency.split(CANDIDATE.input_tokens, CANDIDATE.output_tokens)
    ps, ds = spec.latency.split(SHORT.input_tokens, SHORT.output_tokens)
    assert ds < dl
    engine.admit(long, 1.0)
    engine.admit(short, 1.0)
    done = _drain(engine)
    assert done == [short, long]
    start = 1.0 + pl + ps
    s2 = spec.latency.slowdown(2)
    t_short = start + ds * s2
    assert short.finished_s == pytest.approx(t_short, rel=1e-9)
    # After the short one leaves, the long one decodes alone (slowdown 1).
    assert long.finished_s == pytest.approx(t_short + (dl - ds), rel=1e-9)


def test_call_admitted_during_a_prefill_waits_for_the_backlog() -> None:
    spec = _spec()
    engine = BatchingEngineModel(spec)
    make = _Tickets()
    a, b = make(REVISE), make(REVISE, released_s=0.1)
    prefill, decode = spec.latency.split(REVISE.input_tokens, REVISE.output_tokens)
    assert prefill > 0.1
    engine.admit(a, 0.0)
    engine.admit(b, 0.1)  # a is still prefilling: b's prefill starts when a's ends
    assert engine.next_event_s() == pytest.approx(2 * prefill, rel=1e-12)
    _drain(engine)
    expected = 2 * prefill + decode * spec.latency.slowdown(2)
    assert a.finished_s == pytest.approx(expected, rel=1e-9)
    assert b.finished_s == pytest.approx(expected, rel=1e-9)


def test_prefill_of_a_new_call_pauses_a_running_decode() -> None:
    spec = _spec()
    engine = BatchingEngineModel(spec)
    make = _Tickets()
    a, b = make(REVISE), make(REVISE)
    prefill, decode = spec.latency.split(REVISE.input_tokens, REVISE.output_tokens)
    engine.admit(a, 0.0)
    t1 = prefill + 0.5 * decode  # a is halfway through its decode
    assert engine.advance(t1) == []
    engine.admit(b, t1)
    # a's decode is paused: the next change is b's prefill ending, not a finishing.
    assert engine.next_event_s() == pytest.approx(t1 + prefill, rel=1e-12)
    assert engine.advance(t1 + 0.5 * prefill) == []  # looking mid-prefill changes nothing
    assert engine.next_event_s() == pytest.approx(t1 + prefill, rel=1e-12)
    assert engine.advance(t1 + prefill) == []
    assert a.finished_s is None
    done = _drain(engine)
    assert done == [a, b]
    s2 = spec.latency.slowdown(2)
    t_a = t1 + prefill + 0.5 * decode * s2  # a's remaining half, in a batch of two
    assert a.finished_s == pytest.approx(t_a, rel=1e-9)
    assert b.finished_s == pytest.approx(t_a + 0.5 * decode, rel=1e-9)  # then b alone
    # Without b, a would have finished at prefill + decode.
    assert t_a > prefill + decode


def test_admission_respects_the_kv_cache() -> None:
    per_call = REVISE.input_tokens + REVISE.output_tokens
    spec = _spec(kv_cache_tokens=2 * per_call + 100)
    engine = BatchingEngineModel(spec)
    make = _Tickets()
    a, b, c = make(REVISE), make(REVISE), make(REVISE)
    assert engine.fits(a)
    engine.admit(a, 0.0)
    assert engine.fits(b)
    engine.admit(b, 0.0)
    assert engine.kv_used == 2 * per_call
    assert not engine.fits(c)  # 3 x per_call > capacity
    # A call using exactly the remaining slots still fits; one token more does not, and the
    # reservation counts output tokens too.
    assert engine.fits(make(LLMCall("evaluate", 90, 10)))
    assert not engine.fits(make(LLMCall("evaluate", 90, 11)))
    assert not engine.fits(make(LLMCall("evaluate", 10, 91)))
    _drain(engine)
    assert engine.kv_used == 0 and engine.running == 0
    assert engine.fits(c)


def test_call_larger_than_the_cache_never_fits() -> None:
    spec = _spec(kv_cache_tokens=1000)
    engine = BatchingEngineModel(spec)
    assert not engine.fits(_Tickets()(REVISE))
    assert engine.fits(_Tickets()(LLMCall("evaluate", 900, 100)))


def test_admission_respects_max_batch() -> None:
    spec = _spec(max_batch=2)
    engine = BatchingEngineModel(spec)
    make = _Tickets()
    tickets = [make(SHORT) for _ in range(3)]
    engine.admit(tickets[0], 0.0)
    engine.admit(tickets[1], 0.0)
    assert engine.running == 2
    assert not engine.fits(tickets[2])
    first: list[CallTicket] = []
    while not first:
        first = engine.advance(engine.next_event_s())
    assert engine.running == 2 - len(first)
    assert engine.fits(tickets[2])


def test_larger_batches_finish_later() -> None:
    spec = _spec()
    finish = []
    for n in (1, 2, 4, 8):
        engine = BatchingEngineModel(spec)
        make = _Tickets()
        tickets = [make(SHORT) for _ in range(n)]
        for t in tickets:
            engine.admit(t, 0.0)
        _drain(engine)
        assert [t.finished_s for t in tickets] == sorted(t.finished_s or 0.0 for t in tickets)
        finish.append(max(t.finished_s or 0.0 for t in tickets))
    assert finish == sorted(finish) and finish[-1] > finish[0]


def test_abort_frees_the_slot_and_the_rest_of_the_batch_speeds_up() -> None:
    spec = _spec()
    make = _Tickets()
    engine = BatchingEngineModel(spec)
    keep, drop = make(REVISE), make(REVISE)
    engine.admit(keep, 0.0)
    engine.admit(drop, 0.0)
    prefill, decode = spec.latency.split(REVISE.input_tokens, REVISE.output_tokens)
    joined = 2 * prefill  # both prefills drain, then both decode together
    assert engine.next_event_s() == pytest.approx(joined, rel=1e-12)
    assert engine.advance(joined) == []
    halfway = joined + decode * spec.latency.slowdown(2) / 2
    assert engine.abort(drop, halfway)
    assert engine.running == 1
    assert engine.kv_used == REVISE.input_tokens + REVISE.output_tokens
    assert not engine.abort(drop, halfway)  # gone already
    # The half of `keep`'s decode still to run goes at batch-1 speed now.
    assert engine.next_event_s() == pytest.approx(halfway + decode / 2, rel=1e-9)
    assert _drain(engine) == [keep]


def test_abort_of_a_call_waiting_for_its_prefill() -> None:
    spec = _spec()
    make = _Tickets()
    engine = BatchingEngineModel(spec)
    first, second = make(REVISE), make(SHORT)
    engine.admit(first, 0.0)
    engine.admit(second, 0.0)
    assert engine.abort(second, 0.0)
    assert engine.running == 1 and engine.kv_used == REVISE.input_tokens + REVISE.output_tokens
    assert _drain(engine) == [first]
