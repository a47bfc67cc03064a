"""The worker's state without a network: dispatch, duplicates, cancel, deadline updates,
acks, drops and admission through the local queue into the simulated engine."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import pytest

from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError, UnknownNameError
from hexgen_flow.estimate import Estimator
from hexgen_flow.policies.registration import QUEUES
from hexgen_flow.runtime import CallTicket, ClusterLoad, PolicyContext
from hexgen_flow.scheduler import InstanceScheduler
from hexgen_flow.sim.engines import create_engine_model
from hexgen_flow.workload import LLMCall
from hexgen_service.clock import ClusterClock
from hexgen_worker import DispatchOutcome, WelcomeSettings, WorkerConfig, WorkerState
from hexgen_worker.engines import SimulatedEngine
from hexgen_worker.events import CallFinished, CallReport, CallStarted
from hexgen_worker.state import CallStatus
from worker_welcome import welcome_settings

T = TypeVar("T")
SCALE = 1000.0


def ticket(
    call_id: str, seq: int, *, deadline_s: float = 100.0, input_tokens: int = 1000, out: int = 50
) -> CallTicket:
    return CallTicket.detached(
        seq=seq,
        call_id=call_id,
        query_id="q",
        query_seq=0,
        tenant="t",
        stage=0,
        call=LLMCall("revise", input_tokens, out),
        released_s=0.0,
        deadline_s=deadline_s,
        query_deadline_s=500.0,
        remaining_after_s=0.0,
    )


def settings(**overrides: Any) -> WelcomeSettings:
    overrides.setdefault("clock", ClusterClock(time.time(), SCALE))
    overrides.setdefault("cluster", "A100,A6000")
    return welcome_settings(**overrides)


class Harness:
    """A WorkerState on a simulated engine, recording what it sends."""

    def __init__(self, engine_model: str = "vllm-v1", **config: Any) -> None:
        config.setdefault("gpu", "A100")
        cfg = WorkerConfig(worker_id="w", **config).resolved()
        self.engine = SimulatedEngine(cfg.instance_spec(), engine_model)
        self.sent: list[CallReport] = []
        self.state = WorkerState(
            self.engine,
            gpu=cfg.gpu,
            model=cfg.model,
            kv_cache_tokens=cfg.kv_cache_tokens or 0,
            send=lambda _link, report: self.sent.append(report),
        )

    def finished(self) -> list[str]:
        return [e.call_id for e in self.sent if isinstance(e, CallFinished)]

    def started(self) -> list[str]:
        return [e.call_id for e in self.sent if isinstance(e, CallStarted)]

    async def until(self, predicate: Callable[[], bool], timeout: float = 2.0) -> None:
        end = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < end, "timed out"
            await asyncio.sleep(0.002)


def run(harness: Harness, body: Callable[[], Awaitable[T]], **welcome: Any) -> T:
    async def main() -> T:
        await harness.engine.start()
        events = asyncio.create_task(harness.state.run_engine_events())
        try:
            harness.state.configure(settings(**welcome))
            return await body()
        finally:
            events.cancel()
            await harness.engine.close()

    return asyncio.run(main())


def test_dispatch_runs_a_call_and_keeps_its_result_until_acked() -> None:
    h = Harness()

    async def body() -> None:
        assert h.state.dispatch(ticket("a", 0)) is DispatchOutcome.QUEUED
        assert h.state.status("a") is CallStatus.RUNNING
        await h.until(lambda: h.finished() == ["a"])
        assert h.state.status("a") is None
        assert [f.call_id for f in h.state.unacked()] == ["a"]
        h.state.ack(["a", "unknown"])
        assert h.state.unacked() == []

    run(h, body)
    assert h.started() == ["a"]
    done = h.sent[-1]
    assert isinstance(done, CallFinished) and done.text == "[simulated A100] 50 tokens"


def test_duplicate_dispatch_never_runs_twice() -> None:
    h = Harness()

    async def body() -> None:
        assert h.state.dispatch(ticket("a", 0, out=30_000)) is DispatchOutcome.QUEUED
        assert h.state.dispatch(ticket("a", 0, out=30_000)) is DispatchOutcome.DUPLICATE
        assert h.engine.load().running == 1
        assert h.state.dispatch(ticket("b", 1)) is DispatchOutcome.QUEUED
        await h.until(lambda: "b" in h.finished())
        # finished and unacknowledged: the result is sent again, nothing runs
        assert h.state.dispatch(ticket("b", 1)) is DispatchOutcome.RESENT
        assert h.finished() == ["b", "b"] and h.started() == ["a", "b"]
        assert h.state.resident_call_ids() == ["a"]

    run(h, body)


def test_queue_order_and_capacity() -> None:
    h = Harness(max_batch=1)

    async def body() -> None:
        h.state.dispatch(ticket("first", 0, deadline_s=500.0))  # runs at once
        h.state.dispatch(ticket("late", 1, deadline_s=400.0))
        h.state.dispatch(ticket("urgent", 2, deadline_s=50.0))
        assert h.state.queued() == 2 and h.state.heartbeat().running == 1
        await h.until(lambda: len(h.finished()) == 3)

    run(h, body)
    assert h.started() == ["first", "urgent", "late"]  # least laxity first


def test_kv_limit_holds_calls_in_the_queue() -> None:
    # prefill-first reserves input + output tokens at admission: two calls fit, the third
    # waits in the worker's queue (vllm-v1 would admit it and preempt later).
    h = Harness("prefill-first", kv_cache_tokens=2500)

    async def body() -> None:
        # 1050 tokens each, decodes long enough that none finishes before the third is
        # dispatched, even on a loaded machine
        for n in range(3):
            h.state.dispatch(ticket(f"c{n}", n, input_tokens=650, out=400))
        beat = h.state.heartbeat()
        assert (beat.running, beat.queued, beat.kv_used_tokens) == (2, 1, 2100)
        await h.until(lambda: len(h.finished()) == 3, timeout=30)

    # A slower clock than the other tests': 0.4 wall seconds a call, so that a loaded
    # machine's pause between two dispatches does not let the model finish the first.
    run(h, body, clock=ClusterClock(time.time(), 20.0))
    assert h.started() == ["c0", "c1", "c2"]


def test_a_call_that_can_never_fit_is_reported_failed() -> None:
    h = Harness(kv_cache_tokens=2000)

    async def body() -> None:
        assert h.state.dispatch(ticket("big", 0, input_tokens=5000)) is DispatchOutcome.REJECTED

    run(h, body)
    done = h.sent[-1]
    assert isinstance(done, CallFinished) and "never fit" in done.error
    assert [f.call_id for f in h.state.unacked()] == ["big"]


def test_cancel_queued_and_running_calls() -> None:
    h = Harness(max_batch=1)

    async def body() -> None:
        h.state.dispatch(ticket("run", 0, out=400))
        h.state.dispatch(ticket("wait", 1))
        h.engine.prompts["wait"] = "a prompt"
        assert h.state.cancel("wait") and "wait" not in h.engine.prompts
        assert h.state.queued() == 0
        assert h.state.cancel("run")
        assert not h.state.cancel("run") and not h.state.cancel("never-here")
        assert h.state.resident_call_ids() == []
        h.state.dispatch(ticket("next", 2))
        await h.until(lambda: h.finished() == ["next"])
        await asyncio.sleep(0.05)  # "run" would have ended by now

    run(h, body)
    assert h.finished() == ["next"]


def test_cancel_forgets_an_unacknowledged_result() -> None:
    h = Harness()

    async def body() -> None:
        h.state.dispatch(ticket("a", 0))
        await h.until(lambda: h.finished() == ["a"])
        assert h.state.cancel("a") and h.state.unacked() == []

    run(h, body)


def test_deadline_update_moves_a_queued_call_ahead() -> None:
    h = Harness(max_batch=1)

    async def body() -> None:
        h.state.dispatch(ticket("first", 0, out=200))
        h.state.dispatch(ticket("x", 1, deadline_s=100.0))
        h.state.dispatch(ticket("y", 2, deadline_s=200.0))
        assert h.state.update_deadline("y", 10.0)
        assert not h.state.update_deadline("unknown", 1.0)
        ticket_y = h.state.ticket("y")
        assert ticket_y is not None and ticket_y.deadline_s == 10.0
        await h.until(lambda: len(h.finished()) == 3)

    run(h, body)
    assert h.started() == ["first", "y", "x"]


def test_deadline_extension_moves_a_queued_call_back() -> None:
    h = Harness(max_batch=1)

    async def body() -> None:
        h.state.dispatch(ticket("first", 0, out=200))
        h.state.dispatch(ticket("x", 1, deadline_s=100.0))
        h.state.dispatch(ticket("y", 2, deadline_s=200.0))
        h.state.update_deadline("x", 300.0)
        await h.until(lambda: len(h.finished()) == 3)

    run(h, body)
    assert h.started() == ["first", "y", "x"]


def test_welcome_drops_calls_and_rebuilds_the_queue() -> None:
    h = Harness(max_batch=1)

    async def body() -> None:
        h.state.dispatch(ticket("run", 0, out=300))
        h.state.dispatch(ticket("keep", 1, deadline_s=300.0))
        h.state.dispatch(ticket("drop", 2))
        h.state.dispatch(ticket("sooner", 3, deadline_s=250.0))
        assert h.state.settings is not None
        # a reconnect's welcome: another queue policy, and one call to drop
        h.state.configure(
            settings(
                clock=h.state.settings.clock,
                queue_policy="fcfs",
                queue_params={},
                drop_call_ids=("drop",),
            )
        )
        assert h.state.resident_call_ids() == ["run", "keep", "sooner"]
        assert h.state.queued() == 2
        await h.until(lambda: len(h.finished()) == 3)

    run(h, body)
    assert h.started() == ["run", "keep", "sooner"]  # fcfs now: release order


def test_clock_change_moves_held_times() -> None:
    h = Harness(max_batch=1, kv_cache_tokens=4000)

    async def body() -> None:
        h.state.dispatch(ticket("a", 0))
        await h.until(lambda: h.finished() == ["a"])
        assert h.state.dispatch(ticket("big", 3, input_tokens=5000)) is DispatchOutcome.REJECTED
        h.state.dispatch(ticket("b", 1, out=2000))
        h.state.dispatch(ticket("c", 2, deadline_s=100.0))
        assert h.state.settings is not None
        old = h.state.settings.clock
        h.state.configure(settings(clock=ClusterClock(old.epoch_unix_s - 10.0, SCALE)))
        moved = h.state.ticket("c")
        assert moved is not None and moved.deadline_s == pytest.approx(10_100.0)
        done, failed = h.state.unacked()
        assert done.call_id == "a" and done.finished_s > 10_000.0
        assert done.started_s <= done.first_token_s < done.finished_s  # moved with them
        assert failed.call_id == "big" and failed.started_s > 10_000.0
        assert failed.first_token_s == 0.0  # not given stays not given on any clock

    run(h, body)


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"slot": 1}, ConfigError, "A6000"),
        ({"slot": 5}, ConfigError, "not in the cluster"),
        ({"queue_policy": "nope"}, UnknownNameError, "urgency"),
        ({"queue_params": {"bogus": 1}}, ConfigError, "bogus"),
    ],
)
def test_welcomes_this_worker_cannot_serve(
    overrides: dict[str, Any], error: type[Exception], match: str
) -> None:
    h = Harness()
    with pytest.raises(error, match=match):
        h.state.configure(settings(**overrides))


def test_dispatch_before_the_welcome_is_a_bug() -> None:
    h = Harness()
    with pytest.raises(RuntimeError, match="welcome"):
        h.state.dispatch(ticket("a", 0))


def test_a_cluster_file_this_machine_lacks_gets_a_stand_in() -> None:
    h = Harness(max_batch=1)

    async def body() -> None:
        h.state.dispatch(ticket("first", 0))
        h.state.dispatch(ticket("late", 1, deadline_s=400.0))
        h.state.dispatch(ticket("urgent", 2, deadline_s=50.0))
        await h.until(lambda: len(h.finished()) == 3)

    run(h, body, cluster="/nowhere/cluster.yaml", slot=2, instance="A100#2")
    assert h.started() == ["first", "urgent", "late"]


def test_worker_reproduces_the_simulators_latencies() -> None:
    """A loaded instance in real time (time scale 200) against the same model driven in
    simulated time with the same arrivals: P95 within 3 %."""
    rng = random.Random(1)
    steps = [(308, 5), (667, 45), (11748, 678), (5963, 79), (1109, 103), (961, 22)]
    gaps = [rng.expovariate(4.0) for _ in range(60)]
    sizes = [rng.choice(steps) for _ in range(60)]
    h = Harness(gpu="A6000", kv_cache_tokens=60_000)
    arrived: dict[str, float] = {}
    scale = 200.0

    async def body() -> None:
        clock = h.state.clock
        assert clock is not None
        t = clock.now()
        for n, (gap, (inp, out)) in enumerate(zip(gaps, sizes, strict=True)):
            t += gap
            await asyncio.sleep(max(clock.wall_time(t) - time.time(), 0.0))
            arrived[f"c{n}"] = now = clock.now()
            h.state.dispatch(ticket(f"c{n}", n, input_tokens=inp, out=out, deadline_s=now))
        await h.until(lambda: len(h.finished()) == 60, timeout=5.0)

    run(
        h,
        body,
        cluster="A6000",
        instance="A6000#0",
        clock=ClusterClock(time.time(), scale),
        queue_policy="fcfs",
        queue_params={},
    )
    mesh = {
        e.call_id: e.finished_s - arrived[e.call_id] for e in h.sent if isinstance(e, CallFinished)
    }

    # The same engine model the worker runs (vllm-v1, caching as the worker does), driven
    # offline in simulated time.
    model = create_engine_model(
        h.engine.engine_model, h.engine.spec, prefix_caching=h.engine.prefix_caching
    )
    queue = QUEUES.create("fcfs", policy_context("A6000"), 0)
    scheduler = InstanceScheduler(queue, model)
    arrivals = sorted((t, int(c[1:])) for c, t in arrived.items())
    sim: dict[str, float] = {}
    k = 0
    while len(sim) < 60:
        next_arrival = arrivals[k][0] if k < len(arrivals) else float("inf")
        if next_arrival <= model.next_event_s():
            now, n = arrivals[k]
            k += 1
            inp, out = sizes[n]
            queue.push(ticket(f"c{n}", n, input_tokens=inp, out=out, deadline_s=now), now)
        else:
            now = model.next_event_s()
            for done in model.advance(now):
                sim[done.call_id] = now - arrived[done.call_id]
        scheduler.admit_ready(now)
    assert p95(mesh.values()) == pytest.approx(p95(sim.values()), rel=0.03)


def p95(values: Iterable[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.95 * (len(ordered) - 1))]


def policy_context(cluster: str) -> PolicyContext:
    parsed = parse_cluster(cluster)
    return PolicyContext(parsed, Estimator(parsed), ClusterLoad(parsed), random.Random(0))
