"""Many WatchQuery streams at once, and a watcher that falls behind.

Hostile testing opened 3,000 WatchQuery streams at once against a real coordinator: about
600 ended CANCELLED within seconds, with nothing in the coordinator's log. The cause is
gRPC core's backlog of calls the server has not accepted yet: above 1,000 pending calls
(``grpc.server.max_pending_requests``) it refuses new ones at random, and all of them
above 3,000 (``..._hard_limit``), with CANCELLED and before the application sees them.
A burst of streams is accepted more slowly than it arrives (one asyncio loop), so it fills
that backlog. Every stream of such a burst must be served.

A watcher that stops reading while its query logs more than `WATCH_BUFFER` events has its
stream ended by the coordinator: that end is RESOURCE_EXHAUSTED naming the buffer, with a
``retry-after-s`` hint, and a line in the coordinator's log, not an OK that reads as the
end of the query's events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import coordinator_pb2_grpc as cpb_grpc
from hexgen_api.v1 import workflow_pb2 as flow
from hexgen_coordinator.client_messages import EventKind
from hexgen_coordinator.events import WATCH_BUFFER, record_event
from in_process_mesh import in_process_mesh
from process_mesh import ProcessMesh
from redis_here import needs_redis

pytestmark = needs_redis

STREAMS = 3_000
QUERIES = 3


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[ProcessMesh]:
    """A coordinator process on a private prefix, no workers: admitted queries wait
    parked, so their watch streams stay open."""
    mesh = ProcessMesh(tmp_path, ["--admission", "off"], workers=0, cluster="A100")
    try:
        yield mesh
    finally:
        mesh.stop()


def _one_call() -> flow.Workflow:
    return flow.Workflow(
        stages=[
            flow.Stage(
                id="a", step="revise", calls=[flow.LLMCall(input_tokens=100, output_tokens=8)]
            )
        ]
    )


async def _watch_many(address: str) -> tuple[int, Counter[str], list[str]]:
    """(streams that got their first event, how the ended ones ended, their details)."""
    channel = grpc.aio.insecure_channel(address)
    stub = cpb_grpc.CoordinatorServiceStub(channel)
    for n in range(QUERIES):
        await stub.SubmitQuery(
            cpb.SubmitQueryRequest(query_id=f"watched-{n}", workflow=_one_call()), timeout=10
        )
    served = 0
    ended: Counter[str] = Counter()
    details: list[str] = []

    async def watch(k: int) -> None:
        nonlocal served
        call = stub.WatchQuery(cpb.WatchQueryRequest(query_id=f"watched-{k % QUERIES}"))
        first = True
        try:
            async for _ in call:
                if first:
                    served += 1
                    first = False
            ended["OK"] += 1  # the parked query never ends: an OK end is a dropped stream
        except grpc.aio.AioRpcError as exc:
            ended[exc.code().name] += 1
            details.append(exc.details() or "")

    tasks = [asyncio.create_task(watch(k)) for k in range(STREAMS)]
    deadline = time.monotonic() + 60
    while served + sum(ended.values()) < STREAMS and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    await asyncio.sleep(5.0)  # and they stay open
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await channel.close()
    return served, ended, details


def test_three_thousand_watch_streams_at_once_are_all_served(coordinator: ProcessMesh) -> None:
    served, ended, details = asyncio.run(_watch_many(coordinator.address))
    assert not ended, (ended, Counter(details).most_common(3))
    assert served == STREAMS
    log = coordinator.log("coordinator")
    assert "Traceback" not in log, log[-3000:]


async def test_a_watcher_that_falls_behind_gets_resource_exhausted_and_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with in_process_mesh(["A100"], "hostile-watch", admission="off") as (
        coordinator,
        address,
    ):
        # No call of this query can run before the test ends: it stays running.
        workflow = flow.Workflow(
            stages=[
                flow.Stage(
                    id="a",
                    step="revise",
                    calls=[flow.LLMCall(input_tokens=100, output_tokens=100_000)],
                )
            ]
        )
        async with grpc.aio.insecure_channel(address) as channel:
            stub = cpb_grpc.CoordinatorServiceStub(channel)
            await stub.SubmitQuery(
                cpb.SubmitQueryRequest(query_id="slow-watch", workflow=workflow), timeout=10
            )
            call = stub.WatchQuery(cpb.WatchQueryRequest(query_id="slow-watch"))
            first = await call.read()
            assert isinstance(first, cpb.WatchQueryResponse)
            entry = coordinator.active["slow-watch"]
            assert len(entry.watchers) == 1
            # The query logs more events than the watcher's buffer holds, all in one turn
            # of the loop: the stream cannot drain any of them in between.
            now = coordinator.clock.now()
            with caplog.at_level(logging.WARNING):
                for n in range(WATCH_BUFFER + 1):
                    record_event(entry, EventKind.CALL_TOKENS, now, text=f"t{n}")
                assert not entry.watchers  # dropped
                read = 0
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    while await call.read() is not grpc.aio.EOF:
                        read += 1
                    raise AssertionError(f"the stream ended OK after {read} events")
            assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details = ended.value.details() or ""
            assert str(WATCH_BUFFER) in details and "watch again" in details, details
            trailers = dict(ended.value.trailing_metadata() or ())
            assert float(trailers["retry-after-s"]) > 0
            logged = [r.getMessage() for r in caplog.records if "fell" in r.getMessage()]
            assert len(logged) == 1 and "slow-watch" in logged[0], logged
            # Watching again replays the log and goes on.
            again = stub.WatchQuery(cpb.WatchQueryRequest(query_id="slow-watch"))
            replayed = await again.read()
            assert isinstance(replayed, cpb.WatchQueryResponse)
            again.cancel()
