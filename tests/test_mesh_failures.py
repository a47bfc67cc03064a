"""200 queries of trace3 through the whole mesh (real processes: private redis-server,
coordinator, four simulated workers), undisturbed, with a worker SIGKILLed mid-run, and
with the coordinator SIGKILLed and restarted mid-run.

Every query must complete, and every call must be completed exactly once: the Redis
`completions` stream (one entry per applied completion) holds each call id of the run once
and nothing else. The runs replay at time scale 50 (about 15-25 s of wall time each).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterator

import grpc
import pytest
import redis

from hexgen_api.v1 import coordinator_pb2, coordinator_pb2_grpc
from hexgen_client.client import CoordinatorClient
from hexgen_flow.traces import load_trace, take_queries
from hexgen_flow.workload import Query
from hexgen_launch.cluster import LocalCluster, LocalClusterConfig
from hexgen_launch.errors import ClusterError
from hexgen_launch.processes import find_redis_server
from hexgen_launch.replay import replay

NUM_QUERIES = 200
QPS = 0.5
TIME_SCALE = 50.0

try:
    find_redis_server()
    HAVE_REDIS_SERVER = True
except ClusterError:
    HAVE_REDIS_SERVER = False

pytestmark = pytest.mark.skipif(
    not HAVE_REDIS_SERVER, reason="redis-server is not installed (apt install redis-server)"
)

QUERIES: list[Query] = take_queries(load_trace("trace3"), NUM_QUERIES)
CALL_IDS = {
    f"{q.query_id}/{k}.{i}"
    for q in QUERIES
    for k, stage in enumerate(q.workflow.stages)
    for i in range(len(stage.calls))
}


@pytest.fixture
def mesh() -> Iterator[LocalCluster]:
    config = LocalClusterConfig(
        listen="127.0.0.1:0",
        tuner=False,
        time_scale=TIME_SCALE,
        start_timeout_s=30,
        admission="off",  # every query is admitted: the point is what faults do to them
    )
    with LocalCluster(config) as cluster:
        yield cluster


def _run(mesh: LocalCluster, disturb: Callable[[], None] | None, at_s: float) -> float:
    """Replay the 200 queries; call `disturb` (in a thread) `at_s` wall seconds in."""

    async def main() -> None:
        async with CoordinatorClient(mesh.coordinator_address) as client:
            run = asyncio.create_task(replay(client, QUERIES, QPS, seed=0, retry_s=60))
            if disturb is not None:
                await asyncio.sleep(at_s)
                assert not run.done(), "the run ended before it could be disturbed"
                await asyncio.to_thread(disturb)
            metrics = await run
        assert metrics.completed == metrics.num_queries == NUM_QUERIES

    started = time.monotonic()
    asyncio.run(main())
    return time.monotonic() - started


def _completions(mesh: LocalCluster) -> Counter[str]:
    assert mesh.redis_url is not None
    client = redis.Redis.from_url(mesh.redis_url)
    try:
        entries = client.xrange(f"{mesh.config.redis_prefix}completions")
        return Counter(fields[b"call_id"].decode() for _, fields in entries)
    finally:
        client.close()


def _assert_each_call_completed_once(mesh: LocalCluster) -> None:
    done = _completions(mesh)
    assert set(done) == CALL_IDS, "calls lost or unknown calls completed"
    twice = [c for c, n in done.items() if n != 1]
    assert not twice, f"completed more than once: {twice[:5]}"
    status = mesh.status()
    assert status.queries_running == 0
    assert sum(i.in_flight for i in status.instances) == 0


def _events(mesh: LocalCluster, kind: int) -> int:
    with grpc.insecure_channel(mesh.coordinator_address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        total = 0
        for q in QUERIES:
            reply = stub.GetQuery(coordinator_pb2.GetQueryRequest(query_id=q.query_id))
            assert reply.query.state == coordinator_pb2.QUERY_STATE_SUCCEEDED
            total += sum(1 for e in reply.events if e.kind == kind)
        return total


def test_200_queries_all_complete(mesh: LocalCluster) -> None:
    wall = _run(mesh, None, 0.0)
    print(f"200 queries of trace3 at time scale {TIME_SCALE:g}: {wall:.1f} s wall")
    _assert_each_call_completed_once(mesh)
    assert _events(mesh, coordinator_pb2.QUERY_EVENT_KIND_CALL_REDISPATCHED) == 0


def test_a_worker_sigkilled_mid_run_loses_nothing(mesh: LocalCluster) -> None:
    killed = 1  # an A100: it holds the most calls

    def kill() -> None:
        assert mesh.status().instances[killed].in_flight > 0, "nothing to lose yet"
        mesh.kill_worker(killed)

    wall = _run(mesh, kill, 5.0)
    print(f"worker {killed} SIGKILLed 5 s in: {wall:.1f} s wall")
    _assert_each_call_completed_once(mesh)
    assert not mesh.status().instances[killed].connected
    assert _events(mesh, coordinator_pb2.QUERY_EVENT_KIND_CALL_REDISPATCHED) > 0


def test_a_coordinator_sigkilled_and_restarted_mid_run_loses_nothing(mesh: LocalCluster) -> None:
    def crash_and_restart() -> None:
        mesh.kill_coordinator()
        time.sleep(1.0)  # workers finish calls meanwhile; their results wait in outboxes
        mesh.restart_coordinator()

    wall = _run(mesh, crash_and_restart, 5.0)
    print(f"coordinator SIGKILLed 5 s in and restarted: {wall:.1f} s wall")
    _assert_each_call_completed_once(mesh)
