"""The gateway, secured (issue 8): it serves HTTPS (``--tls-cert/--tls-key``), verifies a TLS
coordinator (``--tls-ca``), holds no key for its callers (each request's
``Authorization: Bearer`` key goes to the coordinator with every RPC made for it), and maps
the coordinator's refusals onto OpenAI's errors: UNAUTHENTICATED 401, PERMISSION_DENIED 403,
NOT_FOUND 404.

Real processes: a coordinator with API keys and TLS (its workers' door mutual TLS), a
simulated worker with the workers' certificate, gateways in front of it; and, for what the
real coordinator never answers the gateway (PERMISSION_DENIED), a stand-in coordinator
guarded by the real `AuthInterceptor`. Credentials from `AuthDir`; the real Redis
(HEXGEN_TEST_REDIS), under a prefix of this module's own."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import redis

from hexgen_api.v1 import coordinator_pb2
from hexgen_client.client import CoordinatorClient
from hexgen_gateway.__main__ import parse_config
from hexgen_launch.processes import free_port
from hexgen_service.auth import API_KEY_ENV, AuthInterceptor, KeyStore, Role, current_principal
from hexgen_service.auth_dir import AuthDir
from hexgen_service.server import GrpcServer
from hexgen_service.tls import TLS_CA_ENV
from redis_here import REDIS_URL, needs_redis

pytestmark = needs_redis

MODEL = "llama-3.1-70b"
COORDINATOR_SERVICE = "hexgen_flow.v1.CoordinatorService"


def key(path: Path) -> str:
    return path.read_text().strip()


def tls_context(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


@pytest.fixture(scope="module")
def auth(tmp_path_factory: pytest.TempPathFactory) -> AuthDir:
    auth = AuthDir(tmp_path_factory.mktemp("gateway-auth") / "auth")
    auth.init(["acme", "beta"])
    return auth


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, TLS_CA_ENV)}
    return {**env, **extra}


@contextlib.contextmanager
def _process(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[Any]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env or _clean_env())
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait(what: str, ready: Any, proc: Any, log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited {proc.returncode}: {log.read_text()[-3000:]}")
        if ready():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} did not come up: {log.read_text()[-3000:]}")


def _gateway_argv(listen: str, coordinator: str, *options: str) -> list[str]:
    return [
        sys.executable, "-m", "hexgen_gateway", "--listen", listen,
        "--coordinator", coordinator, "--log-level", "WARNING", *options,
    ]  # fmt: skip


def _answers(url: str, verify: ssl.SSLContext | bool = False) -> bool:
    try:
        httpx.get(url, timeout=5, verify=verify)
    except httpx.TransportError:
        return False
    return True


@dataclass
class Mesh:
    coordinator: str
    gateway: str
    """HOST:PORT of the HTTPS gateway."""
    gateway_log: Path
    auth: AuthDir

    @property
    def url(self) -> str:
        return f"https://{self.gateway}/v1"

    def sdk(self, api_key: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url,
            api_key=api_key,
            max_retries=0,
            timeout=60,
            http_client=openai.DefaultHttpxClient(verify=tls_context(self.auth.ca)),
        )

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, verify=tls_context(self.auth.ca), timeout=60)

    def admin(self) -> CoordinatorClient:
        return CoordinatorClient(
            self.coordinator, api_key=key(self.auth.admin_key), tls_ca=self.auth.ca
        )


@pytest.fixture(scope="module")
def mesh(auth: AuthDir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """A secured coordinator (keys, TLS, mutual TLS for workers), one simulated worker, and
    an HTTPS gateway verifying the coordinator with the CA. The gateway has a key of its
    own (the operator key, for /health) and an admin key in its environment: neither may
    ever reach the coordinator for a caller."""
    logs = tmp_path_factory.mktemp("gateway-mesh")
    prefix = f"hf-test-gwsec-{uuid.uuid4().hex[:8]}:"
    coordinator = f"127.0.0.1:{free_port()}"
    worker_door = f"127.0.0.1:{free_port()}"
    gateway = f"127.0.0.1:{free_port()}"
    with contextlib.ExitStack() as stack:
        coord = stack.enter_context(
            _process(
                [sys.executable, "-m", "hexgen_coordinator", "--listen", coordinator,
                 "--worker-listen", worker_door, "--redis-url", REDIS_URL,
                 "--redis-prefix", prefix, "--cluster", "A100", "--time-scale", "50",
                 "--api-keys-file", str(auth.keys), "--tls-cert", str(auth.server_cert),
                 "--tls-key", str(auth.server_key), "--tls-ca", str(auth.ca),
                 "--log-level", "WARNING"],
                logs / "coordinator.log",
            )
        )  # fmt: skip
        stack.enter_context(
            _process(
                [sys.executable, "-m", "hexgen_worker", "--coordinator", worker_door,
                 "--worker-id", "secure-worker-0", "--slot", "0", "--gpu", "A100",
                 "--tls-ca", str(auth.ca), "--tls-cert", str(auth.worker_cert),
                 "--tls-key", str(auth.worker_key), "--log-level", "WARNING"],
                logs / "worker.log",
            )
        )  # fmt: skip
        gateway_log = logs / "gateway.log"
        gw = stack.enter_context(
            _process(
                _gateway_argv(
                    gateway, coordinator, "--tls-ca", str(auth.ca),
                    "--tls-cert", str(auth.server_cert), "--tls-key", str(auth.server_key),
                    "--api-key-file", str(auth.tuner_key),
                ),
                gateway_log,
                env=_clean_env(**{API_KEY_ENV: key(auth.admin_key)}),
            )
        )  # fmt: skip
        found = Mesh(coordinator, gateway, gateway_log, auth)

        def worker_connected() -> bool:
            async def ask() -> bool:
                async with found.admin() as admin:
                    try:
                        status = await admin.status()
                    except Exception:
                        return False
                    return any(inst.connected for inst in status.instances)

            return asyncio.run(ask())

        _wait("the coordinator's worker", worker_connected, coord, logs / "coordinator.log")
        health = f"https://{gateway}/health"
        _wait("the gateway", lambda: _answers(health, tls_context(auth.ca)), gw, gateway_log)
        yield found
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)


# ------------------------------------------------------------------ the caller's own key


def test_a_tenant_key_runs_completions_as_its_tenant(mesh: Mesh) -> None:
    client = mesh.sdk(key(mesh.auth.tenant_key("acme")))
    workflow = f"acme-{uuid.uuid4().hex[:8]}"
    headers = {"X-Hexgen-Workflow": workflow, "X-Hexgen-Stage": "chat"}
    done = client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_headers=headers)
    assert done.choices[0].text.endswith(" 4 tokens")
    # Streamed (RunCall is a server stream: the key must ride on it too).
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "q"}],
        max_tokens=3,
        stream=True,
        extra_headers=headers,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.endswith(" 3 tokens")
    assert [m.id for m in client.models.list()] == [MODEL]

    async def owner() -> tuple[str, int]:
        async with mesh.admin() as admin:
            info = (await admin.get(workflow)).query
            return info.tenant, info.calls_total

    assert asyncio.run(owner()) == ("acme", 2)  # the workflow is the key's tenant's


def test_no_key_or_a_bad_key_is_401_and_the_gateway_lends_none(mesh: Mesh) -> None:
    with mesh.http() as http:
        # A keyed caller fills the gateway's ClusterStatus memory first: it is not shared.
        acme = {"Authorization": f"Bearer {key(mesh.auth.tenant_key('acme'))}"}
        assert http.get("/models", headers=acme).status_code == 200
        for headers in ({}, {"Authorization": "Basic dXNlcjpwdw=="}):
            for method, path, body in (
                ("GET", "/models", None),
                ("POST", "/completions", {"prompt": "x", "max_tokens": 2}),
                ("POST", "/chat/completions", {"messages": [{"role": "user", "content": "q"}]}),
            ):
                answer = http.request(method, path, json=body, headers=headers)
                assert answer.status_code == 401, (path, answer.text)
                assert answer.headers["WWW-Authenticate"].startswith("Bearer")
                error = answer.json()["error"]
                assert error["code"] == "invalid_api_key" and "no API key" in error["message"]
                assert error["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError) as bad:
        mesh.sdk("hfk_0123456789ab_" + "x" * 43).completions.create(model=MODEL, prompt="x")
    assert bad.value.status_code == 401 and "unknown API key" in bad.value.message
    # 401s, not answers: neither the gateway's --api-key-file key (an operator's) nor the
    # admin key in its environment went out for those callers.
    assert "Traceback" not in mesh.gateway_log.read_text()


def test_another_tenants_workflow_is_404_and_stays_untouched(mesh: Mesh) -> None:
    workflow = f"shared-{uuid.uuid4().hex[:8]}"
    headers = {"X-Hexgen-Workflow": workflow, "X-Hexgen-Stage": "s"}
    acme = {"Authorization": f"Bearer {key(mesh.auth.tenant_key('acme'))}", **headers}
    beta = {"Authorization": f"Bearer {key(mesh.auth.tenant_key('beta'))}", **headers}
    body = {"prompt": "x", "max_tokens": 2}
    with mesh.http() as http:
        assert http.post("/completions", json=body, headers=acme).status_code == 200
        stolen = http.post("/completions", json=body, headers=beta)
        assert stolen.status_code == 404, stolen.text
        assert stolen.json()["error"]["code"] == "not_found"
        closed = http.post(f"/workflows/{workflow}/close", headers=beta)
        assert closed.status_code == 404, closed.text

    async def calls() -> tuple[str, int, int]:
        async with mesh.admin() as admin:
            info = (await admin.get(workflow)).query
            return info.tenant, info.calls_total, info.state

    tenant, total, state = asyncio.run(calls())
    assert (tenant, total) == ("acme", 1)  # beta's call did not join it
    assert state != coordinator_pb2.QUERY_STATE_CANCELLED
    with mesh.http() as http:  # its owner still may close it
        closed = http.post(f"/workflows/{workflow}/close", headers=acme)
        assert closed.status_code == 200, closed.text


def test_health_uses_the_gateways_own_key(mesh: Mesh) -> None:
    with mesh.http() as http:
        health = http.get(f"https://{mesh.gateway}/health")
    assert health.status_code == 200, health.text
    # The operator key of --api-key-file sees the instances.
    assert health.json()["instances"] == 1 and health.json()["connected"] == 1
    done = subprocess.run(
        [sys.executable, "-m", "hexgen_gateway.healthcheck", "--tls-ca", str(mesh.auth.ca),
         mesh.gateway],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


# ----------------------------------------------------------------------------------- TLS


def test_the_gateway_speaks_https_only(mesh: Mesh, tmp_path: Path) -> None:
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://{mesh.gateway}/health", timeout=10)
    other = AuthDir(tmp_path / "other")
    other.init()
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://{mesh.gateway}/health", timeout=10, verify=tls_context(other.ca))
    done = subprocess.run(
        [sys.executable, "-m", "hexgen_gateway.healthcheck", mesh.gateway],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 1  # plain HTTP against it


def test_a_gateway_that_does_not_trust_the_coordinators_ca_is_503(
    mesh: Mesh, tmp_path: Path
) -> None:
    other = AuthDir(tmp_path / "other")
    other.init()
    acme = {"Authorization": f"Bearer {key(mesh.auth.tenant_key('acme'))}"}
    for options in ([], ["--tls-ca", str(other.ca)]):
        listen = f"127.0.0.1:{free_port()}"
        log = tmp_path / f"gateway-{len(options)}.log"
        with _process(_gateway_argv(listen, mesh.coordinator, *options), log) as proc:
            _wait("the gateway", functools.partial(_answers, f"http://{listen}/health"), proc, log)
            answer = httpx.get(f"http://{listen}/v1/models", headers=acme, timeout=30)
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["type"] == "service_unavailable"


# ------------------------------------------- against a stand-in coordinator (real gRPC)

STAND_IN_RULES = {
    f"/{COORDINATOR_SERVICE}/OpenWorkflow": Role.TENANT,
    f"/{COORDINATOR_SERVICE}/RunCall": Role.TENANT,
    f"/{COORDINATOR_SERVICE}/ClusterStatus": Role.TENANT,
    f"/{COORDINATOR_SERVICE}/CloseWorkflow": Role.OPERATOR,
}
"""The stand-in's choice: closing a workflow is an operator's, so a tenant meets a 403."""


class _StandIn:
    """OpenWorkflow, RunCall, CloseWorkflow and ClusterStatus of a coordinator behind the
    real `AuthInterceptor`, recording who each RPC came from."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []
        """(method, workflow id, the caller's tenant) of every RPC let through."""

    def _record(self, method: str, workflow: str) -> None:
        principal = current_principal.get()
        assert principal is not None
        self.seen.append((method, workflow, principal.tenant))

    def register(self, server: grpc.aio.Server) -> None:
        k = coordinator_pb2

        async def open_workflow(
            request: k.OpenWorkflowRequest, context: Any
        ) -> k.OpenWorkflowResponse:
            self._record("OpenWorkflow", request.workflow_id)
            await asyncio.sleep(0.01)
            info = k.QueryInfo(query_id=request.workflow_id, deadline_s=30.0)
            return k.OpenWorkflowResponse(workflow=info, created=True)

        async def run_call(request: k.RunCallRequest, context: Any) -> AsyncIterator[Any]:
            self._record("RunCall", request.workflow_id)
            call_id = f"{request.workflow_id}/0.0"
            for kind, text in (
                (k.QUERY_EVENT_KIND_CALL_SUBMITTED, ""),
                (k.QUERY_EVENT_KIND_CALL_TOKENS, "a "),
                (k.QUERY_EVENT_KIND_CALL_FINISHED, "a b"),
            ):
                await asyncio.sleep(0.02)  # let other requests' RPCs interleave
                first = kind == k.QUERY_EVENT_KIND_CALL_SUBMITTED
                event = k.QueryEvent(
                    query_id=request.workflow_id, kind=kind, text=text, call_id=call_id
                )
                yield k.RunCallResponse(
                    event=event, call_id=call_id if first else "", deadline_s=9.0
                )

        async def close_workflow(
            request: k.CloseWorkflowRequest, context: Any
        ) -> k.CloseWorkflowResponse:
            self._record("CloseWorkflow", request.workflow_id)
            if request.workflow_id.startswith("unknown"):
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no query {request.workflow_id!r}")
            return k.CloseWorkflowResponse(workflow=k.QueryInfo(query_id=request.workflow_id))

        async def cluster_status(
            request: k.ClusterStatusRequest, context: Any
        ) -> k.ClusterStatusResponse:
            self._record("ClusterStatus", "")
            return k.ClusterStatusResponse(instances=[k.InstanceStatus(model=MODEL)])

        def unary(handler: Any, request: Any, response: Any) -> Any:
            return grpc.unary_unary_rpc_method_handler(
                handler, request.FromString, response.SerializeToString
            )

        handlers = {
            "OpenWorkflow": unary(open_workflow, k.OpenWorkflowRequest, k.OpenWorkflowResponse),
            "RunCall": grpc.unary_stream_rpc_method_handler(
                run_call, k.RunCallRequest.FromString, k.RunCallResponse.SerializeToString
            ),
            "CloseWorkflow": unary(close_workflow, k.CloseWorkflowRequest, k.CloseWorkflowResponse),
            "ClusterStatus": unary(cluster_status, k.ClusterStatusRequest, k.ClusterStatusResponse),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(COORDINATOR_SERVICE, handlers),)
        )


@pytest.fixture
async def stand_in(auth: AuthDir, tmp_path: Path) -> AsyncIterator[tuple[_StandIn, str]]:
    """The stand-in behind the real interceptor, and a plain-HTTP gateway (loopback) in
    front of it; the gateway's environment holds the admin key (never to be lent)."""
    coordinator = _StandIn()
    address = f"127.0.0.1:{free_port()}"
    server = GrpcServer(
        address,
        coordinator.register,
        [COORDINATOR_SERVICE],
        grace_s=0.1,
        interceptors=[AuthInterceptor(KeyStore(auth.keys), STAND_IN_RULES)],
    )
    await server.start()
    listen = f"127.0.0.1:{free_port()}"
    log = (tmp_path / "gateway.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        *_gateway_argv(listen, address),
        stdout=log, stderr=subprocess.STDOUT,
        env=_clean_env(**{API_KEY_ENV: key(auth.admin_key)}),
    )  # fmt: skip
    try:
        async with httpx.AsyncClient() as http:
            for _ in range(300):
                try:
                    await http.get(f"http://{listen}/health", timeout=2)
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
        yield coordinator, listen
    finally:
        proc.terminate()
        await proc.wait()
        log.close()
        await server.stop()


async def test_permission_denied_is_403_and_not_found_404(
    stand_in: tuple[_StandIn, str], auth: AuthDir
) -> None:
    coordinator, listen = stand_in
    tenant = {"Authorization": f"Bearer {key(auth.tenant_key('acme'))}"}
    operator = {"Authorization": f"Bearer {key(auth.tuner_key)}"}
    async with httpx.AsyncClient(base_url=f"http://{listen}/v1", timeout=30) as http:
        denied = await http.post("/workflows/w1/close", headers=tenant)
        assert denied.status_code == 403, denied.text
        error = denied.json()["error"]
        assert error["code"] == "permission_denied"
        assert "CloseWorkflow needs the operator role" in error["message"]
        assert (await http.post("/workflows/w1/close", headers=operator)).status_code == 200
        unknown = await http.post("/workflows/unknown-1/close", headers=operator)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
        keyless = await http.post("/workflows/w1/close")
        assert keyless.status_code == 401  # not the admin key of the gateway's environment
    assert [(m, w, t) for m, w, t in coordinator.seen if m == "CloseWorkflow"] == [
        ("CloseWorkflow", "w1", "tuner"),
        ("CloseWorkflow", "unknown-1", "tuner"),
    ]
    sdk = openai.OpenAI(
        base_url=f"http://{listen}/v1", api_key=key(auth.tenant_key("acme")), max_retries=0
    )
    with pytest.raises(openai.PermissionDeniedError):
        await asyncio.to_thread(sdk.post, "/workflows/w2/close", cast_to=object)


async def test_concurrent_callers_keys_never_cross(
    stand_in: tuple[_StandIn, str], auth: AuthDir
) -> None:
    coordinator, listen = stand_in
    keys = {tenant: key(auth.tenant_key(tenant)) for tenant in ("acme", "beta")}

    async def ask(http: httpx.AsyncClient, n: int) -> None:
        tenant = ("acme", "beta")[n % 2]
        headers = {
            "Authorization": f"Bearer {keys[tenant]}",
            "X-Hexgen-Workflow": f"{tenant}-{n}",
            "X-Hexgen-Stage": "s",
        }
        body: dict[str, Any] = {"prompt": "p", "max_tokens": 2, "stream": n % 4 < 2}
        async with http.stream("POST", "/completions", json=body, headers=headers) as answer:
            assert answer.status_code == 200, await answer.aread()
            await answer.aread()

    async with httpx.AsyncClient(base_url=f"http://{listen}/v1", timeout=60) as http:
        await asyncio.gather(*(ask(http, n) for n in range(16)))
    calls = [(m, w, t) for m, w, t in coordinator.seen if m in ("OpenWorkflow", "RunCall")]
    assert len(calls) == 32
    assert all(w.split("-")[0] == t for _, w, t in calls), calls


# ------------------------------------------------------------------------- command line


def _refused(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "hexgen_gateway", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("hexgen-gateway: error: ")
    return done.stderr.removeprefix("hexgen-gateway: error: ").strip()


def test_protected_mode_and_bad_security_flags_exit_2(auth: AuthDir, tmp_path: Path) -> None:
    listen = f"0.0.0.0:{free_port()}"
    assert _refused("--listen", listen).startswith(
        f"--listen: refusing to listen on {listen} without --tls-cert/--tls-key"
    )
    tls = ["--tls-cert", str(auth.server_cert), "--tls-key", str(auth.server_key)]
    assert parse_config(["--listen", listen, *tls])[0].https
    assert not parse_config(["--listen", listen, "--insecure"])[0].https
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert _refused("--tls-cert", str(auth.server_cert)) == (
        "--tls-cert and --tls-key: give both or neither"
    )
    assert _refused("--tls-cert", str(not_pem), "--tls-key", str(auth.server_key)).startswith(
        f"--tls-cert/--tls-key: cannot load {not_pem}"
    )
    assert _refused("--tls-ca", str(not_pem)) == f"--tls-ca: {not_pem} is not a PEM file"
    assert _refused("--api-key-file", str(empty)) == f"--api-key-file: {empty} is empty"
