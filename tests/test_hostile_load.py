"""No tenant can hold the cluster hostage: admission, storage and crash loops under hostile
load, through real processes (a coordinator and simulated workers, `process_mesh`, on the
Redis at 127.0.0.1:6379 or a private one).

- a call of 100,000 output tokens is refused for good (its SLO cannot be met even on an idle
  cluster), runs best-effort when the coordinator says so, and, given an SLO it can meet,
  runs without keeping anyone else out: small queries of its tenant and of another are
  admitted at once and meet their SLO;
- a workflow session is held to a submission's limits; declared token counts are checked
  against the prompt; output tokens are capped;
- prompts live in Redis only while their calls may need them; a tenant keeps at most its
  quota of prompt bytes; near Redis's maxmemory new work is refused before Redis refuses
  writes;
- a call that kills every worker that runs it ends FAILED after the attempt limit while
  other queries complete.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import coordinator_pb2_grpc as cpb_grpc
from hexgen_api.v1 import workflow_pb2 as wfpb
from hexgen_client.client import CoordinatorClient
from hexgen_client.errors import CoordinatorError
from hexgen_flow.admission import AdmissionModel
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.workload import LLMCall, Workflow
from hexgen_launch.processes import RedisServer
from hexgen_service.auth import KeyStore, Role, TenantLimits
from process_mesh import MeshFactory, ProcessMesh, meshes
from redis_here import needs_redis
from up_runner import check_state

pytestmark = needs_redis

PAPER = "A100,A100,A6000,L40S"


@pytest.fixture
def mesh_factory(tmp_path: Path) -> Iterator[MeshFactory]:
    yield from meshes(tmp_path)


def _workflow(*calls: tuple[int, int, str]) -> wfpb.Workflow:
    """A chain of one-call stages (input tokens, output tokens, prompt)."""
    stages = []
    for k, (i, o, prompt) in enumerate(calls):
        stages.append(
            wfpb.Stage(
                id=f"s{k}",
                step="revise",
                after=[f"s{k - 1}"] if k else [],
                calls=[wfpb.LLMCall(input_tokens=i, output_tokens=o, prompt=prompt)],
            )
        )
    return wfpb.Workflow(stages=stages)


async def _submit(
    stub: Any,
    query_id: str,
    workflow: wfpb.Workflow,
    *,
    tenant: str = "",
    slo_s: float = 0.0,
) -> cpb.SubmitQueryResponse:
    request = cpb.SubmitQueryRequest(
        query_id=query_id, tenant=tenant, workflow=workflow, slo_s=slo_s
    )
    answer: cpb.SubmitQueryResponse = await stub.SubmitQuery(request, timeout=10)
    return answer


async def _refusal(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    return caught.value


def _details(error: grpc.aio.AioRpcError) -> str:
    return error.details() or ""


async def _ended(client: CoordinatorClient, query_id: str, timeout_s: float) -> cpb.QueryInfo:
    async def wait() -> None:
        async for _ in client.watch(query_id):
            pass

    await asyncio.wait_for(wait(), timeout_s)
    return (await client.get(query_id)).query


async def _started(client: CoordinatorClient, query_id: str, timeout_s: float) -> str:
    """The instance the query's first call started on."""

    async def wait() -> str:
        async for event in client.watch(query_id):
            if event.kind == cpb.QUERY_EVENT_KIND_CALL_STARTED:
                return event.instance
        raise AssertionError(f"{query_id} ended before a call started")

    return await asyncio.wait_for(wait(), timeout_s)


# ------------------------------------------------------------------ one oversized call


async def _small_queries_get_in(mesh: ProcessMesh, big_tenant: str) -> None:
    """While the huge call ("huge") runs, a small query of its tenant and one of another
    are admitted within a second and meet their SLO; then the huge one is cancelled."""
    async with CoordinatorClient(mesh.address) as client:
        await _started(client, "huge", timeout_s=30)
        stub = cpb_grpc.CoordinatorServiceStub(grpc.aio.insecure_channel(mesh.address))
        for tenant in (big_tenant, "other"):
            t0 = time.monotonic()
            answer = await _submit(stub, f"small-{tenant}", _workflow((10, 5, "hi")), tenant=tenant)
            admitted_in = time.monotonic() - t0
            assert answer.created and not answer.query.best_effort
            assert admitted_in < 1.0, admitted_in
            info = await _ended(client, f"small-{tenant}", timeout_s=60)
            assert info.state == cpb.QUERY_STATE_SUCCEEDED
            latency = info.finished_s - info.arrival_s
            assert latency <= info.slo_s, (latency, info.slo_s)
        await client.cancel("huge")


async def test_an_oversized_call_is_refused_for_good_or_runs_without_blocking_anyone(
    mesh_factory: MeshFactory,
) -> None:
    mesh = mesh_factory([], cluster=PAPER, time_scale=20.0)
    huge = _workflow((100, 100_000, "write a novel"))
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = cpb_grpc.CoordinatorServiceStub(channel)
        # Its default SLO (246 s) is below what it needs even alone: no wait can help.
        error = await _refusal(_submit(stub, "huge", huge, tenant="a"))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, _details(error)
        assert _details(error).startswith("slo_s: the query needs about 3229 s even alone"), (
            _details(error)
        )
        assert "no wait can help" in _details(error)
        assert "retry-after-s" not in dict(error.trailing_metadata() or ())
        # Given an SLO it can meet, it runs, and keeps no one out while it does.
        answer = await _submit(stub, "huge", huge, tenant="a", slo_s=20_000.0)
        assert answer.created and not answer.query.best_effort
        await _small_queries_get_in(mesh, "a")


async def test_best_effort_runs_the_oversized_call_without_blocking_anyone(
    mesh_factory: MeshFactory,
) -> None:
    mesh = mesh_factory(["--admission", "best-effort"], cluster=PAPER, time_scale=20.0)
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = cpb_grpc.CoordinatorServiceStub(channel)
        answer = await _submit(stub, "huge", _workflow((100, 100_000, "x")), tenant="a")
        assert answer.created and answer.query.best_effort
        await _small_queries_get_in(mesh, "a")


# ------------------------------------------------------------------ limits and checks


async def test_sessions_and_calls_are_held_to_the_submission_limits(
    mesh_factory: MeshFactory,
) -> None:
    mesh = mesh_factory(["--max-stages", "4", "--max-calls", "6"], workers=0)
    async with CoordinatorClient(mesh.address) as client:
        stub = cpb_grpc.CoordinatorServiceStub(grpc.aio.insecure_channel(mesh.address))

        async def give(
            stage: str,
            prompt: str = "p",
            *,
            workflow: str = "w",
            input_tokens: int = 0,
            max_tokens: int = 0,
        ) -> None:
            calls = client.run_call(
                workflow, stage, prompt, input_tokens=input_tokens, max_tokens=max_tokens
            )
            async for _ in calls:
                return  # given: the first response names the call

        await client.open_workflow("w", template="single", slo_s=3600)
        for name in ("n1", "n2", "n3"):  # the template's stage and three added: four
            await give(name)
        with pytest.raises(CoordinatorError) as refused:
            await give("n4")
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details.startswith("stage: the workflow has 4 stages")
        await give("n1")  # joins n1: five calls
        await give("n2")  # six
        with pytest.raises(CoordinatorError) as refused:
            await give("n3")
        assert refused.value.details.startswith("call: the workflow has 6 calls")
        # A declared token count far below its prompt, and more output than the model takes.
        await client.open_workflow("v", template="single", slo_s=3600)
        with pytest.raises(CoordinatorError) as refused:
            await give("n1", "x" * (1 << 20), workflow="v", input_tokens=10)
        assert refused.value.details.startswith("call.input_tokens: 10 tokens cannot cover")
        with pytest.raises(CoordinatorError) as refused:
            await give("n1", workflow="v", max_tokens=200_000)
        assert refused.value.details.startswith("call.output_tokens: must be at most 131072")
        error = await _refusal(
            _submit(stub, "q", _workflow((5000, 10, "p"), (10, 5, "y" * (1 << 20))))
        )
        assert _details(error).startswith("workflow.stages[1].calls[0].input_tokens:")
        error = await _refusal(_submit(stub, "q", _workflow((100, 140_000, "p"))))
        assert _details(error).startswith("workflow.stages[0].calls[0].output_tokens:")


# ------------------------------------------------------------------ what Redis keeps


def _hash_bytes(client: redis.Redis[bytes], key: str) -> int:
    return sum(len(k) + len(v) for k, v in client.hgetall(key).items())


async def test_prompts_stay_in_redis_only_while_their_calls_may_need_them(
    mesh_factory: MeshFactory,
) -> None:
    mesh = mesh_factory([], time_scale=20.0)
    r = redis.Redis.from_url(mesh.redis_url)
    prompt = "the schema and the question " * 4000  # 112 KB a call
    async with CoordinatorClient(mesh.address) as client:
        stub = cpb_grpc.CoordinatorServiceStub(grpc.aio.insecure_channel(mesh.address))
        await _submit(
            stub, "q", _workflow((30_000, 200, prompt), (30_000, 200, prompt), (400, 5, "ok"))
        )
        assert r.hlen(f"{mesh.prefix}pr:q") >= 2  # the calls not done yet keep theirs
        assert prompt.encode() not in r.hget(f"{mesh.prefix}q:q", "submit")  # type: ignore[operator]
        info = await _ended(client, "q", timeout_s=60)
        assert info.state == cpb.QUERY_STATE_SUCCEEDED
        assert not r.exists(f"{mesh.prefix}pr:q")
        assert _hash_bytes(r, f"{mesh.prefix}q:q") < 10_000  # its shape and state only
        # A session given 20 calls of 200 KB: each prompt goes with its call, and the key
        # that held them does not outlive the close.
        await client.open_workflow("s", template="single", slo_s=3600)
        for n in range(20):
            async for _ in client.run_call("s", f"step{n % 3}", "y" * 200_000):
                pass  # until the call finished
        assert r.hlen(f"{mesh.prefix}pr:s") == 0
        await client.close_workflow("s")
        assert (await _ended(client, "s", timeout_s=30)).state == cpb.QUERY_STATE_SUCCEEDED
        assert not r.exists(f"{mesh.prefix}pr:s")
        assert _hash_bytes(r, f"{mesh.prefix}q:s") < 100_000
        # A cancelled query drops what it kept.
        await _submit(
            stub, "c", _workflow((30_000, 20_000, prompt), (30_000, 200, prompt)), slo_s=3600
        )
        await client.cancel("c")
        assert not r.exists(f"{mesh.prefix}pr:c")
    status, report = check_state(mesh.redis_url, "--prefix", mesh.prefix)
    assert status == 0 and report["stale_prompts"] == 0, report


async def test_a_tenant_keeps_at_most_its_quota_of_prompt_bytes(
    mesh_factory: MeshFactory,
) -> None:
    # No workers: admitted queries stay running with their prompts kept.
    mesh = mesh_factory(["--max-tenant-prompt-bytes", str(3 << 20)], workers=0)
    r = redis.Redis.from_url(mesh.redis_url)
    big = "z" * (1 << 20)
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = cpb_grpc.CoordinatorServiceStub(channel)
        for n in range(3):
            await _submit(stub, f"a{n}", _workflow((300_000, 5, big)), tenant="a", slo_s=3600)
        error = await _refusal(
            _submit(stub, "a3", _workflow((300_000, 5, big)), tenant="a", slo_s=3600)
        )
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant 'a' keeps 3145728 bytes of prompts" in _details(error)
        assert float(dict(error.trailing_metadata() or ())["retry-after-s"]) >= 1.0
        # What the mesh's keys hold: a's three queries (a 1 MiB string takes 1.25 MiB of
        # Redis's allocator), and nothing of the fourth.
        kept = sum(r.memory_usage(k) or 0 for k in r.scan_iter(match=f"{mesh.prefix}*"))
        assert 3 << 20 < kept < 3 * (5 << 18) + (256 << 10), kept
        # Another tenant is not held to a's quota, and a gets room back as its queries end.
        await _submit(stub, "b0", _workflow((300_000, 5, big)), tenant="b", slo_s=3600)
        await stub.CancelQuery(cpb.CancelQueryRequest(query_id="a0"), timeout=10)
        await _submit(stub, "a3", _workflow((300_000, 5, big)), tenant="a", slo_s=3600)


async def test_near_maxmemory_new_work_is_refused_before_redis_refuses_writes(
    mesh_factory: MeshFactory, tmp_path: Path
) -> None:
    with RedisServer(appendfsync=None, maxmemory="48mb") as server:
        mesh = mesh_factory([], redis_url=server.url, time_scale=20.0)
        r = redis.Redis.from_url(server.url)
        async with CoordinatorClient(mesh.address) as client:
            stub = cpb_grpc.CoordinatorServiceStub(grpc.aio.insecure_channel(mesh.address))
            # A query that runs a while, admitted while there is room.
            await _submit(stub, "first", _workflow((2000, 3000, "p"), (2000, 300, "p")))
            # Someone else's data fills Redis to about 95 % of its maxmemory.
            junk = b"j" * (1 << 20)
            n = 0
            while r.info("memory")["used_memory"] < 0.95 * (48 << 20):
                r.set(f"junk:{n}", junk)
                n += 1
            await asyncio.sleep(1.5)  # the coordinator reads INFO memory every second
            error = await _refusal(_submit(stub, "second", _workflow((10, 5, "p"))))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "of its maxmemory" in _details(error) and "--redis-memory-limit" in _details(
                error
            )
            # The admitted query still completes: its writes were not refused.
            assert (await _ended(client, "first", 60)).state == cpb.QUERY_STATE_SUCCEEDED
            for k in range(n):
                r.delete(f"junk:{k}")
            await asyncio.sleep(1.5)
            assert (await _submit(stub, "second", _workflow((10, 5, "p")))).created


# ------------------------------------------------------------------ a call that kills its worker


async def test_a_call_that_kills_its_worker_fails_after_the_attempt_limit(
    mesh_factory: MeshFactory,
) -> None:
    mesh = mesh_factory(["--max-call-attempts", "3"], cluster="A100,A100,A100,A100", time_scale=20)
    slot_of = {s.name: s.index for s in mesh.status().instances}
    kills = 0

    async def kill_whoever_runs_it(client: CoordinatorClient) -> None:
        # The poison: whichever worker starts the call dies at once (SIGKILL), and a
        # supervisor starts it again a moment later.
        nonlocal kills
        async for event in client.watch("poison"):
            if event.kind == cpb.QUERY_EVENT_KIND_CALL_STARTED:
                slot = slot_of[event.instance]
                mesh.kill_worker(slot)
                kills += 1
                await asyncio.sleep(0.3)
                mesh.start_worker(slot)

    async with CoordinatorClient(mesh.address) as client:
        stub = cpb_grpc.CoordinatorServiceStub(grpc.aio.insecure_channel(mesh.address))
        await _submit(stub, "poison", _workflow((2000, 4000, "boom")), slo_s=3600)
        killer = asyncio.create_task(kill_whoever_runs_it(client))
        for n in range(20):
            await _submit(stub, f"ok{n}", _workflow((1500, 60, "fine"), (800, 30, "fine")))
        poison = await _ended(client, "poison", timeout_s=90)
        await asyncio.wait_for(killer, 10)
        assert poison.state == cpb.QUERY_STATE_FAILED
        assert "failed 3 times" in poison.failure_reason
        assert "worker died while running it" in poison.failure_reason
        assert kills == 3
        others = [await _ended(client, f"ok{n}", timeout_s=90) for n in range(20)]
        assert all(o.state == cpb.QUERY_STATE_SUCCEEDED for o in others), [
            (o.query_id, o.failure_reason) for o in others if o.state != cpb.QUERY_STATE_SUCCEEDED
        ]
    status, report = check_state(mesh.redis_url, "--prefix", mesh.prefix)
    assert status == 0, report
    assert math.isfinite(poison.finished_s)


# ------------------------------------------------------------------ retry hints


async def test_retry_hints_are_at_least_a_second_and_spread(mesh_factory: MeshFactory) -> None:
    # No workers: the admitted query waits parked and is soon past its deadline, so the
    # hint for its tenant's next query ("when one of its queries is due") is 0 s. Told to
    # retry at once, a burst of refused clients comes back at once, as a burst.
    mesh = mesh_factory(["--max-tenant-queries", "1"], workers=0)
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = cpb_grpc.CoordinatorServiceStub(channel)
        await _submit(stub, "first", _workflow((100, 5, "p")), tenant="a", slo_s=5.0)
        await asyncio.sleep(1.0)  # 10 cluster seconds: past its deadline
        hints = []
        for n in range(20):
            error = await _refusal(_submit(stub, f"q{n}", _workflow((100, 5, "p")), tenant="a"))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, _details(error)
            hints.append(float(dict(error.trailing_metadata() or ())["retry-after-s"]))
    assert min(hints) >= 1.0 and max(hints) < 1.5, hints
    assert len(set(hints)) >= 10, hints  # spread, so that they come back spread out


async def test_an_unknown_template_name_of_any_size_is_invalid_argument(
    mesh_factory: MeshFactory,
) -> None:
    # Its error repeats the name: a name of 100 KB once made a status whose message
    # overflowed gRPC's metadata, which the client saw as RESOURCE_EXHAUSTED.
    mesh = mesh_factory([], workers=0)
    async with CoordinatorClient(mesh.address) as client:
        for name in ("nope", "n" * 100_000):
            with pytest.raises(CoordinatorError) as refused:
                await client.open_workflow("w", template=name)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details.startswith("template:"), refused.value.details[:80]


async def test_a_tenant_keeps_at_most_its_quota_of_work_in_flight(
    mesh_factory: MeshFactory, tmp_path: Path
) -> None:
    # The keys file's max_work_s, with admission control off (it still holds), no workers
    # (admitted queries stay in flight).
    keys = KeyStore.create(tmp_path / "keys.json")
    a_key, _ = keys.add("a", Role.TENANT)
    b_key, _ = keys.add("b", Role.TENANT)
    model = AdmissionModel(parse_cluster("A100,A100"))
    one = sum(model.stage_work_s(Workflow.chain([(LLMCall("revise", 8000, 300),)])))
    keys.set_limits("a", TenantLimits(max_work_s=2.5 * one))
    mesh = mesh_factory(
        ["--api-keys-file", str(tmp_path / "keys.json"), "--admission", "off"], workers=0
    )
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = cpb_grpc.CoordinatorServiceStub(channel)

        async def submit(key: str, query_id: str, *calls: tuple[int, int, str]) -> object:
            request = cpb.SubmitQueryRequest(query_id=query_id, workflow=_workflow(*calls))
            metadata = (("authorization", f"Bearer {key}"),)
            return await stub.SubmitQuery(request, metadata=metadata, timeout=10)

        for n in range(2):
            await submit(a_key, f"a{n}", (8000, 300, "p"))
        error = await _refusal(submit(a_key, "a2", (8000, 300, "p")))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, _details(error)
        assert "tenant 'a' has about" in _details(error) and "max_work_s" in _details(error)
        error = await _refusal(submit(a_key, "big", *[(8000, 300, "p")] * 3))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, _details(error)
        assert _details(error).startswith("workflow: the query is about")
        await submit(b_key, "b0", (8000, 300, "p"))  # another tenant: not a's quota
        # a's work in flight falls as its queries end.
        await stub.CancelQuery(
            cpb.CancelQueryRequest(query_id="a0"),
            metadata=(("authorization", f"Bearer {a_key}"),),
            timeout=10,
        )
        await submit(a_key, "a2", (8000, 300, "p"))
