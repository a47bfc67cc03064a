"""``hexgen-flow check-state`` on states built by the coordinator's own store scripts in a
real Redis: clean ones pass (exit 0), and each kind of damage is counted (exit 1)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from hexgen_coordinator.store import WorkflowStore
from hexgen_flow.runtime import CompletionEffect
from redis_here import REDIS_URL, needs_redis
from up_runner import check_state

pytestmark = needs_redis

# What the core's rule (`QueryRun.completion_effect`) gives each completion below, which the
# store's script applies: the first stage of two releases the second; the last call ends
# the query.
FIRST = CompletionEffect(True, (1,), False)
LAST = CompletionEffect(True, (), True)


@pytest.fixture
async def store() -> AsyncIterator[WorkflowStore]:
    client = aioredis.Redis.from_url(REDIS_URL)
    store = WorkflowStore(client, f"hf-fsck-{uuid.uuid4().hex[:8]}:", retention_s=60)
    yield store
    keys = [k async for k in client.scan_iter(match=f"{store.prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


def _record(call_id: str) -> dict[str, str | int | float]:
    return {"query_id": call_id.split("/", maxsplit=1)[0], "call_id": call_id}


async def _two_stage(store: WorkflowStore, query_id: str) -> None:
    await store.submit(query_id, b"s", "t", 0.0, 100.0, [1, 1], [0, 1])


def _check(store: WorkflowStore) -> tuple[int, dict[str, object]]:
    return check_state(REDIS_URL, "--prefix", store.prefix)


async def test_a_clean_state_passes(store: WorkflowStore) -> None:
    await _two_stage(store, "done")
    await store.complete("done", "done/0.0", 0, [1], FIRST, 1.0, _record("done/0.0"))
    await store.complete("done", "done/1.0", 1, [], LAST, 2.0, _record("done/1.0"))
    await _two_stage(store, "running")
    # a write-behind that landed after its query expired: it has the window again, no query
    await store.write(store.place_commands("gone", {}, {0: 9.0}, [b"late"], ended=True))
    # the α history, and the one an older tuner kept (retired, harmless: no orphan)
    await store.set_alpha(0.4, 1.0, "operator")
    await store.redis.rpush(f"{store.prefix}tuner:alpha_history", b"{}")
    code, report = _check(store)
    assert code == 0, report
    assert (report["queries"], report["calls"], report["running"]) == (2, 4, 1)


async def test_each_kind_of_damage_is_counted(store: WorkflowStore) -> None:
    r, p = store.redis, store.prefix
    await _two_stage(store, "twice")
    await store.complete("twice", "twice/0.0", 0, [1], FIRST, 1.0, _record("twice/0.0"))
    await r.hincrby(store.qkey("twice"), "calls_left", -1)  # counted down again
    await r.xadd(store.completions_key, _record("twice/0.0"))  # and recorded again
    await _two_stage(store, "uncounted")
    await r.hset(store.qkey("uncounted"), "c:uncounted/0.0", "done")  # done, not counted
    await _two_stage(store, "lost")
    await r.srem(store.active_key, "lost")  # running, but no coordinator would resume it
    await _two_stage(store, "forever")
    await store.cancel("forever", 3.0)
    await r.persist(store.qkey("forever"))  # ended, yet never expires
    await r.rpush(store.evkey("nobody"), b"e")  # a log without its query
    await r.set(f"{p}stray", b"x")  # belongs to nothing
    await store.write(store.place_commands("late", {}, {0: 9.0}))  # a late write, no window
    code, report = _check(store)
    assert code == 1
    assert report["duplicate_completions"] == 2, report  # the count and the stream
    assert report["missing_completions"] == 1, report
    assert report["stuck_queries"] == 1, report
    assert report["orphan_keys"] == 4, report
    problems = "\n".join(report["problems"])  # type: ignore[arg-type]
    for words in ("twice", "uncounted", "'lost'", "never expires", "nobody", "stray", "'late'"):
        assert words in problems


def test_no_redis_is_exit_2_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hexgen_cli", "check-state", "--redis-url",
         "redis://127.0.0.1:1/0"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "cannot reach redis://127.0.0.1:1/0" in line
