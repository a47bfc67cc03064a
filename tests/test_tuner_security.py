"""The tuner's door, secured (issue 8): `python -m hexgen_tuner` with ``--api-keys-file`` and
``--tls-cert/--tls-key`` checks every caller's key (GetAlpha: tenant; ListTuningRuns and
Retune: operator) over TLS only, and logs in to Redis as its own ACL user with
``--redis-password-file``. Real processes, real Redis (HEXGEN_TEST_REDIS, default
127.0.0.1:6379, each test under its own prefix), credentials from `AuthDir`."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis
import redis.asyncio as aioredis

from hexgen_api.v1 import tuner_pb2, tuner_pb2_grpc
from hexgen_client.client import CoordinatorClient
from hexgen_client.credentials import open_channel
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.traces import load_trace
from hexgen_flow.tuning import retune
from hexgen_launch.processes import free_port
from hexgen_service.auth import API_KEY_ENV, KeyStore, Role
from hexgen_service.auth_dir import AuthDir
from hexgen_service.convert import submit_from_query
from hexgen_service.healthcheck import check
from hexgen_service.status import cluster_from_status
from hexgen_service.tls import TLS_CA_ENV
from hexgen_tuner.config import TunerConfig
from hexgen_tuner.service import SERVICE_NAME
from hexgen_tuner.store import TunerStore
from hexgen_tuner.window import finished_key, read_window
from redis_here import REDIS_URL, needs_redis

pytestmark = needs_redis

CODE = grpc.StatusCode
TRACE = load_trace("trace1")


@pytest.fixture(autouse=True)
def _no_ambient_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test says which key and CA it uses: none comes from the environment."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(TLS_CA_ENV, raising=False)


@pytest.fixture(scope="module")
def auth(tmp_path_factory: pytest.TempPathFactory) -> AuthDir:
    auth = AuthDir(tmp_path_factory.mktemp("tuner-auth") / "auth")
    auth.init(["acme"])
    return auth


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> AuthDir:
    """Another mesh's credentials: its CA did not sign the tuner's certificate."""
    other = AuthDir(tmp_path_factory.mktemp("other-auth") / "auth")
    other.init()
    return other


def key(path: Path) -> str:
    return path.read_text().strip()


@dataclass
class Tuner:
    address: str
    prefix: str
    log: Path
    proc: subprocess.Popen[bytes]


def _tuner_argv(listen: str, *options: str) -> list[str]:
    return [
        sys.executable, "-m", "hexgen_tuner", "--listen", listen,
        "--coordinator", f"127.0.0.1:{free_port()}",  # nobody there
        "--period-s", "3600", "--log-level", "WARNING", *options,
    ]  # fmt: skip


async def _serving(address: str, ca: Path | None, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until the health service answers SERVING (health needs no key)."""
    for _ in range(300):
        if proc.poll() is not None:
            raise AssertionError(f"the tuner exited {proc.returncode}: {log.read_text()}")
        if await asyncio.to_thread(check, address, SERVICE_NAME, 2.0, ca) is None:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the tuner did not start: {log.read_text()}")


@contextlib.asynccontextmanager
async def running_tuner(
    tmp_path: Path, ca: Path | None, *options: str, prefix: str | None = None
) -> AsyncIterator[Tuner]:
    prefix = prefix or f"hf-test-tsec-{uuid.uuid4().hex[:8]}:"
    listen = f"127.0.0.1:{free_port()}"
    log = tmp_path / f"tuner-{listen.rsplit(':', 1)[1]}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            _tuner_argv(listen, "--redis-prefix", prefix, *options),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        await _serving(listen, ca, proc, log)
        yield Tuner(listen, prefix, log, proc)
    finally:
        proc.terminate()
        proc.wait(timeout=15)


@pytest.fixture
async def redis_client() -> AsyncIterator[aioredis.Redis[bytes]]:
    client: aioredis.Redis[bytes] = aioredis.Redis.from_url(REDIS_URL)
    yield client
    await client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


@pytest.fixture
async def secured(
    tmp_path: Path, auth: AuthDir, redis_client: aioredis.Redis[bytes]
) -> AsyncIterator[Tuner]:
    """The tuner with keys and TLS, its coordinator unreachable."""
    async with running_tuner(
        tmp_path,
        auth.ca,
        "--redis-url", REDIS_URL,
        "--api-keys-file", str(auth.keys),
        "--tls-cert", str(auth.server_cert),
        "--tls-key", str(auth.server_key),
    ) as tuner:  # fmt: skip
        yield tuner
        keys = [k async for k in redis_client.scan_iter(match=f"{tuner.prefix}*")]
        if keys:
            await redis_client.delete(*keys)


async def _call(
    tuner: Tuner, ca: Path | None, api_key: str | None, method: str
) -> tuple[CODE, object]:
    """One RPC of the TunerService: its status code and its answer (None when refused)."""
    request = {
        "GetAlpha": tuner_pb2.GetAlphaRequest(),
        "ListTuningRuns": tuner_pb2.ListTuningRunsRequest(),
        "Retune": tuner_pb2.RetuneRequest(),
    }[method]
    async with open_channel(tuner.address, api_key=api_key, tls_ca=ca) as channel:
        stub = tuner_pb2_grpc.TunerServiceStub(channel)
        try:
            answer = await getattr(stub, method)(request, timeout=15)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()
        return CODE.OK, answer


async def _tuner_keys(client: aioredis.Redis[bytes], prefix: str) -> list[bytes]:
    return sorted([k async for k in client.scan_iter(match=f"{prefix}tuner:*")])


# --------------------------------------------------------------------------------- keys


async def test_without_a_key_every_method_is_unauthenticated(
    secured: Tuner, auth: AuthDir, redis_client: aioredis.Redis[bytes]
) -> None:
    for method in ("GetAlpha", "ListTuningRuns", "Retune"):
        code, details = await _call(secured, auth.ca, None, method)
        assert code == CODE.UNAUTHENTICATED, (method, details)
        assert "no API key" in str(details)
    code, details = await _call(secured, auth.ca, "hfk_000000000000_" + "x" * 43, "Retune")
    assert code == CODE.UNAUTHENTICATED and "unknown API key" in str(details)
    assert await _tuner_keys(redis_client, secured.prefix) == []  # no run was made


async def test_a_tenant_reads_alpha_but_may_not_retune_nor_list_runs(
    secured: Tuner, auth: AuthDir, redis_client: aioredis.Redis[bytes]
) -> None:
    store = TunerStore(redis_client, secured.prefix)
    before = await _tuner_keys(redis_client, secured.prefix)
    tenant = key(auth.tenant_key("acme"))

    # Let in: the α is the coordinator's to tell (here unreachable), not refused to a tenant.
    code, got = await _call(secured, auth.ca, tenant, "GetAlpha")
    assert code == CODE.UNAVAILABLE, got
    assert "no alpha known: the coordinator at" in str(got)

    for method in ("Retune", "ListTuningRuns"):
        code, details = await _call(secured, auth.ca, tenant, method)
        assert code == CODE.PERMISSION_DENIED, (method, details)
        assert f"{method} needs the operator role" in str(details)
    # The refused Retune made no run: nothing was written to Redis.
    assert await _tuner_keys(redis_client, secured.prefix) == before
    assert await store.runs(10) == []
    log = secured.log.read_text()
    assert f"denied /{SERVICE_NAME}/Retune: permission denied" in log  # the audit line


async def test_an_operator_retunes_and_lists_runs(
    secured: Tuner, auth: AuthDir, redis_client: aioredis.Redis[bytes]
) -> None:
    operator = key(auth.tuner_key)
    code, answer = await _call(secured, auth.ca, operator, "Retune")
    assert code == CODE.OK, answer
    assert isinstance(answer, tuner_pb2.RetuneResponse)
    assert answer.run.run_id == "tune-000001"
    assert answer.run.reason.startswith("cannot reach the coordinator")
    assert math.isnan(answer.run.previous_alpha)

    code, listed = await _call(secured, auth.ca, key(auth.admin_key), "ListTuningRuns")
    assert code == CODE.OK, listed  # an admin may do what an operator may
    assert isinstance(listed, tuner_pb2.ListTuningRunsResponse)
    assert [r.run_id for r in listed.runs] == ["tune-000001"]
    runs = await TunerStore(redis_client, secured.prefix).runs(10)
    assert [r.run_id for r in runs] == ["tune-000001"]


async def test_a_revoked_key_is_refused_within_seconds(
    secured: Tuner, auth: AuthDir, tmp_path: Path
) -> None:
    # A key minted, then revoked, in the file the running tuner reads.
    minted, record = KeyStore(auth.keys).add("ops", Role.OPERATOR, note="revoked in the test")
    deadline = time.monotonic() + 10
    while True:  # the tuner re-reads the file at most once a second
        code, _ = await _call(secured, auth.ca, minted, "ListTuningRuns")
        if code == CODE.OK or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert code == CODE.OK
    KeyStore(auth.keys).revoke(record.key_id)
    deadline = time.monotonic() + 10
    while True:
        code, details = await _call(secured, auth.ca, minted, "ListTuningRuns")
        if code != CODE.OK or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert code == CODE.UNAUTHENTICATED and "revoked" in str(details)


# ---------------------------------------------------------------------------------- TLS


async def test_a_plaintext_client_and_a_client_trusting_another_ca_get_nothing(
    secured: Tuner, auth: AuthDir, other_ca: AuthDir, redis_client: aioredis.Redis[bytes]
) -> None:
    operator = key(auth.tuner_key)
    code, details = await _call(secured, None, operator, "Retune")  # plaintext
    assert code == CODE.UNAVAILABLE, details
    code, details = await _call(secured, other_ca.ca, operator, "Retune")
    assert code == CODE.UNAVAILABLE, details
    assert await _tuner_keys(redis_client, secured.prefix) == []  # neither reached Retune
    code, _ = await _call(secured, auth.ca, operator, "GetAlpha")  # the right CA does
    assert code == CODE.UNAVAILABLE  # let in: no α known, no coordinator
    code, _ = await _call(secured, auth.ca, operator, "ListTuningRuns")
    assert code == CODE.OK


# ---------------------------------------------------------------------------- the Redis user


def _redis_with_acl(folder: Path, acl: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(folder), "--aclfile", str(acl)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            redis.Redis(port=port, socket_timeout=1).ping()
        except redis.AuthenticationError:
            return proc, port  # it answers (and wants a login: the default user is off)
        except redis.RedisError:
            time.sleep(0.05)
            continue
        return proc, port
    proc.kill()
    raise AssertionError("redis-server with the ACL file did not start")


@pytest.fixture
def acl_redis(tmp_path: Path, auth: AuthDir) -> Iterator[int]:
    """A private redis-server whose users are the auth directory's ACL file."""
    if subprocess.run(["which", "redis-server"], capture_output=True, check=False).returncode:
        pytest.skip("redis-server is not installed")
    proc, port = _redis_with_acl(tmp_path, auth.redis_acl)
    yield port
    proc.terminate()
    proc.wait(timeout=10)


async def test_the_tuner_logs_in_to_redis_as_its_acl_user(
    tmp_path: Path, auth: AuthDir, acl_redis: int
) -> None:
    url = f"redis://tuner@127.0.0.1:{acl_redis}/0"
    password = str(auth.redis_password("tuner"))
    # Without the password (the default user is off): refused before it listens.
    for options in ([], ["--redis-password-file", str(auth.redis_password("coordinator"))]):
        done = subprocess.run(
            _tuner_argv(f"127.0.0.1:{free_port()}", "--redis-url", url, *options),
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(f"hexgen-tuner: error: cannot reach Redis at {url}: ")
        assert done.stderr.count("\n") == 1

    async with running_tuner(
        tmp_path, None, "--redis-url", url, "--redis-password-file", password, prefix="hf:"
    ) as tuner:
        code, answer = await _call(tuner, None, None, "Retune")  # no keys file: open door
        assert code == CODE.OK, answer
        assert isinstance(answer, tuner_pb2.RetuneResponse)
        assert answer.run.run_id == "tune-000001"
        code, listed = await _call(tuner, None, None, "ListTuningRuns")
        assert code == CODE.OK and isinstance(listed, tuner_pb2.ListTuningRunsResponse)
        assert [r.run_id for r in listed.runs] == ["tune-000001"]
    # The run is in that Redis, under the tuner's own keys.
    client = redis.Redis(
        port=acl_redis, username="tuner", password=key(auth.redis_password("tuner"))
    )
    assert client.lrange("hf:tuner:runs", 0, -1) != []
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.xadd("hf:finished", {"query_id": "forged"})  # it only reads the stream


# ------------------------------------------------------------------------- command line


def _parse_error(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "hexgen_tuner", "--redis-url", "redis://127.0.0.1:1/0", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("hexgen-tuner: error: ")
    return done.stderr.removeprefix("hexgen-tuner: error: ").strip()


def test_protected_mode_refuses_an_open_door_beyond_loopback(auth: AuthDir) -> None:
    listen = f"0.0.0.0:{free_port()}"
    refused = _parse_error("--listen", listen)
    assert refused.startswith(
        f"--listen: refusing to listen on {listen} without --api-keys-file and --tls-cert/--tls-key"
    )
    # Keys without TLS are not enough (a key would cross the network in the clear).
    assert _parse_error("--listen", listen, "--api-keys-file", str(auth.keys)).startswith(
        "--listen: refusing"
    )
    # Protected, or --insecure: the flags pass, and it goes on to Redis (unreachable here).
    protected = [
        "--api-keys-file", str(auth.keys),
        "--tls-cert", str(auth.server_cert), "--tls-key", str(auth.server_key),
    ]  # fmt: skip
    for options in (protected, ["--insecure"]):
        assert _parse_error("--listen", listen, *options).startswith("cannot reach Redis")


def test_security_flags_name_what_is_wrong(auth: AuthDir, tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert _parse_error("--tls-cert", str(auth.server_cert)) == (
        "--tls-cert and --tls-key: give both or neither"
    )
    assert _parse_error("--api-keys-file", str(missing)).startswith(
        f"--api-keys-file: cannot read {missing}"
    )
    assert (
        _parse_error("--tls-cert", str(not_pem), "--tls-key", str(auth.server_key))
        == f"--tls-cert: {not_pem} is not a PEM file"
    )
    assert _parse_error("--tls-ca", str(missing)).startswith(f"--tls-ca: cannot read {missing}")
    assert _parse_error("--api-key-file", str(empty)) == f"--api-key-file: {empty} is empty"
    assert _parse_error("--redis-password-file", str(missing)).startswith(
        f"--redis-password-file: cannot read {missing}"
    )
    assert _parse_error(
        "--redis-url", "redis://tuner:pw@127.0.0.1:1/0",
        "--redis-password-file", str(auth.redis_password("tuner")),
    ).startswith("--redis-password-file: --redis-url carries a password already")  # fmt: skip
    # A password in the URL never reaches the error line.
    refused = _parse_error("--redis-url", "redis://tuner:s3cret@127.0.0.1:1/0")
    assert refused.startswith("cannot reach Redis at redis://tuner:***@127.0.0.1:1/0: ")
    assert "s3cret" not in refused


# -------------------------------------------------------- against a secured coordinator


@dataclass
class SecuredCoordinator:
    address: str
    prefix: str


@pytest.fixture(scope="module")
def secured_coordinator(
    auth: AuthDir, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SecuredCoordinator]:
    """`python -m hexgen_coordinator` with API keys and TLS (no workers: the tuner only
    reads its status and sets its α), and a window of finished queries in its stream."""
    logs = tmp_path_factory.mktemp("tuner-coordinator")
    prefix = f"hf-test-tsec-coord-{uuid.uuid4().hex[:8]}:"
    address = f"127.0.0.1:{free_port()}"
    argv = [
        sys.executable, "-m", "hexgen_coordinator", "--listen", address,
        "--worker-listen", f"127.0.0.1:{free_port()}", "--redis-url", REDIS_URL,
        "--redis-prefix", prefix, "--cluster", "A100,A100,A6000,L40S",
        "--api-keys-file", str(auth.keys), "--tls-cert", str(auth.server_cert),
        "--tls-key", str(auth.server_key), "--tls-ca", str(auth.ca), "--log-level", "WARNING",
    ]  # fmt: skip
    client = redis.Redis.from_url(REDIS_URL)
    for i, query in enumerate(TRACE[:24]):  # as the coordinator writes them
        client.xadd(
            finished_key(prefix),
            {
                "query_id": query.query_id,
                "tenant": query.tenant,
                "arrival_s": repr(500.0 + 6.0 * i),
                "finished_s": repr(600.0 + 6.0 * i),
                "slo_s": "176.7",
                "submit": submit_from_query(query).SerializeToString(),
            },
        )
    log = logs / "coordinator.log"
    env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, TLS_CA_ENV)}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while check(address, "", 2.0, auth.ca) is not None:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield SecuredCoordinator(address, prefix)
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)


async def _an_alpha_the_tuner_would_change(coordinator: SecuredCoordinator, auth: AuthDir) -> float:
    """Set the coordinator's α to one the window's replays beat (the tuner's own rule,
    computed here), so that a Retune calls SetAlpha; return it."""
    admin = CoordinatorClient(coordinator.address, api_key=key(auth.admin_key), tls_ca=auth.ca)
    reader: aioredis.Redis[bytes] = aioredis.Redis.from_url(REDIS_URL)
    async with admin:
        status = await admin.status()
        window = await read_window(reader, coordinator.prefix, TunerConfig().window)
        await reader.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose
        cluster = cluster_from_status(status)
        preset = resolve_policy(status.policy)
        for alpha in (0.0, 1.0, 0.2, 0.8, 0.5):
            run = retune(window.tuning, cluster, preset, alpha, min_queries=20, tolerance=0.0)
            if run.decision.change:
                await admin.set_alpha(alpha, reason="test")
                return alpha
    raise AssertionError("no alpha of the grid is beaten on this window")


async def _alpha(coordinator: SecuredCoordinator, auth: AuthDir) -> float:
    admin = CoordinatorClient(coordinator.address, api_key=key(auth.admin_key), tls_ca=auth.ca)
    async with admin:
        return (await admin.status()).alpha


async def test_the_tuner_tunes_a_secured_coordinator_with_its_operator_key(
    secured_coordinator: SecuredCoordinator, auth: AuthDir, tmp_path: Path
) -> None:
    coordinator = secured_coordinator
    start = await _an_alpha_the_tuner_would_change(coordinator, auth)
    common = [
        "--redis-url", REDIS_URL, "--coordinator", coordinator.address,
        "--tolerance", "0",
    ]  # fmt: skip

    async def retune_with(*options: str) -> tuner_pb2.TuningRun:
        async with running_tuner(
            tmp_path, None, *common, *options, prefix=coordinator.prefix
        ) as tuner:
            code, answer = await _call(tuner, None, None, "Retune")
        assert code == CODE.OK and isinstance(answer, tuner_pb2.RetuneResponse), answer
        return answer.run

    # No CA: the TLS handshake fails.
    run = await retune_with("--api-key-file", str(auth.tuner_key))
    assert run.reason.startswith(f"cannot reach the coordinator at {coordinator.address}")
    ca = ["--tls-ca", str(auth.ca)]
    # No key: ClusterStatus is refused.
    run = await retune_with(*ca)
    assert run.reason.startswith("ClusterStatus failed: ") and "UNAUTHENTICATED" in run.reason
    # A tenant's key reads the status, but SetAlpha is an operator's.
    run = await retune_with(*ca, "--api-key-file", str(auth.tenant_key("acme")))
    assert "SetAlpha failed" in run.reason and "PERMISSION_DENIED" in run.reason, run.reason
    assert not run.applied and run.previous_alpha == start
    assert await _alpha(coordinator, auth) == start
    # The tuner's own (operator) key: the better α is pushed.
    run = await retune_with(*ca, "--api-key-file", str(auth.tuner_key))
    assert run.applied, run.reason
    assert run.best_alpha != start
    assert await _alpha(coordinator, auth) == run.best_alpha
