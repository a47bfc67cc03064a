"""Small defects found by hostile testing of the mesh, each checked through real processes
(``python -m hexgen_coordinator`` and ``python -m hexgen_worker`` on the test Redis under a
private key prefix, deleted afterwards):

- a worker hello with an enum value the enum does not name (proto3 keeps it) is
  INVALID_ARGUMENT naming the field, not UNKNOWN with a traceback in the coordinator's log;
- a coordinator SIGKILLed and restarted costs its worker one WARNING line per restart (no
  ERROR, no traceback), and the worker reconnects and serves;
- ids, tenant names, stage ids and step names refuse invisible and deceptive characters
  (Unicode categories Cc, Cf, Zl, Zp, Cs, Co, Cn) and leading or trailing whitespace, as
  INVALID_ARGUMENT naming the field, while prompts stay free text and stored submissions
  still parse; API keys refuse such tenants too.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import grpc
import pytest

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import coordinator_pb2_grpc as cpb_grpc
from hexgen_api.v1 import worker_pb2 as wpb
from hexgen_api.v1 import worker_pb2_grpc as wpb_grpc
from hexgen_api.v1 import workflow_pb2 as flow
from hexgen_client.client import CoordinatorClient
from hexgen_flow.errors import ConfigError
from hexgen_flow.workload import LLMCall, Query, Workflow
from hexgen_launch.processes import ManagedProcess, stop_processes
from hexgen_service.auth import KeyStore, Role
from hexgen_service.convert import DEFAULT_LIMITS, SubmitLimits, check_text, parse_submit
from hexgen_service.errors import InvalidFieldError
from process_mesh import ProcessMesh
from redis_here import needs_redis

pytestmark = needs_redis

TIMEOUT_S = 30.0


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[ProcessMesh]:
    """A coordinator process on a key prefix of its own, no workers unless a test starts
    one (admitted queries wait parked); `kill_coordinator` then `start_coordinator` is a
    crash and a restart on the same address and state."""
    mesh = ProcessMesh(tmp_path, ["--admission", "off"], workers=0, time_scale=50, cluster="A100")
    try:
        yield mesh
    finally:
        mesh.stop()


def _error(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    call = cast(grpc.Call, exc)
    return call.code(), call.details() or ""


def _no_traceback(log: str) -> None:
    assert "Traceback" not in log, log[-4000:]
    assert not re.search(r"^\S+ \S+ (ERROR|CRITICAL) ", log, re.MULTILINE), log[-4000:]


# ------------------------------------------------------------------ b. worker hello enums


def _connect(address: str, hello: wpb.WorkerHello) -> tuple[grpc.StatusCode, str]:
    """Send `hello` as a raw worker would; the stream's status (OK: a welcome came)."""
    with grpc.insecure_channel(address) as channel:
        replies = wpb_grpc.WorkerServiceStub(channel).Connect(
            iter([wpb.ConnectRequest(hello=hello)]), timeout=10
        )
        try:
            for reply in replies:
                assert reply.WhichOneof("message") == "welcome"
                return grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            return _error(exc)
    return grpc.StatusCode.OK, "no reply"


def test_a_hello_with_an_unknown_engine_is_invalid_argument_naming_the_field(
    coordinator: ProcessMesh,
) -> None:
    hello = wpb.WorkerHello(worker_id="hostile", slot=0, gpu="A100")
    hello.engine = cast(wpb.EngineKind.ValueType, 7)  # proto3 keeps a value it cannot name
    code, details = _connect(coordinator.address, hello)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith("hello.engine: unknown engine kind 7"), details
    assert "ENGINE_KIND_SIMULATED" in details and "\n" not in details

    hello.engine = cast(wpb.EngineKind.ValueType, -3)
    code, details = _connect(coordinator.address, hello)
    assert (code, details.split(":")[0]) == (grpc.StatusCode.INVALID_ARGUMENT, "hello.engine")

    hello.engine, hello.slot = wpb.ENGINE_KIND_SIMULATED, -5
    code, details = _connect(coordinator.address, hello)
    assert (code, details.split(":")[0]) == (grpc.StatusCode.INVALID_ARGUMENT, "hello.slot")

    # Every named engine kind, and none (an older worker), still takes the slot.
    for engine in wpb.EngineKind.values():
        hello.engine, hello.slot = engine, 0
        assert _connect(coordinator.address, hello) == (grpc.StatusCode.OK, "")
    time.sleep(0.5)  # the coordinator logs what it logs about those streams
    log = coordinator.log("coordinator")
    _no_traceback(log)
    assert "refused a worker hello" in log and "hello.engine" in log


# ------------------------------------------------------ c. a coordinator restart, at a worker


def test_a_coordinator_restart_is_one_warning_at_its_worker_which_reconnects(
    coordinator: ProcessMesh, tmp_path: Path
) -> None:
    worker_log = tmp_path / "worker.log"
    worker = ManagedProcess(
        "worker",
        [
            sys.executable, "-m", "hexgen_worker",
            "--coordinator", coordinator.address,
            "--worker-id", "restarted-under",
            "--slot", "0",
            "--gpu", "A100",
        ],
        worker_log,
    )  # fmt: skip
    restarts = 3

    def welcomes() -> int:
        return worker_log.read_text().count("welcomed by")

    def wait_welcomes(n: int) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while welcomes() < n:
            assert worker.running, worker_log.read_text()
            assert time.monotonic() < deadline, worker_log.read_text()
            time.sleep(0.05)

    worker.start()
    try:
        wait_welcomes(1)
        for n in range(restarts):
            time.sleep(1.0)  # heartbeats flow on the stream when it breaks
            coordinator.kill_coordinator()
            time.sleep(0.5)
            coordinator.start_coordinator()
            wait_welcomes(n + 2)

        async def serve() -> cpb.QueryEvent:
            async with CoordinatorClient(coordinator.address) as client:
                await client.submit(
                    Query("after-restarts", Workflow.chain([(LLMCall("a", 50, 4),)]))
                )
                events = [e async for e in client.watch("after-restarts")]
                return events[-1]

        last = asyncio.run(asyncio.wait_for(serve(), TIMEOUT_S))
        assert last.kind == cpb.QUERY_EVENT_KIND_SUCCEEDED
        assert worker.running
    finally:
        stop_processes([worker], grace_s=5.0)
    log = worker_log.read_text()
    _no_traceback(log)
    # Each restart: the loss of the welcomed stream is the first line after its welcome,
    # one WARNING; the failed attempts to reconnect while the coordinator is down follow
    # (WARNING each, as documented), then the next welcome.
    lines = log.splitlines()
    welcomed = [i for i, line in enumerate(lines) if "welcomed by" in line]
    assert len(welcomed) == restarts + 1, log
    for start, end in itertools.pairwise(welcomed):
        between = [line for line in lines[start + 1 : end] if " hexgen_worker" in line]
        assert between, log
        assert " WARNING " in between[0] and "link to coordinator" in between[0], between
        assert all(" WARNING " in line or " INFO " in line for line in between), between


# ------------------------------------------------------------------ d. names and ids

REFUSED = {
    "rlo": "evil\u202etxt.exe",
    "zwsp": "default\u200b",
    "line-separator": "a\u2028b",
    "paragraph-separator": "a\u2029b",
    "bom": "\ufeffdefault",
    "lrm": "a\u200eb",
    "private-use": "a\ue000",
    "unassigned": "a\U000e0080",
    "nul": "a\x00b",
    "c1": "a\x85b",
    "trailing-space": "default ",
    "leading-space": " default",
    "trailing-nbsp": "default\u00a0",
    "trailing-tab": "default\t",
}
ALLOWED = ["default", "acme-prod", "é-tenant", "数据", "a b", "🙂", "q:1/2", "x" * 40]


@pytest.mark.parametrize("name", REFUSED)
def test_check_text_refuses_invisible_and_deceptive_characters(name: str) -> None:
    strict = SubmitLimits(allow_control_characters=False)
    with pytest.raises(InvalidFieldError) as refused:
        check_text("tenant", REFUSED[name], None, strict)
    assert refused.value.field == "tenant"
    message = str(refused.value)
    assert message.startswith("tenant: must not ")
    assert message.isascii() and message.isprintable(), message  # no character written out
    # Stored submissions are parsed with the default limits: they still load.
    check_text("tenant", REFUSED[name], None, DEFAULT_LIMITS)


@pytest.mark.parametrize("value", ALLOWED)
def test_check_text_allows_ordinary_names(value: str) -> None:
    check_text("query_id", value, None, SubmitLimits(allow_control_characters=False))


def test_a_stored_submission_with_such_names_still_parses() -> None:
    request = cpb.SubmitQueryRequest(
        query_id="q\u202e1 ",
        tenant="default ",
        workflow=flow.Workflow(
            stages=[
                flow.Stage(
                    id="a\u200b",
                    step="revise\u2028",
                    calls=[flow.LLMCall(input_tokens=10, output_tokens=2)],
                )
            ]
        ),
    )
    query, _ = parse_submit(request)
    assert (query.query_id, query.tenant) == ("q\u202e1 ", "default ")


def _stage(
    stage_id: str = "a", step: str = "revise", call_step: str = "", prompt: str = ""
) -> flow.Stage:
    call = flow.LLMCall(input_tokens=100, output_tokens=10, step=call_step, prompt=prompt)
    return flow.Stage(id=stage_id, step=step, calls=[call])


def test_the_coordinator_refuses_such_names_and_keeps_prompts_free(
    coordinator: ProcessMesh,
) -> None:
    bad = "x\u202ey"
    with grpc.insecure_channel(coordinator.address) as channel:
        stub = cpb_grpc.CoordinatorServiceStub(channel)

        def submit(
            query_id: str = "", tenant: str = "", stages: list[flow.Stage] | None = None
        ) -> tuple[grpc.StatusCode, str]:
            request = cpb.SubmitQueryRequest(
                query_id=query_id or f"q-{uuid.uuid4().hex[:8]}",
                tenant=tenant,
                workflow=flow.Workflow(stages=stages or [_stage()]),
            )
            try:
                stub.SubmitQuery(request, timeout=10)
            except grpc.RpcError as exc:
                return _error(exc)
            return grpc.StatusCode.OK, ""

        cases: list[tuple[str, str, list[flow.Stage] | None, str]] = [
            (bad, "", None, "query_id"),
            ("q\u200b", "", None, "query_id"),
            ("q\u2028", "", None, "query_id"),
            (" q-lead", "", None, "query_id"),
            ("", "default ", None, "tenant"),
            ("", "\u200bdefault", None, "tenant"),
            ("", "acme\u202e", None, "tenant"),
            ("", "", [_stage(stage_id=bad)], "workflow.stages[0].id"),
            ("", "", [_stage(stage_id="a ")], "workflow.stages[0].id"),
            ("", "", [_stage(step="revise\u200b")], "workflow.stages[0].step"),
            ("", "", [_stage(call_step="\u2029x")], "workflow.stages[0].calls[0].step"),
        ]
        for query_id, tenant, stages, field in cases:
            code, details = submit(query_id, tenant, stages)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (query_id, tenant, code, details)
            assert details.startswith(f"{field}: must not "), (query_id, tenant, details)
            assert details.isascii() and details.isprintable(), details

        # Prompts are free text: every one of those characters is fine there.
        prompt = "".join(REFUSED.values()) + " trailing "
        assert submit(stages=[_stage(prompt=prompt)]) == (grpc.StatusCode.OK, "")
        # And ordinary non-ASCII names are fine.
        assert submit(query_id="q-é-数据-🙂", tenant="é-tenant") == (grpc.StatusCode.OK, "")

        # Workflow sessions: OpenWorkflow names its fields as that request does.
        def open_workflow(workflow_id: str, tenant: str = "") -> tuple[grpc.StatusCode, str]:
            try:
                stub.OpenWorkflow(
                    cpb.OpenWorkflowRequest(
                        workflow_id=workflow_id, tenant=tenant, template="single"
                    ),
                    timeout=10,
                )
            except grpc.RpcError as exc:
                return _error(exc)
            return grpc.StatusCode.OK, ""

        for workflow_id, tenant, field in [
            ("w\u2028", "", "workflow_id"),
            ("w\u200b", "", "workflow_id"),
            ("w-trailing ", "", "workflow_id"),
            ("w-ok-1", "t\u202e", "tenant"),
            ("w-ok-2", " t", "tenant"),
        ]:
            code, details = open_workflow(workflow_id, tenant)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (workflow_id, tenant, details)
            assert details.startswith(f"{field}: must not "), details

        assert open_workflow("w-open") == (grpc.StatusCode.OK, "")

        def run_call(stage: str, prompt: str = "p", step: str = "") -> tuple[grpc.StatusCode, str]:
            replies = stub.RunCall(
                cpb.RunCallRequest(
                    workflow_id="w-open",
                    stage=stage,
                    call=flow.LLMCall(input_tokens=10, output_tokens=2, prompt=prompt, step=step),
                ),
                timeout=10,
            )
            try:
                first = next(iter(replies))
            except grpc.RpcError as exc:
                return _error(exc)
            finally:
                replies.cancel()
            assert first.call_id
            return grpc.StatusCode.OK, ""

        for stage in ["chat\u200b", "chat\u202e", "chat\u2028", " chat", "chat "]:
            code, details = run_call(stage)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (stage, details)
            assert details.startswith("stage: must not "), details
        for step in ["plan\u200b", "plan\u202e", " plan"]:
            code, details = run_call("chat", step=step)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (step, details)
            assert details.startswith("call.step: must not "), details
        assert run_call("chat", prompt="free \u202e text\u200b ") == (grpc.StatusCode.OK, "")
    _no_traceback(coordinator.log("coordinator"))


@pytest.mark.parametrize("tenant", ["default ", " default", "acme\u202e", "a\u200bb", "a\u2028b"])
def test_api_keys_refuse_such_tenants(tmp_path: Path, tenant: str) -> None:
    store = KeyStore.create(tmp_path / "keys.json")
    with pytest.raises(ConfigError, match=r"^tenant: .* without leading or trailing whitespace"):
        store.add(tenant, Role.TENANT)
    assert store.records() == []
    # A keys file edited by hand with such a tenant is refused when read, naming the key.
    store.add("acme", Role.TENANT)
    text = (tmp_path / "keys.json").read_text()
    (tmp_path / "keys.json").write_text(text.replace('"acme"', f'"{ascii(tenant)[1:-1]}"'))
    with pytest.raises(ConfigError, match=r"keys\[0\]: tenant: "):
        KeyStore(tmp_path / "keys.json")


def test_auth_add_key_refuses_such_a_tenant_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hexgen_cli", "auth", "init", str(tmp_path / "auth")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for tenant in ["default ", "acme\u202e"]:
        done = subprocess.run(
            [sys.executable, "-m", "hexgen_cli", "auth", "add-key", str(tmp_path / "auth"),
             "--tenant", tenant],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert "Traceback" not in done.stderr and done.stdout == ""
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "without leading or trailing whitespace" in lines[0], lines


@pytest.mark.parametrize("tenant", ["acme\u202e", "a\u200bb", "a/b"])
def test_auth_init_with_a_bad_tenant_writes_nothing(tmp_path: Path, tenant: str) -> None:
    # Every tenant is checked before the CA, the certificates or the keys are made: a
    # refused `auth init` leaves no half-made folder behind.
    folder = tmp_path / "auth"
    done = subprocess.run(
        [sys.executable, "-m", "hexgen_cli", "auth", "init", str(folder), "--tenants",
         f"ok,{tenant}"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--tenants: " in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not folder.exists() or not any(folder.rglob("*")), list(folder.rglob("*"))
