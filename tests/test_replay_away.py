"""`hexgen-flow replay` (`hexgen_launch.replay.replay`) across a coordinator restart longer
than the query retention, on a real coordinator and simulated workers (`process_mesh`,
``--retention-s 1``), with the real client:

- a query whose end the replay saw (its SUCCEEDED event) but whose state it could not read
  before the coordinator was SIGKILLed, and which expired while the coordinator was down,
  is reported from that event (it once ended the whole replay with NOT_FOUND);
- a query that vanished while running (its keys deleted from Redis under a dead
  coordinator: a lost query) still ends the replay with NOT_FOUND: nothing is made up.

The restart is set off by the client itself, at the moment that matters (`_Away`); every
other part is what users run.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import redis

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_client.client import CoordinatorClient
from hexgen_client.errors import CoordinatorError
from hexgen_flow.traces import load_trace, take_queries
from hexgen_flow.workload import Query
from hexgen_launch.replay import replay
from hexgen_service import redis_schema as rs
from process_mesh import MeshFactory, ProcessMesh, meshes
from redis_here import needs_redis

pytestmark = needs_redis

RETENTION_S = 1.0


@pytest.fixture
def mesh_factory(tmp_path: Path) -> Iterator[MeshFactory]:
    yield from meshes(tmp_path)


def _query(tag: str) -> Query:
    query = take_queries(load_trace("trace1"), 1)[0]
    return replace(query, query_id=f"{tag}/{query.query_id}")


class _Away(CoordinatorClient):
    """The real client; on its first `get` (`on_get`) or at its first event of the query
    (`on_event`) it SIGKILLs the coordinator, lets the query's fate play out in Redis
    (`while_down`), and starts the coordinator again `down_s` later, while the replay
    retries. It records the terminal event it passed on and the errors it raised."""

    def __init__(
        self, mesh: ProcessMesh, *, on_get: bool, down_s: float, while_down: str = ""
    ) -> None:
        super().__init__(mesh.address, timeout_s=5.0)
        self.mesh = mesh
        self.on_get = on_get
        self.down_s = down_s
        self.while_down = while_down
        self.killed = False
        self.restarted: asyncio.Task[None] | None = None
        self.terminal: cpb.QueryEvent | None = None
        self.admitted: cpb.QueryInfo | None = None
        self.errors: list[str] = []

    async def submit(
        self,
        query: Query,
        *,
        slo_scale: float | None = None,
        prompts: Sequence[Sequence[str]] | None = None,
    ) -> cpb.SubmitQueryResponse:
        response = await super().submit(query, slo_scale=slo_scale, prompts=prompts)
        self.admitted = response.query
        return response

    async def _away(self) -> None:
        if self.killed:
            return
        self.killed = True
        self.mesh.kill_coordinator()
        if self.while_down:  # what a coordinator bug could do: the query's keys gone
            client = redis.Redis.from_url(self.mesh.redis_url)
            try:
                client.delete(
                    rs.query_key(self.mesh.prefix, self.while_down),
                    rs.events_key(self.mesh.prefix, self.while_down),
                    rs.prompts_key(self.mesh.prefix, self.while_down),
                )
                client.srem(rs.key(self.mesh.prefix, rs.ACTIVE), self.while_down)
            finally:
                client.close()

        async def restart() -> None:
            await asyncio.sleep(self.down_s)
            await asyncio.to_thread(self.mesh.start_coordinator)

        self.restarted = asyncio.create_task(restart())

    async def watch(self, query_id: str) -> AsyncIterator[cpb.QueryEvent]:  # type: ignore[override]
        try:
            async for event in super().watch(query_id):
                if event.kind == cpb.QUERY_EVENT_KIND_SUCCEEDED:
                    self.terminal = event
                yield event
                if not self.on_get and event.kind == cpb.QUERY_EVENT_KIND_CALL_STARTED:
                    await self._away()
        except CoordinatorError as exc:
            self.errors.append(exc.code.name)
            raise

    async def get(self, query_id: str) -> cpb.GetQueryResponse:
        if self.on_get:
            await self._away()
        try:
            return await super().get(query_id)
        except CoordinatorError as exc:
            self.errors.append(exc.code.name)
            raise


async def test_a_query_seen_ending_then_expired_while_away_is_reported_from_its_event(
    mesh_factory: MeshFactory,
) -> None:
    mesh = mesh_factory(["--retention-s", str(RETENTION_S)])
    query = _query("away")
    client = _Away(mesh, on_get=True, down_s=2 * RETENTION_S)
    async with client:
        metrics = await replay(client, [query], qps=1.0, retry_s=60.0)
    assert client.restarted is not None
    await client.restarted
    terminal, admitted = client.terminal, client.admitted
    assert terminal is not None and admitted is not None
    # The coordinator was down at the read, and the query was gone once it was back.
    assert client.errors[0] == "UNAVAILABLE" and client.errors[-1] == "NOT_FOUND", client.errors
    assert (metrics.num_queries, metrics.completed) == (1, 1)
    assert metrics.extra["failed"] == 0
    # Its arrival and SLO are what the submission answered; its finish, the event's time.
    assert metrics.latencies == [pytest.approx(terminal.time_s - admitted.arrival_s)]
    assert metrics.slo_attainment == (terminal.time_s - admitted.arrival_s <= admitted.slo_s)


async def test_a_query_that_vanished_while_running_still_fails_the_replay(
    mesh_factory: MeshFactory,
) -> None:
    mesh = mesh_factory(["--retention-s", str(RETENTION_S)])
    query = _query("lost")
    client = _Away(mesh, on_get=False, down_s=0.5, while_down=query.query_id)
    async with client:
        with pytest.raises(CoordinatorError) as lost:
            await replay(client, [query], qps=1.0, retry_s=60.0)
    assert client.restarted is not None
    await client.restarted
    assert lost.value.code == grpc.StatusCode.NOT_FOUND
    assert client.terminal is None
