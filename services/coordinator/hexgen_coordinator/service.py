"""gRPC adapters of the coordinator: protobuf in, protobuf out, errors as statuses; and
their registration on a server (`add_coordinator_services`, `add_worker_service`) through
the edge's guarded deserializers (`hexgen_coordinator.edge.add_services`).

The worker stream is translated here, at the edge (`hexgen_coordinator.worker_wire`): the
coordinator gets the reports of `hexgen_coordinator.worker_messages` and puts that module's
commands in a link's outbox, which the stream's writer encodes. So is the client API
(`hexgen_coordinator.client_wire`): the RPCs decode each request into the values of
`hexgen_coordinator.client_messages` (a submission, checked against the input limits as it
is decoded; a workflow session opened; a call given to one) and encode the coordinator's
answers from them (a query's info and events, the cluster's status)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import coordinator_pb2_grpc as cpb_grpc
from hexgen_api.v1 import worker_pb2 as wpb
from hexgen_api.v1 import worker_pb2_grpc as wpb_grpc
from hexgen_coordinator.client_wire import (
    decode_open_workflow,
    decode_run_call,
    decode_submit,
    encode_alpha_history,
    encode_call_update,
    encode_detail,
    encode_event,
    encode_info,
    encode_status,
)
from hexgen_coordinator.coordinator import (
    Coordinator,
    SlotTakenError,
    UnknownQueryError,
    WorkerLink,
)
from hexgen_coordinator.edge import add_services, request_limits, statuses
from hexgen_coordinator.shards import OWNER_METADATA
from hexgen_coordinator.worker_wire import (
    decode_finished,
    decode_heartbeat,
    decode_hello,
    decode_started,
    decode_tokens,
    encode_command,
    hello_problem,
)
from hexgen_flow.workload import DEFAULT_TENANT
from hexgen_service.auth import Role, current_principal
from hexgen_service.worker_token import TOKEN_METADATA, check_token

__all__ = [
    "CoordinatorServicer",
    "WorkerServicer",
    "add_coordinator_services",
    "add_worker_service",
]

log = logging.getLogger(__name__)
audit = logging.getLogger("hexgen.audit")

Context = grpc.aio.ServicerContext


class CoordinatorServicer(cpb_grpc.CoordinatorServiceServicer):
    """Every handler runs in `statuses`: errors become statuses with a one-line message
    (INVALID_ARGUMENT, ALREADY_EXISTS, RESOURCE_EXHAUSTED with ``retry-after-s``,
    UNAVAILABLE while Redis is unreachable, NOT_FOUND for an unknown query).

    With API keys (`hexgen_service.auth`), a tenant's key works on its own queries only: it
    submits as its tenant (naming another is PERMISSION_DENIED), another tenant's query is
    NOT_FOUND exactly as an unknown one is (its existence is not revealed), and cluster
    status comes without the workers' ids. Operators and admins see every tenant."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.c = coordinator

    # ------------------------------------------------------------------ tenant scoping

    async def _tenant_for(self, context: Context[object, object], field: str, asked: str) -> str:
        """The tenant a submission runs as: the key's own unless an operator names one."""
        principal = current_principal.get()
        if principal is None:
            return asked
        if asked == DEFAULT_TENANT and not principal.may(Role.OPERATOR):
            asked = ""  # a client's unnamed tenant: the key's own
        if asked and not principal.sees(asked):
            audit.warning(
                "denied %s=%r to key %s of tenant %r",
                field,
                asked,
                principal.key_id,
                principal.tenant,
            )
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{field}: the key of tenant {principal.tenant!r} may not act for {asked!r}",
            )
        return asked or principal.tenant

    async def _hidden(self, context: Context[object, object], query_id: str) -> str | None:
        """The tenant of `query_id` when the caller is a tenant's key that may not see it;
        None when it may, or when no such query exists (the handler answers that)."""
        principal = current_principal.get()
        if principal is None or principal.may(Role.OPERATOR) or not query_id:
            return None
        async with statuses(context):
            try:
                tenant = (await self.c.get_info(query_id)).tenant
            except UnknownQueryError:
                return None
        return None if principal.sees(tenant) else tenant

    async def _visible(self, context: Context[object, object], query_id: str) -> None:
        """NOT_FOUND, as for an unknown id, unless the caller may see `query_id`."""
        tenant = await self._hidden(context, query_id)
        if tenant is not None:
            principal = current_principal.get()
            audit.warning(
                "denied query %r of tenant %r to key %s",
                query_id,
                tenant,
                principal.key_id if principal else "",
            )
            await _not_found(context, query_id)

    async def _id_free(self, context: Context[object, object], query_id: str) -> None:
        """ALREADY_EXISTS when another tenant's query has this id (an idempotent resend of
        one's own returns it; another's is not shown)."""
        if await self._hidden(context, query_id) is not None:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"query_id: {query_id!r} is taken; choose another"
            )

    async def _owned(self, context: Context[object, object], query_id: str) -> None:
        """With shards, a workflow of another shard is redirected: FAILED_PRECONDITION naming
        the owner, its address in the trailing metadata `OWNER_METADATA` (clients follow
        it); UNAVAILABLE while no coordinator holds that shard (a takeover under way)."""
        async with statuses(context):
            lease = self.c.lease
            if lease is None or not query_id:
                return
            shard = lease.shards.shard_of(query_id)
            if shard == lease.shard:
                return
            prefix = lease.shards.prefixes[shard]
            owner = await lease.owner(shard)
            if owner is None:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, f"shard {shard} ({prefix}) has no coordinator now"
                )
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"query {query_id!r} belongs to shard {shard} ({prefix}), served at {owner}",
                trailing_metadata=((OWNER_METADATA, str(owner)),),
            )

    # ------------------------------------------------------------------ RPCs

    async def SubmitQuery(  # noqa: N802 - gRPC method name
        self, request: cpb.SubmitQueryRequest, context: Context[object, object]
    ) -> cpb.SubmitQueryResponse:
        await self._owned(context, request.query_id)
        request.tenant = await self._tenant_for(context, "tenant", request.tenant)
        await self._id_free(context, request.query_id)
        async with statuses(context):
            info, created = await self.c.submit(decode_submit(request, self.c.limits))
            return cpb.SubmitQueryResponse(query=encode_info(info), created=created)
        raise AssertionError("unreachable")

    async def WatchQuery(  # noqa: N802
        self, request: cpb.WatchQueryRequest, context: Context[object, object]
    ) -> AsyncIterator[cpb.WatchQueryResponse]:
        if not request.query_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "query_id: must not be empty")
        await self._owned(context, request.query_id)
        await self._visible(context, request.query_id)
        async with statuses(context):
            try:
                async for event in self.c.watch(request.query_id):
                    yield cpb.WatchQueryResponse(event=encode_event(event))
            except UnknownQueryError:
                await _not_found(context, request.query_id)

    async def RunQuery(  # noqa: N802
        self, request: cpb.RunQueryRequest, context: Context[object, object]
    ) -> AsyncIterator[cpb.RunQueryResponse]:
        await self._owned(context, request.query.query_id)
        request.query.tenant = await self._tenant_for(context, "query.tenant", request.query.tenant)
        await self._id_free(context, request.query.query_id)
        async with statuses(context, "query."):
            info, _ = await self.c.submit(decode_submit(request.query, self.c.limits))
        async with statuses(context):
            async for event in self.c.watch(info.query_id):
                yield cpb.RunQueryResponse(event=encode_event(event))

    async def CancelQuery(  # noqa: N802
        self, request: cpb.CancelQueryRequest, context: Context[object, object]
    ) -> cpb.CancelQueryResponse:
        await self._owned(context, request.query_id)
        await self._visible(context, request.query_id)
        async with statuses(context):
            try:
                return cpb.CancelQueryResponse(
                    query=encode_info(await self.c.cancel(request.query_id))
                )
            except UnknownQueryError:
                await _not_found(context, request.query_id)
        raise AssertionError("unreachable")

    async def GetQuery(  # noqa: N802
        self, request: cpb.GetQueryRequest, context: Context[object, object]
    ) -> cpb.GetQueryResponse:
        await self._owned(context, request.query_id)
        await self._visible(context, request.query_id)
        async with statuses(context):
            try:
                return encode_detail(await self.c.get(request.query_id))
            except UnknownQueryError:
                await _not_found(context, request.query_id)
        raise AssertionError("unreachable")

    async def ClusterStatus(  # noqa: N802
        self, request: cpb.ClusterStatusRequest, context: Context[object, object]
    ) -> cpb.ClusterStatusResponse:
        async with statuses(context):
            status = encode_status(self.c.status())
        principal = current_principal.get()
        if principal is not None and not principal.may(Role.OPERATOR):
            for instance in status.instances:  # who holds a slot is the operators' business
                instance.worker_id = ""
        return status

    async def SetAlpha(  # noqa: N802
        self, request: cpb.SetAlphaRequest, context: Context[object, object]
    ) -> cpb.SetAlphaResponse:
        async with statuses(context):
            previous = await self.c.set_alpha(request.alpha, request.reason)
            return cpb.SetAlphaResponse(previous_alpha=previous, alpha=request.alpha)
        raise AssertionError("unreachable")

    async def GetAlphaHistory(  # noqa: N802
        self, request: cpb.GetAlphaHistoryRequest, context: Context[object, object]
    ) -> cpb.GetAlphaHistoryResponse:
        async with statuses(context):
            return encode_alpha_history(await self.c.alpha_history(request.limit))
        raise AssertionError("unreachable")

    async def OpenWorkflow(  # noqa: N802
        self, request: cpb.OpenWorkflowRequest, context: Context[object, object]
    ) -> cpb.OpenWorkflowResponse:
        await self._owned(context, request.workflow_id)
        request.tenant = await self._tenant_for(context, "tenant", request.tenant)
        await self._id_free(context, request.workflow_id)
        async with statuses(context):
            c = self.c
            opened = decode_open_workflow(request, c.limits, c.config.session_idle_s)
            info, created = await c.open_workflow(opened)
            return cpb.OpenWorkflowResponse(workflow=encode_info(info), created=created)
        raise AssertionError("unreachable")

    async def RunCall(  # noqa: N802
        self, request: cpb.RunCallRequest, context: Context[object, object]
    ) -> AsyncIterator[cpb.RunCallResponse]:
        await self._owned(context, request.workflow_id)
        await self._visible(context, request.workflow_id)
        async with statuses(context):
            try:
                async for update in self.c.run_call(decode_run_call(request)):
                    yield encode_call_update(update)
            except UnknownQueryError:
                await _not_found(context, request.workflow_id)

    async def CloseWorkflow(  # noqa: N802
        self, request: cpb.CloseWorkflowRequest, context: Context[object, object]
    ) -> cpb.CloseWorkflowResponse:
        await self._owned(context, request.workflow_id)
        await self._visible(context, request.workflow_id)
        async with statuses(context):
            try:
                return cpb.CloseWorkflowResponse(
                    workflow=encode_info(await self.c.close_workflow(request.workflow_id))
                )
            except UnknownQueryError:
                await _not_found(context, request.workflow_id)
        raise AssertionError("unreachable")


async def _not_found(context: Context[object, object], query_id: str) -> None:
    await context.abort(grpc.StatusCode.NOT_FOUND, f"query_id: no query {query_id!r}")


class WorkerServicer(wpb_grpc.WorkerServiceServicer):
    """One stream per worker: a reader task feeds the coordinator, the RPC writes."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.c = coordinator

    async def Connect(  # noqa: N802
        self,
        request_iterator: AsyncIterator[wpb.ConnectRequest],
        context: Context[object, object],
    ) -> AsyncIterator[wpb.ConnectResponse]:
        expected = self.c.config.worker_token
        if expected:
            given = dict(context.invocation_metadata() or ()).get(TOKEN_METADATA)
            if not check_token(expected, given if isinstance(given, str) else None):
                log.warning("refused a worker stream from %s: worker token", context.peer())
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"worker token {'invalid' if given else 'missing'}: the coordinator "
                    f"takes workers that send the token of its --worker-token-file",
                )
                return
        async with statuses(context):
            first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("message") != "hello":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "hello: the first message must be a WorkerHello"
            )
            return
        if not first.hello.worker_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "hello.worker_id: must not be empty"
            )
        problem = hello_problem(first.hello)
        if problem is not None:
            log.warning("refused a worker hello from %s: %s", context.peer(), problem)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        hello = decode_hello(first.hello)  # the engine kind is one the enum names
        link = WorkerLink(worker_id=hello.worker_id, engine=hello.engine)
        async with statuses(context):
            try:
                self.c.connect(hello, link)
            except SlotTakenError as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"hello.slot: {exc}")
        reader = asyncio.create_task(self._read(link, request_iterator))
        try:
            while True:
                message = await link.outbox.get()
                if message is None:
                    break
                yield encode_command(message)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            self.c.disconnect(link, "stream closed")

    async def _read(
        self, link: WorkerLink, request_iterator: AsyncIterator[wpb.ConnectRequest]
    ) -> None:
        c = self.c
        pending: set[asyncio.Task[None]] = set()
        try:
            async for message in request_iterator:
                link.last_seen = time.monotonic()
                kind = message.WhichOneof("message")
                if kind == "finished":
                    # Completions of different queries proceed concurrently; each query's
                    # lock keeps its own in order.
                    task = asyncio.create_task(
                        c.on_finished(link, decode_finished(message.finished))
                    )
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                elif kind == "started":
                    c.on_started(link, decode_started(message.started))
                elif kind == "tokens":
                    c.on_tokens(link, decode_tokens(message.tokens))
                elif kind == "heartbeat":
                    c.on_heartbeat(link, decode_heartbeat(message.heartbeat))
                else:
                    log.warning("worker %s sent an unexpected %s", link.worker_id, kind)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        except Exception:
            log.exception("worker %s stream failed", link.worker_id)
        finally:
            c.disconnect(link, "stream ended")


# ------------------------------------------------------------------ registration


def add_coordinator_services(
    server: grpc.aio.Server, coordinator: Any, *, workers: bool = True
) -> None:
    """Register `coordinator`'s CoordinatorService (and its WorkerService, with `workers`)
    on `server` (what ``python -m hexgen_coordinator`` serves), undecodable requests
    answered with INVALID_ARGUMENT."""
    add_services(
        server,
        cpb_grpc.add_CoordinatorServiceServicer_to_server,
        CoordinatorServicer(coordinator),
        request_limits(coordinator.config),
    )
    if workers:
        add_worker_service(server, coordinator)


def add_worker_service(server: grpc.aio.Server, coordinator: Any) -> None:
    """Register `coordinator`'s WorkerService on `server` (the workers' door)."""
    add_services(
        server,
        wpb_grpc.add_WorkerServiceServicer_to_server,
        WorkerServicer(coordinator),
        request_limits(coordinator.config),
    )
