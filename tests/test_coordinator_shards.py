"""Coordinator shards with a spare, as real processes on one real Redis
(`hexgen_launch.sharded_mesh.LocalShardedMesh`: two shards, one spare, four simulated
workers linked to all three).

Each shard is held by the coordinator started for it (its lease in Redis), the spare waits
with its doors closed, a workflow sent to the wrong shard is redirected to its owner
(FAILED_PRECONDITION with the owner's address in ``hexgen-shard-owner``), and a shard whose
coordinator is SIGKILLed is taken over by the spare, which resumes the shard's workflows
from Redis and finishes them: the workers hand the dead coordinator's calls over to the spare
(`hexgen_worker.handover`), which takes them (reclaims them, or the results that finished
meanwhile) instead of running them again, every call completes exactly once and
`check-state` is clean for both shards. The lease rules themselves (take, renew, lose,
release) are tests/test_shard_lease.py's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import redis.asyncio as aioredis

from hexgen_api.v1 import coordinator_pb2, coordinator_pb2_grpc
from hexgen_client.client import CoordinatorClient
from hexgen_client.convert import submit_request
from hexgen_client.errors import CoordinatorUnavailableError
from hexgen_coordinator.__main__ import parse_args
from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.shards import OWNER_METADATA, ShardMap
from hexgen_flow.errors import ConfigError
from hexgen_flow.workload import Query
from hexgen_launch.cluster_config import (
    SHARDED_ADMISSION,
    redis_login,
    secure_argv,
    secure_settings,
)
from hexgen_launch.processes import RedisServer
from hexgen_launch.sharded_mesh import (
    SPARE_PREFIX,
    LocalShardedMesh,
    ShardedMeshConfig,
    parse_coordinator_argv,
)
from hexgen_tuner.config import TunerConfig
from hexgen_tuner.tuner import AlphaTuner
from replay_on_redis import assert_each_call_completed_once, trace3_replay
from up_runner import check_state

TIME_SCALE = 20.0
TAKEOVER_TIMEOUT_S = 30.0
RESUME_GRACE_S = 5.0
"""Long enough for every worker's link to the spare to connect (its reconnect backoff
reaches 2 s while the spare's door is closed)."""


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalShardedMesh]:
    logs = tmp_path_factory.mktemp("coordinator-shards")
    with RedisServer(appendfsync=None) as server:
        config = ShardedMeshConfig(
            server.url, logs, time_scale=TIME_SCALE, resume_grace_s=RESUME_GRACE_S
        )
        with LocalShardedMesh(config) as running:
            yield running


def _shard_map(mesh: LocalShardedMesh) -> ShardMap:
    return ShardMap(mesh.config.prefixes)


def _ids_of(mesh: LocalShardedMesh, queries: list[Query], shard: int) -> list[Query]:
    return [q for q in queries if _shard_map(mesh).shard_of(q.query_id) == shard]


async def _submit_at(address: str, query: Query) -> coordinator_pb2.SubmitQueryResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        response: coordinator_pb2.SubmitQueryResponse = await stub.SubmitQuery(
            submit_request(query, None, None), timeout=10
        )
        return response


async def _wait_done(address: str, query_ids: list[str], timeout_s: float) -> None:
    """Until each query is SUCCEEDED at the coordinator at `address` (its shard's)."""
    deadline = time.monotonic() + timeout_s
    async with CoordinatorClient(address) as client:
        await client.wait_ready(timeout_s)  # a spare opens its doors once it has resumed
        for query_id in query_ids:
            while True:
                got = await client.get(query_id)
                if got.query.state == coordinator_pb2.QUERY_STATE_SUCCEEDED:
                    break
                assert time.monotonic() < deadline, f"{query_id}: {got.query.state}"
                await asyncio.sleep(0.2)


def test_each_shard_is_held_by_its_coordinator_and_the_spare_waits(
    mesh: LocalShardedMesh,
) -> None:
    shard_holders = [c.listen for c in mesh.coordinators[:2]]
    assert mesh.holders() == shard_holders
    spare = mesh.coordinators[2]
    assert spare.process.running
    deadline = time.monotonic() + mesh.config.start_timeout_s
    while "waiting as a spare" not in spare.process.log_path.read_text():
        assert spare.process.running, spare.process.log_tail()
        assert time.monotonic() < deadline, spare.process.log_tail()
        time.sleep(0.2)
    with pytest.raises(CoordinatorUnavailableError, match="cannot reach the coordinator"):
        asyncio.run(_status(spare.listen, timeout_s=1.0))  # its doors are closed


async def _status(address: str, timeout_s: float) -> coordinator_pb2.ClusterStatusResponse:
    async with CoordinatorClient(address, timeout_s=timeout_s) as client:
        return await client.status()


def test_a_workflow_of_another_shard_is_redirected_to_its_owner(mesh: LocalShardedMesh) -> None:
    queries, _ = trace3_replay("redirect", 8)
    theirs = _ids_of(mesh, queries, 1)[0]
    s0, s1 = mesh.coordinators[0].listen, mesh.coordinators[1].listen
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        asyncio.run(_submit_at(s0, theirs))
    error = caught.value
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"belongs to shard 1 (hf:{{s1}}:), served at {s1}" in (error.details() or "")
    assert (OWNER_METADATA, s1) in tuple(error.trailing_metadata() or ())
    # Its owner takes it, and keeps it under its own prefix only.
    assert asyncio.run(_submit_at(s1, theirs)).created
    client = redis.Redis.from_url(mesh.config.redis_url)
    try:
        assert client.exists(f"hf:{{s1}}:q:{theirs.query_id}")
        assert not client.exists(f"hf:{{s0}}:q:{theirs.query_id}")
    finally:
        client.close()


def test_the_tuner_sets_alpha_on_every_shard_and_skips_the_spare(mesh: LocalShardedMesh) -> None:
    config = TunerConfig(
        coordinator=mesh.client_addresses,
        redis_url=mesh.config.redis_url,
        shards=mesh.config.prefixes,
    )

    async def push() -> list[float]:
        store: aioredis.Redis[bytes] = aioredis.Redis.from_url(config.redis_url)
        async with CoordinatorClient(config.coordinator) as client:
            try:
                await AlphaTuner(config, store, client).push_alpha(0.37, "test")
            finally:
                await store.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose
        return [(await _status(c.listen, 10.0)).alpha for c in mesh.coordinators[:2]]

    assert asyncio.run(push()) == [0.37, 0.37]
    client = redis.Redis.from_url(mesh.config.redis_url)
    try:  # each shard keeps it: a spare that takes a shard over starts with it
        assert [float(client.hget(p + "meta", "alpha") or "nan") for p in mesh.config.prefixes] == [
            0.37,
            0.37,
        ]
    finally:
        client.close()


def test_a_killed_shard_is_taken_over_by_the_spare_and_loses_nothing(
    mesh: LocalShardedMesh,
) -> None:
    queries, calls = trace3_replay("takeover", 24)
    by_shard = [_ids_of(mesh, queries, k) for k in (0, 1)]
    assert all(by_shard), "both shards get queries"
    s0, s1, spare = mesh.coordinators
    asyncio.run(_until_own_calls_in_flight(s0.listen, 0))  # every worker has joined shard 0
    for shard, coordinator in ((0, s0), (1, s1)):
        for query in by_shard[shard]:
            assert asyncio.run(_submit_at(coordinator.listen, query)).created
    asyncio.run(_until_own_calls_in_flight(s0.listen, 1))  # shard 0's calls are on the workers
    time.sleep(0.5)  # (and Redis has their placements, written behind)
    s0.process.kill()
    # The spare takes shard 0 within about a lease time, then resumes it from Redis.
    deadline = time.monotonic() + TAKEOVER_TIMEOUT_S
    while mesh.holders()[0] != spare.listen:
        assert time.monotonic() < deadline, f"no takeover: holders {mesh.holders()}"
        time.sleep(0.2)
    asyncio.run(_wait_done(spare.listen, [q.query_id for q in by_shard[0]], TAKEOVER_TIMEOUT_S))
    asyncio.run(_wait_done(s1.listen, [q.query_id for q in by_shard[1]], TAKEOVER_TIMEOUT_S))
    log = spare.process.log_path.read_text()
    assert "took over shard 0" in log
    # The calls shard 0 had on the workers were handed over to the spare and reclaimed (or
    # their results delivered), not dispatched again.
    grace = re.search(
        r"resume grace over: (\d+) of (\d+) dispatched calls reclaimed by their workers, "
        r"(\d+) reported finished, (\d+) not reclaimed",
        log,
    )
    assert grace is not None, log[-3000:]
    reclaimed, waiting, reported, unclaimed = map(int, grace.groups())
    # (at this time scale most calls finish during the takeover: their results are handed
    # over; one the coordinator recorded but had not yet sent when killed goes out again)
    assert waiting > 0 and reclaimed + reported > 0, grace.group(0)
    assert unclaimed <= waiting // 10, grace.group(0)

    client = redis.Redis.from_url(mesh.config.redis_url)
    try:
        for shard, prefix in enumerate(mesh.config.prefixes):
            entries = client.xrange(prefix + "completions")
            mine = {c for c in calls if _shard_map(mesh).shard_of(c.rsplit("/", 1)[0]) == shard}
            ours = [(i, f) for i, f in entries if f[b"call_id"].decode() in calls]
            assert_each_call_completed_once(ours, mine)
    finally:
        client.close()
    for prefix in mesh.config.prefixes:
        code, report = check_state(mesh.config.redis_url, "--prefix", prefix)
        assert code == 0, report


async def _until_own_calls_in_flight(address: str, least: int) -> None:
    """Until every slot of the coordinator at `address` has a worker and at least `least`
    calls of its own shard are in flight on them."""
    deadline = time.monotonic() + TAKEOVER_TIMEOUT_S
    while True:
        try:
            status = await _status(address, timeout_s=5.0)
        except CoordinatorUnavailableError:  # its doors are not open yet
            assert time.monotonic() < deadline, "the coordinator never opened its doors"
            await asyncio.sleep(0.1)
            continue
        slots = status.instances
        own = sum(i.in_flight - i.others_in_flight for i in slots)
        if all(i.connected for i in slots) and own >= least:
            return
        assert time.monotonic() < deadline, status
        await asyncio.sleep(0.1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--listen", "127.0.0.1:0"], "--advertise: with --shards"),
        (["--advertise", "0.0.0.0:50051"], "--advertise: with --shards"),
        (["--shards", "hf:{s0}:,hf:{s0}:"], "--shards: a prefix appears twice"),
        (["--redis-cluster", "--shards", "hf:{s0}:,hf:s1:"], "hash tag"),
        (["--lease-ttl-s", "0"], "--lease-ttl-s must be > 0"),
    ],
)
def test_bad_shard_flags_exit_2_naming_the_flag(flags: list[str], message: str) -> None:
    argv = [sys.executable, "-m", "hexgen_coordinator", "--shards", "hf:{s0}:,hf:{s1}:", *flags]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


# ------------------------------------------------ the coordinators' command lines (no mesh)


def _mesh_here(tmp_path: Path, *, secured: bool, **given: Any) -> LocalShardedMesh:
    """A mesh, not started, as `start` leaves it before its coordinators: on a given Redis,
    or, secured, on a private one (not started either) whose ACL users the services log in
    as, with the credentials made."""
    auth_dir = tmp_path / "auth" if secured else None
    url = "" if secured else "redis://127.0.0.1:7000/0"
    config = ShardedMeshConfig(url, tmp_path / "logs", auth_dir=auth_dir, **given)
    mesh = LocalShardedMesh(config)
    mesh.redis_url = url or "redis://127.0.0.1:7000/0"
    if mesh.auth is not None:
        mesh.auth.init(config.tenants, redis_prefix=config.tuner_prefix, shards=config.prefixes)
        mesh.redis_server = RedisServer(aclfile=mesh.auth.redis_acl)
    return mesh


def _by_hand(mesh: LocalShardedMesh, listen: str, door: str, prefix: str) -> list[str]:
    """The coordinator's options as the mesh wrote them by hand before they were rendered
    through `CoordinatorConfig` (the reference the rendered ones must agree with)."""
    cfg, auth = mesh.config, mesh.auth
    redis_url, login = mesh.redis_url, list[str]()
    if auth is not None:
        redis_url, login = redis_login(mesh.redis_url, auth, "coordinator")
    token = ["--worker-token-file", str(auth.worker_token)] if auth is not None else []
    secure = []
    if auth is not None:
        secure = ["--api-keys-file", str(auth.keys), "--tls-cert", str(auth.server_cert)]
        secure += ["--tls-key", str(auth.server_key), "--tls-ca", str(auth.ca)]
    return [
        "--listen", listen,
        "--worker-listen", door,
        "--redis-url", redis_url, *login,
        "--shards", ",".join(cfg.prefixes),
        "--redis-prefix", prefix,
        *(["--redis-cluster"] if cfg.redis_cluster else []),
        "--lease-ttl-s", repr(cfg.lease_ttl_s),
        "--resume-grace-s", repr(cfg.resume_grace_s),
        "--cluster", cfg.cluster,
        "--time-scale", repr(cfg.time_scale),
        "--log-level", "INFO",
        *cfg.extra_coordinator_args,
        *token,
        *secure,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("secured", "given"),
    [
        (False, {}),
        (False, {"redis_cluster": True, "shards": 3, "lease_ttl_s": 0.5, "time_scale": 1.0}),
        (False, {"extra_coordinator_args": ("--admission", "reject", "--alpha", "0.25")}),
        (True, {"tenants": ("a",), "resume_grace_s": 4.0}),
    ],
)
def test_the_coordinators_are_rendered_through_their_settings(
    secured: bool, given: dict[str, Any], tmp_path: Path
) -> None:
    """Each coordinator's options, rendered through `CoordinatorConfig`, parse (with the
    coordinator's own parser) to what the hand-written ones did, for a shard and a spare."""
    mesh = _mesh_here(tmp_path, secured=secured, **given)
    cfg = mesh.config
    for prefix in (cfg.prefixes[-1], SPARE_PREFIX):
        argv = mesh.coordinator_argv("127.0.0.1:7101", "127.0.0.1:7201", prefix)
        parsed, level = parse_args(argv)
        assert parsed == parse_args(_by_hand(mesh, "127.0.0.1:7101", "127.0.0.1:7201", prefix))[0]
        assert level == "INFO"
        assert parse_coordinator_argv(argv) == dataclasses.replace(
            parsed,
            advertise="",  # what parse_args adds with --shards, said by no one
        )
        assert (parsed.listen, parsed.worker_listen) == ("127.0.0.1:7101", "127.0.0.1:7201")
        assert (parsed.shards, parsed.redis_prefix) == (cfg.prefixes, prefix)
        assert parsed.redis_cluster == cfg.redis_cluster
        assert (parsed.lease_ttl_s, parsed.resume_grace_s) == (cfg.lease_ttl_s, cfg.resume_grace_s)
        assert (parsed.cluster, parsed.time_scale) == (cfg.cluster, cfg.time_scale)
        extra = dict(
            zip(cfg.extra_coordinator_args[::2], cfg.extra_coordinator_args[1::2], strict=True)
        )
        assert parsed.admission == extra["--admission"]
        assert parsed.alpha == (float(extra["--alpha"]) if "--alpha" in extra else None)
        if mesh.auth is None:
            assert parsed.redis_url == mesh.redis_url and not parsed.redis_password
            assert not (parsed.worker_token or parsed.api_keys_file or parsed.tls_cert)
            continue
        auth = mesh.auth
        assert parsed.redis_url == "redis://coordinator@127.0.0.1:7000/0"
        assert parsed.redis_password == auth.redis_password("coordinator").read_text().strip()
        assert parsed.worker_token == auth.worker_token.read_text().strip()
        assert dataclasses.replace(CoordinatorConfig(), **secure_settings(auth, "coordinator")) == (
            dataclasses.replace(
                CoordinatorConfig(),
                api_keys_file=parsed.api_keys_file,
                tls_cert=parsed.tls_cert,
                tls_key=parsed.tls_key,
                tls_ca=parsed.tls_ca,
            )
        )
        assert parsed.api_keys_file == str(auth.keys) and parsed.tls_ca == str(auth.ca)
        assert secure_argv(auth, "coordinator") == [
            "--api-keys-file", str(auth.keys), "--tls-cert", str(auth.server_cert),
            "--tls-key", str(auth.server_key), "--tls-ca", str(auth.ca),
        ]  # fmt: skip


def test_sharded_coordinators_do_not_admit_by_default(tmp_path: Path) -> None:
    """The one default that differs from `up`'s coordinator, a named constant."""
    mesh = _mesh_here(tmp_path, secured=False)
    assert mesh.config.extra_coordinator_args == ("--admission", SHARDED_ADMISSION)
    parsed, _ = parse_args(mesh.coordinator_argv("127.0.0.1:7101", "127.0.0.1:7201", "hf:{s0}:"))
    assert parsed.admission == SHARDED_ADMISSION == "off" != CoordinatorConfig().admission


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--admission", "maybe"), "argument --admission: invalid choice: 'maybe'"),
        (("--no-such-option",), "unrecognized arguments: --no-such-option"),
        (("--alpha", "2"), r"--alpha must be in \[0, 1\]"),
        (("--max-calls", "x"), "argument --max-calls: invalid int value: 'x'"),
    ],
)
def test_a_wrong_extra_coordinator_option_fails_at_launch(
    extra: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=f"^the sharded coordinators' options: {message}"):
        ShardedMeshConfig("redis://127.0.0.1:7000/0", tmp_path, extra_coordinator_args=extra)


def test_extra_options_that_clash_with_the_meshs_fail_before_the_coordinator_starts(
    tmp_path: Path,
) -> None:
    """Fine alone, wrong with the mesh's own options: refused when the command line is
    made (the mesh's Redis is behind Sentinel, the extra option says a Redis Cluster)."""
    mesh = _mesh_here(tmp_path, secured=False, extra_coordinator_args=("--redis-cluster",))
    mesh.redis_url = "redis+sentinel://127.0.0.1:26379/mymaster"
    with pytest.raises(ConfigError, match=r"^the coordinator on 127\.0\.0\.1:7101: --redis-url: a"):
        mesh.coordinator_argv("127.0.0.1:7101", "127.0.0.1:7201", "hf:{s0}:")
