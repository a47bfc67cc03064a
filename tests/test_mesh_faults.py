"""The mesh under faults, with real processes and a real Redis: a call that always fails, a
Redis killed -9 and restarted mid-replay, query ids shaped like other keys, and Redis kept
bounded by the retention window. Each run ends with ``hexgen-flow check-state`` clean.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import redis

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_client.client import CoordinatorClient
from hexgen_flow.traces import load_trace, take_queries
from hexgen_flow.workload import LLMCall, Query, Workflow
from hexgen_launch.cluster import LocalCluster, LocalClusterConfig, WorkerLaunch
from hexgen_launch.errors import ClusterError
from hexgen_launch.processes import RedisServer, find_redis_server
from hexgen_launch.replay import replay
from up_runner import check_state

try:
    REDIS_SERVER = find_redis_server()
except ClusterError:
    REDIS_SERVER = ""

pytestmark = pytest.mark.skipif(
    not REDIS_SERVER, reason="redis-server is not installed (apt install redis-server)"
)

K = cpb.QueryEventKind


def assert_clean(mesh: LocalCluster) -> dict[str, object]:
    assert mesh.redis_url is not None
    status, report = check_state(mesh.redis_url, "--prefix", mesh.config.redis_prefix)
    assert status == 0, report
    assert report["running"] == 0, report
    return report


def _one_call(query_id: str, input_tokens: int = 300) -> Query:
    return Query(query_id, Workflow.chain([(LLMCall("evaluate", input_tokens, 8),)]))


async def _events(client: CoordinatorClient, query_id: str) -> list[cpb.QueryEvent]:
    return [e async for e in client.watch(query_id)]


# ----------------------------------------------------------------------- failing calls


def test_a_call_that_always_fails_ends_its_query_failed_and_the_mesh_serves_on() -> None:
    # The worker declares a KV cache smaller than its slot's: a 5,000-token call fits the
    # cluster (the coordinator admits it) but never this engine, so every attempt fails.
    config = LocalClusterConfig(
        cluster="A100",
        listen="127.0.0.1:0",
        tuner=False,
        time_scale=50.0,
        max_call_attempts=3,
        workers=(WorkerLaunch(args=("--kv-cache-tokens", "2000")),),
        start_timeout_s=30,
    )

    async def main(mesh: LocalCluster) -> None:
        async with CoordinatorClient(mesh.coordinator_address) as client:
            await client.submit(_one_call("doomed", 5000))
            await client.submit(_one_call("fine", 300))
            doomed = await _events(client, "doomed")
            fine = await _events(client, "fine")
            kinds = Counter(e.kind for e in doomed)
            assert kinds[K.QUERY_EVENT_KIND_CALL_FAILED] == 3
            assert kinds[K.QUERY_EVENT_KIND_CALL_DISPATCHED] == 3  # no endless redispatch
            assert doomed[-1].kind == K.QUERY_EVENT_KIND_FAILED
            assert "failed 3 times" in doomed[-1].text and "never fit" in doomed[-1].text
            assert fine[-1].kind == K.QUERY_EVENT_KIND_SUCCEEDED
            info = (await client.get("doomed")).query
            assert info.state == cpb.QUERY_STATE_FAILED
            assert "never fit" in info.failure_reason
            status = await client.status()
            assert (status.queries_failed, status.queries_finished) == (1, 1)

    with LocalCluster(config) as mesh:
        asyncio.run(main(mesh))
        assert_clean(mesh)


# ----------------------------------------------------------------------- ids and retention


def test_ids_shaped_like_other_keys_keep_to_their_own_query() -> None:
    ids = ["x", "x:ev", "ev:x", "q:x", "active", "finished"]
    config = LocalClusterConfig(
        cluster="A100", listen="127.0.0.1:0", tuner=False, time_scale=50.0, start_timeout_s=30
    )

    async def main(mesh: LocalCluster) -> None:
        async with CoordinatorClient(mesh.coordinator_address) as client:
            for query_id in ids:
                await client.submit(_one_call(query_id))
            for query_id in ids:
                events = await _events(client, query_id)
                assert events[-1].kind == K.QUERY_EVENT_KIND_SUCCEEDED, query_id
                reply = await client.get(query_id)
                assert reply.query.state == cpb.QUERY_STATE_SUCCEEDED
                assert {e.query_id for e in reply.events} == {query_id}

    with LocalCluster(config) as mesh:
        asyncio.run(main(mesh))
        assert_clean(mesh)


def test_redis_stays_bounded_after_a_thousand_queries_and_the_retention_window() -> None:
    retention_s = 2.0
    config = LocalClusterConfig(
        cluster="A100,A100",
        listen="127.0.0.1:0",
        tuner=False,
        time_scale=200.0,
        retention_s=retention_s,
        start_timeout_s=30,
    )
    queries = [_one_call(f"r{n}") for n in range(1000)]

    async def main(mesh: LocalCluster) -> None:
        async with CoordinatorClient(mesh.coordinator_address) as client:
            metrics = await replay(client, queries, 50.0, seed=0)
            assert metrics.completed == len(queries)

    with LocalCluster(config) as mesh:
        asyncio.run(main(mesh))
        assert mesh.redis_url is not None
        client = redis.Redis.from_url(mesh.redis_url)
        try:
            prefix = mesh.config.redis_prefix
            during = sum(1 for _ in client.scan_iter(match=prefix + "*", count=1000))
            time.sleep(retention_s + 1.0)
            keys = sorted(k.decode() for k in client.scan_iter(match=prefix + "*", count=1000))
            print(f"keys under {prefix!r}: {during} at the end of the run, {len(keys)} after")
            # meta, qseq, the two streams and nothing per query (`active` is empty: gone)
            assert len(keys) <= 6, keys
            assert client.xlen(prefix + "completions") == len(queries)
            used = client.info("memory")["used_memory"]
            print(f"redis used_memory after the window: {used / 1e6:.1f} MB")
        finally:
            client.close()
        report = assert_clean(mesh)
        assert report["queries"] == 0


# ----------------------------------------------------------------------- Redis restarts


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own (append-only file, fsync always), which the test
    kills -9 and starts again on the same port with the same data."""
    with RedisServer(appendfsync="always") as server:
        yield server


def test_redis_killed_and_restarted_mid_replay_loses_and_repeats_nothing(
    own_redis: RedisServer,
) -> None:
    queries = take_queries(load_trace("trace3"), 100)
    call_ids = {
        f"{q.query_id}/{k}.{i}"
        for q in queries
        for k, stage in enumerate(q.workflow.stages)
        for i in range(len(stage.calls))
    }
    config = LocalClusterConfig(
        listen="127.0.0.1:0",
        tuner=False,
        time_scale=50.0,
        redis_url=own_redis.url,
        admission="off",  # the point is Redis going away, not overload
        start_timeout_s=30,
    )

    def outage() -> None:
        assert own_redis.process is not None
        own_redis.process.send(signal.SIGKILL)
        time.sleep(2.0)
        own_redis.restart(wait=True)

    async def main(mesh: LocalCluster) -> None:
        async with CoordinatorClient(mesh.coordinator_address) as client:
            run = asyncio.create_task(replay(client, queries, 1.0, seed=0, retry_s=60))
            await asyncio.sleep(1.5)
            assert not run.done(), "the run ended before Redis went away"
            await asyncio.to_thread(outage)
            metrics = await run
            assert metrics.completed == len(queries)

    with LocalCluster(config) as mesh:
        asyncio.run(main(mesh))
        assert not mesh.exited(), "a service died with Redis"
        client = redis.Redis.from_url(own_redis.url)
        try:
            entries = client.xrange(f"{config.redis_prefix}completions")
            done = Counter(fields[b"call_id"].decode() for _, fields in entries)
        finally:
            client.close()
        assert set(done) == call_ids
        assert [c for c, n in done.items() if n != 1] == []
        assert_clean(mesh)
