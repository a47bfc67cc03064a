"""Coordinator shards in the test's own process: real gRPC servers that own workflows by the
coordinators' rule and redirect the rest exactly as a sharded coordinator does.

What it stands for: N coordinator shards on one Redis (``hexgen_coordinator.shards``), as
their clients see them. `ShardTable` is the Redis part: which address holds each shard's
lease (None while a takeover is under way) and the workflows' state and events, shared by
every server, so that a shard taken over at another address still has its workflows. Each
`ShardServer` listens on a free loopback port and serves `CoordinatorService` for the
shard it holds; an RPC about a workflow of another shard is answered as the coordinator
answers it:

- FAILED_PRECONDITION ``query 'X' belongs to shard 1 (hf:{s1}:), served at HOST:PORT``,
  the owner's address in the trailing metadata ``hexgen-shard-owner``
  (`hexgen_service.errors.SHARD_OWNER_KEY`);
- UNAVAILABLE ``shard 1 (hf:{s1}:) has no coordinator now`` while no one holds that shard.

A workflow belongs to shard ``crc32(UTF-8 id) mod N``. `stop` is a dead coordinator: the
server closes at once, its open streams break and its port answers nothing. Workflows run
only as far as the test says (`ShardTable.finish`): a submitted query is RUNNING with a
SUBMITTED event; a session's call answers at once. Every RPC a server receives is counted
(`rpcs`, by method), redirected ones included, so that tests count the hops.

It is the client's side of sharding that this tests (tests/test_client_shards.py): the
coordinators' own redirects, leases and takeovers are tests/test_coordinator_shards.py's,
with real coordinator processes.

Run as a program (``python tests/shard_redirect_server.py``), it serves the fixtures of the
Go and TypeScript clients' redirect tests (`serve_fixtures`: a circle of redirects, a chain
longer than a client follows, a shard without a holder, two shards that redirect to each
other), prints their addresses as one JSON line and serves until SIGTERM;
scripts/test_clients.py starts it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import coordinator_pb2_grpc
from hexgen_client.routing import MAX_REDIRECTS
from hexgen_service.errors import SHARD_OWNER_KEY

__all__ = ["ShardServer", "ShardTable", "serve_fixtures", "shard_of"]

Context = grpc.aio.ServicerContext[Any, Any]

_ENDED = {
    cpb.QUERY_EVENT_KIND_SUCCEEDED,
    cpb.QUERY_EVENT_KIND_CANCELLED,
    cpb.QUERY_EVENT_KIND_FAILED,
}


def shard_of(query_id: str, shards: int) -> int:
    """The shard that owns `query_id` (the coordinators' rule, `ShardMap.shard_of`)."""
    return zlib.crc32(query_id.encode()) % shards


@dataclass
class ShardTable:
    """What the shards share through Redis: the leases and the workflows."""

    shards: int
    holders: list[str | None] = field(default_factory=list)
    """Each shard's coordinator (its client address), None while it has none."""
    queries: dict[str, cpb.QueryInfo] = field(default_factory=dict)
    events: dict[str, list[cpb.QueryEvent]] = field(default_factory=dict)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def __post_init__(self) -> None:
        self.holders = self.holders or [None] * self.shards

    @staticmethod
    def prefix(shard: int) -> str:
        return f"hf:{{s{shard}}}:"

    def ids_of(self, shard: int, count: int, stem: str = "q") -> list[str]:
        """`count` query ids that belong to `shard`."""
        ids = (f"{stem}-{k}" for k in range(10_000))
        return [i for i in ids if shard_of(i, self.shards) == shard][:count]

    def add(self, query_id: str) -> tuple[cpb.QueryInfo, bool]:
        """The query, created RUNNING with its SUBMITTED event when unknown; and whether it
        was created (submission is idempotent on the id)."""
        known = self.queries.get(query_id)
        if known is not None:
            return known, False
        info = cpb.QueryInfo(
            query_id=query_id, state=cpb.QUERY_STATE_RUNNING, arrival_s=0.0, slo_s=60.0
        )
        self.queries[query_id] = info
        self.events[query_id] = [
            cpb.QueryEvent(query_id=query_id, kind=cpb.QUERY_EVENT_KIND_SUBMITTED, stage=-1)
        ]
        return info, True

    async def end(self, query_id: str, kind: cpb.QueryEventKind.ValueType) -> None:
        """End the query with the terminal event `kind`, waking its watchers."""
        state = {
            cpb.QUERY_EVENT_KIND_SUCCEEDED: cpb.QUERY_STATE_SUCCEEDED,
            cpb.QUERY_EVENT_KIND_CANCELLED: cpb.QUERY_STATE_CANCELLED,
        }[kind]
        async with self.changed:
            self.queries[query_id].state = state
            self.queries[query_id].finished_s = 1.0
            events = self.events[query_id]
            events.append(
                cpb.QueryEvent(query_id=query_id, kind=kind, stage=-1, sequence=len(events))
            )
            self.changed.notify_all()

    async def finish(self, query_id: str) -> None:
        await self.end(query_id, cpb.QUERY_EVENT_KIND_SUCCEEDED)


class ShardCoordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """`CoordinatorService` of the coordinator at `address`, serving what its shard owns."""

    def __init__(self, table: ShardTable, address: str) -> None:
        self.table = table
        self.address = address
        self.rpcs: Counter[str] = Counter()
        """RPCs received, by method name, redirected ones included."""

    async def _owned(self, context: Context, method: str, query_id: str) -> None:
        """Count the RPC; redirect it (abort) unless this coordinator holds its shard."""
        self.rpcs[method] += 1
        shard = shard_of(query_id, self.table.shards)
        holder = self.table.holders[shard]
        if holder == self.address:
            return
        prefix = self.table.prefix(shard)
        if holder is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"shard {shard} ({prefix}) has no coordinator now"
            )
        context.set_trailing_metadata(((SHARD_OWNER_KEY, str(holder)),))
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"query {query_id!r} belongs to shard {shard} ({prefix}), served at {holder}",
        )

    async def _known(self, context: Context, query_id: str) -> cpb.QueryInfo:
        info = self.table.queries.get(query_id)
        if info is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no query {query_id!r}")
        assert info is not None  # abort raised
        return info

    async def _events(self, query_id: str) -> AsyncIterator[cpb.QueryEvent]:
        """The query's events, past ones first, until its terminal one."""
        sent = 0
        while True:
            async with self.table.changed:
                while len(self.table.events[query_id]) == sent:
                    await self.table.changed.wait()
                fresh = self.table.events[query_id][sent:]
            for event in fresh:
                sent += 1
                yield event
                if event.kind in _ENDED:
                    return

    # ------------------------------------------------------------------------- queries

    async def SubmitQuery(  # noqa: N802 - gRPC method name
        self, request: cpb.SubmitQueryRequest, context: Context
    ) -> cpb.SubmitQueryResponse:
        await self._owned(context, "SubmitQuery", request.query_id)
        info, created = self.table.add(request.query_id)
        return cpb.SubmitQueryResponse(query=info, created=created)

    async def WatchQuery(  # noqa: N802
        self, request: cpb.WatchQueryRequest, context: Context
    ) -> AsyncIterator[cpb.WatchQueryResponse]:
        await self._owned(context, "WatchQuery", request.query_id)
        await self._known(context, request.query_id)
        async for event in self._events(request.query_id):
            yield cpb.WatchQueryResponse(event=event)

    async def RunQuery(  # noqa: N802
        self, request: cpb.RunQueryRequest, context: Context
    ) -> AsyncIterator[cpb.RunQueryResponse]:
        await self._owned(context, "RunQuery", request.query.query_id)
        self.table.add(request.query.query_id)
        async for event in self._events(request.query.query_id):
            yield cpb.RunQueryResponse(event=event)

    async def CancelQuery(  # noqa: N802
        self, request: cpb.CancelQueryRequest, context: Context
    ) -> cpb.CancelQueryResponse:
        await self._owned(context, "CancelQuery", request.query_id)
        info = await self._known(context, request.query_id)
        if info.state == cpb.QUERY_STATE_RUNNING:
            await self.table.end(request.query_id, cpb.QUERY_EVENT_KIND_CANCELLED)
        return cpb.CancelQueryResponse(query=info)

    async def GetQuery(  # noqa: N802
        self, request: cpb.GetQueryRequest, context: Context
    ) -> cpb.GetQueryResponse:
        await self._owned(context, "GetQuery", request.query_id)
        info = await self._known(context, request.query_id)
        return cpb.GetQueryResponse(query=info, events=self.table.events[request.query_id])

    # -------------------------------------------------------- this coordinator's own

    async def ClusterStatus(  # noqa: N802
        self, request: cpb.ClusterStatusRequest, context: Context
    ) -> cpb.ClusterStatusResponse:
        self.rpcs["ClusterStatus"] += 1
        instance = cpb.InstanceStatus(index=0, name="A100#0", gpu="A100", model="llama")
        return cpb.ClusterStatusResponse(
            instances=[instance], policy="hexgen-flow", time_scale=1.0, cluster="A100"
        )

    async def SetAlpha(  # noqa: N802
        self, request: cpb.SetAlphaRequest, context: Context
    ) -> cpb.SetAlphaResponse:
        self.rpcs["SetAlpha"] += 1
        return cpb.SetAlphaResponse(alpha=request.alpha)

    async def GetAlphaHistory(  # noqa: N802
        self, request: cpb.GetAlphaHistoryRequest, context: Context
    ) -> cpb.GetAlphaHistoryResponse:
        self.rpcs["GetAlphaHistory"] += 1
        return cpb.GetAlphaHistoryResponse()

    # ------------------------------------------------------------- workflow sessions

    async def OpenWorkflow(  # noqa: N802
        self, request: cpb.OpenWorkflowRequest, context: Context
    ) -> cpb.OpenWorkflowResponse:
        await self._owned(context, "OpenWorkflow", request.workflow_id)
        info, created = self.table.add(request.workflow_id)
        return cpb.OpenWorkflowResponse(workflow=info, created=created)

    async def RunCall(  # noqa: N802
        self, request: cpb.RunCallRequest, context: Context
    ) -> AsyncIterator[cpb.RunCallResponse]:
        await self._owned(context, "RunCall", request.workflow_id)
        await self._known(context, request.workflow_id)
        call_id = f"{request.workflow_id}/{request.stage}"
        yield cpb.RunCallResponse(
            event=cpb.QueryEvent(
                query_id=request.workflow_id,
                kind=cpb.QUERY_EVENT_KIND_CALL_SUBMITTED,
                call_id=call_id,
            ),
            call_id=call_id,
            deadline_s=30.0,
        )
        text = f"{self.address} answers {request.call.prompt}"
        yield cpb.RunCallResponse(
            event=cpb.QueryEvent(
                query_id=request.workflow_id,
                kind=cpb.QUERY_EVENT_KIND_CALL_FINISHED,
                call_id=call_id,
                instance="A100#0",
                text=text,
            )
        )

    async def CloseWorkflow(  # noqa: N802
        self, request: cpb.CloseWorkflowRequest, context: Context
    ) -> cpb.CloseWorkflowResponse:
        await self._owned(context, "CloseWorkflow", request.workflow_id)
        info = await self._known(context, request.workflow_id)
        if info.state == cpb.QUERY_STATE_RUNNING:
            await self.table.finish(request.workflow_id)
        return cpb.CloseWorkflowResponse(workflow=info)


class ShardServer:
    """One coordinator of the table on a free loopback port; `start` it, `stop` (kill) it.
    It holds no shard until the test gives it one (`take`)."""

    def __init__(self, table: ShardTable) -> None:
        self.table = table
        self._server = grpc.aio.server()
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.coordinator = ShardCoordinator(table, self.address)
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(
            self.coordinator, self._server
        )

    @property
    def rpcs(self) -> Counter[str]:
        return self.coordinator.rpcs

    def take(self, shard: int) -> ShardServer:
        """Hold `shard` (its lease) from now on."""
        self.table.holders[shard] = self.address
        return self

    async def start(self) -> ShardServer:
        await self._server.start()
        return self

    async def stop(self) -> None:
        """Die: no grace, its streams broken, its port closed. Its shards keep naming it
        (a dead holder's lease outlives it) until the test hands them on."""
        await self._server.stop(None)


# ------------------------------------------------------------------- as a program


async def serve_fixtures(ready: Callable[[dict[str, str]], None]) -> None:
    """Start the servers of the other clients' redirect tests, report them to `ready` and
    serve until SIGTERM or SIGINT (`python tests/shard_redirect_server.py`;
    scripts/test_clients.py starts it for the Go and TypeScript clients' tests). Two shards
    everywhere, shard 0 held by the first server of each set; `query` is an id of shard 1:

    - ``loop``: two coordinators that disagree on who holds shard 1, each naming the other
      (a circle: ``A -> B -> A``);
    - ``chain``: ``MAX_REDIRECTS + 2`` coordinators, each naming the next as shard 1's
      holder (no circle, but further than a client follows);
    - ``takeover``: one coordinator, shard 1 without a holder (UNAVAILABLE, as while a spare
      takes a dead coordinator's shard over);
    - ``shards``: ``S0,S1``, each holding its shard of one table (redirects that end).
    """
    first, second = ShardTable(2), ShardTable(2)
    circle = [await ShardServer(first).take(0).start(), await ShardServer(second).take(0).start()]
    first.holders[1], second.holders[1] = circle[1].address, circle[0].address
    tables = [ShardTable(2) for _ in range(MAX_REDIRECTS + 2)]
    chain = [await ShardServer(t).take(0).start() for t in tables]
    for here, there in zip(tables, chain[1:], strict=False):
        here.holders[1] = there.address
    takeover = [await ShardServer(ShardTable(2)).take(0).start()]
    shared = ShardTable(2)
    shards = [await ShardServer(shared).take(0).start(), await ShardServer(shared).take(1).start()]
    servers = [*circle, *chain, *takeover, *shards]
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    try:
        ready(
            {
                name: ",".join(s.address for s in group)
                for name, group in (
                    ("loop", circle),
                    ("chain", chain),
                    ("takeover", takeover),
                    ("shards", shards),
                )
            }
            | {"query": first.ids_of(1, 1, "redirected")[0]}
        )
        await stop.wait()
    finally:
        for server in servers:
            await server.stop()


def main() -> None:
    """Print the fixtures' addresses as one JSON line, then serve until SIGTERM."""

    def ready(fixtures: dict[str, str]) -> None:
        print(json.dumps(fixtures), flush=True)

    asyncio.run(serve_fixtures(ready))


if __name__ == "__main__":
    main()
