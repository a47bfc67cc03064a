"""Workflow sessions, for real: `hexgen-flow up` with simulated workers, driven through the
Python client's session API (OpenWorkflow, RunCall, CloseWorkflow).

A session's calls arrive as the client learns them; the stages it never uses are skipped;
every stage completion recomputes the deadlines of the calls still waiting, tells their
workers (UpdateDeadline), and moves one that can no longer meet its deadline where it
waits when another instance can.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import workflow_pb2 as wfpb
from hexgen_client.client import CoordinatorClient
from hexgen_client.errors import CoordinatorError
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow
from hexgen_service.convert import parse_submit
from up_runner import Up, check_state, running_up, wait_for

needs_redis_server = pytest.mark.skipif(
    subprocess.run(["which", "redis-server"], capture_output=True, check=False).returncode != 0,
    reason="redis-server is not installed (apt install redis-server)",
)
pytestmark = needs_redis_server

K = cpb.QueryEventKind


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    with running_up(
        tmp_path_factory.mktemp("sessions"),
        "--cluster", "A100,A6000",
        "--time-scale", "25",
        "--no-tuner",
        "--no-gateway",
        "--admission", "off",
    ) as running:  # fmt: skip
        yield running


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def _run(client: CoordinatorClient, workflow: str, stage: str, tokens: int = 16) -> str:
    """Give one call; return its id once it finished (its events in order on the way)."""
    kinds, call_id = [], ""
    async for response in client.run_call(
        workflow, stage, f"{stage} prompt " * 20, max_tokens=tokens
    ):
        if response.call_id:
            call_id = response.call_id
            assert response.deadline_s > 0
        kinds.append(response.event.kind)
    assert kinds[0] == K.QUERY_EVENT_KIND_CALL_SUBMITTED
    assert kinds[-1] == K.QUERY_EVENT_KIND_CALL_FINISHED, [K.Name(k) for k in kinds]
    assert K.QUERY_EVENT_KIND_CALL_DISPATCHED in kinds
    return call_id


async def test_a_session_runs_the_calls_it_is_given_and_skips_the_rest(up: Up) -> None:
    workflow = _id("chess")
    async with CoordinatorClient(up.coordinator) as client:
        opened = await client.open_workflow(workflow, template="chess", slo_s=600)
        assert opened.created and opened.workflow.session and opened.workflow.session_open
        assert (await client.open_workflow(workflow, template="chess", slo_s=600)).created is False

        assert await _run(client, workflow, "extract_keywords") == f"{workflow}/0.0"
        # Three candidates at once: one stage (information_retriever, never given, is skipped).
        ids = await asyncio.gather(
            *(_run(client, workflow, "generate_candidate") for _ in range(3))
        )
        assert sorted(ids) == [f"{workflow}/2.{i}" for i in range(3)]
        # A fourth candidate after the three came back: the stage ran, this is a new stage.
        assert await _run(client, workflow, "revise") == f"{workflow}/3.0"
        # The first revise round's calls all came back: the next revise is the second round.
        assert await _run(client, workflow, "revise") == f"{workflow}/4.0"
        # A stage the template does not know is added at the end.
        assert await _run(client, workflow, "summarize", 8) == f"{workflow}/6.0"
        last_finish = (await client.get(workflow)).stages[6].finished_s

        running = await client.get(workflow)
        assert running.query.state == cpb.QUERY_STATE_RUNNING  # open: it may still grow
        await asyncio.sleep(0.5)  # think time after the last answer is not latency
        info = await client.close_workflow(workflow)
        assert info.state == cpb.QUERY_STATE_SUCCEEDED and not info.session_open
        assert info.finished_s == pytest.approx(last_finish)
        got = await client.get(workflow)

    table = [(s.name, s.calls_given, s.calls_total, s.calls_skipped) for s in got.stages]
    assert table == [
        ("extract_keywords", 1, 1, 0),
        ("information_retriever", 0, 1, 1),
        ("generate_candidate", 3, 3, 0),
        ("revise", 1, 3, 2),
        ("revise", 1, 3, 2),
        ("evaluate", 0, 1, 1),
        ("summarize", 1, 1, 0),
    ]
    assert got.query.calls_total == 13 and got.query.calls_done == 13
    skipped = [e for e in got.events if e.kind == K.QUERY_EVENT_KIND_CALL_SKIPPED]
    assert len(skipped) == 6
    assert [e.kind for e in got.events][-2:] == [
        K.QUERY_EVENT_KIND_STAGE_FINISHED,
        K.QUERY_EVENT_KIND_SUCCEEDED,
    ]
    # Redis agrees: every call done once, the query counted down to zero.
    status, report = check_state(up.banner["redis"].split()[0])
    assert status == 0, report
    # The `finished` stream (what the tuner replays) keeps the calls that ran, not the
    # template's: 7 calls, the skipped ones and the stages they emptied gone.
    finished = redis.Redis.from_url(up.banner["redis"].split()[0]).xrange("hf:finished")
    (entry,) = [f for _, f in finished if f[b"query_id"] == workflow.encode()]
    shape = parse_submit(cpb.SubmitQueryRequest.FromString(entry[b"submit"]))[0].workflow
    assert [(s.step, len(s.calls)) for s in shape.stages] == [
        ("extract_keywords", 1),
        ("generate_candidate", 3),
        ("revise", 1),
        ("revise", 1),
        ("summarize", 1),
    ]


async def test_a_stage_that_finishes_early_leaves_the_next_a_larger_budget(up: Up) -> None:
    # Two workflows alike but for the length of their first stage's answer.
    budgets = {}
    async with CoordinatorClient(up.coordinator) as client:
        for label, tokens in (("early", 4), ("late", 1500)):
            workflow = _id(label)
            expected = Query(
                workflow,
                Workflow.chain(
                    [(LLMCall("extract_keywords", 500, 1500),), (LLMCall("revise", 500, 50),)]
                ),
            )
            await client.open_workflow(workflow, expected=expected, slo_s=300)
            await _run(client, workflow, "s0", tokens)
            async for response in client.run_call(workflow, "s1", "fix it", max_tokens=8):
                if response.call_id:
                    deadline = response.deadline_s
            got = await client.get(workflow)
            second = got.stages[1]
            assert second.deadline_s == pytest.approx(deadline)
            budgets[label] = second.deadline_s - second.released_s
            await client.close_workflow(workflow)
    assert budgets["early"] > budgets["late"] + 10, budgets


async def test_bad_session_requests_are_refused_naming_the_field(up: Up) -> None:
    async with CoordinatorClient(up.coordinator) as client:

        async def refused(coro: object) -> CoordinatorError:
            with pytest.raises(CoordinatorError) as caught:
                if hasattr(coro, "__anext__"):
                    async for _ in coro:  # type: ignore[attr-defined]
                        pass
                else:
                    await coro  # type: ignore[misc]
            return caught.value

        error = await refused(client.open_workflow(_id("none"), slo_s=10))
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT and error.details.startswith(
            "template:"
        )
        error = await refused(client.open_workflow(_id("x"), template="nope"))
        assert "no template 'nope' (known: chess, single)" in error.details
        with_prompt = wfpb.Workflow(
            stages=[
                wfpb.Stage(
                    id="a",
                    step="a",
                    calls=[wfpb.LLMCall(input_tokens=1, output_tokens=1, prompt="p")],
                )
            ]
        )
        error = await refused(client.open_workflow(_id("p"), expected=with_prompt))
        assert error.details.startswith("expected.stages[0].calls[0].prompt:")
        error = await refused(client.open_workflow("", template="chess"))
        assert error.details.startswith("workflow_id:")

        workflow = _id("same")
        await client.open_workflow(workflow, template="chess", slo_s=100)
        error = await refused(client.open_workflow(workflow, template="chess", slo_s=200))
        assert error.code == grpc.StatusCode.ALREADY_EXISTS
        error = await refused(client.run_call(workflow, "", "x"))
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT and error.details.startswith("stage:")
        error = await refused(client.run_call(workflow, "bad\nname", "x"))
        assert error.details.startswith("stage: must not contain control characters")
        error = await refused(client.run_call(_id("unknown"), "s", "x"))
        assert error.code == grpc.StatusCode.NOT_FOUND
        await client.close_workflow(workflow)  # closed with no call given: cancelled
        error = await refused(client.run_call(workflow, "revise", "x"))
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "has cancelled: it takes no more calls" in error.details

        whole = Query(_id("whole"), Workflow.chain([(LLMCall("a", 10, 2),)]))
        await client.submit(whole)
        error = await refused(client.run_call(whole.query_id, "a", "x"))
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "submitted whole" in error.details


async def test_an_idle_session_is_closed(up: Up) -> None:
    workflow = _id("idle")
    async with CoordinatorClient(up.coordinator) as client:
        await client.open_workflow(workflow, template="chess", slo_s=600, idle_timeout_s=1.0)
        await _run(client, workflow, "extract_keywords")
        deadline = time.monotonic() + 10
        while (await client.get(workflow)).query.state == cpb.QUERY_STATE_RUNNING:
            assert time.monotonic() < deadline, "the idle session was not closed"
            await asyncio.sleep(0.2)
        got = await client.get(workflow)
    assert got.query.state == cpb.QUERY_STATE_SUCCEEDED
    closed = [e for e in got.events if e.kind == K.QUERY_EVENT_KIND_CLOSED]
    assert closed and closed[0].text == "idle for more than 1 s"


async def test_a_session_goes_on_after_the_coordinator_is_killed(up: Up) -> None:
    # Last of the shared mesh's tests: its coordinator is killed and restarted by `up`.
    workflow = _id("restart")
    async with CoordinatorClient(up.coordinator) as client:
        await client.open_workflow(workflow, template="chess", slo_s=600)
        await _run(client, workflow, "extract_keywords")
        await _run(client, workflow, "my_extra")  # a stage added: it must come back too
        chat = [("system", "You write SQL."), ("user", "How many artists?")]
        async for _ in client.run_call(workflow, "generate_candidate", "c", messages=chat):
            pass
        victim = up.service_pid("hexgen_coordinator")
        os.kill(victim, signal.SIGKILL)
        up.wait_stderr(r"coordinator exited with code -9; restarting")
        deadline = time.monotonic() + 30
        while True:
            try:
                got = await client.get(workflow)
                break
            except CoordinatorError:
                assert time.monotonic() < deadline, "the coordinator did not come back"
                await asyncio.sleep(0.2)
        assert got.query.state == cpb.QUERY_STATE_RUNNING and got.query.session_open
        assert [s.name for s in got.stages][-1] == "my_extra"
        # The session takes calls where it was: both revise rounds are still ahead.
        assert await _run(client, workflow, "revise") == f"{workflow}/3.0"
        assert await _run(client, workflow, "revise") == f"{workflow}/4.0"
        info = await client.close_workflow(workflow)
        assert info.state == cpb.QUERY_STATE_SUCCEEDED
        got = await client.get(workflow)
    given = {s.index: s.calls_given for s in got.stages}
    assert given == {0: 1, 1: 0, 2: 1, 3: 1, 4: 1, 5: 0, 6: 1}
    status, report = check_state(up.banner["redis"].split()[0])
    assert status == 0, report


# ---------------------------------------------- re-budgeting: a mesh of its own (round-robin)


@pytest.fixture
def rr(tmp_path: Path) -> Iterator[Up]:
    # Round-robin places calls in turn (A100, A6000, A100, ...), whatever the load: the test
    # knows where each call waits. The template budget moves deadlines with the time left.
    with running_up(
        tmp_path,
        "--cluster", "A100,A6000",
        "--policy", "round-robin+urgency",
        "--time-scale", "20",
        "--no-tuner",
        "--no-gateway",
        "--admission", "off",
    ) as running:  # fmt: skip
        yield running


async def test_a_stage_completion_updates_waiting_calls_and_moves_one_that_would_be_late(
    rr: Up,
) -> None:
    async with CoordinatorClient(rr.coordinator) as client:
        # A long call on each instance; the A6000's fills its KV cache, so calls wait there.
        filler = Query(
            "filler",
            Workflow(
                (Stage("generate_candidate", (LLMCall("generate_candidate", 120_000, 2000),) * 2),)
            ),
        )
        await client.submit(filler, prompts=[["x", "y"]])

        async def a6000_kv() -> int:
            return int((await client.status()).instances[1].kv_used_tokens)

        deadline = time.monotonic() + 30
        while await a6000_kv() < 116_000:  # then a call of 20,500 tokens waits there
            assert time.monotonic() < deadline, "the filler never took the A6000's KV cache"
            await asyncio.sleep(0.1)

        async def session(workflow: str, slo_s: float) -> str:
            expected = wfpb.Workflow(
                stages=[
                    wfpb.Stage(
                        id="a",
                        step="extract_keywords",
                        calls=[wfpb.LLMCall(input_tokens=1000, output_tokens=20)],
                    ),
                    wfpb.Stage(
                        id="b",
                        step="generate_candidate",
                        calls=[wfpb.LLMCall(input_tokens=20_000, output_tokens=500)],
                    ),
                ]
            )
            await client.open_workflow(workflow, expected=expected, slo_s=slo_s)
            first_a = client.run_call(workflow, "a", "k", input_tokens=1000, max_tokens=20)
            a_id = (await anext(first_a)).call_id  # dispatched to the A100
            b_calls = client.run_call(workflow, "b", "c", input_tokens=20_000, max_tokens=500)
            b_id = (await anext(b_calls)).call_id  # to the A6000, where it waits
            async for _ in first_a:  # stage a finishes: b's deadline is recomputed
                pass
            await b_calls.aclose()
            assert a_id.endswith("/0.0")
            return b_id

        # A generous SLO: b can still make it where it waits; its worker hears the new deadline.
        kept = await session("generous", 3000)
        log = rr.log_dir / "worker-1.log"
        wait_for(
            "the A6000's worker to log the new deadline",
            lambda: f"call {kept}: stage deadline" in log.read_text(),
            timeout_s=20,
        )
        assert f"call {kept}: stage deadline" in log.read_text()
        assert "(queued)" in next(
            line for line in log.read_text().splitlines() if f"call {kept}:" in line
        )
        # A tight one: b would be late on the A6000 and is not on the A100: it moves.
        moved = await session("tight", 100)
        deadline = time.monotonic() + 30
        while True:
            got = await client.get("tight")
            finished = [
                e
                for e in got.events
                if e.kind == K.QUERY_EVENT_KIND_CALL_FINISHED and e.call_id == moved
            ]
            if finished:
                break
            assert time.monotonic() < deadline, [K.Name(e.kind) for e in got.events]
            await asyncio.sleep(0.2)
        assert finished[0].instance == "A100#0"
        updates = [e for e in got.events if e.kind == K.QUERY_EVENT_KIND_DEADLINE_UPDATED]
        assert updates and updates[0].call_id == moved
        redispatched = [e for e in got.events if e.kind == K.QUERY_EVENT_KIND_CALL_REDISPATCHED]
        assert redispatched and redispatched[0].text.startswith("moved from A6000#1")
        generous = await client.get("generous")
        assert not [e for e in generous.events if e.kind == K.QUERY_EVENT_KIND_CALL_REDISPATCHED]
        for workflow in ("filler", "generous", "tight"):
            await client.cancel(workflow)
