"""The coordinator's Redis state: idempotent submission, exactly-once completion, atomic
stage release, placements that never undo a completion, failures up to a limit, retention
and keys no id can collide with. Runs against the real Redis at HEXGEN_TEST_REDIS (default
127.0.0.1:6379), and again on a real local 3-master Redis Cluster (`redis_cluster_here`)
through the coordinator's cluster client, with a hash tag in the prefix."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from hexgen_coordinator.redis_retry import redis_client
from hexgen_coordinator.store import (
    ALPHA_HISTORY_MAX,
    COMPLETE_DUPLICATE,
    COMPLETE_STALE,
    CompletionResult,
    FailureResult,
    Placement,
    WorkflowStore,
)
from hexgen_flow.runtime import CompletionEffect, QueryRun
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow
from hexgen_service.redis_schema import PLACED
from redis_cluster_here import RedisClusterHere, needs_redis_cluster

REDIS_URL = os.environ.get("HEXGEN_TEST_REDIS", "redis://127.0.0.1:6379/0")


@pytest.fixture(
    scope="module", params=["redis", pytest.param("cluster", marks=needs_redis_cluster)]
)
def backend(request: pytest.FixtureRequest) -> Iterator[tuple[str, bool]]:
    """(URL, is a Redis Cluster): the single Redis, then a cluster started for the module."""
    if request.param == "redis":
        yield REDIS_URL, False
        return
    with RedisClusterHere() as cluster:
        yield cluster.url, True


@pytest.fixture
async def store(backend: tuple[str, bool]) -> AsyncIterator[WorkflowStore]:
    url, cluster = backend
    tag = uuid.uuid4().hex[:8]
    if cluster:  # the coordinator's own client; every key in the slot of the prefix's tag
        redis = redis_client(url, cluster=True)
        prefix = f"hf-test-{{{tag}}}:"
    else:
        redis = aioredis.Redis.from_url(url)
        prefix = f"hf-test-{tag}:"
    yield WorkflowStore(redis, prefix)
    keys = [k async for k in redis.scan_iter(match=f"{prefix}*")]
    if keys:
        await redis.delete(*keys)
    await redis.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


async def _place(
    store: WorkflowStore,
    query_id: str,
    placements: dict[str, Placement],
    deadlines: dict[int, float],
    events: list[bytes] | None = None,
    *,
    ended: bool = False,
) -> None:
    """The write-behind's writes of one query, as one pipeline."""
    await store.write(
        store.place_commands(query_id, placements, deadlines, events or [], ended=ended)
    )


def _record(call_id: str) -> dict[str, str | int | float]:
    return {"query_id": "q", "call_id": call_id, "step": "revise"}


async def _diamond(store: WorkflowStore, query_id: str = "q") -> tuple[bool, int]:
    # 0 -> {1 (two calls), 2} -> 3
    return await store.submit(query_id, b"spec", "acme", 10.0, 100.0, [1, 2, 1, 1], [0, 1, 1, 2])


def _diamond_run() -> QueryRun:
    """The core's state of `_diamond`'s query: what decides each completion's effect."""
    call = LLMCall("revise", 10, 1)
    flow = Workflow(
        (
            Stage("revise", (call,)),
            Stage("revise", (call, call), after=(0,)),
            Stage("revise", (call,), after=(0,)),
            Stage("revise", (call,), after=(1, 2)),
        )
    )
    return QueryRun(Query("q", flow), 0, 10.0, 100.0)


async def _complete(
    store: WorkflowStore,
    run: QueryRun,
    call_id: str,
    now: float,
    record: dict[str, str | int | float] | None = None,
    **placed: int,
) -> CompletionResult:
    """Complete a call as the coordinator does: the core's effect (`completion_effect`),
    applied by Redis's script, then by the core's state when Redis took it."""
    stage = int(call_id.rpartition("/")[2].partition(".")[0])
    result = await store.complete(
        run.query.query_id,
        call_id,
        stage,
        run.query.workflow.dependents[stage],
        run.completion_effect(stage),
        now,
        record if record is not None else _record(call_id),
        **placed,
    )
    if result.applied:
        run.complete_call(stage, now)
    return result


async def test_submit_is_idempotent_and_counts_queries(store: WorkflowStore) -> None:
    assert await _diamond(store, "a") == (True, 0)
    assert await _diamond(store, "a") == (False, 0)
    assert await _diamond(store, "b") == (True, 1)
    stored = await store.load("a")
    assert stored is not None
    assert stored.submit == b"spec"
    assert stored.fields["state"] == "running"
    assert stored.num("deadline_s") == 110.0
    assert stored.stage(0, "rel") == "10.0"  # the root is released at arrival
    assert stored.stage(1, "rel") is None
    assert await store.active_ids() == ["a", "b"]


async def test_a_workflow_declared_whole_enters_the_admitted_stream_once(
    store: WorkflowStore,
) -> None:
    await store.submit("w", b"spec", "acme", 10.0, 100.0, [1, 2], [0, 1], shape=b"shape")
    await store.submit("w", b"spec", "acme", 10.0, 100.0, [1, 2], [0, 1], shape=b"shape")
    # A session is not declared whole: the tuner sees it once it has finished, not here.
    await store.submit("s", b"spec", "acme", 12.0, 50.0, [0], [0], session_idle_s=30.0)
    entries = await store.redis.xrange(store.admitted_key)
    assert [e[1] for e in entries] == [
        {
            b"query_id": b"w",
            b"tenant": b"acme",
            b"arrival_s": b"10.0",
            b"slo_s": b"100.0",
            b"submit": b"shape",  # the shape: no prompts
        }
    ]


async def test_completion_applies_the_cores_release_of_each_stage(
    store: WorkflowStore,
) -> None:
    """The script marks released what the core's rule releases, finishes what it
    finishes, and keeps the counters a restart rebuilds the query from."""
    await _diamond(store)
    run = _diamond_run()
    r = await _complete(store, run, "q/0.0", 11.0)
    assert r.applied and set(r.released) == {1, 2} and r.calls_left == 4
    r = await _complete(store, run, "q/1.0", 12.0)
    assert r.applied and r.released == ()  # stage 1 has a second call
    r = await _complete(store, run, "q/2.0", 13.0)
    assert r.applied and r.released == ()  # stage 3 still waits for stage 1
    stored = await store.load("q")
    assert stored is not None
    assert (stored.stage(2, "fin"), stored.stage(3, "rel"), stored.stage(3, "deps")) == (
        "13.0",
        None,
        "1",
    )
    r = await _complete(store, run, "q/1.1", 14.0)
    assert r.released == (3,)
    r = await _complete(store, run, "q/3.0", 15.0)
    assert r.applied and r.calls_left == 0 and run.finished_s == 15.0
    stored = await store.load("q")
    assert stored is not None
    assert stored.fields["state"] == "succeeded"
    assert stored.num("finished_s") == 15.0
    assert await store.active_ids() == []
    redis = store.redis
    assert await redis.xlen(store.completions_key) == 5
    (entry,) = await redis.xrange(store.finished_key)
    assert entry[1][b"query_id"] == b"q" and entry[1][b"submit"] == b"spec"


async def test_a_call_completes_once_even_when_reported_concurrently(store: WorkflowStore) -> None:
    await _diamond(store)
    effect = _diamond_run().completion_effect(0)
    results = await asyncio.gather(
        *[
            store.complete("q", "q/0.0", 0, [1, 2], effect, 11.0, _record("q/0.0"))
            for _ in range(10)
        ]
    )
    assert sorted(r.status for r in results) == [0] * 9 + [1]
    released = [r.released for r in results if r.applied]
    assert set(released[0]) == {1, 2}
    stored = await store.load("q")
    assert stored is not None
    assert stored.fields["calls_left"] == "4"
    assert await store.redis.xlen(store.completions_key) == 1


async def test_cancelled_or_unknown_queries_take_no_completions(store: WorkflowStore) -> None:
    await _diamond(store)
    assert await store.cancel("q", 12.0)
    assert not await store.cancel("q", 13.0)
    r = await _complete(store, _diamond_run(), "q/0.0", 14.0)
    assert r.status == -1
    last = CompletionEffect(True, (), True)
    r = await store.complete("nope", "nope/0.0", 0, [], last, 14.0, _record("nope/0.0"))
    assert r.status == -1
    stored = await store.load("q")
    assert stored is not None and stored.fields["state"] == "cancelled"
    assert await store.active_ids() == []


async def test_the_cluster_clock_and_alpha_survive_a_new_store(store: WorkflowStore) -> None:
    assert await store.epoch(1000.0, 20.0) == (1000.0, 20.0)
    again = WorkflowStore(store.redis, store.prefix)
    assert await again.epoch(2000.0, 1.0) == (1000.0, 20.0)
    assert await again.alpha() is None
    await again.set_alpha(0.7, 5.0, "test")
    assert await store.alpha() == 0.7


# ----------------------------------------------------------------------- exactly once


async def test_a_late_placement_never_overwrites_a_completed_call(store: WorkflowStore) -> None:
    await _diamond(store)
    assert (await _complete(store, _diamond_run(), "q/0.0", 11.0)).applied
    # The write-behind of the call's (earlier) placement lands after its completion.
    await _place(store, "q", {"q/0.0": Placement(0, 7, 1)}, {0: 50.0})
    stored = await store.load("q")
    assert stored is not None and stored.done("q/0.0")
    again = await _complete(store, _diamond_run(), "q/0.0", 12.0, slot=0)
    assert again.status == COMPLETE_DUPLICATE
    stored = await store.load("q")
    assert stored is not None and stored.fields["calls_left"] == "4"


async def test_a_completion_is_taken_only_from_the_slot_and_attempt_it_was_placed_on(
    store: WorkflowStore,
) -> None:
    await _diamond(store)
    await _place(store, "q", {"q/0.0": Placement(1, 0, 2)}, {})
    run = _diamond_run()
    wrong_slot = await _complete(store, run, "q/0.0", 11.0, _record("x"), slot=0)
    old_attempt = await _complete(store, run, "q/0.0", 11.0, _record("x"), slot=1, attempt=1)
    assert wrong_slot.status == old_attempt.status == COMPLETE_STALE
    assert await store.redis.xlen(store.completions_key) == 0
    right = await _complete(store, run, "q/0.0", 11.0, _record("x"), slot=1, attempt=2)
    assert right.applied and set(right.released) == {1, 2}


async def test_a_call_failing_on_every_attempt_fails_its_query_once(store: WorkflowStore) -> None:
    await _diamond(store)

    async def fail(attempt: int) -> FailureResult:
        await _place(store, "q", {"q/0.0": Placement(0, 0, attempt)}, {})
        return await store.fail_call(
            "q", "q/0.0", slot=0, attempt=attempt, max_attempts=3, now=20.0, reason="boom"
        )

    assert (await fail(1)).retry
    # The failed attempt is over: its late completion is not taken for the next one.
    late = await _complete(store, _diamond_run(), "q/0.0", 11.0, _record("x"), slot=0, attempt=1)
    assert late.status == COMPLETE_STALE
    assert (await fail(2)).retry
    last = await fail(3)
    assert last.query_failed and last.failures == 3
    stored = await store.load("q")
    assert stored is not None
    assert (stored.fields["state"], stored.fields["reason"]) == ("failed", "boom")
    assert await store.active_ids() == []
    assert 0 < await store.redis.pttl(store.qkey("q")) <= store.retention_ms
    assert (await fail(4)).status == -1  # ended: nothing more is counted


async def test_finished_queries_expire_after_the_retention_window(store: WorkflowStore) -> None:
    short = WorkflowStore(store.redis, store.prefix, retention_s=0.2, stream_maxlen=10)
    await short.submit("q", b"spec", "acme", 0.0, 100.0, [1], [0], shape=b"shape")
    await _place(short, "q", {}, {}, [b"event"])
    r = await short.complete(
        "q", "q/0.0", 0, [], CompletionEffect(True, (), True), 1.0, _record("q/0.0")
    )
    assert r.applied and r.calls_left == 0
    (entry,) = await store.redis.xrange(short.finished_key)
    assert entry[1][b"submit"] == b"shape"  # the finished stream keeps no prompts
    # A log written after the end (the write-behind) gets the window again.
    await _place(short, "q", {}, {}, [b"late event"], ended=True)
    assert 0 < await store.redis.pttl(short.evkey("q")) <= 200
    await asyncio.sleep(0.4)
    assert await store.redis.exists(short.qkey("q"), short.evkey("q")) == 0
    # Even one that lands after the window leaves nothing that does not expire.
    await _place(short, "q", {"q/0.0": Placement(0, 0, 1)}, {}, [b"very late"], ended=True)
    assert 0 < await store.redis.pttl(short.qkey("q")) <= 200
    assert 0 < await store.redis.pttl(short.evkey("q")) <= 200
    # What it left is no query (reading it once raised KeyError: INTERNAL to a client)...
    assert await short.load("q") is None
    # ... and a new query of that id starts clean: none of its placements or events.
    created, _ = await short.submit("q", b"again", "acme", 2.0, 100.0, [1], [0])
    assert created
    again = await short.load("q")
    assert again is not None and again.submit == b"again"
    assert not any(k.startswith(PLACED) for k in again.fields), again.fields
    assert await short.events("q") == []
    assert await store.redis.pttl(short.qkey("q")) == -1  # running: no retention window
    # A late log alone (no placements) is no query either, and no new one inherits it.
    await _place(short, "lone", {}, {}, [b"late"], ended=True)
    assert await short.load("lone") is None
    assert (await short.submit("lone", b"new", "acme", 3.0, 100.0, [1], [0]))[0]
    assert await short.events("lone") == []


async def test_no_query_id_can_reach_another_querys_keys(store: WorkflowStore) -> None:
    ids = ["x", "x:ev", "ev:x", "q:x", "active", "x/0.0"]
    for query_id in ids:
        assert (await store.submit(query_id, b"s", "t", 0.0, 10.0, [1], [0]))[0]
        await _place(store, query_id, {}, {}, [query_id.encode()])
    for query_id in ids:
        assert await store.events(query_id) == [query_id.encode()]
        stored = await store.load(query_id)
        assert stored is not None and stored.fields["state"] == "running"
    assert await store.active_ids() == sorted(ids)


async def test_alpha_history_is_bounded(store: WorkflowStore) -> None:
    for n in range(ALPHA_HISTORY_MAX + 20):
        await store.set_alpha(0.5, float(n), "test")
    assert await store.redis.llen(f"{store.prefix}alpha:history") == ALPHA_HISTORY_MAX
    history = await store.alpha_history()
    assert len(history) == ALPHA_HISTORY_MAX and history[0].time_s == 20.0  # oldest first
    assert [c.time_s for c in await store.alpha_history(2)] == [
        ALPHA_HISTORY_MAX + 18.0,
        ALPHA_HISTORY_MAX + 19.0,
    ]


async def test_the_alpha_history_is_every_change_kept_or_only_recorded(
    store: WorkflowStore,
) -> None:
    assert await store.alpha_history() == [] and await store.alpha() is None
    await store.record_alpha(0.5, 1.0, "--alpha at start")  # the history alone
    assert await store.alpha() is None
    await store.set_alpha(0.3, 2.0, "tune-000001")  # kept for a restart, and recorded
    await store.redis.rpush(f"{store.prefix}alpha:history", b"not json")
    await store.set_alpha(0.7, 3.0, "operator")
    assert await store.alpha() == 0.7
    assert [(c.time_s, c.alpha, c.reason) for c in await store.alpha_history()] == [
        (1.0, 0.5, "--alpha at start"),
        (2.0, 0.3, "tune-000001"),
        (3.0, 0.7, "operator"),  # the unreadable entry skipped
    ]
