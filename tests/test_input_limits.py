"""Input limits at the coordinator's edge, through a real coordinator process
(``python -m hexgen_coordinator`` with small limits, on the Redis at 127.0.0.1:6379 under a
private key prefix, no workers: admitted queries wait parked).

Every limit answers INVALID_ARGUMENT naming the field; a known id with other content
ALREADY_EXISTS; undecodable bytes INVALID_ARGUMENT; and random submissions, valid or not,
only ever get OK, INVALID_ARGUMENT, ALREADY_EXISTS or RESOURCE_EXHAUSTED while the
coordinator stays up.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
import redis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import coordinator_pb2_grpc as cpb_grpc
from hexgen_api.v1 import workflow_pb2 as wpb
from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.edge import add_services
from hexgen_coordinator.service import CoordinatorServicer, add_coordinator_services
from hexgen_launch.processes import free_port
from hexgen_service.healthcheck import check
from redis_here import REDIS_URL, needs_redis

LIMITS = {
    "--max-prompt-bytes": 1000,
    "--max-calls": 50,
    "--max-stages": 20,
    "--max-id-bytes": 32,
    "--max-tenant-bytes": 16,
    "--max-slo-s": 1000,
}
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


pytestmark = needs_redis


class _Coordinator:
    """A coordinator process on a private prefix of the shared Redis."""

    def __init__(self, log: Path, *args: str) -> None:
        self.prefix = f"test-limits-{uuid.uuid4().hex[:8]}:"
        self.address = f"127.0.0.1:{free_port()}"
        argv = [
            sys.executable, "-m", "hexgen_coordinator",
            "--listen", self.address,
            "--redis-url", REDIS_URL,
            "--redis-prefix", self.prefix,
            "--cluster", "A100,A100",
            "--log-level", "WARNING",
            *args,
        ]  # fmt: skip
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while check(self.address, timeout_s=1.0) is not None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"the coordinator did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = cpb_grpc.CoordinatorServiceStub(self.channel)

    def stop(self) -> None:
        self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{self.prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def _limited(tmp: pytest.TempPathFactory, *args: str) -> Iterator[_Coordinator]:
    log = tmp.mktemp("limits") / "coordinator.log"
    limits = [item for flag, value in LIMITS.items() for item in (flag, str(value))]
    c = _Coordinator(log, *limits, *args)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Coordinator]:
    """Admission control off: what passes the limits is admitted (and waits parked)."""
    yield from _limited(tmp_path_factory, "--admission", "off")


@pytest.fixture(scope="module")
def rejecting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Coordinator]:
    """The default admission control: the backlog of parked queries soon refuses more."""
    yield from _limited(tmp_path_factory)


def _call(n: int = 1, prompt: str = "", inp: int = 100, out: int = 10) -> list[wpb.LLMCall]:
    return [wpb.LLMCall(input_tokens=inp, output_tokens=out, prompt=prompt) for _ in range(n)]


def _request(query_id: str, **fields: Any) -> cpb.SubmitQueryRequest:
    stages = fields.pop("stages", None) or [wpb.Stage(id="a", step="revise", calls=_call())]
    return cpb.SubmitQueryRequest(query_id=query_id, workflow=wpb.Workflow(stages=stages), **fields)


def _submit(c: _Coordinator, request: cpb.SubmitQueryRequest) -> tuple[grpc.StatusCode, str]:
    try:
        c.stub.SubmitQuery(request, timeout=10)
    except grpc.RpcError as exc:
        call = cast(grpc.Call, exc)
        return call.code(), call.details() or ""
    return grpc.StatusCode.OK, ""


def _chain(n: int, calls: int = 1) -> list[wpb.Stage]:
    return [
        wpb.Stage(id=f"s{k}", step="revise", calls=_call(calls), after=[f"s{k - 1}"] if k else [])
        for k in range(n)
    ]


CASES: dict[str, tuple[Callable[[str], cpb.SubmitQueryRequest], str]] = {
    "prompt": (
        lambda i: _request(i, stages=[wpb.Stage(step="revise", calls=_call(prompt="x" * 1001))]),
        "workflow.stages[0].calls[0].prompt",
    ),
    "prompt-bytes": (
        lambda i: _request(i, stages=[wpb.Stage(step="revise", calls=_call(prompt="é" * 501))]),
        "workflow.stages[0].calls[0].prompt",
    ),
    "calls": (
        lambda i: _request(i, stages=[wpb.Stage(step="revise", calls=_call(51))]),
        "workflow.stages[0].calls",
    ),
    "calls-repeated": (
        lambda i: _request(i, stages=[wpb.Stage(step="revise", calls=_call(10), repeat=6)]),
        "workflow.stages[0].repeat",
    ),
    "stages": (lambda i: _request(i, stages=_chain(21)), "workflow.stages"),
    "stages-repeated": (
        lambda i: _request(i, stages=[wpb.Stage(step="revise", calls=_call(), repeat=21)]),
        "workflow.stages[0].repeat",
    ),
    "id-bytes": (lambda i: _request("é" * 17), "query_id"),
    "id-nul": (lambda i: _request(i + "\x00x"), "query_id"),
    "id-newline": (lambda i: _request(i + "\nx"), "query_id"),
    "tenant-bytes": (lambda i: _request(i, tenant="t" * 17), "tenant"),
    "tenant-control": (lambda i: _request(i, tenant="a\x1b[31m"), "tenant"),
    "stage-id-control": (
        lambda i: _request(i, stages=[wpb.Stage(id="a\x00", step="revise", calls=_call())]),
        "workflow.stages[0].id",
    ),
    "step-control": (
        lambda i: _request(i, stages=[wpb.Stage(step="re\x07vise", calls=_call())]),
        "workflow.stages[0].step",
    ),
    "slo-huge": (lambda i: _request(i, slo_s=1e308), "slo_s"),
    "slo-over-max": (lambda i: _request(i, slo_s=1000.5), "slo_s"),
    "slo-inf": (lambda i: _request(i, slo_s=math.inf), "slo_s"),
    "slo-nan": (lambda i: _request(i, slo_s=math.nan), "slo_s"),
    "slo-negative": (lambda i: _request(i, slo_s=-1.0), "slo_s"),
    "slo-scale-huge": (lambda i: _request(i, slo_scale=1e308), "slo_scale"),
    "tokens": (
        lambda i: _request(i, stages=[wpb.Stage(step="revise", calls=_call(inp=0))]),
        "workflow.stages[0].calls[0].input_tokens",
    ),
    "after": (
        lambda i: _request(
            i, stages=[wpb.Stage(id="a", step="revise", calls=_call(), after=["zz"])]
        ),
        "workflow.stages[0].after[0]",
    ),
    "no-workflow": (lambda i: cpb.SubmitQueryRequest(query_id=i), "workflow"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_limit_is_invalid_argument_naming_its_field(
    coordinator: _Coordinator, case: str
) -> None:
    build, field = CASES[case]
    code, details = _submit(coordinator, build(f"limit-{case}"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.startswith(f"{field}: "), details
    assert "\n" not in details


def test_limits_admit_what_fits(coordinator: _Coordinator) -> None:
    fits = _request(
        "é" * 16,  # 32 bytes
        tenant="t" * 16,
        slo_s=1000.0,
        stages=[
            wpb.Stage(id="s0", step="revise", calls=_call(5, prompt="é" * 500), repeat=2),
            *_chain(18, calls=2)[1:],  # 20 stages, 45 calls in all
            wpb.Stage(id="z", step="evaluate", calls=_call(1), after=["s0"]),
        ],
    )
    code, details = _submit(coordinator, fits)
    assert code == grpc.StatusCode.OK, details


def test_a_resubmission_is_idempotent_only_with_the_same_content(
    coordinator: _Coordinator,
) -> None:
    first = _request("resubmit", tenant="t1", slo_s=100.0)
    assert coordinator.stub.SubmitQuery(first, timeout=10).created
    again = coordinator.stub.SubmitQuery(first, timeout=10)
    assert not again.created and again.query.query_id == "resubmit"
    for different in (
        _request("resubmit", tenant="t2", slo_s=100.0),
        _request("resubmit", tenant="t1", slo_s=200.0),
        _request(
            "resubmit",
            tenant="t1",
            slo_s=100.0,
            stages=[wpb.Stage(id="a", step="revise", calls=_call(prompt="other"))],
        ),
    ):
        code, details = _submit(coordinator, different)
        assert code == grpc.StatusCode.ALREADY_EXISTS, details
        assert details.startswith("query_id: ")
    code, _ = _submit(coordinator, first)
    assert code == grpc.StatusCode.OK


def test_a_finished_query_is_compared_with_its_stored_submission(
    coordinator: _Coordinator,
) -> None:
    request = _request("stored-then-cancelled", tenant="t1")
    assert coordinator.stub.SubmitQuery(request, timeout=10).created
    coordinator.stub.CancelQuery(cpb.CancelQueryRequest(query_id=request.query_id), timeout=10)
    again = coordinator.stub.SubmitQuery(request, timeout=10)
    assert not again.created and again.query.state == cpb.QUERY_STATE_CANCELLED
    code, details = _submit(coordinator, _request("stored-then-cancelled", tenant="t2"))
    assert code == grpc.StatusCode.ALREADY_EXISTS, details


# ---------------------------------------------------------------- undecodable requests

GARBAGE = b"\xff\xff\xff\xff\x0f"


def _identity(data: bytes) -> bytes:
    return data


async def _raw_statuses(address: str) -> dict[str, grpc.StatusCode]:
    """Undecodable bytes sent to a unary, a server-streaming and a bidi method."""
    found: dict[str, grpc.StatusCode] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        unary = channel.unary_unary(
            "/hexgen_flow.v1.CoordinatorService/SubmitQuery", _identity, _identity
        )
        watch = channel.unary_stream(
            "/hexgen_flow.v1.CoordinatorService/WatchQuery", _identity, _identity
        )
        connect = channel.stream_stream(
            "/hexgen_flow.v1.WorkerService/Connect", _identity, _identity
        )

        async def requests() -> AsyncIterator[bytes]:
            yield GARBAGE

        for name, call in (
            ("SubmitQuery", lambda: unary(GARBAGE, timeout=10)),
            ("WatchQuery", lambda: _drain(watch(GARBAGE, timeout=10))),
            ("Connect", lambda: _drain(connect(requests(), timeout=10))),
        ):
            try:
                await call()
            except grpc.aio.AioRpcError as exc:
                found[name] = exc.code()
                assert "\n" not in (exc.details() or ""), exc.details()
            else:
                found[name] = grpc.StatusCode.OK
    return found


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


class _StatusOnly:
    """Stands in for the coordinator behind the servicers: only ClusterStatus answers."""

    config = CoordinatorConfig()  # the defaults: no worker token

    def status(self) -> cpb.ClusterStatusResponse:
        return cpb.ClusterStatusResponse(policy="stub")


async def test_undecodable_bytes_are_invalid_argument_at_the_edge() -> None:
    server = grpc.aio.server()
    add_coordinator_services(server, _StatusOnly())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        address = f"127.0.0.1:{port}"
        found = await _raw_statuses(address)
        assert found == dict.fromkeys(found, grpc.StatusCode.INVALID_ARGUMENT), found
        assert set(found) == {"SubmitQuery", "WatchQuery", "Connect"}
        # Well-formed requests pass through the same handlers.
        async with grpc.aio.insecure_channel(address) as channel:
            stub = cpb_grpc.CoordinatorServiceStub(channel)
            status = await stub.ClusterStatus(cpb.ClusterStatusRequest(), timeout=10)
        assert status.policy == "stub"
    finally:
        await server.stop(None)


async def test_add_services_keeps_a_servicers_methods() -> None:
    server = grpc.aio.server()
    add_services(
        server,
        cpb_grpc.add_CoordinatorServiceServicer_to_server,
        CoordinatorServicer(cast(Any, _StatusOnly())),
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cpb_grpc.CoordinatorServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetQuery(cpb.GetQueryRequest(query_id="x"), timeout=10)
        # The stand-in has no get(): an unexpected error is INTERNAL, on one line.
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "\n" not in (info.value.details() or "")
    finally:
        await server.stop(None)


def test_undecodable_bytes_are_invalid_argument_on_a_live_coordinator(
    coordinator: _Coordinator,
) -> None:
    found = asyncio.run(_raw_statuses(coordinator.address))
    assert found == dict.fromkeys(found, grpc.StatusCode.INVALID_ARGUMENT), found


# --------------------------------------------------------------------- random requests

_text = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40
) | st.sampled_from(["", "q", "\x00", "a\nb", "é" * 20, "x" * 300])
_floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [0.0, 1.0, 100.0, 1000.0, 1e308, -1.0]
)
_tokens = st.integers(-5, 2**31 - 1) | st.integers(1, 2000)
_calls = st.lists(
    st.builds(
        wpb.LLMCall,
        step=st.sampled_from(["", "revise", "Information Retriever", "x\x01"]),
        input_tokens=_tokens,
        output_tokens=_tokens,
        prompt=st.sampled_from(["", "short", "p" * 999, "é" * 600]),
    ),
    max_size=60,
)


@st.composite
def _workflows(draw: st.DrawFn) -> wpb.Workflow:
    stages: list[wpb.Stage] = []
    for n in range(draw(st.integers(0, 24))):
        ids = [s.id for s in stages]
        after = draw(st.lists(st.sampled_from([*ids, "nope", ""]), max_size=3))
        stages.append(
            wpb.Stage(
                id=draw(st.sampled_from([f"s{n}", "", "dup", "s\x00"])),
                step=draw(st.sampled_from(["revise", "", "evaluate", "generate_candidate_x"])),
                calls=draw(_calls),
                after=after,
                repeat=draw(st.integers(-2, 60)),
            )
        )
    return wpb.Workflow(stages=stages)


_wild = st.builds(
    cpb.SubmitQueryRequest,
    query_id=_text,
    tenant=_text,
    workflow=_workflows(),
    slo_s=_floats,
    slo_scale=_floats,
)
"""Anything: mostly invalid."""


_ids = itertools.count()


@st.composite
def _plausible(draw: st.DrawFn) -> cpb.SubmitQueryRequest:
    """Mostly valid submissions (some under two fixed ids, which repeat), sometimes with
    one field pushed past its limit."""
    stages: list[wpb.Stage] = []
    for n in range(draw(st.integers(1, 5))):
        earlier = [s.id for s in stages]
        stages.append(
            wpb.Stage(
                id=f"s{n}",
                step=draw(st.sampled_from(["revise", "evaluate", "information_retriever"])),
                calls=[
                    wpb.LLMCall(
                        input_tokens=draw(st.integers(1, 12_000)),
                        output_tokens=draw(st.integers(1, 1_000)),
                        prompt=draw(st.sampled_from(["", "SELECT 1", "é" * 100])),
                    )
                    for _ in range(draw(st.integers(1, 4)))
                ],
                after=draw(st.lists(st.sampled_from(earlier), max_size=2)) if earlier else [],
                repeat=draw(st.integers(0, 3)),
            )
        )
    request = cpb.SubmitQueryRequest(
        query_id="random-dup" if draw(st.integers(0, 9)) == 0 else f"random-{next(_ids)}",
        tenant=draw(st.sampled_from(["", "a", "b"])),
        workflow=wpb.Workflow(stages=stages),
    )
    slo = draw(st.sampled_from(["none", "slo_s", "slo_scale"]))
    if slo == "slo_s":
        request.slo_s = draw(st.floats(1.0, 1000.0))
    elif slo == "slo_scale":
        request.slo_scale = draw(st.floats(0.5, 10.0))
    broken = draw(st.sampled_from([None] * 8 + ["slo_s", "tenant", "tokens", "prompt"]))
    if broken == "slo_s":
        request.slo_s, request.slo_scale = draw(st.sampled_from([1e308, -1.0, math.nan])), 0
    elif broken == "tenant":
        request.tenant = draw(st.sampled_from(["x" * 17, "a\x00b"]))
    elif broken == "tokens":
        request.workflow.stages[0].calls[0].input_tokens = draw(st.sampled_from([0, -3, 2**31 - 1]))
    elif broken == "prompt":
        request.workflow.stages[0].calls[0].prompt = "p" * 1001
    return request


_requests = _plausible() | _plausible() | _wild


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=_requests, admission=st.booleans())
def test_random_submissions_get_only_expected_statuses(
    coordinator: _Coordinator,
    rejecting: _Coordinator,
    request: cpb.SubmitQueryRequest,
    admission: bool,
) -> None:
    target = rejecting if admission else coordinator
    code, details = _submit(target, request)
    event(f"{'reject' if admission else 'off'}: {code.name}")
    assert code in ALLOWED, (code, details)
    assert "\n" not in details and "Traceback" not in details
    assert target.proc.poll() is None


def test_the_coordinator_is_still_up_after_all_that(
    coordinator: _Coordinator, rejecting: _Coordinator
) -> None:
    for c in (coordinator, rejecting):
        c.stub.ClusterStatus(cpb.ClusterStatusRequest(), timeout=10)
        assert c.proc.poll() is None
    status = coordinator.stub.ClusterStatus(cpb.ClusterStatusRequest(), timeout=10)
    assert status.queries_running > 0
    assert "Traceback" not in rejecting.log.read_text()
    log = coordinator.log.read_text()
    assert "Traceback" not in log, log[-3000:]


# --------------------------------------------------------------------- Redis unavailable


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server binary")
def test_redis_going_away_is_unavailable_not_unknown(tmp_path: Path) -> None:
    port = free_port()
    redis_proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis.from_url(url, socket_timeout=0.5).ping():
                    break
            except redis.RedisError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        c = _Coordinator(tmp_path / "coordinator.log", "--redis-url", url)
        try:
            assert c.stub.SubmitQuery(_request("before"), timeout=10).created
            redis_proc.kill()
            redis_proc.wait()
            for call in (
                lambda: c.stub.SubmitQuery(_request("during"), timeout=10),
                lambda: c.stub.GetQuery(cpb.GetQueryRequest(query_id="unknown"), timeout=10),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                error = cast(grpc.Call, info.value)
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
                details = error.details() or ""
                assert details.startswith("redis unavailable: ") and details.endswith(", retry")
                assert "\n" not in details
            # What the coordinator holds in memory is still served.
            status = c.stub.ClusterStatus(cpb.ClusterStatusRequest(), timeout=10)
            assert status.queries_running == 1
            assert c.proc.poll() is None
        finally:
            c.channel.close()
            c.proc.kill()
            c.proc.wait()
    finally:
        if redis_proc.poll() is None:
            redis_proc.kill()
            redis_proc.wait()
