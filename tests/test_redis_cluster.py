"""The mesh on a real Redis Cluster: three masters on this machine (`redis_cluster_here`),
the coordinator, the tuner and ``hexgen-flow check-state`` run with ``--redis-cluster``.

The coordinator's prefix carries a hash tag (``hf:{0}:`` by default there), so every key it
and the tuner write hashes to that tag's one slot, and every Lua script, pipeline and
transaction touches that slot only. The module's mesh replays queries of a trace with the
coordinator SIGKILLed and restarted mid-run, then checks that each call was completed once,
that every key is in one slot, that the state is clean, and that the tuner retunes from the
cluster. A prefix without a hash tag is refused in one line (exit 2); the Redis ACL lines of
an auth directory let the coordinator's and the tuner's users do on a cluster what they do.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import redis

from hexgen_api.v1 import coordinator_pb2, coordinator_pb2_grpc, tuner_pb2, tuner_pb2_grpc
from hexgen_client.client import CoordinatorClient
from hexgen_coordinator.group_commit import GroupCommit
from hexgen_coordinator.redis_retry import CLUSTER_PREFIX, cluster_prefix, redis_client
from hexgen_coordinator.session_store import SessionStore
from hexgen_coordinator.store import Placement, WorkflowStore
from hexgen_flow.errors import ConfigError
from hexgen_flow.runtime import CompletionEffect
from hexgen_launch.cluster import LocalCluster
from hexgen_launch.replay import replay
from hexgen_service.auth_dir import redis_acl_line
from hexgen_tuner.store import TunerStore, TuningRunRecord
from hexgen_tuner.window import read_window
from redis_cluster_here import RedisClusterHere, needs_redis_cluster
from replay_on_redis import assert_each_call_completed_once, mesh_config, trace3_replay
from up_runner import check_state

# What the core's rule (`QueryRun.completion_effect`) gives each completion below, which the
# store's script applies: the first stage of two releases the second; the last call ends
# the query.
FIRST = CompletionEffect(True, (1,), False)
LAST = CompletionEffect(True, (), True)


pytestmark = needs_redis_cluster

NUM_QUERIES = 24
QPS = 2.0
TIME_SCALE = 25.0  # slow enough that the replay is still running when the coordinator dies
QUERIES, CALL_IDS = trace3_replay("rc", NUM_QUERIES)


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterHere]:
    with RedisClusterHere() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def mesh(redis_cluster: RedisClusterHere) -> Iterator[LocalCluster]:
    # redis_cluster: the default prefix, the services' hf:{0}:
    config = mesh_config(redis_cluster.url, TIME_SCALE, redis_cluster=True)
    with LocalCluster(config) as cluster:
        yield cluster


# ---------------------------------------------------------------------- the prefix


def test_a_cluster_prefix_needs_a_hash_tag() -> None:
    # one rule, for the coordinator, the tuner and check-state (hexgen_service.redis_keys)
    assert cluster_prefix(None, cluster=True) == CLUSTER_PREFIX == "hf:{0}:"
    assert cluster_prefix(None, cluster=False) == "hf:"
    assert cluster_prefix("hf:", cluster=False) == "hf:"  # a single Redis: as it was
    for tagged in ("hf:{s0}:", "{x}", "a{b}c{}:"):
        assert cluster_prefix(tagged, cluster=True) == tagged
    for untagged in ("hf:", "hf:{}:", "hf:}{:", "hf:{"):
        with pytest.raises(ConfigError, match="--redis-prefix"):
            cluster_prefix(untagged, cluster=True)


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "hexgen_coordinator", "--redis-cluster", "--redis-prefix", "hf:"],
        ["-m", "hexgen_tuner", "--redis-cluster", "--redis-prefix", "shard0:"],
        ["-m", "hexgen_cli", "check-state", "--redis-cluster", "--prefix", "hf:{}:"],
    ],
    ids=["coordinator", "tuner", "check-state"],
)
def test_a_prefix_without_a_hash_tag_is_refused_in_one_line(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, *argv, "--redis-url", "redis://127.0.0.1:1/0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "error: --redis-prefix" in done.stderr and "hash tag" in done.stderr


async def test_a_burst_waits_for_connections_as_on_a_single_redis(
    redis_cluster: RedisClusterHere,
) -> None:
    """redis-py's cluster client fails a command at once when its node's connections are
    all busy; the coordinator's waits for one, as its single-Redis pool does."""
    client = redis_client(redis_cluster.url, max_connections=2, cluster=True)
    try:
        key = "burst:{b}:n"
        await asyncio.gather(*(client.incr(key) for _ in range(100)))
        assert int(await client.get(key) or 0) == 100
        await client.delete(key)
    finally:
        await client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


async def test_a_group_commit_batch_runs_in_its_prefix_slot(
    redis_cluster: RedisClusterHere,
) -> None:
    """Completions batched by `GroupCommit` span workflows; their keys share the prefix's
    hash tag, so the batch is one slot's script on a cluster too."""
    client = redis_client(redis_cluster.url, max_connections=4, cluster=True)
    script = """
local function apply(KEYS, ARGV)
  return redis.call('INCRBY', KEYS[1], ARGV[1])
end
"""
    commit = GroupCommit(client, script)
    keys = [f"{CLUSTER_PREFIX}q:{i}" for i in range(8)]
    try:
        await asyncio.gather(*(commit(keys=[key], args=[i + 1]) for i, key in enumerate(keys)))
        assert commit.round_trips == 2  # one alone, seven in one batch
        assert [int(await client.get(key) or 0) for key in keys] == list(range(1, 9))
        await client.delete(*keys)
    finally:
        await client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


# ------------------------------------------------------------------------ the mesh


def test_a_replay_with_a_coordinator_restart_completes_every_call_once(
    mesh: LocalCluster,
) -> None:
    async def main() -> None:
        async with CoordinatorClient(mesh.coordinator_address) as client:
            run = asyncio.create_task(replay(client, QUERIES, QPS, seed=0, retry_s=60))
            await asyncio.sleep(4.0)
            assert not run.done(), "the run ended before the coordinator could be killed"
            await asyncio.to_thread(mesh.restart_coordinator)  # SIGKILL, start, reconnect
            metrics = await run
        assert metrics.completed == metrics.num_queries == NUM_QUERIES

    asyncio.run(main())
    client = _cluster_client(mesh)
    try:
        entries = client.xrange(CLUSTER_PREFIX + "completions")
    finally:
        client.close()
    assert_each_call_completed_once(entries, CALL_IDS)
    status = mesh.status()
    assert status.queries_running == 0
    with grpc.insecure_channel(mesh.coordinator_address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        for q in QUERIES:  # the restarted coordinator reads them back from the cluster
            reply = stub.GetQuery(coordinator_pb2.GetQueryRequest(query_id=q.query_id))
            assert reply.query.state == coordinator_pb2.QUERY_STATE_SUCCEEDED


def test_the_tuner_retunes_from_the_cluster(mesh: LocalCluster) -> None:
    async def retune() -> tuner_pb2.TuningRun:
        assert mesh.tuner_address is not None
        async with grpc.aio.insecure_channel(mesh.tuner_address) as channel:
            stub = tuner_pb2_grpc.TunerServiceStub(channel)
            run = (await stub.Retune(tuner_pb2.RetuneRequest(), timeout=120)).run
            listed = await stub.ListTuningRuns(tuner_pb2.ListTuningRunsRequest())
            assert run.run_id in [r.run_id for r in listed.runs]
            got = await stub.GetAlpha(tuner_pb2.GetAlphaRequest())
            assert got.history  # the coordinator's: the α it started with, at least
            return run

    client = _cluster_client(mesh)
    try:
        finished = client.xlen(CLUSTER_PREFIX + "finished")
        run = asyncio.run(retune())
        assert client.llen(CLUSTER_PREFIX + "tuner:runs") >= 1
    finally:
        client.close()
    assert finished >= NUM_QUERIES
    assert run.window_queries == min(finished, 200) and run.reason


def test_every_key_is_in_one_slot_and_the_state_is_clean(mesh: LocalCluster) -> None:
    client = _cluster_client(mesh)
    try:
        keys = [k.decode() for k in client.scan_iter(match="*", count=1000)]  # every master
        slots = {int(client.cluster_keyslot(k)) for k in keys}  # type: ignore[no-untyped-call]
        per_master = [int(client.dbsize(target_nodes=node)) for node in client.get_primaries()]
    finally:
        client.close()
    assert keys and all(k.startswith(CLUSTER_PREFIX) for k in keys), keys[:5]
    assert {f"{CLUSTER_PREFIX}{name}" for name in ("qseq", "meta", "finished")} <= set(keys)
    assert any(k.startswith(f"{CLUSTER_PREFIX}tuner:") for k in keys)  # the tuner's too
    assert len(slots) == 1, slots
    assert sorted(per_master)[:-1] == [0, 0], per_master  # one master holds them all
    code, report = check_state(mesh.redis_url or "", "--redis-cluster")
    assert code == 0, report
    assert report["queries"] == NUM_QUERIES and report["running"] == 0, report


def _cluster_client(mesh: LocalCluster) -> redis.RedisCluster[bytes]:
    assert mesh.redis_url is not None
    return redis.RedisCluster.from_url(mesh.redis_url)


# ------------------------------------------------------------------- the Redis ACL


async def test_the_acl_users_do_their_work_on_a_cluster(redis_cluster: RedisClusterHere) -> None:
    """Each master gets the ACL lines of an auth directory (`redis_acl_line`) for a prefix
    with a hash tag; the coordinator's store and sessions and the tuner's store, logged in
    as their users through the cluster clients, are refused nothing (ACL LOG)."""
    prefix = "acl:{t}:"
    for port in redis_cluster.ports:
        with redis.Redis(port=port) as node:
            node.acl_log_reset()
            for user, password in (("coordinator", "c-secret"), ("tuner", "t-secret")):
                words = redis_acl_line(user, password, prefix).split()
                assert words[:2] == ["user", user]
                node.execute_command("ACL", "SETUSER", user, "reset", *words[2:])
    host = f"127.0.0.1:{redis_cluster.ports[1]}"  # any node: the others are discovered
    coordinator = redis_client(f"redis://coordinator@{host}/0", password="c-secret", cluster=True)
    tuner_client = redis_client(f"redis://tuner@{host}/0", password="t-secret", cluster=True)
    try:
        store = WorkflowStore(coordinator, prefix, retention_s=60)
        await store.epoch(time.time(), 1.0)
        await store.set_alpha(0.5, 0.0, "test")  # a MULTI/EXEC transaction
        assert await store.submit("q", b"spec", "t", 0.0, 10.0, [1, 1], [0, 1]) == (True, 0)
        await store.write(
            store.place_commands("q", {"q/0.0": Placement(0, 1, 1)}, {0: 5.0}, [b"e"])
        )
        await store.complete(
            "q", "q/0.0", 0, [1], FIRST, 1.0, {"call_id": "q/0.0"}, slot=0, attempt=1
        )
        await store.complete("q", "q/1.0", 1, [], LAST, 2.0, {"call_id": "q/1.0"})
        assert (await store.load("q")) is not None and await store.events("q") == [b"e"]
        await store.submit("s", b"spec", "t", 0.0, 10.0, [0], [0], session_idle_s=5.0)
        closed = await SessionStore(store).close_stages(
            "s", [0], shape=None, close_session=True, now=3.0
        )
        assert closed == 2  # closing the session ended it
        assert await store.active_ids() == []
        tuner = TunerStore(tuner_client, prefix)
        assert (await tuner.next_run_id()).startswith("tune-")
        run = TuningRunRecord("tune-000001", 1.0, 2.0, 0, 0.0, (), 0.5, 0.5, False, "test")
        await tuner.record_run(run)  # a transaction too
        window = await read_window(tuner_client, prefix, 10)
        # Both streams read (no NOPERM): the made-up shapes above, q's in `admitted` and
        # q's and s's in `finished`.
        assert window.skipped == 3
    finally:
        for client in (coordinator, tuner_client):
            await client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose
    denied: list[str] = []
    for port in redis_cluster.ports:
        with redis.Redis(port=port) as node:
            entries: list[dict[str, Any]] = node.acl_log()
            denied += [
                f"{_text(e['username'])}: {_text(e['object'])}"
                for e in entries
                if _text(e["object"]) != "client|setinfo"  # redis-py ignores its refusal
            ]
            for key in node.scan_iter(match=f"{prefix}*"):  # the mesh's keys stay alone
                node.delete(key)
    assert denied == []


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def test_up_on_a_redis_cluster_needs_the_node_to_use() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hexgen_cli", "up", "--redis-cluster"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--redis-cluster: give --redis-url, a node of the Redis Cluster" in done.stderr
