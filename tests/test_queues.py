"""Local queue disciplines against their formulas (docs/algorithm.md §4 and §7), on hand-built
tickets. Estimates come from the latency model directly, not from the queue's Estimator."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from hexgen_flow.cluster import Cluster, parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.estimate import REPRESENTATIVE_TOKENS, Estimator
from hexgen_flow.latency import latency_model
from hexgen_flow.policies.base import LocalQueue
from hexgen_flow.policies.queues import (
    FcfsQueue,
    LeastLaxityQueue,
    QlmQueue,
    ShortestJobFirstQueue,
    UrgencyQueue,
    VirtualTokenCounterQueue,
)
from hexgen_flow.runtime import CallTicket, ClusterLoad, PolicyContext, QueryRun
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow

MODEL = "llama-3.1-70b"
GPUS = ("A100", "A100", "A6000", "L40S")
CLUSTER: Cluster = parse_cluster(",".join(GPUS))

BIG = LLMCall("generate_candidate", 11748, 678)
REVISE = LLMCall("revise", 5963, 79)
SMALL = LLMCall("information_retriever", 308, 5)
EVAL = LLMCall("evaluate", 961, 22)
KEYWORDS = LLMCall("extract_keywords", 667, 45)
TESTER = LLMCall("unit_tester", 275, 4)


def _ctx() -> PolicyContext:
    return PolicyContext(CLUSTER, Estimator(CLUSTER), ClusterLoad(CLUSTER), random.Random(0))


def _single(gpu: str, call: LLMCall) -> float:
    return latency_model(MODEL, gpu).single_s(call.input_tokens, call.output_tokens)


def _step(gpu: str, call: LLMCall) -> float:
    """t_g(s): single-request latency at the step's representative tokens."""
    return latency_model(MODEL, gpu).single_s(*REPRESENTATIVE_TOKENS[call.step])


def _mean_single(call: LLMCall) -> float:
    return sum(_single(g, call) for g in GPUS) / len(GPUS)


def _ticket(
    seq: int,
    call: LLMCall,
    released_s: float = 0.0,
    deadline_s: float = 100.0,
    *,
    run: QueryRun | None = None,
    stage: int = 0,
    client: int | None = None,
    tenant: str = "default",
    query_deadline_s: float | None = None,
) -> CallTicket:
    if run is None:
        query = Query(f"q{seq}", Workflow.chain([(call,)]), tenant=tenant)
        slo = (query_deadline_s if query_deadline_s is not None else deadline_s) - released_s
        run = QueryRun(query, seq if client is None else client, released_s, slo)
    return CallTicket(seq, run, stage, call, released_s, deadline_s)


def _drain(queue: LocalQueue, now: float) -> list[int]:
    out = []
    while len(queue):
        head = queue.peek(now)
        t = queue.pop(now)
        assert t is head
        queue.on_admit(t, now)
        out.append(t.seq)
    return out


def _fill(queue: LocalQueue, tickets: Sequence[CallTicket]) -> None:
    for t in tickets:
        queue.push(t, t.released_s)


# --------------------------------------------------------------------------- fcfs


def test_fcfs_admits_in_release_order() -> None:
    queue = FcfsQueue(_ctx(), 0)
    tickets = [
        _ticket(i, c, released_s=i, deadline_s=50 - 10 * i)
        for i, c in enumerate([BIG, SMALL, REVISE, EVAL])
    ]
    _fill(queue, tickets)
    assert queue.remove(tickets[1])
    assert _drain(queue, 10.0) == [0, 2, 3]


# --------------------------------------------------------------------------- urgency


def _urgency(t: CallTicket, now: float, gpu: str, *, per_call: bool = False) -> float:
    """docs/algorithm.md §4.3: U = (now − a_r) + t_g(i)(s_r) − SLO_stage, SLO_stage = d − a_r."""
    estimate = _single(gpu, t.call) if per_call else _step(gpu, t.call)
    slo_stage = t.deadline_s - t.released_s
    return (now - t.released_s) + estimate - slo_stage


def _by_urgency(
    tickets: Sequence[CallTicket], now: float, gpu: str, per_call: bool = False
) -> list[int]:
    """Largest U first, ties on release order."""
    ranked = sorted(tickets, key=lambda t: (-_urgency(t, now, gpu, per_call=per_call), t.seq))
    return [t.seq for t in ranked]


URGENCY_TICKETS = [
    # (call, released a_r, stage budget SLO_stage)
    (REVISE, 0.0, 30.0),
    (BIG, 5.0, 24.0),
    (TESTER, 10.0, 8.0),
    (EVAL, 2.0, 25.0),
    (KEYWORDS, 12.0, 14.0),
    (BIG, 1.0, 70.0),
]


def _urgency_tickets() -> list[CallTicket]:
    return [_ticket(i, call, a, a + budget) for i, (call, a, budget) in enumerate(URGENCY_TICKETS)]


@pytest.mark.parametrize("instance", [0, 2, 3])
def test_urgency_admits_largest_u_first(instance: int) -> None:
    gpu = GPUS[instance]
    tickets = _urgency_tickets()
    queue = UrgencyQueue(_ctx(), instance)
    _fill(queue, tickets)
    now = 20.0
    expected = _by_urgency(tickets, now, gpu)
    assert _drain(queue, now) == expected
    # The order is neither release order nor earliest stage deadline first: the estimate
    # on this instance matters.
    assert expected != sorted(expected)
    edf = [t.seq for t in sorted(tickets, key=lambda t: (t.deadline_s, t.seq))]
    assert expected != edf


def test_urgency_is_recomputed_at_every_scheduling_point() -> None:
    """Pushes and pops interleaved at a moving clock: each pop is the waiting call with the
    largest U at that moment."""
    rng = random.Random(4)
    calls = [BIG, REVISE, TESTER, EVAL, KEYWORDS, SMALL]
    queue = UrgencyQueue(_ctx(), 3)
    waiting: list[CallTicket] = []
    now = 0.0
    for seq in range(40):
        now += rng.uniform(0, 2)
        t = _ticket(seq, rng.choice(calls), now, now + rng.uniform(5, 80))
        queue.push(t, now)
        waiting.append(t)
        if seq % 3 == 2:
            now += rng.uniform(0, 5)
            expected = _by_urgency(waiting, now, "L40S")[0]
            assert queue.pop(now).seq == expected
            waiting = [w for w in waiting if w.seq != expected]
    assert _drain(queue, now + 1) == _by_urgency(waiting, now + 1, "L40S")


def test_urgency_with_per_call_estimates_uses_the_calls_tokens() -> None:
    # Two revise calls: same step, very different sizes. Per step they tie on t_g(s) and
    # the earlier deadline wins; per call the long one is more urgent.
    long = LLMCall("revise", 30000, 900)
    short = LLMCall("revise", 500, 10)
    tickets = [_ticket(0, short, 0.0, 40.0), _ticket(1, long, 0.0, 45.0)]
    step_queue = UrgencyQueue(_ctx(), 0)
    call_queue = UrgencyQueue(_ctx(), 0, estimate="call")
    _fill(step_queue, tickets)
    _fill(call_queue, tickets)
    assert _drain(step_queue, 5.0) == _by_urgency(tickets, 5.0, "A100") == [0, 1]
    assert _drain(call_queue, 5.0) == _by_urgency(tickets, 5.0, "A100", per_call=True) == [1, 0]


# --------------------------------------------------------------------------- llf


def test_llf_orders_by_query_laxity_over_the_longest_remaining_path() -> None:
    """Laxity = query deadline − now − (own estimate + cluster-mean longest path after)."""
    now = 10.0
    # A: first stage of a chain with heavy stages after it.
    qa = Query("A", Workflow.chain([(REVISE,), (BIG,), (EVAL,)]))
    # B: the last stage of its query, earliest deadline.
    qb = Query("B", Workflow.chain([(SMALL,), (REVISE,)]))
    # C: a fan-out after the ticket's stage: its slowest call counts.
    qc = Query("C", Workflow.chain([(SMALL,), (REVISE, BIG), (EVAL,)]))
    # D: a diamond after the ticket's stage: the longer branch counts, not both.
    qd = Query(
        "D",
        Workflow(
            (
                Stage("information_retriever", (SMALL,)),
                Stage("generate_candidate", (BIG,), (0,)),
                Stage("revise", (REVISE,), (0,)),
                Stage("evaluate", (EVAL,), (1, 2)),
            )
        ),
    )
    runs = [
        QueryRun(qa, 0, 0.0, 110.0),
        QueryRun(qb, 1, 0.0, 60.0),
        QueryRun(qc, 2, 0.0, 105.0),
        QueryRun(qd, 3, 0.0, 100.0),
    ]
    after = [
        _mean_single(BIG) + _mean_single(EVAL),
        0.0,
        max(_mean_single(REVISE), _mean_single(BIG)) + _mean_single(EVAL),
        max(_mean_single(BIG), _mean_single(REVISE)) + _mean_single(EVAL),
    ]
    own_calls = [REVISE, REVISE, SMALL, SMALL]
    stages = [0, 1, 0, 0]
    tickets = [
        _ticket(i, own_calls[i], 0.0, 1000.0, run=runs[i], stage=stages[i]) for i in range(4)
    ]
    # The driver (GlobalScheduler.release) sets the remaining path; the scheduler's own
    # test checks that it is the longest path, here the queue must order by it.
    for ticket, rest in zip(tickets, after, strict=True):
        ticket.remaining_after_s = rest
    for gpu_index in (0, 2):
        gpu = GPUS[gpu_index]
        laxity = [
            runs[i].deadline_s - now - (_single(gpu, own_calls[i]) + after[i]) for i in range(4)
        ]
        expected = sorted(range(4), key=lambda i: (laxity[i], i))
        queue = LeastLaxityQueue(_ctx(), gpu_index)
        _fill(queue, list(reversed(tickets)))
        assert _drain(queue, now) == expected
        assert expected != [0, 1, 2, 3]
    # Summing both diamond branches instead of the longer one would make D the least lax.
    assert runs[3].deadline_s - (_mean_single(BIG) + _mean_single(REVISE)) < 70


# --------------------------------------------------------------------------- sjf


def test_sjf_admits_the_shortest_estimated_call_first() -> None:
    calls = [BIG, REVISE, SMALL, EVAL, KEYWORDS, LLMCall("evaluate", 961, 22)]
    tickets = [_ticket(i, c, released_s=i) for i, c in enumerate(calls)]
    queue = ShortestJobFirstQueue(_ctx(), 2)
    _fill(queue, tickets)
    expected = sorted(range(len(calls)), key=lambda i: (_single("A6000", calls[i]), i))
    assert _drain(queue, 10.0) == expected == [2, 3, 5, 4, 1, 0]


# --------------------------------------------------------------------------- vtc


def test_vtc_charges_input_plus_twice_output_at_pop() -> None:
    """Clients A and B each pop one call; the smaller counter goes next. A's call costs
    100 + 2×10 = 120, B's 108 + 2×5 = 118, so B goes next; charging input + output (110 vs
    113) would pick A instead."""
    a1, a2 = _ticket(0, LLMCall("revise", 100, 10), client=0), _ticket(2, SMALL, client=0)
    b1, b2 = _ticket(1, LLMCall("revise", 108, 5), client=1), _ticket(3, SMALL, client=1)
    queue = VirtualTokenCounterQueue(_ctx(), 0)
    _fill(queue, [a1, b1, a2, b2])
    assert _drain(queue, 0.0) == [0, 1, 3, 2]
    plain = VirtualTokenCounterQueue(_ctx(), 0, output_weight=1.0)
    _fill(plain, [a1, b1, a2, b2])
    assert _drain(plain, 0.0) == [0, 1, 2, 3]


def test_vtc_is_fifo_within_a_client_and_fair_across_clients() -> None:
    cost = LLMCall("revise", 100, 10)  # 120 per call
    cheap = LLMCall("revise", 10, 1)  # 12 per call
    # Client 0's calls: an expensive one first, then cheap ones; client 1: all cheap.
    tickets = [
        _ticket(0, cost, client=0),
        _ticket(1, cheap, client=0),
        _ticket(2, cheap, client=0),
        _ticket(3, cheap, client=1),
        _ticket(4, cheap, client=1),
        _ticket(5, cheap, client=1),
    ]
    queue = VirtualTokenCounterQueue(_ctx(), 0)
    _fill(queue, tickets)
    # 0 (A=120); then B pops until it passes 120: 3 (12), 4 (24), 5 (36); then A's FIFO.
    assert _drain(queue, 0.0) == [0, 3, 4, 5, 1, 2]


def test_vtc_lifts_a_newly_active_client_to_the_smallest_active_counter() -> None:
    call = LLMCall("revise", 100, 10)  # 120 per call
    queue = VirtualTokenCounterQueue(_ctx(), 0)
    for seq in range(6):
        queue.push(_ticket(seq, call, client=1), 0.0)  # B: b1..b6
    assert [queue.pop(0.0).seq for _ in range(4)] == [0, 1, 2, 3]  # B's counter: 480
    for seq in (6, 7, 8):
        queue.push(_ticket(seq, call, client=0), 1.0)  # A arrives with counter 0
    # A is lifted to 480: b5 (counter tie, older head), a1, b6 (tie at 600), a2, a3.
    # Without the lift A's three calls (0, 120, 240 < 480) would all go first.
    assert _drain(queue, 1.0) == [4, 6, 5, 7, 8]


def test_vtc_returning_client_earns_no_credit_for_idling() -> None:
    call = LLMCall("revise", 100, 10)  # 120 per call
    queue = VirtualTokenCounterQueue(_ctx(), 0)
    queue.push(_ticket(0, call, client=0), 0.0)
    assert queue.pop(0.0).seq == 0  # A: 120, then idle
    for seq in range(1, 7):
        queue.push(_ticket(seq, call, client=1), 1.0)
    assert [queue.pop(1.0).seq for _ in range(4)] == [1, 2, 3, 4]  # B: 480
    queue.push(_ticket(7, call, client=0), 2.0)
    queue.push(_ticket(8, call, client=0), 2.0)
    # A returns at max(120, 480) = 480: it alternates with B instead of catching up.
    assert _drain(queue, 2.0) == [5, 7, 6, 8]


def test_vtc_keeps_a_client_counter_above_the_floor() -> None:
    """Lifting never lowers a counter: a client that spent more than the others stays
    behind them when it returns."""
    big = LLMCall("revise", 1000, 100)  # 1200
    small = LLMCall("revise", 100, 10)  # 120
    queue = VirtualTokenCounterQueue(_ctx(), 0)
    queue.push(_ticket(0, big, client=0), 0.0)
    assert queue.pop(0.0).seq == 0  # A: 1200
    for seq in (1, 2, 3):
        queue.push(_ticket(seq, small, client=1), 1.0)
    queue.push(_ticket(4, small, client=0), 1.0)  # A returns with 1200 > B's 0
    assert _drain(queue, 1.0) == [1, 2, 3, 4]


def test_vtc_per_tenant_clients_share_one_counter() -> None:
    call = LLMCall("revise", 100, 10)
    # Three queries of tenant x, one query of tenant y, in release order x, x, x, y.
    tickets = [_ticket(i, call, tenant="x") for i in range(3)]
    tickets.append(_ticket(3, call, tenant="y"))
    per_query = VirtualTokenCounterQueue(_ctx(), 0)
    per_tenant = VirtualTokenCounterQueue(_ctx(), 0, client="tenant")
    _fill(per_query, tickets)
    _fill(per_tenant, tickets)
    assert _drain(per_query, 0.0) == [0, 1, 2, 3]  # four clients at 0: release order
    assert _drain(per_tenant, 0.0) == [0, 3, 1, 2]  # x pays for its first call, y goes


def test_vtc_rejects_unknown_client() -> None:
    with pytest.raises(ConfigError, match="client"):
        VirtualTokenCounterQueue(_ctx(), 0, client="user")


# --------------------------------------------------------------------------- qlm


def test_qlm_serves_in_arrival_order_while_on_time_and_edf_when_late() -> None:
    # Query deadlines 95 s (group 9), 35 s (group 3, the most urgent: ends at 40 s), 200 s.
    tickets = [
        _ticket(0, BIG, query_deadline_s=95.0),
        _ticket(1, BIG, query_deadline_s=35.0),
        _ticket(2, BIG, query_deadline_s=200.0),
    ]
    wait = 3 * _single("A100", BIG) / 8.0  # summed estimates / parallelism
    on_time = 40.0 - wait - 0.5
    late = 40.0 - wait + 0.5
    queue = QlmQueue(_ctx(), 0)
    _fill(queue, tickets)
    head = queue.peek(on_time)
    assert head is not None and head.seq == 0
    head = queue.peek(late)
    assert head is not None and head.seq == 1
    # After the urgent call leaves, the wait (2 calls) fits group 9's time left again.
    assert _drain(queue, late) == [1, 0, 2]


def test_qlm_edf_is_over_groups_and_fifo_inside_a_group() -> None:
    # At now = 100 every group with a deadline before 100 s is late: EDF mode.
    tickets = [
        _ticket(0, SMALL, query_deadline_s=38.0),  # group 3
        _ticket(1, SMALL, query_deadline_s=31.0),  # group 3
        _ticket(2, SMALL, query_deadline_s=25.0),  # group 2
        _ticket(3, SMALL, query_deadline_s=500.0),  # group 50
    ]
    queue = QlmQueue(_ctx(), 0)
    _fill(queue, tickets)
    assert _drain(queue, 100.0) == [2, 0, 1, 3]  # per-call EDF would be [2, 1, 0, 3]
    narrow = QlmQueue(_ctx(), 0, bucket_s=5.0)  # 38 -> group 7, 31 -> group 6
    _fill(narrow, tickets)
    assert _drain(narrow, 100.0) == [2, 1, 0, 3]
    fcfs = QlmQueue(_ctx(), 0)
    _fill(fcfs, tickets)
    assert _drain(fcfs, 0.0) == [0, 1, 2, 3]  # all on time


def test_qlm_waiting_time_shrinks_when_calls_are_removed() -> None:
    tickets = [
        _ticket(0, BIG, query_deadline_s=95.0),
        _ticket(1, BIG, query_deadline_s=35.0),
        _ticket(2, BIG, query_deadline_s=200.0),
    ]
    queue = QlmQueue(_ctx(), 0)
    _fill(queue, tickets)
    now = 40.0 - 2.5 * _single("A100", BIG) / 8.0  # between the 2-call and 3-call waits
    head = queue.peek(now)
    assert head is not None and head.seq == 1  # three calls queued: late
    assert queue.remove(tickets[2])
    head = queue.peek(now)
    assert head is not None and head.seq == 0  # two calls queued: on time


@pytest.mark.parametrize("params", [{"bucket_s": 0.0}, {"parallelism": -1.0}])
def test_qlm_rejects_non_positive_settings(params: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        QlmQueue(_ctx(), 0, **params)
