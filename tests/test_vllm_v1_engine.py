"""The vllm-v1 engine model (vLLM V1's scheduler, step by step), driven by hand, and the
engine-model registry through the simulator and the real ``hexgen-flow simulate``."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from cli_runner import one_error_line, run_cli, run_json
from hexgen_flow.cluster import Cluster, InstanceSpec, parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.latency import latency_model
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.prefix import DEFAULT_PREFIX_SHARE
from hexgen_flow.runtime import CallTicket, QueryRun
from hexgen_flow.sim.engine import BatchingEngineModel
from hexgen_flow.sim.engines import ENGINE_MODELS, check_engine_model, create_engine_model
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.sim.vllm_v1 import (
    BLOCK_SIZE,
    VllmV1EngineModel,
    default_max_num_batched_tokens,
)
from hexgen_flow.traces import load_traces, take_queries
from hexgen_flow.workload import LLMCall, Query, Workflow

REVISE = LLMCall("revise", 5963, 79)
CANDIDATE = LLMCall("generate_candidate", 11748, 678)
EVALUATE = LLMCall("evaluate", 961, 22)
ONE_TOKEN = LLMCall("evaluate", 961, 1)
"""A call whose prefill's step samples its only output token: no decode step at all."""


def _spec(gpu: str = "A100", calibration: str = "aiconfigurator", **overrides: int) -> InstanceSpec:
    return Cluster.build([{"gpu": gpu, **overrides}], gpu, calibration=calibration).instances[0]


_seq = itertools.count()


def _ticket(call: LLMCall, released_s: float = 0.0, query: str | None = None) -> CallTicket:
    seq = next(_seq)
    q = Query(query or f"q{seq}", Workflow.chain([(call,)]))
    run = QueryRun(q, seq, arrival_s=released_s, slo_s=1000.0)
    return CallTicket(seq, run, 0, call, released_s, deadline_s=released_s + 1000.0)


def _drain(engine: VllmV1EngineModel, until: float = math.inf) -> list[CallTicket]:
    """Advance from event to event up to `until` (or idle); the finished tickets in order."""
    done: list[CallTicket] = []
    for _ in range(1_000_000):
        t = engine.next_event_s()
        if t > until or t == math.inf:
            return done
        done.extend(engine.advance(t))
    raise AssertionError("engine never went idle")


def _finished(ticket: CallTicket) -> float:
    assert ticket.finished_s is not None, ticket
    return ticket.finished_s


def _prefill_s(spec: InstanceSpec, call: LLMCall, start: int, end: int) -> float:
    """What the model charges for prefill tokens [start, end) of `call`: the call's own
    prefill, spread along the calibration's prefill curve."""
    lat = spec.latency
    scale = lat.split(call.input_tokens, call.output_tokens)[0] / lat.prefill_curve_s(
        call.input_tokens
    )
    before = lat.prefill_curve_s(start) if start else 0.0
    if end == 0:  # the curve's intercept: the fixed part of the step that starts the prompt
        return scale * lat.prefill_curve_s(0)
    return scale * (lat.prefill_curve_s(end) - before)


# ----------------------------------------------------------------------- one call alone


@pytest.mark.parametrize("call", [REVISE, CANDIDATE, EVALUATE, ONE_TOKEN])
def test_a_call_alone_takes_its_prefill_then_one_fitted_step_per_further_token(
    call: LLMCall,
) -> None:
    spec = _spec()
    engine = VllmV1EngineModel(spec)
    assert engine.max_num_batched_tokens == 2048  # vLLM's server default on an A100
    ticket = _ticket(call, 5.0)
    engine.admit(ticket, 5.0)
    events = []
    while math.isfinite(t := engine.next_event_s()):
        events.append(t)
        engine.advance(t)
    prefill, decode = spec.latency.split(call.input_tokens, call.output_tokens)
    # The chunks of the prompt add up to the calibration's prefill exactly: the step that
    # completes it (and samples the first output token) ends at 5 + prefill.
    assert 5.0 + prefill in [pytest.approx(t, abs=1e-9) for t in events]
    # Then one decode step per further output token, at the fitted step time for a batch
    # of one whose KV read grows by a token per step.
    fit = engine.step_fit
    steps = sum(fit.step_s(1, call.input_tokens + k + 1) for k in range(call.output_tokens - 1))
    assert ticket.finished_s == pytest.approx(5.0 + prefill + steps, abs=1e-9)
    # Against the calibration's single-request latency: the same prefill, and decode steps
    # within the plane's own fitted error of the calibration's (its largest over the grid).
    assert steps == pytest.approx(decode, rel=fit.max_rel_error)
    assert _finished(ticket) - 5.0 == pytest.approx(prefill + decode, rel=fit.max_rel_error)
    assert (engine.running, engine.kv_used) == (0, 0)


def test_the_token_budget_follows_vllms_server_defaults() -> None:
    assert default_max_num_batched_tokens(_spec("A100")) == 2048  # vLLM special-cases A100
    assert default_max_num_batched_tokens(_spec("L40S")) == 2048  # 48 GiB
    assert default_max_num_batched_tokens(_spec("H100")) == 8192  # 80 GiB, not an A100
    assert default_max_num_batched_tokens(_spec("A100", max_batch=4096)) == 4096
    with pytest.raises(ConfigError, match="max_num_seqs"):
        VllmV1EngineModel(_spec(), max_num_batched_tokens=128)


# ----------------------------------------------------------------------- chunked prefill


def test_a_long_prompt_is_chunked_between_the_running_decodes() -> None:
    spec = _spec()
    engine = VllmV1EngineModel(spec)
    fit = engine.step_fit
    short = LLMCall("information_retriever", 300, 4)
    a, b = _ticket(short), _ticket(CANDIDATE)
    engine.admit(a, 0.0)
    prefill_a = spec.latency.split(300, 4)[0]
    assert _drain(engine, until=prefill_a) == []  # a's prefill is done, a is decoding
    engine.admit(b, prefill_a + 1e-6)  # during a's first decode step
    done = _drain(engine)
    assert done == [a, b]
    # a's three decode steps: the first alone, the next two each carrying a 2047-token chunk
    # of b's prompt (the 2048-token budget less a's decode): a finishes long before b's
    # prompt is through, where a prefill-first engine would pause a for all of it. The step
    # that starts b's prompt pays one fixed cost (the larger of b's prefill intercept and
    # the decode plane's), not both.
    chunk = engine.max_num_batched_tokens - 1
    intercept_b = _prefill_s(spec, CANDIDATE, 0, 0)
    assert intercept_b > 0 and fit.a_s > 0
    expected = (
        prefill_a
        + fit.step_s(1, 301)
        + fit.step_s(1, 302)
        - fit.a_s
        + max(intercept_b, fit.a_s)
        + _prefill_s(spec, CANDIDATE, 0, chunk)
        - intercept_b
        + fit.step_s(1, 303)
        + _prefill_s(spec, CANDIDATE, chunk, 2 * chunk)
    )
    assert a.finished_s == pytest.approx(expected, abs=1e-9)
    prefill_b = spec.latency.split(CANDIDATE.input_tokens, CANDIDATE.output_tokens)[0]
    assert _finished(a) < prefill_a + prefill_b < _finished(b)


def test_prompts_that_join_one_step_pay_its_fixed_cost_once() -> None:
    # Two short prompts admitted together into an idle engine share one step: the step
    # costs the larger intercept plus each prompt's marginal tokens, not two intercepts.
    spec = _spec()
    engine = VllmV1EngineModel(spec)
    short = LLMCall("extract_keywords", 400, 1)
    a, b = _ticket(short), _ticket(short)
    engine.admit(a, 0.0)
    engine.admit(b, 0.0)
    assert _drain(engine) == [a, b]
    intercept = _prefill_s(spec, short, 0, 0)
    marginal = _prefill_s(spec, short, 0, 400) - intercept
    assert intercept > 0 and marginal > 0
    assert _finished(b) == pytest.approx(intercept + 2 * marginal, abs=1e-9)
    assert _finished(b) < 2 * spec.latency.split(400, 1)[0]


# ----------------------------------------------------------------------- preemption


def test_a_kv_starved_instance_preempts_and_the_preempted_call_still_finishes() -> None:
    spec = _spec(kv_cache_tokens=3000)  # 188 blocks: two 1000 + 900-token calls cannot both fit
    engine = VllmV1EngineModel(spec, coalesce=False)  # every step observable
    call = LLMCall("revise", 1000, 900)
    first, last = _ticket(call), _ticket(call)
    assert engine.fits(first)
    engine.admit(first, 0.0)
    assert engine.fits(last)  # only its first chunk must fit: blocks come on demand
    engine.admit(last, 0.0)
    seen: list[tuple[int, int]] = []
    done: list[CallTicket] = []
    while math.isfinite(t := engine.next_event_s()):
        assert engine.kv_used <= engine.kv_capacity + BLOCK_SIZE
        progress = engine.progress(last)
        if progress is not None:
            seen.append(progress)
        done.extend(engine.advance(t))
    assert engine.preemptions >= 1
    assert done == [first, last]  # the call that started last was the one preempted
    # It lost its KV cache mid-decode and recomputed its prompt plus what it had generated.
    dropped = next(i for i, (kv, gen) in enumerate(seen) if kv == 0 and gen > 0)
    generated = seen[dropped][1]
    assert any(kv >= call.input_tokens + generated for kv, _ in seen[dropped:])
    # Before it was reported, it had generated its whole output.
    assert seen[-1][1] == call.output_tokens
    roomy = VllmV1EngineModel(_spec())
    again = _ticket(call)
    roomy.admit(_ticket(call), 0.0)
    roomy.admit(again, 0.0)
    _drain(roomy)
    assert roomy.preemptions == 0
    assert _finished(last) > _finished(again)  # the recompute cost it time


def test_a_call_starts_only_when_its_whole_prompt_fits_unless_told_otherwise() -> None:
    spec = _spec(kv_cache_tokens=6000)  # 375 blocks
    for full, admitted in ((True, False), (False, True)):
        engine = VllmV1EngineModel(spec, admit_full_prompt=full)
        running, big = _ticket(LLMCall("revise", 2000, 10)), _ticket(LLMCall("revise", 4500, 10))
        engine.admit(running, 0.0)
        # 250 blocks left beside the first call's 125: the 4500-token prompt needs 282, its
        # first 2048-token chunk 128 (vLLM before scheduler_reserve_full_isl).
        assert engine.fits(big) is admitted
        engine.admit(big, 0.0)
        engine.next_event_s()  # plans the first step
        assert engine.progress(big) == ((2048 - 2000 if admitted else 0), 0)
        assert _drain(engine) == [running, big]


def test_aborting_frees_the_blocks_and_reports_nothing() -> None:
    engine = VllmV1EngineModel(_spec())
    a, b = _ticket(REVISE), _ticket(REVISE)
    engine.admit(a, 0.0)
    engine.admit(b, 0.0)
    _drain(engine, until=1.0)
    assert engine.kv_used > 0
    assert engine.abort(a, 1.0) and not engine.abort(a, 1.0)
    assert _drain(engine) == [b]
    assert (engine.running, engine.kv_used) == (0, 0)


# ----------------------------------------------------------------------- coalescing


def _random_calls(n: int, seed: int, queries: int) -> list[tuple[float, CallTicket]]:
    calls = [
        c
        for q in take_queries(load_traces(["trace1"]), None)
        for stage in q.workflow.stages
        for c in stage.calls
    ]
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(2.0)
        out.append((t, _ticket(rng.choice(calls), t, f"query{rng.randrange(queries)}")))
    return out


def _replay(engine: VllmV1EngineModel, seed: int) -> dict[int, float]:
    """Random arrivals (and some aborts) into `engine`; the finish time of every call that
    finished, by its position in the arrivals."""
    arrivals = _random_calls(250, seed, queries=6)
    rng = random.Random(seed + 1)
    aborts = sorted((t + rng.uniform(0, 20), k) for t, k in arrivals if rng.random() < 0.2)
    index = {k.seq: n for n, (_, k) in enumerate(arrivals)}
    finished: dict[int, float] = {}
    i = j = 0
    while True:
        times = (
            engine.next_event_s(),
            arrivals[i][0] if i < len(arrivals) else math.inf,
            aborts[j][0] if j < len(aborts) else math.inf,
        )
        now = min(times)
        if now == math.inf:
            return finished
        if times[0] == now:
            finished.update((index[k.seq], now) for k in engine.advance(now))
        elif times[1] == now:
            engine.admit(arrivals[i][1], now)
            i += 1
        else:
            engine.abort(aborts[j][1], now)
            j += 1


@pytest.mark.parametrize(("caching", "full"), [(False, True), (True, True), (False, False)])
def test_coalesced_steps_agree_with_stepping_one_by_one(caching: bool, full: bool) -> None:
    spec = _spec("L40S", kv_cache_tokens=30_000)  # starved: preemptions and evictions
    for seed in range(3):
        options = {"enable_prefix_caching": caching, "admit_full_prompt": full}
        fast = VllmV1EngineModel(spec, **options)
        slow = VllmV1EngineModel(spec, coalesce=False, **options)
        a, b = _replay(fast, seed), _replay(slow, seed)
        assert a.keys() == b.keys() and len(a) > 150
        assert max(abs(a[k] - b[k]) for k in a) < 1e-6
        assert fast.preemptions == slow.preemptions > 0
        assert fast.running == fast.kv_used == 0


# ----------------------------------------------------------------------- the step fit


@pytest.mark.parametrize("calibration", ["aiconfigurator", "chess-measured"])
def test_the_decode_step_fit_stays_close_to_the_latency_model(calibration: str) -> None:
    lat = latency_model("llama-3.1-70b", "A100", calibration=calibration)
    fit = lat.decode_step_fit(256, lat.kv_capacity_tokens)
    assert min(fit.a_s, fit.b_s, fit.c_s) >= 0 and fit.points > 100
    assert fit.max_rel_error < 0.08 and fit.rms_rel_error < 0.03
    # Recomputed here on the grid's corners and a few points off it.
    errors = [
        fit.step_s(b, b * n) / lat.decode_step_s(b, n) - 1
        for b in (1, 7, 40, 200, 256)
        for n in (128, 1000, 1900)
    ]
    assert max(abs(e) for e in errors) < 0.08
    # Larger batches and contexts cost more per step, as the latency model says.
    assert fit.step_s(256, 256 * 2000) > fit.step_s(1, 2000) > 0


# ----------------------------------------------------------------------- prefix caching


def test_prefix_caching_shortens_a_later_call_of_the_same_query_and_step() -> None:
    spec = _spec()
    call = LLMCall("revise", 6000, 10)
    latencies = {}
    for caching in (False, True):
        engine = VllmV1EngineModel(spec, enable_prefix_caching=caching)
        first, same, other = (
            _ticket(call, 0.0, "q"),
            _ticket(call, 10.0, "q"),
            _ticket(LLMCall("evaluate", 6000, 10), 20.0, "q"),
        )
        for t, ticket in ((0.0, first), (10.0, same), (20.0, other)):
            _drain(engine, until=t)
            engine.admit(ticket, t)
        _drain(engine)
        latencies[caching] = [_finished(k) - k.released_s for k in (first, same, other)]
    plain, cached = latencies[False], latencies[True]
    assert plain[0] == pytest.approx(plain[1]) == pytest.approx(cached[0])
    # The second call of the step starts with the cached full blocks of 75 % of its prompt:
    # it saves their compute, not the fixed cost of the step that starts it.
    hit = int(DEFAULT_PREFIX_SHARE * 6000) // BLOCK_SIZE * BLOCK_SIZE
    saved = _prefill_s(spec, call, 0, hit) - _prefill_s(spec, call, 0, 0)
    assert saved > 0.1
    assert cached[1] == pytest.approx(plain[1] - saved, abs=1e-9)
    # Another step type of the same query shares nothing.
    assert cached[2] == pytest.approx(plain[2])


# ----------------------------------------------------------------------- registry


def test_the_registry_names_both_models_and_refuses_others() -> None:
    spec = _spec()
    assert isinstance(create_engine_model("prefill-first", spec), BatchingEngineModel)
    assert isinstance(create_engine_model("vllm-v1", spec), VllmV1EngineModel)
    assert set(ENGINE_MODELS) == {"prefill-first", "vllm-v1"}
    with pytest.raises(
        ConfigError, match=r"unknown engine model 'vllm'; known: prefill-first, vllm-v1"
    ):
        check_engine_model("vllm")
    with pytest.raises(ConfigError, match="unknown engine model"):
        SimConfig(qps=1.0, engine="sglang")
    with pytest.raises(ConfigError, match="no prefix cache"):
        SimConfig(qps=1.0, engine="prefill-first", prefix_caching=True)
    assert SimConfig(qps=1.0).engine == "vllm-v1"  # the default
    assert SimConfig(qps=1.0).prefix_caching is True  # vLLM V1's default, made explicit
    assert SimConfig(qps=1.0, engine="prefill-first").prefix_caching is False


def test_the_simulator_runs_every_query_to_the_end_on_either_model() -> None:
    queries = take_queries(load_traces(["trace1"]), 40)
    cluster = parse_cluster("A100,L40S", calibration="aiconfigurator")
    preset = resolve_policy("hexgen-flow").with_alpha(0.5)
    p95 = {}
    for engine in ENGINE_MODELS:
        sim = Simulation(queries, cluster, preset, SimConfig(qps=1.0, engine=engine))
        metrics = sim.run()
        again = Simulation(queries, cluster, preset, SimConfig(qps=1.0, engine=engine)).run()
        assert metrics.completed == 40 and sim.calls_done == sum(
            q.workflow.num_calls for q in queries
        )
        assert metrics.latency_summary() == again.latency_summary()  # deterministic
        assert all(e.running == 0 for e in sim.engines)
        p95[engine] = metrics.latency_summary()["p95"]
    assert p95["prefill-first"] != p95["vllm-v1"]


# ----------------------------------------------------------------------- the command line


def test_simulate_runs_the_vllm_v1_engine_model() -> None:
    args = ("simulate", "--trace", "trace1", "--num-queries", "30", "--alpha", "0.5")
    doc = run_json(*args, "--engine", "vllm-v1", "--cluster", "A100,L40S")
    assert doc["engine"] == "vllm-v1" and doc["prefix_caching"] is True  # vLLM V1's default
    assert doc["completed"] == 30 and isinstance(doc["preemptions"], int)
    assert doc == run_json(*args, "--cluster", "A100,L40S")  # the default
    off = run_json(*args, "--cluster", "A100,L40S", "--no-prefix-caching")
    assert off["prefix_caching"] is False and off["latency_s"] != doc["latency_s"]
    base = run_json(*args, "--engine", "prefill-first", "--cluster", "A100,L40S")
    assert base["engine"] == "prefill-first" and base["preemptions"] == 0
    assert base["prefix_caching"] is False  # it has no prefix cache
    assert doc["latency_s"] != base["latency_s"]
    line = one_error_line(run_cli("simulate", "--engine", "vllm"))
    assert "unknown engine model 'vllm'; known: prefill-first, vllm-v1" in line
