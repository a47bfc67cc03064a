"""The contract every registered policy keeps, run over the registries (docs/algorithm.md
§11: a conformance test parametrised over the registries gives every policy the contract
tests for free). A new policy registered in `hexgen_flow.policies.registration` is picked
up here without editing this file.

- queues: `peek(now)` is what `pop(now)` removes; the order is total and stable (ties on
  `seq`, independent of the order of pushes); `len` tracks push/pop/remove; `remove` of an
  unknown ticket is False and a removed ticket is never popped;
- dispatchers: always an instance whose KV cache can hold the call; same seed, same choices;
- budgets: finite deadlines between the release time and the query's deadline;
- registries: unknown names and parameters fail listing the valid ones.
"""

from __future__ import annotations

import inspect
import math
import random
import re
from collections.abc import Sequence
from typing import Any

import pytest

from hexgen_flow.cluster import Cluster, parse_cluster
from hexgen_flow.errors import ConfigError, UnknownNameError
from hexgen_flow.estimate import Estimator
from hexgen_flow.policies.base import Dispatcher, LocalQueue, StageBudget
from hexgen_flow.policies.registration import BUDGETS, DISPATCHERS, QUEUES
from hexgen_flow.policies.registry import Registry
from hexgen_flow.runtime import CallTicket, ClusterLoad, PolicyContext, QueryRun
from hexgen_flow.traces import load_trace
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow

CLUSTER = "A100,A100,A6000,L40S"
SMALL_KV = 5_000
"""KV-cache slots of the deliberately small instance: holds short calls, not candidates."""
BIG = LLMCall("generate_candidate", 11748, 678)
SMALL = LLMCall("information_retriever", 308, 5)

# FCFS admits in push order by construction (tickets reach one instance in release order),
# so pushing out of seq order is outside its contract.
PUSH_IN_SEQ_ORDER_ONLY = {"fcfs"}


def _ctx(cluster: Cluster, seed: int = 0) -> PolicyContext:
    return PolicyContext(cluster, Estimator(cluster), ClusterLoad(cluster), random.Random(seed))


def _trace_tickets(n_queries: int = 6, per_query: int = 3, seed: int = 11) -> list[CallTicket]:
    """Tickets of the first trace1 queries: varied steps, releases, deadlines and clients.

    Ticket seq follows the list order, which interleaves the queries."""
    rng = random.Random(seed)
    queries = load_trace("trace1")[:n_queries]
    runs = [
        QueryRun(q, i, arrival_s=rng.uniform(0, 50), slo_s=rng.uniform(60, 300))
        for i, q in enumerate(queries)
    ]
    picks: list[tuple[QueryRun, int, LLMCall]] = []
    for run in runs:
        stages = run.query.workflow.stages
        for k in sorted(rng.sample(range(len(stages)), per_query)):
            picks.append((run, k, stages[k].calls[-1]))
    rng.shuffle(picks)
    tickets = []
    for seq, (run, k, call) in enumerate(picks):
        released = run.arrival_s + rng.uniform(0, 20)
        tickets.append(CallTicket(seq, run, k, call, released, released + rng.uniform(1, 120)))
    return tickets


def _one_per_query(tickets: Sequence[CallTicket]) -> list[CallTicket]:
    seen: set[int] = set()
    out = []
    for t in tickets:
        if t.query_seq not in seen:
            seen.add(t.query_seq)
            out.append(t)
    return out


def _drain(queue: LocalQueue, now: float) -> list[CallTicket]:
    out = []
    while len(queue):
        head = queue.peek(now)
        popped = queue.pop(now)
        assert head is popped
        out.append(popped)
    assert queue.peek(now) is None
    return out


def _queue(name: str, cluster: Cluster | None = None, instance: int = 2) -> LocalQueue:
    cluster = cluster or parse_cluster(CLUSTER)
    return QUEUES.create(name, _ctx(cluster), instance)


# --------------------------------------------------------------------------- queues


@pytest.mark.parametrize("name", QUEUES.names())
def test_queue_peek_is_what_pop_removes_and_len_tracks(name: str) -> None:
    queue = _queue(name)
    assert len(queue) == 0
    assert queue.peek(0.0) is None
    tickets = _trace_tickets()
    for n, t in enumerate(tickets, start=1):
        queue.push(t, t.released_s)
        assert len(queue) == n
    popped = _drain(queue, now=60.0)
    assert sorted(t.seq for t in popped) == [t.seq for t in tickets]
    assert len(queue) == 0


@pytest.mark.parametrize("name", QUEUES.names())
def test_queue_order_does_not_depend_on_push_order(name: str) -> None:
    # One ticket per query: a client's own calls always arrive in release order, and
    # VTC is FIFO within a client, so only the interleaving across queries may vary.
    tickets = _one_per_query(_trace_tickets(n_queries=6, per_query=2))
    assert len(tickets) == 6
    reference = _queue(name)
    for t in tickets:
        reference.push(t, 0.0)
    expected = [t.seq for t in _drain(reference, 30.0)]
    if name in PUSH_IN_SEQ_ORDER_ONLY:
        assert expected == sorted(expected)
        return
    for seed in range(5):
        shuffled = list(tickets)
        random.Random(seed).shuffle(shuffled)
        queue = _queue(name)
        for t in shuffled:
            queue.push(t, 0.0)
        assert [t.seq for t in _drain(queue, 30.0)] == expected


@pytest.mark.parametrize("name", QUEUES.names())
def test_queue_ties_break_on_release_order(name: str) -> None:
    # Identical calls of identical queries released together: every key ties, so the
    # admitted order must be seq order whatever order they were pushed in.
    workflow = Workflow.chain([(SMALL,)])
    tickets = [
        CallTicket(seq, QueryRun(Query(f"q{seq}", workflow), seq, 0.0, 100.0), 0, SMALL, 0.0, 50.0)
        for seq in range(6)
    ]
    order = tickets if name in PUSH_IN_SEQ_ORDER_ONLY else [tickets[i] for i in (3, 5, 0, 4, 1, 2)]
    queue = _queue(name)
    for t in order:
        queue.push(t, 0.0)
    assert [t.seq for t in _drain(queue, 1.0)] == list(range(6))


@pytest.mark.parametrize("name", QUEUES.names())
def test_queue_remove_contract(name: str) -> None:
    queue = _queue(name)
    tickets = _trace_tickets()
    stranger = _trace_tickets(n_queries=1, per_query=1)[0]
    stranger.seq = 10_000
    assert not queue.remove(stranger)  # empty queue
    for t in tickets:
        queue.push(t, t.released_s)
    assert not queue.remove(stranger)  # never pushed
    removed = {tickets[0].seq, tickets[5].seq, tickets[-1].seq}
    for t in tickets:
        if t.seq in removed:
            assert queue.remove(t)
            assert not queue.remove(t)  # second time: already gone
    # Removing the ticket currently at the head must move the head on.
    head = queue.peek(60.0)
    assert head is not None
    assert queue.remove(head)
    removed.add(head.seq)
    assert len(queue) == len(tickets) - len(removed)
    popped = _drain(queue, 60.0)
    assert {t.seq for t in popped} == {t.seq for t in tickets} - removed
    assert not queue.remove(popped[0])  # popped earlier: not waiting any more


@pytest.mark.parametrize("name", QUEUES.names())
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_queue_random_operations_keep_the_contract(name: str, seed: int) -> None:
    """Interleaved pushes (in release order), pops, removals and re-pushes of removed
    tickets (a redispatch back to the same instance), at a clock that moves forward."""
    rng = random.Random(seed)
    queue = _queue(name)
    pending = _trace_tickets(n_queries=8, per_query=3, seed=seed)
    pending.sort(key=lambda t: t.seq)
    waiting: dict[int, CallTicket] = {}
    removed: list[CallTicket] = []
    popped_seqs: list[int] = []
    now = 0.0
    while pending or waiting:
        now += rng.uniform(0.0, 3.0)
        op = rng.random()
        if pending and (op < 0.45 or not waiting):
            t = pending.pop(0)
            queue.push(t, now)
            waiting[t.seq] = t
        elif op < 0.6 and waiting:
            t = rng.choice(sorted(waiting.values(), key=lambda x: x.seq))
            assert queue.remove(t)
            del waiting[t.seq]
            removed.append(t)
        elif op < 0.65 and removed and name not in PUSH_IN_SEQ_ORDER_ONLY:
            t = removed.pop(rng.randrange(len(removed)))
            queue.push(t, now)
            waiting[t.seq] = t
        else:
            head = queue.peek(now)
            assert head is not None
            t = queue.pop(now)
            assert t is head
            assert t.seq in waiting, "popped a ticket that was not waiting"
            del waiting[t.seq]
            popped_seqs.append(t.seq)
            queue.on_admit(t, now)
        assert len(queue) == len(waiting)
    assert queue.peek(now) is None
    assert len(popped_seqs) == len(set(popped_seqs))
    assert not set(popped_seqs) & {t.seq for t in removed}


# --------------------------------------------------------------------------- dispatchers


def _cluster_with_small(small_index: int) -> Cluster:
    gpus = CLUSTER.split(",")
    entries: list[dict[str, Any]] = [{"gpu": g} for g in gpus]
    entries[small_index]["kv_cache_tokens"] = SMALL_KV
    return Cluster.build(entries, "conformance")


def _dispatch_sequence(name: str, cluster: Cluster, seed: int, n: int = 80) -> list[int]:
    """Dispatch a mixed stream through `name`, keeping the load ledger as the driver does
    (completing earlier calls now and then, and telling the dispatcher, `on_complete`);
    check every choice can hold its call."""
    ctx = _ctx(cluster, seed)
    dispatcher: Dispatcher = DISPATCHERS.create(name, ctx)
    load = ctx.load
    workflow = Workflow.chain([(BIG,), (SMALL,)])
    traffic = random.Random(99)  # the workload is fixed; only the policy's seed varies
    in_flight: list[CallTicket] = []
    choices = []
    for seq in range(n):
        call = BIG if traffic.random() < 0.5 else SMALL
        run = QueryRun(Query(f"q{seq}", workflow), seq, float(seq), 100.0)
        ticket = CallTicket(seq, run, 0 if call is BIG else 1, call, float(seq), seq + 50.0)
        i = dispatcher.select(ticket, float(seq))
        assert isinstance(i, int)
        assert 0 <= i < len(cluster)
        assert load.can_serve(i, call), f"{name} sent {call} to instance {i}"
        ticket.instance = i
        ticket.work_s = ctx.estimator.call_time(i, call)
        load.on_dispatch(ticket)
        in_flight.append(ticket)
        choices.append(i)
        if traffic.random() < 0.4:
            done = in_flight.pop(traffic.randrange(len(in_flight)))
            load.on_complete(done)
            dispatcher.on_complete(done, seq + 0.5)  # as `GlobalScheduler.complete` does
    return choices


@pytest.mark.parametrize("name", DISPATCHERS.names())
@pytest.mark.parametrize("small_index", [0, 2])
def test_dispatcher_only_picks_instances_that_hold_the_call(name: str, small_index: int) -> None:
    cluster = _cluster_with_small(small_index)
    choices = _dispatch_sequence(name, cluster, seed=5)
    assert len(choices) == 80


@pytest.mark.parametrize("name", DISPATCHERS.names())
def test_dispatcher_is_deterministic_for_a_seed(name: str) -> None:
    cluster = _cluster_with_small(2)
    first = _dispatch_sequence(name, cluster, seed=7)
    assert _dispatch_sequence(name, cluster, seed=7) == first


@pytest.mark.parametrize("name", DISPATCHERS.names())
def test_dispatcher_with_a_single_fitting_instance_picks_it(name: str) -> None:
    entries: list[dict[str, Any]] = [
        {"gpu": "A100", "kv_cache_tokens": SMALL_KV},
        {"gpu": "A6000"},
        {"gpu": "L40S", "kv_cache_tokens": SMALL_KV},
    ]
    cluster = Cluster.build(entries, "one-fits")
    ctx = _ctx(cluster)
    dispatcher = DISPATCHERS.create(name, ctx)
    run = QueryRun(Query("q", Workflow.chain([(BIG,)])), 0, 0.0, 100.0)
    for seq in range(5):
        assert dispatcher.select(CallTicket(seq, run, 0, BIG, 0.0, 50.0), 0.0) == 1


# --------------------------------------------------------------------------- budgets


def _diamond() -> Query:
    a = LLMCall("information_retriever", 308, 5)
    stages = (
        Stage("information_retriever", (a,)),
        Stage("generate_candidate", (BIG, LLMCall("generate_candidate", 9000, 400)), (0,)),
        Stage("extract_keywords", (LLMCall("extract_keywords", 667, 45),), (0,)),
        Stage("evaluate", (LLMCall("evaluate", 961, 22),) * 3, (1, 2)),
    )
    return Query("diamond", Workflow(stages))


@pytest.mark.parametrize("name", BUDGETS.names())
def test_budget_deadlines_are_finite_and_within_the_query_deadline(name: str) -> None:
    cluster = parse_cluster(CLUSTER)
    budget: StageBudget = BUDGETS.create(name, _ctx(cluster))
    queries = [*load_trace("trace1")[:8], _diamond()]
    runs = [QueryRun(q, i, arrival_s=10.0 * i, slo_s=180.0) for i, q in enumerate(queries)]
    for run in runs:
        budget.start(run)
    # Release the queries' stages interleaved (as a busy cluster would), every release on
    # time: spread evenly over the first 90 % of the query's SLO.
    releases = []
    for run in runs:
        n = len(run.query.workflow.stages)
        for k in range(n):
            releases.append((run.arrival_s + 0.9 * run.slo_s * k / n, run.index, k))
    for now, index, k in sorted(releases):
        run = runs[index]
        deadline = budget.deadline(run, k, now)
        assert math.isfinite(deadline)
        assert now <= deadline <= run.deadline_s + 1e-9, (run.query.query_id, k)


# --------------------------------------------------------------------------- registries

REGISTRIES: list[Registry[Any]] = [DISPATCHERS, QUEUES, BUDGETS]
ALL_POLICIES = [(r, n) for r in REGISTRIES for n in r.names()]


def _create(registry: Registry[Any], name: str, params: dict[str, Any] | None = None) -> Any:
    ctx = _ctx(parse_cluster(CLUSTER))
    args: tuple[Any, ...] = (ctx, 0) if registry is QUEUES else (ctx,)
    return registry.create(name, *args, params=params)


def test_every_family_is_registered() -> None:
    assert {
        "workload-balanced",
        "marginal-latency",
        "round-robin",
        "pow2",
        "least-work",
        "least-requests",
    } <= set(DISPATCHERS.names())
    assert {"urgency", "fcfs", "llf", "vtc", "qlm", "sjf"} <= set(QUEUES.names())
    assert {"template", "e2e", "dag"} <= set(BUDGETS.names())


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda r: r.kind)
def test_unknown_name_lists_the_valid_ones(registry: Registry[Any]) -> None:
    with pytest.raises(UnknownNameError) as info:
        registry.factory("no-such-policy")
    assert info.value.known == tuple(registry.names())
    for name in registry.names():
        assert name in str(info.value)
    with pytest.raises(UnknownNameError):
        _create(registry, "no-such-policy")


@pytest.mark.parametrize(
    ("registry", "name"), ALL_POLICIES, ids=[f"{r.kind}:{n}" for r, n in ALL_POLICIES]
)
def test_unknown_parameter_names_the_valid_ones(registry: Registry[Any], name: str) -> None:
    with pytest.raises(ConfigError, match="no parameter bogus") as info:
        _create(registry, name, {"bogus": 1})
    message = str(info.value)
    known = registry.parameters(name)
    if known:
        for param in known:
            assert param in message
    else:
        assert "none" in message


@pytest.mark.parametrize(
    ("registry", "name"), ALL_POLICIES, ids=[f"{r.kind}:{n}" for r, n in ALL_POLICIES]
)
def test_policy_is_named_documented_and_buildable_with_defaults(
    registry: Registry[Any], name: str
) -> None:
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name), "names are kebab-case"
    params = registry.parameters(name)
    for param, default in params.items():
        assert default is not inspect.Parameter.empty, f"{name}: {param} has no default"
    doc = registry.doc(name)  # inspect.getdoc, or the source where mypyc compiled it
    assert doc, f"{name} has no docstring"
    for param in params:
        assert param in doc, f"{name}: parameter {param} is not documented"
    # Explicitly passing every default builds the same kind of policy as passing nothing.
    policy = _create(registry, name, dict(params))
    assert type(policy) is registry.factory(name)
    assert type(_create(registry, name)) is registry.factory(name)
