"""One event sequence through both drivers of the scheduling protocol, the same actions.

The simulator runs a workload and its core (`hexgen_flow.protocol.Scheduler`) records every
event it was handed and every action it returned. That very event sequence is then played
to a real coordinator (real Redis under a fresh prefix, its real admission, completion,
dispatch and worker-link code) the way its workers and clients would deliver it: each
submission as a SubmitQuery, each start and finish as the CallStarted / CallFinished a
worker on the simulator's instance sends (decoded as the servicer decodes them,
`hexgen_coordinator.worker_wire`), an α change as SetAlpha, each at the cluster time the
simulator had (a hand-set cluster clock). The test then asserts that

- the coordinator's core was handed the same events and returned the same actions (the
  same calls released to the same instances with the same deadlines, the same new
  deadlines and moves, the same queries finished, bit for bit), and
- what reached each worker's stream (each command of its link's outbox encoded as the
  servicer's writer encodes it) is what the simulator did with those actions: a
  dispatch to the instance where the simulator queued the call, with its deadline, an
  UpdateDeadline where it re-queued one, a cancel and a dispatch where it moved one.

A driver that decided anything itself (which waiting calls a finished stage revises, where
a call goes, when a query ends) would differ here. Three runs: the default policy on
workflows with parallel branches (with an α change), and two policies that queue calls
where a finished branch then revises and moves them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pprint
import random
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from hexgen_api.v1 import worker_pb2 as wpb
from hexgen_client.convert import submit_request
from hexgen_coordinator.client_wire import decode_submit
from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.coordinator import Coordinator, WorkerLink
from hexgen_coordinator.worker_wire import (
    decode_finished,
    decode_hello,
    decode_started,
    encode_command,
)
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.lengths import OutputLengths
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.protocol import (
    Action,
    Admitted,
    AlphaChanged,
    CallDone,
    CallMoved,
    CallStarted,
    DeadlineChanged,
    Event,
    Finish,
    StageReleased,
    Submit,
)
from hexgen_flow.runtime import CallState, CallTicket
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow
from hexgen_service.clock import ClusterClock
from redis_here import REDIS_URL, needs_redis

pytestmark = needs_redis

CLUSTER = "A100,A6000,L40S"

# ------------------------------------------------------------------------ workloads


def branching(n: int, seed: int) -> list[Query]:
    """Workflows whose stages run in parallel branches (candidates and unit tests after
    the retrieval, an evaluation after both): a branch finishing revises the other's
    waiting calls."""
    rng = random.Random(seed)

    def calls(step: str, k: int, inp: tuple[int, int], out: tuple[int, int]) -> tuple[LLMCall, ...]:
        return tuple(LLMCall(step, rng.randint(*inp), rng.randint(*out)) for _ in range(k))

    return [
        Query(
            f"branching-{i}",
            Workflow(
                (
                    Stage(
                        "information_retriever",
                        calls("information_retriever", 1, (300, 900), (5, 30)),
                    ),
                    Stage(
                        "generate_candidate",
                        calls("generate_candidate", 3, (4000, 12000), (150, 700)),
                        after=(0,),
                    ),
                    Stage(
                        "generate_unit_test",
                        calls("generate_unit_test", 2, (800, 1500), (40, 120)),
                        after=(0,),
                    ),
                    Stage("revise", calls("revise", 1, (3000, 6000), (40, 100)), after=(1,)),
                    Stage("evaluate", calls("evaluate", 3, (900, 1000), (15, 30)), after=(2, 3)),
                    Stage("unit_tester", calls("unit_tester", 1, (250, 300), (3, 8)), after=(4,)),
                )
            ),
        )
        for i in range(n)
    ]


def queueing(n: int) -> list[Query]:
    """A quick keyword stage beside six large candidates that fill the KV caches and
    queue: when the keywords finish, the queued candidates get new deadlines, and those
    late where they wait move."""
    big = LLMCall("generate_candidate", 40_000, 400)
    flow = Workflow(
        (
            Stage("extract_keywords", (LLMCall("extract_keywords", 649, 21),)),
            Stage("generate_candidate", (big,) * 6),
            Stage("evaluate", (LLMCall("evaluate", 500, 10),), after=(0, 1)),
        )
    )
    return [Query(f"queueing-{i}", flow, slo_s=120.0) for i in range(n)]


@dataclasses.dataclass(frozen=True)
class Case:
    policy: str
    queries: Callable[[], list[Query]]
    qps: float
    alpha_at: float | None = None
    """Cluster time of an α change to 0.3 (SetAlpha), if any."""
    expect: tuple[str, ...] = ()
    """Action kinds the run must contain, so that the comparison covers them."""
    lengths: str = "known"
    """What both schedulers believe of output lengths: the declared (``known``), or a
    prediction learned from finished calls (``learned``: clients then declare each call's
    cap, `CAP`, and the worker reports what it generated)."""


CASES = {
    "hexgen-flow": Case(
        "hexgen-flow", lambda: branching(10, 7), 1.0, alpha_at=20.0, expect=("StageReleased",)
    ),
    "round-robin+urgency": Case(
        "round-robin+urgency",
        lambda: queueing(6),
        1.0,
        expect=("DeadlineChanged", "CallMoved"),
    ),
    "llm-d-predicted": Case(
        "llm-d-predicted", lambda: queueing(6), 1.0, expect=("DeadlineChanged", "CallMoved")
    ),
    "hexgen-flow, learned lengths": Case(
        "hexgen-flow", lambda: branching(10, 11), 1.0, expect=("StageReleased",), lengths="learned"
    ),
}

CAP = 4096
"""The output tokens a client declares for every call when lengths are learned: a cap
(max_tokens) above what any call generates and above every step's cold prediction."""


def capped(workflow: Workflow) -> Workflow:
    """`workflow` as a client that declares only caps sends it."""
    return Workflow(
        tuple(
            dataclasses.replace(
                stage,
                calls=tuple(dataclasses.replace(c, output_tokens=CAP) for c in stage.calls),
            )
            for stage in workflow.stages
        )
    )


# ------------------------------------------------------------------ canonical forms


def call_key(ticket: CallTicket) -> str:
    return f"{ticket.query_id}/{ticket.stage}.{ticket.index}"  # the coordinator's call id


def canon_event(event: Event) -> tuple[Any, ...]:
    if isinstance(event, Submit):
        return ("Submit", event.query.query_id, event.order, event.now, event.slo_s)
    if isinstance(event, CallStarted | CallDone):
        return (type(event).__name__, call_key(event.ticket), event.now)
    if isinstance(event, AlphaChanged):
        return ("AlphaChanged", event.alpha)
    return (type(event).__name__,)  # any other kind fails the comparison by itself


def canon_action(action: Action) -> tuple[Any, ...]:
    if isinstance(action, Admitted):
        return ("Admitted", action.run.query.query_id, action.run.deadline_s)
    if isinstance(action, StageReleased):
        return (
            "StageReleased",
            action.run.query.query_id,
            action.stage,
            tuple(
                (call_key(t), t.instance, t.state.name, t.deadline_s, t.seq) for t in action.tickets
            ),
        )
    if isinstance(action, DeadlineChanged):
        return ("DeadlineChanged", call_key(action.ticket), action.deadline_s)
    if isinstance(action, CallMoved):
        return (
            "CallMoved",
            call_key(action.ticket),
            action.source,
            action.target,
            action.deadline_s,
        )
    if isinstance(action, Finish):
        return ("Finish", action.run.query.query_id, action.now)
    return (type(action).__name__,)


Step = tuple[tuple[Any, ...], tuple[tuple[Any, ...], ...]]


def wire_of(actions: tuple[tuple[Any, ...], ...]) -> list[tuple[Any, ...]]:
    """What each worker should get for the (canonical) actions of one event, in order:
    what the simulator did to its instances' queues, as worker messages."""
    wire: list[tuple[Any, ...]] = []
    for action in actions:
        kind = action[0]
        if kind == "StageReleased":
            for key, instance, state, deadline, _ in action[3]:
                if state == CallState.QUEUED.name:
                    wire.append((instance, "dispatch", key, deadline))
        elif kind == "DeadlineChanged":
            pass  # the instance is the one its call was last sent to: see `expected_wire`
        elif kind == "CallMoved":
            _, key, source, target, deadline = action
            wire.append((source, "cancel", key))
            wire.append((target, "dispatch", key, deadline))
    return wire


def expected_wire(steps: list[Step]) -> list[list[tuple[Any, ...]]]:
    """Per event, the worker messages the simulator's actions call for (an UpdateDeadline
    goes to the instance the call waits on: the last one it was dispatched or moved to)."""
    where: dict[str, int] = {}
    out: list[list[tuple[Any, ...]]] = []
    for _, actions in steps:
        wire: list[tuple[Any, ...]] = []
        for action in actions:
            if action[0] == "DeadlineChanged":
                _, key, deadline = action
                if where.get(key, -1) >= 0:
                    wire.append((where[key], "deadline", key, deadline))
                continue
            for message in wire_of((action,)):
                wire.append(message)
                if message[1] == "dispatch":
                    where[message[2]] = message[0]
        out.append(wire)
    return out


def per_worker(messages: list[tuple[Any, ...]]) -> dict[int, list[tuple[Any, ...]]]:
    out: dict[int, list[tuple[Any, ...]]] = {}
    for message in messages:
        out.setdefault(message[0], []).append(message[1:])
    return out


def drain(
    links: list[WorkerLink], asked: list[tuple[int, int]] | None = None
) -> list[tuple[Any, ...]]:
    """The messages the workers got since the last drain (acks and welcomes aside);
    `asked` collects each dispatch's (output tokens asked of the engine, expected)."""
    got: list[tuple[Any, ...]] = []
    for slot, link in enumerate(links):
        while not link.outbox.empty():
            command = link.outbox.get_nowait()
            if command is None:
                continue
            message = encode_command(command)  # what the servicer's writer sends
            kind = message.WhichOneof("message")
            if kind == "dispatch":
                if asked is not None:
                    asked.append(
                        (message.dispatch.output_tokens, message.dispatch.expected_output_tokens)
                    )
                got.append(
                    (slot, "dispatch", message.dispatch.call_id, message.dispatch.deadline_s)
                )
            elif kind == "deadline":
                got.append(
                    (slot, "deadline", message.deadline.call_id, message.deadline.deadline_s)
                )
            elif kind == "cancel":
                got.append((slot, "cancel", message.cancel.call_id))
    return got


# ------------------------------------------------------------------ the two drivers


def simulate(case: Case) -> tuple[list[Query], list[Step], dict[str, int], float]:
    """The simulator's run: its queries, its core's (event, actions) in canonical form,
    the instance each call ran on, and its SLO base."""
    queries = case.queries()
    config = SimConfig(
        qps=case.qps,
        seed=3,
        prefix_caching=False,
        output_lengths=OutputLengths.parse(case.lengths),
    )
    sim = Simulation(queries, parse_cluster(CLUSTER), resolve_policy(case.policy), config)
    steps: list[Step] = []
    ran_on: dict[str, int] = {}

    def record(event: Event, actions: tuple[Action, ...]) -> None:
        if isinstance(event, CallStarted):
            ran_on[call_key(event.ticket)] = event.ticket.instance
        steps.append((canon_event(event), tuple(canon_action(a) for a in actions)))

    sim.core.observer = record
    if case.alpha_at is not None:
        changed = [False]

        def change_alpha(now: float, run: Simulation) -> None:
            if not changed[0] and now >= case.alpha_at:  # type: ignore[operator]
                changed[0] = True
                run.core.handle(AlphaChanged(0.3))

        sim.every(case.alpha_at, change_alpha)
    metrics = sim.run()
    assert metrics.completed == len(queries)
    assert not sim.core.runs and not sim.core.parked
    return queries, steps, ran_on, sim.slo_base_s


class HandClock(ClusterClock):
    """The cluster clock as the replay sets it: the time of the event being delivered."""

    def __init__(self) -> None:
        super().__init__(0.0, 1.0)
        object.__setattr__(self, "at", 0.0)

    def now(self) -> float:
        return float(self.__dict__["at"])

    def set(self, t: float) -> None:
        object.__setattr__(self, "at", t)


@pytest.fixture
async def coordinator_for() -> AsyncIterator[Callable[[str, str], Any]]:
    redis: aioredis.Redis[bytes] = aioredis.Redis.from_url(REDIS_URL)
    made: list[tuple[Coordinator, str]] = []

    async def make(policy: str, lengths: str) -> Coordinator:
        prefix = f"hf-conformance-{uuid.uuid4().hex[:8]}:"
        coordinator = Coordinator(
            CoordinatorConfig(
                redis_prefix=prefix,
                cluster=CLUSTER,
                policy=policy,
                seed=3 + 1,  # the simulator seeds its scheduler with its seed + 1
                admission="off",
                prefix_caching=False,  # as the simulated engines' (SimConfig below)
                output_lengths=lengths,
                heartbeat_timeout_s=3600.0,
            ),
            redis,
        )
        await coordinator.start()
        made.append((coordinator, prefix))
        return coordinator

    yield make
    for coordinator, prefix in made:
        await coordinator.stop()
        keys = [k async for k in redis.scan_iter(match=f"{prefix}*")]
        if keys:
            await redis.delete(*keys)
    await redis.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


@pytest.mark.parametrize("name", list(CASES))
async def test_both_drivers_take_the_same_actions_for_the_same_events(
    name: str, coordinator_for: Callable[[str, str], Any]
) -> None:
    case = CASES[name]
    queries, sim_steps, ran_on, slo_base_s = simulate(case)
    kinds = {a[0] for _, actions in sim_steps for a in actions}
    for kind in case.expect:
        assert kind in kinds, f"the simulated run has no {kind}: the case no longer covers it"

    coordinator: Coordinator = await coordinator_for(case.policy, case.lengths)
    assert coordinator.slo_base_s == pytest.approx(slo_base_s)
    clock = HandClock()
    coordinator.ledger.clock.set(clock)  # every part reads it through the one holder
    links = []
    for slot, gpu in enumerate(CLUSTER.split(",")):
        link = WorkerLink(worker_id=f"conformance-{slot}", engine="ENGINE_KIND_SIMULATED")
        hello = wpb.WorkerHello(worker_id=link.worker_id, slot=slot, gpu=gpu)
        coordinator.connect(decode_hello(hello), link)
        links.append(link)
    drain(links)  # the welcomes
    steps: list[Step] = []
    coordinator.core.observer = lambda e, a: steps.append(
        (canon_event(e), tuple(canon_action(x) for x in a))
    )
    by_id = {q.query_id: q for q in queries}
    truth = {
        f"{q.query_id}/{k}.{i}": call.output_tokens
        for q in queries
        for k, stage in enumerate(q.workflow.stages)
        for i, call in enumerate(stage.calls)
    }
    wire: list[list[tuple[Any, ...]]] = []
    asked: list[tuple[int, int]] = []
    for event, _ in sim_steps:
        kind = event[0]
        if kind == "Submit":
            _, query_id, _, now, slo_s = event
            clock.set(now)
            query = dataclasses.replace(by_id[query_id], slo_s=slo_s)
            if case.lengths == "learned":  # a client declares caps, not lengths
                query = dataclasses.replace(query, workflow=capped(query.workflow))
            submission = decode_submit(submit_request(query), coordinator.limits)
            _, created = await coordinator.submit(submission)
            assert created
        elif kind in ("CallStarted", "CallDone"):
            _, key, now = event
            clock.set(now)
            link = links[ran_on[key]]
            if kind == "CallStarted":
                coordinator.on_started(link, decode_started(wpb.CallStarted(call_id=key)))
            else:
                generated = truth[key]  # what the simulated engine generated
                finished = wpb.CallFinished(call_id=key, output_tokens=generated)
                await coordinator.on_finished(link, decode_finished(finished))
        elif kind == "AlphaChanged":
            await coordinator.set_alpha(event[1], "conformance test")
        else:
            raise AssertionError(f"no way to deliver {event} to the coordinator")
        await asyncio.sleep(0)  # the acks of this turn go out
        wire.append(drain(links, asked))

    for i, (mine, theirs) in enumerate(zip(steps, sim_steps, strict=False)):
        assert mine == theirs, (
            f"event {i}: the coordinator's core and the simulator's differ\n"
            f"coordinator: {pprint.pformat(mine)}\nsimulator:   {pprint.pformat(theirs)}"
        )
    assert len(steps) == len(sim_steps)
    expected = expected_wire(sim_steps)
    for i, (got, want) in enumerate(zip(wire, expected, strict=True)):
        # Each worker's stream in order (streams are not ordered among themselves).
        assert per_worker(got) == per_worker(want), (
            f"event {i} {sim_steps[i][0]}: the workers got other messages"
        )
    assert coordinator.queries_finished == len(queries)
    # Planned with a belief, each call still asks its engine for what its client declared,
    # and tells the worker's queue what the coordinator expects (0: the same).
    if case.lengths == "learned":
        assert asked and {a for a, _ in asked} == {CAP}
        assert all(0 < expected < CAP for _, expected in asked)
    else:
        assert asked and {a for a, _ in asked} <= set(truth.values())
        assert {expected for _, expected in asked} == {0}
    assert not coordinator.core.runs and not coordinator.core.parked  # it holds nothing more
