"""The mesh on Redis behind Sentinel (``--redis-url redis+sentinel://HOST:PORT/SERVICE``): the
URL form and its refusals, then a real master, replica and Sentinel (`RedisSentinelHere`)
under a local mesh, failed over mid-replay: every call completes once, on the promoted
replica, and ``check-state`` through the Sentinel finds the state clean."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest

from hexgen_api.v1 import tuner_pb2, tuner_pb2_grpc
from hexgen_client.client import CoordinatorClient
from hexgen_flow.errors import ConfigError
from hexgen_launch.cluster import LocalCluster
from hexgen_launch.replay import replay
from hexgen_service.redis_sentinel import SentinelUrl, parse_sentinel_url, sync_master
from redis_sentinel_here import SERVICE, RedisSentinelHere, needs_redis_sentinel
from replay_on_redis import assert_each_call_completed_once, mesh_config, trace3_replay
from up_runner import check_state

NUM_QUERIES = 24
QPS = 2.0
TIME_SCALE = 25.0
PREFIX = "hf:"
QUERIES, CALL_IDS = trace3_replay("rs", NUM_QUERIES)


# ------------------------------------------------------------------------- the URL


def test_a_sentinel_url_names_its_sentinels_service_user_and_db() -> None:
    assert parse_sentinel_url("redis://127.0.0.1:6379/0") is None  # a plain Redis
    assert parse_sentinel_url("redis+sentinel://10.0.0.1:26379/hexgen") == SentinelUrl(
        (("10.0.0.1", 26379),), "hexgen"
    )
    url = parse_sentinel_url("redis+sentinel://coordinator@a:1,b:2,[::1]:3/my%20svc/4")
    assert url == SentinelUrl((("a", 1), ("b", 2), ("::1", 3)), "my svc", 4, "coordinator")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("redis+sentinel://127.0.0.1:26379", "name the master's service"),
        ("redis+sentinel://127.0.0.1:26379/hexgen/x", "name the master's service"),
        ("redis+sentinel://127.0.0.1/hexgen", "is not HOST:PORT"),
        ("redis+sentinel://h:1,h:70000/hexgen", "is not HOST:PORT"),
        ("redis+sentinel://u:secret@h:1/hexgen", "no password in the URL"),
    ],
)
def test_a_malformed_sentinel_url_names_the_option(url: str, words: str) -> None:
    with pytest.raises(ConfigError, match="--redis-url") as caught:
        parse_sentinel_url(url)
    assert words in str(caught.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "hexgen_coordinator"],
        ["-m", "hexgen_tuner"],
        ["-m", "hexgen_cli", "check-state"],
    ],
    ids=["coordinator", "tuner", "check-state"],
)
@pytest.mark.parametrize(
    ("options", "words"),
    [
        (["--redis-url", "redis+sentinel://127.0.0.1:1"], "name the master's service"),
        (
            ["--redis-url", "redis+sentinel://127.0.0.1:1/hexgen", "--redis-cluster"],
            "give one or the other",
        ),
    ],
    ids=["no-service", "with-cluster"],
)
def test_the_services_refuse_a_bad_sentinel_url_in_one_line(
    argv: list[str], options: list[str], words: str
) -> None:
    done = subprocess.run(
        [sys.executable, *argv, *options],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "error: --redis-url" in done.stderr and words in done.stderr


# ------------------------------------------------------------------------ the mesh


@pytest.fixture(scope="module")
def here() -> Iterator[RedisSentinelHere]:
    with RedisSentinelHere() as started:
        yield started


@pytest.fixture(scope="module")
def mesh(here: RedisSentinelHere) -> Iterator[LocalCluster]:
    config = mesh_config(here.url, TIME_SCALE)
    with LocalCluster(config) as cluster:
        yield cluster


@needs_redis_sentinel
def test_a_replay_rides_out_a_failover_and_completes_every_call_once(
    here: RedisSentinelHere, mesh: LocalCluster
) -> None:
    first = here.master_address()
    assert first == ("127.0.0.1", here.master_port)

    async def main() -> tuple[str, int]:
        async with CoordinatorClient(mesh.coordinator_address) as client:
            run = asyncio.create_task(replay(client, QUERIES, QPS, seed=0, retry_s=60))
            await asyncio.sleep(3.0)
            assert not run.done(), "the run ended before the failover"
            promoted = await asyncio.to_thread(here.failover)
            metrics = await run
        assert metrics.completed == metrics.num_queries == NUM_QUERIES
        return promoted

    promoted = asyncio.run(main())
    assert promoted == ("127.0.0.1", here.replica_port)  # the replica is the master now
    url = parse_sentinel_url(here.url)
    assert url is not None
    client = sync_master(url)
    try:
        entries = client.xrange(PREFIX + "completions")
    finally:
        client.close()
    assert_each_call_completed_once(entries, CALL_IDS)
    assert mesh.status().queries_running == 0
    code, report = check_state(here.url)  # through the Sentinel, on the new master
    assert code == 0, report
    assert report["queries"] == NUM_QUERIES and report["running"] == 0, report


@needs_redis_sentinel
def test_the_tuner_retunes_from_the_promoted_master(
    here: RedisSentinelHere, mesh: LocalCluster
) -> None:
    async def retune() -> tuner_pb2.TuningRun:
        assert mesh.tuner_address is not None
        async with grpc.aio.insecure_channel(mesh.tuner_address) as channel:
            stub = tuner_pb2_grpc.TunerServiceStub(channel)
            return (await stub.Retune(tuner_pb2.RetuneRequest(), timeout=120)).run

    assert mesh.redis_url == here.url and here.url.endswith(f"/{SERVICE}")
    run = asyncio.run(retune())  # its window: the replay's queries, read on the new master
    assert run.window_queries == NUM_QUERIES and run.reason
