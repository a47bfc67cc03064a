"""A secured mesh under attack: `hexgen-flow up --secure --tenants a,b` as a real process,
attacked the way someone on the same network, or holding one tenant's key, would.

Every refusal is checked twice: the caller gets the status and message it should, and the
mesh's state in Redis is byte for byte what it was before (`_snapshot`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import coordinator_pb2_grpc as cpb_grpc
from hexgen_api.v1 import worker_pb2 as wpb
from hexgen_api.v1 import worker_pb2_grpc as wpb_grpc
from hexgen_service.auth import KeyStore, Role
from hexgen_service.auth_dir import AuthDir
from hexgen_service.worker_token import TOKEN_METADATA
from up_runner import Up, running_up, wait_for

needs_redis_server = pytest.mark.skipif(
    subprocess.run(["which", "redis-server"], capture_output=True, check=False).returncode != 0,
    reason="redis-server is not installed (apt install redis-server)",
)
pytestmark = needs_redis_server


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Up, AuthDir]]:
    folder = tmp_path_factory.mktemp("secure")
    auth = AuthDir(folder / "auth")
    options = ("--secure", "--auth-dir", str(auth.path), "--tenants", "a,b", "--cluster",
               "A100,A6000", "--no-tuner", "--no-gateway", "--time-scale", "20")  # fmt: skip
    with running_up(folder, *options) as running:
        yield running, auth


# ------------------------------------------------------------------------------ helpers


def _key(path: Path) -> str:
    return path.read_text().strip()


def _redis(up: Up, auth: AuthDir) -> redis.Redis[bytes]:
    """The private Redis, logged in as the coordinator's ACL user."""
    url = up.banner["redis"].split()[0]
    return redis.Redis.from_url(
        url, username="coordinator", password=_key(auth.redis_password("coordinator"))
    )


def _snapshot(up: Up, auth: AuthDir) -> dict[bytes, Any]:
    """Every key of the mesh and its content (the content of a string key, the query
    counter, is out of the coordinator user's reach; a submission moves it only together
    with a new query hash, which is in)."""
    client = _redis(up, auth)
    try:
        state: dict[bytes, Any] = {}
        for key in client.scan_iter(match="hf:*"):
            kind = client.execute_command("TYPE", key)
            if kind == b"hash":
                state[key] = client.hgetall(key)
            elif kind == b"stream":
                state[key] = client.xrange(key)
            elif kind == b"list":
                state[key] = client.lrange(key, 0, -1)
            elif kind == b"set":
                state[key] = sorted(client.smembers(key))
            elif kind == b"zset":
                state[key] = client.zrange(key, 0, -1, withscores=True)
            else:  # the query counter: the coordinator's user may not GET (least privilege)
                state[key] = kind
        return state
    finally:
        client.close()


def _cli(
    *args: str, key: Path | None = None, ca: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEXGEN_FLOW_")}
    if key is not None:
        env["HEXGEN_FLOW_API_KEY"] = _key(key)
    if ca is not None:
        env["HEXGEN_FLOW_TLS_CA"] = str(ca)
    return subprocess.run(
        [sys.executable, "-m", "hexgen_cli", *args],
        capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip


def _channel(up: Up, auth: AuthDir, address: str | None = None) -> grpc.Channel:
    return grpc.secure_channel(
        address or up.coordinator, grpc.ssl_channel_credentials(auth.ca.read_bytes())
    )


def _call(up: Up, auth: AuthDir, method: str, request: Any, key: Path | None) -> Any:
    """One RPC of the clients' door with `key` (None: no key); raises grpc.RpcError."""
    metadata = (("authorization", f"Bearer {_key(key)}"),) if key is not None else None
    with _channel(up, auth) as channel:
        stub = cpb_grpc.CoordinatorServiceStub(channel)
        rpc = getattr(stub, method)
        if method == "WatchQuery":
            return list(rpc(request, metadata=metadata, timeout=10))
        return rpc(request, metadata=metadata, timeout=10)


@dataclass(frozen=True)
class Refusal:
    """What a refused RPC answered."""

    code: grpc.StatusCode
    details: str
    trailers: dict[str, str]


def _refused(up: Up, auth: AuthDir, method: str, request: Any, key: Path | None) -> Refusal:
    with pytest.raises(grpc.RpcError) as caught:
        _call(up, auth, method, request, key)
    error = caught.value
    assert isinstance(error, grpc.Call)
    trailers = {str(k): str(v) for k, v in error.trailing_metadata() or ()}
    return Refusal(error.code(), error.details() or "", trailers)


@pytest.fixture(scope="module")
def a_query(secure: tuple[Up, AuthDir]) -> str:
    """Tenant a's finished query, submitted by `replay` with a's key."""
    up, auth = secure
    done = _cli("replay", "--coordinator", up.coordinator, "--num-queries", "2", "--qps", "4",
                "--json", key=auth.tenant_key("a"), ca=auth.ca)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["completed"] == 2, report
    return "trace1-0"


# ------------------------------------------------------------------ the Done-when list


def test_replay_with_a_tenant_key_runs_as_that_tenant(
    secure: tuple[Up, AuthDir], a_query: str
) -> None:
    up, auth = secure
    info = _call(up, auth, "GetQuery", cpb.GetQueryRequest(query_id=a_query),
                 auth.tenant_key("a")).query  # fmt: skip
    assert (info.tenant, cpb.QueryState.Name(info.state)) == ("a", "QUERY_STATE_SUCCEEDED")


def test_without_a_key_replay_exits_2_unauthenticated_and_changes_nothing(
    secure: tuple[Up, AuthDir], a_query: str
) -> None:
    up, auth = secure
    before = _snapshot(up, auth)
    done = _cli("replay", "--coordinator", up.coordinator, "--num-queries", "1", "--qps", "1",
                ca=auth.ca)  # fmt: skip
    assert done.returncode == 2
    assert "UNAUTHENTICATED: unauthenticated: no API key" in done.stderr
    assert _snapshot(up, auth) == before


def test_another_tenant_finds_nothing_of_a_and_cancels_nothing(
    secure: tuple[Up, AuthDir], a_query: str
) -> None:
    up, auth = secure
    b = auth.tenant_key("b")
    before = _snapshot(up, auth)
    for method, request in (
        ("GetQuery", cpb.GetQueryRequest(query_id=a_query)),
        ("CancelQuery", cpb.CancelQueryRequest(query_id=a_query)),
        ("WatchQuery", cpb.WatchQueryRequest(query_id=a_query)),
        ("CloseWorkflow", cpb.CloseWorkflowRequest(workflow_id=a_query)),
    ):
        error = _refused(up, auth, method, request, b)
        assert error.code == grpc.StatusCode.NOT_FOUND, method
        # word for word what an id nobody used gets: a's query is not revealed
        unused = request.__class__()
        setattr(unused, next(iter(request.DESCRIPTOR.fields_by_name)), "nobody-used-this")
        unknown = _refused(up, auth, method, unused, b)
        assert error.details == unknown.details.replace("nobody-used-this", a_query)
    done = _cli("get", a_query, "--coordinator", up.coordinator, key=b, ca=auth.ca)
    assert done.returncode == 2 and "NOT_FOUND" in done.stderr
    # reusing a's id is refused without showing a's query
    taken = _refused(up, auth, "SubmitQuery", cpb.SubmitQueryRequest(
        query_id=a_query, workflow=_one_call_workflow()), b)  # fmt: skip
    assert taken.code == grpc.StatusCode.ALREADY_EXISTS
    assert _snapshot(up, auth) == before
    # an operator (here the admin) sees every tenant
    admin = _call(up, auth, "GetQuery", cpb.GetQueryRequest(query_id=a_query), auth.admin_key)
    assert admin.query.tenant == "a"


def test_a_tenant_key_cannot_submit_for_another_tenant(secure: tuple[Up, AuthDir]) -> None:
    up, auth = secure
    before = _snapshot(up, auth)
    request = cpb.SubmitQueryRequest(query_id="b-as-a", tenant="a", workflow=_one_call_workflow())
    error = _refused(up, auth, "SubmitQuery", request, auth.tenant_key("b"))
    assert error.code == grpc.StatusCode.PERMISSION_DENIED
    assert "tenant: the key of tenant 'b' may not act for 'a'" in error.details
    assert _snapshot(up, auth) == before


def test_set_alpha_needs_an_operator(secure: tuple[Up, AuthDir]) -> None:
    up, auth = secure
    before = _snapshot(up, auth)
    alpha = _call(up, auth, "ClusterStatus", cpb.ClusterStatusRequest(), auth.admin_key).alpha
    error = _refused(up, auth, "SetAlpha", cpb.SetAlphaRequest(alpha=0.0, reason="attack"),
                     auth.tenant_key("a"))  # fmt: skip
    assert error.code == grpc.StatusCode.PERMISSION_DENIED
    assert "SetAlpha needs the operator role" in error.details
    assert _snapshot(up, auth) == before
    status = _call(up, auth, "ClusterStatus", cpb.ClusterStatusRequest(), auth.admin_key)
    assert status.alpha == alpha
    assert (
        "denied /hexgen_flow.v1.CoordinatorService/SetAlpha"
        in (up.log_dir / "coordinator.log").read_text()
    )  # the audit line


def test_a_tenant_sees_the_cluster_without_the_workers_ids(secure: tuple[Up, AuthDir]) -> None:
    up, auth = secure
    tenant = _call(up, auth, "ClusterStatus", cpb.ClusterStatusRequest(), auth.tenant_key("a"))
    admin = _call(up, auth, "ClusterStatus", cpb.ClusterStatusRequest(), auth.admin_key)
    assert [i.worker_id for i in tenant.instances] == ["", ""]
    assert [i.worker_id for i in admin.instances] == ["local-worker-0", "local-worker-1"]


# ------------------------------------------------------------------------------ keys


def test_an_expired_key_and_a_revoked_key_are_refused(secure: tuple[Up, AuthDir]) -> None:
    up, auth = secure
    store = KeyStore(auth.keys)
    expired, _ = store.add("a", Role.TENANT, expires_s=time.time() - 1)
    fresh, record = store.add("a", Role.TENANT)
    path = auth.path / "fresh.key"
    path.write_text(fresh)
    request = cpb.ClusterStatusRequest()
    expired_path = auth.path / "expired.key"
    expired_path.write_text(expired)
    wait_for("the new keys to be read", lambda: _works(up, auth, path), 5)
    error = _refused(up, auth, "ClusterStatus", request, expired_path)
    assert error.code == grpc.StatusCode.UNAUTHENTICATED and "expired" in error.details
    done = _cli("auth", "revoke", str(auth.path), record.key_id)
    assert done.returncode == 0 and f"revoked key {record.key_id}" in done.stderr
    wait_for("the revocation to take", lambda: not _works(up, auth, path), 5)
    error = _refused(up, auth, "ClusterStatus", request, path)
    assert error.code == grpc.StatusCode.UNAUTHENTICATED and "revoked" in error.details
    bogus = auth.path / "bogus.key"
    bogus.write_text(fresh[:-4] + "AAAA")  # the right id, a wrong secret
    error = _refused(up, auth, "ClusterStatus", request, bogus)
    assert error.code == grpc.StatusCode.UNAUTHENTICATED and "unknown" in error.details


def _works(up: Up, auth: AuthDir, key: Path) -> bool:
    try:
        _call(up, auth, "ClusterStatus", cpb.ClusterStatusRequest(), key)
    except grpc.RpcError:
        return False
    return True


# ------------------------------------------------------------------------------ TLS


def test_a_plaintext_client_at_the_tls_port_gets_nothing(secure: tuple[Up, AuthDir]) -> None:
    up, auth = secure
    with grpc.insecure_channel(up.coordinator) as channel:
        stub = cpb_grpc.CoordinatorServiceStub(channel)
        metadata = (("authorization", f"Bearer {_key(auth.admin_key)}"),)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ClusterStatus(cpb.ClusterStatusRequest(), metadata=metadata, timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    done = _cli("status", "--coordinator", up.coordinator, key=auth.admin_key)
    assert done.returncode == 2 and "TLS" in done.stderr, done.stderr


def test_a_client_trusting_another_ca_does_not_connect(
    secure: tuple[Up, AuthDir], tmp_path: Path
) -> None:
    up, auth = secure
    other = AuthDir(tmp_path / "other")
    other.init()
    done = _cli("status", "--coordinator", up.coordinator, key=auth.admin_key, ca=other.ca)
    assert done.returncode == 2 and "TLS handshake failed" in done.stderr, done.stderr


# ------------------------------------------------------------------------------ workers


def _slots(up: Up, auth: AuthDir) -> list[tuple[str, bool]]:
    status = _call(up, auth, "ClusterStatus", cpb.ClusterStatusRequest(), auth.admin_key)
    return [(i.worker_id, i.connected) for i in status.instances]


async def _connect(
    address: str, credentials: grpc.ChannelCredentials | None, token: str | None
) -> grpc.StatusCode:
    """How a forged worker's Connect ends. It sends nothing: every refusal tried here comes
    before the first message (the TLS handshake, the token in the metadata, an unknown
    service), and a message written while the server refuses would race its answer
    (grpc then reports INTERNAL "execute_batch" instead of the server's status)."""
    channel = (
        grpc.aio.secure_channel(address, credentials)
        if credentials is not None
        else grpc.aio.insecure_channel(address)
    )

    async def silent() -> AsyncIterator[wpb.ConnectRequest]:
        await asyncio.Event().wait()  # the stream stays open, as a worker's does
        yield wpb.ConnectRequest()  # pragma: no cover - never reached

    async with channel:
        metadata = ((TOKEN_METADATA, token),) if token else None
        call = wpb_grpc.WorkerServiceStub(channel).Connect(silent(), metadata=metadata, timeout=5)
        code = await call.code()
        assert isinstance(code, grpc.StatusCode)
        return code


def test_a_worker_without_a_certificate_cannot_take_a_slot(
    secure: tuple[Up, AuthDir], tmp_path: Path
) -> None:
    up, auth = secure
    before = _snapshot(up, auth)
    token = _key(auth.worker_token)
    ca = auth.ca.read_bytes()
    other = AuthDir(tmp_path / "other")
    other.init()
    attempts = {
        "plaintext": None,
        "TLS without a certificate": grpc.ssl_channel_credentials(ca),
        "a certificate of another CA": grpc.ssl_channel_credentials(
            ca, other.worker_key.read_bytes(), other.worker_cert.read_bytes()
        ),
    }
    for what, credentials in attempts.items():
        code = asyncio.run(_connect(up.worker_door, credentials, token))
        assert code == grpc.StatusCode.UNAVAILABLE, what
    assert _slots(up, auth) == [("local-worker-0", True), ("local-worker-1", True)]
    # the right certificate without the token: still refused
    mine = grpc.ssl_channel_credentials(
        ca, auth.worker_key.read_bytes(), auth.worker_cert.read_bytes()
    )
    assert asyncio.run(_connect(up.worker_door, mine, None)) == grpc.StatusCode.UNAUTHENTICATED
    assert _slots(up, auth) == [("local-worker-0", True), ("local-worker-1", True)]
    assert _snapshot(up, auth) == before


def test_the_clients_door_serves_no_worker_service(secure: tuple[Up, AuthDir]) -> None:
    up, auth = secure
    creds = grpc.ssl_channel_credentials(
        auth.ca.read_bytes(), auth.worker_key.read_bytes(), auth.worker_cert.read_bytes()
    )
    code = asyncio.run(_connect(up.coordinator, creds, _key(auth.worker_token)))
    assert code == grpc.StatusCode.UNIMPLEMENTED


def test_a_credentialed_worker_completes_only_the_calls_sent_to_its_slot(
    secure: tuple[Up, AuthDir],
) -> None:
    """An insider: a machine of the worker pool, certificate and token in hand, takes a slot
    that fell free and reports a result for a call running on another slot. It is ignored:
    the call completes when its own worker finishes it, with that worker's text."""
    up, auth = secure
    real = up.service_pid("hexgen_worker", "--slot", "1")
    os.kill(real, signal.SIGSTOP)  # slot 1 falls silent: declared dead after 2 s
    try:
        wait_for("slot 1 to fall free", lambda: not _slots(up, auth)[1][1], 15)
        asyncio.run(_forge_a_completion(up, auth))
    finally:
        os.kill(real, signal.SIGCONT)
    wait_for("the real worker of slot 1 back", lambda: _slots(up, auth)[1] == (
        "local-worker-1", True), 30)  # fmt: skip


async def _forge_a_completion(up: Up, auth: AuthDir) -> None:
    creds = grpc.ssl_channel_credentials(
        auth.ca.read_bytes(), auth.worker_key.read_bytes(), auth.worker_cert.read_bytes()
    )
    admin = (("authorization", f"Bearer {_key(auth.admin_key)}"),)
    channel = grpc.aio.secure_channel(up.worker_door, creds)
    client = grpc.aio.secure_channel(up.coordinator, grpc.ssl_channel_credentials(
        auth.ca.read_bytes()))  # fmt: skip
    async with channel, client:
        call = wpb_grpc.WorkerServiceStub(channel).Connect(
            metadata=((TOKEN_METADATA, _key(auth.worker_token)),)
        )
        await call.write(wpb.ConnectRequest(hello=wpb.WorkerHello(
            worker_id="local-worker-1", slot=1, gpu="A6000")))  # fmt: skip
        welcome = await call.read()
        assert isinstance(welcome, wpb.ConnectResponse)
        assert welcome.WhichOneof("message") == "welcome" and welcome.welcome.slot == 1
        # A query whose first call can only go to slot 0 (the A100) while slot 1 is away.
        stub = cpb_grpc.CoordinatorServiceStub(client)
        await stub.SubmitQuery(
            cpb.SubmitQueryRequest(query_id="victim", workflow=_one_call_workflow(4000)),
            metadata=admin,
        )
        call_id = "victim/0.0"
        await call.write(wpb.ConnectRequest(finished=wpb.CallFinished(
            call_id=call_id, text="INJECTED-BY-ATTACKER", output_tokens=1, attempt=1)))  # fmt: skip
        events = stub.WatchQuery(cpb.WatchQueryRequest(query_id="victim"), metadata=admin)
        finished = None
        async for response in events:
            kind = cpb.QueryEventKind.Name(response.event.kind)
            if kind == "QUERY_EVENT_KIND_CALL_FINISHED":
                finished = response.event
            if kind in ("QUERY_EVENT_KIND_SUCCEEDED", "QUERY_EVENT_KIND_FAILED"):
                break
        call.cancel()
        status = await stub.ClusterStatus(cpb.ClusterStatusRequest(), metadata=admin)
    # completed by the real worker of slot 0, with its text; the forged report changed nothing
    assert finished is not None and finished.instance == status.instances[0].name
    assert "INJECTED" not in finished.text
    assert "INJECTED" not in str(await _get(up, auth, "victim"))
    log = (up.log_dir / "coordinator.log").read_text()
    assert "ignored a result of victim/0.0 from local-worker-1: the call is on slot 0" in log


async def _get(up: Up, auth: AuthDir, query_id: str) -> cpb.GetQueryResponse:
    admin = (("authorization", f"Bearer {_key(auth.admin_key)}"),)
    async with grpc.aio.secure_channel(
        up.coordinator, grpc.ssl_channel_credentials(auth.ca.read_bytes())
    ) as channel:
        stub = cpb_grpc.CoordinatorServiceStub(channel)
        return await stub.GetQuery(cpb.GetQueryRequest(query_id=query_id), metadata=admin)


def _one_call_workflow(output_tokens: int = 16) -> Any:
    from hexgen_api.v1 import workflow_pb2

    return workflow_pb2.Workflow(stages=[workflow_pb2.Stage(
        id="only", step="sql", calls=[workflow_pb2.LLMCall(step="sql", input_tokens=1000,
                                               output_tokens=output_tokens)])])  # fmt: skip


def test_check_state_logs_in_as_the_coordinators_redis_user_and_finds_it_clean(
    secure: tuple[Up, AuthDir], a_query: str
) -> None:
    up, auth = secure
    url = up.banner["redis"].split()[0].replace("redis://", "redis://coordinator@")
    done = _cli("check-state", "--redis-url", url, "--redis-password-file",
                str(auth.redis_password("coordinator")), "--json")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["queries"] >= 2
    anonymous = _cli("check-state", "--redis-url", up.banner["redis"].split()[0])
    assert anonymous.returncode == 2 and "cannot reach" in anonymous.stderr, anonymous.stderr


def test_a_tenants_own_rate_limit_is_admission_control(secure: tuple[Up, AuthDir]) -> None:
    up, auth = secure
    done = _cli("auth", "limits", str(auth.path), "--tenant", "b", "--rate-qps", "0.2",
                "--burst", "1")  # fmt: skip
    assert done.returncode == 0, done.stderr
    b = auth.tenant_key("b")
    time.sleep(1.2)  # the services read the keys file within a second of a change
    _call(up, auth, "SubmitQuery", cpb.SubmitQueryRequest(
        query_id="b-1", workflow=_one_call_workflow()), b)  # fmt: skip
    error = _refused(up, auth, "SubmitQuery", cpb.SubmitQueryRequest(
        query_id="b-2", workflow=_one_call_workflow()), b)  # fmt: skip
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'b' submits faster than its rate (0.2 queries/s, burst 1)" in error.details
    retry = error.trailers["retry-after-s"]
    assert 3.0 < float(retry) <= 5.0 * 1.5  # the wait for a token, spread by up to half again
    # tenant a has no limit of its own
    for i in range(2):
        _call(up, auth, "SubmitQuery", cpb.SubmitQueryRequest(
            query_id=f"a-{i}", workflow=_one_call_workflow()), auth.tenant_key("a"))  # fmt: skip
    listed = _cli("auth", "list", str(auth.path), "--json")
    keys = json.loads(listed.stdout)["keys"]
    assert {(k["tenant"], k["role"]) for k in keys} >= {("a", "tenant"), ("admin", "admin")}
    assert _key(auth.tenant_key("a")) not in auth.keys.read_text()  # hashed at rest


def test_up_refuses_to_listen_beyond_loopback_unless_secured(tmp_path: Path) -> None:
    done = _cli("up", "--listen", "0.0.0.0:0", "--gateway-listen", "127.0.0.1:0",
                "--log-dir", str(tmp_path))  # fmt: skip
    assert done.returncode == 2
    assert "--listen 0.0.0.0:0: a mesh reachable beyond this machine must run with --secure" in (
        done.stderr
    )
