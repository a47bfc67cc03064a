"""`CoordinatorClient`: an asyncio wrapper over the generated CoordinatorService stubs.

It takes and returns the core's `Query` on the way in (converted by
`hexgen_wire.convert`) and the API's own messages on the way out (`QueryEvent`,
`QueryInfo`, `ClusterStatusResponse`), and turns gRPC errors into `CoordinatorError` (or
`CoordinatorUnavailableError` when nothing answers), so callers see one exception type::

    async with CoordinatorClient() as client:
        async for event in client.run(query):
            print(event.kind, event.time_s)

A sharded mesh's coordinators are given together (``CoordinatorClient("a:1,b:2")`` or a
list): every RPC about a query goes where `hexgen_client.routing` says (the owner learnt
from an earlier redirect, else the default address), follows redirects and moves on past
coordinators that do not answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import grpc

from hexgen_api.v1 import coordinator_pb2, coordinator_pb2_grpc, workflow_pb2
from hexgen_client.addresses import DEFAULT_COORDINATOR, split_addresses
from hexgen_client.convert import is_terminal, submit_request
from hexgen_client.credentials import open_channel
from hexgen_client.errors import (
    CoordinatorError,
    CoordinatorOverloadedError,
    CoordinatorUnavailableError,
)
from hexgen_client.routing import ShardRouter, owner_of
from hexgen_flow.workload import Query
from hexgen_wire.convert import workflow_to_proto
from hexgen_wire.metadata import RETRY_AFTER_KEY

__all__ = ["RETRY_AFTER_KEY", "CoordinatorClient"]

if TYPE_CHECKING:  # the async stub's class exists in the type stubs only
    _Stub: TypeAlias = coordinator_pb2_grpc.CoordinatorServiceAsyncStub
_Response = TypeVar("_Response")
_EventResponse = TypeVar(
    "_EventResponse", coordinator_pb2.WatchQueryResponse, coordinator_pb2.RunQueryResponse
)

_UNREACHABLE_STATES = (
    grpc.ChannelConnectivity.IDLE,
    grpc.ChannelConnectivity.CONNECTING,
    grpc.ChannelConnectivity.TRANSIENT_FAILURE,
    grpc.ChannelConnectivity.SHUTDOWN,
)


class CoordinatorClient:
    """The coordinator at `address`, or a sharded mesh's coordinators: ``"HOST:PORT"``, a
    comma list ``"A,B"`` or a sequence of addresses. One channel per address used, opened
    on first use inside the running event loop; use it as an async context manager (or call
    `close`)."""

    def __init__(
        self,
        address: str | Sequence[str] = DEFAULT_COORDINATOR,
        *,
        timeout_s: float = 10.0,
        interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
        api_key: str | None = None,
        tls_ca: str | Path | None = None,
    ) -> None:
        self.addresses = split_addresses(address)
        """The coordinators, in the order they are tried when one does not answer."""
        self.address = ",".join(self.addresses)
        """The addresses as one string (the one address, without shards)."""
        self.api_key = api_key
        """Sent as ``authorization: Bearer`` on every RPC; None: ``$HEXGEN_FLOW_API_KEY``."""
        self.tls_ca = tls_ca
        """The CA to verify a TLS coordinator with; None: ``$HEXGEN_FLOW_TLS_CA``, else
        plaintext."""
        self.timeout_s = timeout_s
        """Deadline of every unary RPC (streams have none: a query may run for minutes)."""
        self.router = ShardRouter(self.addresses)
        """Where each query's RPCs go (`hexgen_client.routing`)."""
        self._interceptors = list(interceptors) if interceptors else None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, _Stub] = {}

    def one(self, address: str) -> CoordinatorClient:
        """A client of the coordinator at `address` alone, with this client's key, CA,
        interceptors and timeout: what talks to each shard's coordinator in turn (the
        tuner's SetAlpha on every shard). Close it when done."""
        return CoordinatorClient(
            address,
            timeout_s=self.timeout_s,
            interceptors=self._interceptors,
            api_key=self.api_key,
            tls_ca=self.tls_ca,
        )

    # ------------------------------------------------------------------------- lifecycle

    @property
    def stub(self) -> _Stub:
        """The generated stub of the default coordinator (no routing: for callers of the
        raw API, e.g. benchmarks)."""
        return self._stub_at(self.router.default)

    def _stub_at(self, address: str) -> _Stub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = open_channel(
                address,
                api_key=self.api_key,
                tls_ca=self.tls_ca,
                interceptors=self._interceptors or (),
            )
            self._channels[address] = channel
            stub = self._stubs[address] = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        return stub

    async def close(self) -> None:
        channels = list(self._channels.values())
        self._channels.clear()
        self._stubs.clear()
        for channel in channels:
            await channel.close()

    async def __aenter__(self) -> CoordinatorClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def wait_ready(self, timeout_s: float = 10.0) -> coordinator_pb2.ClusterStatusResponse:
        """Wait until the coordinator answers `ClusterStatus` (while it starts, or restarts);
        `CoordinatorUnavailableError` after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                return await self.status()
            except CoordinatorUnavailableError:
                if loop.time() >= deadline:
                    raise
            await asyncio.sleep(0.1)

    # ------------------------------------------------------------------------------ RPCs

    async def submit(
        self,
        query: Query,
        *,
        slo_scale: float | None = None,
        prompts: Sequence[Sequence[str]] | None = None,
    ) -> coordinator_pb2.SubmitQueryResponse:
        """Admit `query` (idempotent on its id: `created` is False when it was known).
        `slo_scale` applies when the query carries no SLO of its own; `prompts` are the
        calls' prompts, per stage (see `submit_request`). A refusal by admission control
        raises `CoordinatorOverloadedError` (with the coordinator's retry-after hint)."""
        request = submit_request(query, slo_scale, prompts)
        return await self._unary(
            query.query_id, lambda stub: stub.SubmitQuery(request, timeout=self.timeout_s)
        )

    def watch(self, query_id: str) -> AsyncGenerator[coordinator_pb2.QueryEvent, None]:
        """The query's events, past ones first, until it succeeds, fails or is cancelled."""
        request = coordinator_pb2.WatchQueryRequest(query_id=query_id)
        return self._events(query_id, lambda stub: stub.WatchQuery(request))

    def run(
        self,
        query: Query,
        *,
        slo_scale: float | None = None,
        prompts: Sequence[Sequence[str]] | None = None,
    ) -> AsyncGenerator[coordinator_pb2.QueryEvent, None]:
        """Submit `query` and stream its events until it ends (RunQuery); `prompts` as for
        `submit`."""
        request = coordinator_pb2.RunQueryRequest(query=submit_request(query, slo_scale, prompts))
        return self._events(query.query_id, lambda stub: stub.RunQuery(request))

    async def cancel(self, query_id: str) -> coordinator_pb2.QueryInfo:
        request = coordinator_pb2.CancelQueryRequest(query_id=query_id)
        response = await self._unary(
            query_id, lambda stub: stub.CancelQuery(request, timeout=self.timeout_s)
        )
        return response.query

    async def get(self, query_id: str) -> coordinator_pb2.GetQueryResponse:
        """The query's state (`.query`) and its events so far (`.events`)."""
        request = coordinator_pb2.GetQueryRequest(query_id=query_id)
        return await self._unary(
            query_id, lambda stub: stub.GetQuery(request, timeout=self.timeout_s)
        )

    async def status(self) -> coordinator_pb2.ClusterStatusResponse:
        """ClusterStatus of the default coordinator (the next one when it does not answer:
        with shards, every coordinator sees every instance)."""
        request = coordinator_pb2.ClusterStatusRequest()
        return await self._unary(
            None, lambda stub: stub.ClusterStatus(request, timeout=self.timeout_s)
        )

    async def set_alpha(self, alpha: float, reason: str = "") -> coordinator_pb2.SetAlphaResponse:
        """SetAlpha at the default coordinator (the next one when it does not answer)."""
        request = coordinator_pb2.SetAlphaRequest(alpha=alpha, reason=reason)
        return await self._unary(None, lambda stub: stub.SetAlpha(request, timeout=self.timeout_s))

    async def alpha_history(self, limit: int = 0) -> coordinator_pb2.GetAlphaHistoryResponse:
        """GetAlphaHistory at the default coordinator (the next one when it does not
        answer): the α in force and its latest `limit` changes (0: every one kept), oldest
        first. With shards, each coordinator keeps its own."""
        request = coordinator_pb2.GetAlphaHistoryRequest(limit=limit)
        return await self._unary(
            None, lambda stub: stub.GetAlphaHistory(request, timeout=self.timeout_s)
        )

    # ------------------------------------------------------------------ workflow sessions

    async def open_workflow(
        self,
        workflow_id: str,
        *,
        template: str = "",
        expected: Query | workflow_pb2.Workflow | None = None,
        slo_s: float = 0.0,
        slo_scale: float = 0.0,
        tenant: str = "",
        idle_timeout_s: float = 0.0,
    ) -> coordinator_pb2.OpenWorkflowResponse:
        """Open a workflow session whose calls are given one by one (`run_call`): it
        expects the stages of a named `template` (e.g. "chess") or of `expected` (a query
        whose workflow's calls carry the expected token sizes, or the proto workflow, whose
        stage ids are the names calls give). Idempotent on the id."""
        request = coordinator_pb2.OpenWorkflowRequest(
            workflow_id=workflow_id,
            tenant=tenant,
            slo_s=slo_s,
            slo_scale=slo_scale,
            template=template,
            idle_timeout_s=idle_timeout_s,
        )
        if isinstance(expected, Query):
            request.expected.CopyFrom(workflow_to_proto(expected.workflow))
        elif expected is not None:
            request.expected.CopyFrom(expected)
        return await self._unary(
            workflow_id, lambda stub: stub.OpenWorkflow(request, timeout=self.timeout_s)
        )

    async def run_call(
        self,
        workflow_id: str,
        stage: str,
        prompt: str,
        *,
        max_tokens: int = 0,
        input_tokens: int = 0,
        step: str = "",
        messages: Sequence[tuple[str, str] | workflow_pb2.ChatMessage] = (),
        options: workflow_pb2.CallOptions | None = None,
    ) -> AsyncGenerator[coordinator_pb2.RunCallResponse, None]:
        """Give one call of an open session's `stage` and stream its events: the first
        response names the call (``call_id``) and its stage deadline (``deadline_s``);
        the stream ends with the call's CALL_FINISHED (or the query's end). 0 tokens: the
        coordinator estimates the prompt's, and takes the expected call's max tokens. A chat
        request gives its `messages` (role, content, or whole `ChatMessage`s with tool calls)
        too, `prompt` being their rendering; `options` (sampling, stop, seed, tools,
        response_format) go to the engine, which honours them or fails the call naming one."""
        request = coordinator_pb2.RunCallRequest(
            workflow_id=workflow_id,
            stage=stage,
            call=workflow_pb2.LLMCall(
                step=step,
                prompt=prompt,
                input_tokens=input_tokens,
                output_tokens=max_tokens,
                messages=[
                    m
                    if isinstance(m, workflow_pb2.ChatMessage)
                    else workflow_pb2.ChatMessage(role=m[0], content=m[1])
                    for m in messages
                ],
                options=options,
            ),
        )
        async with aclosing(
            self._stream(workflow_id, lambda stub: stub.RunCall(request))
        ) as responses:
            async for response in responses:
                yield response

    async def close_workflow(self, workflow_id: str) -> coordinator_pb2.QueryInfo:
        """Close a session: the calls it expected and was not given are skipped; it ends
        when its last given call finishes."""
        request = coordinator_pb2.CloseWorkflowRequest(workflow_id=workflow_id)
        response = await self._unary(
            workflow_id, lambda stub: stub.CloseWorkflow(request, timeout=self.timeout_s)
        )
        return response.workflow

    # --------------------------------------------------------------------------- routing

    async def _unary(
        self, query_id: str | None, rpc: Callable[[_Stub], Awaitable[_Response]]
    ) -> _Response:
        """`rpc` sent where the router says for `query_id` (None: the default coordinator),
        again after each redirect or unanswered address, until one answers."""
        route = self.router.route(query_id)
        while True:
            try:
                return await rpc(self._stub_at(route.address))
            except grpc.aio.AioRpcError as exc:
                problem = route.reroute(self._error(exc, route.address), owner_of(exc))
                if problem is not None:
                    raise problem from None

    async def _stream(
        self,
        query_id: str,
        open_call: Callable[[_Stub], grpc.aio.UnaryStreamCall[Any, _Response]],
    ) -> AsyncGenerator[_Response, None]:
        """The responses of the stream `open_call` opens, routed as `_unary`: a redirect
        (or an unanswered address) arrives as its error before any response. An error once
        responses came surfaces as it is (resending would repeat them); when the coordinator
        went away, the router stops preferring it, so that a re-watch finds the successor."""
        route = self.router.route(query_id)
        while True:
            call = open_call(self._stub_at(route.address))
            answered = False
            try:
                async for response in call:
                    answered = True
                    yield response
                return
            except grpc.aio.AioRpcError as exc:
                error = self._error(exc, route.address)
                if answered:
                    if isinstance(error, CoordinatorUnavailableError):
                        # It served this stream and broke it: it went away (or lost its
                        # Redis), so a re-watch asks the others before it.
                        self.router.went_away(route.address)
                    raise error from None
                problem = route.reroute(error, owner_of(exc))
                if problem is not None:
                    raise problem from None
            finally:
                call.cancel()

    async def _events(
        self,
        query_id: str,
        open_call: Callable[[_Stub], grpc.aio.UnaryStreamCall[Any, _EventResponse]],
    ) -> AsyncGenerator[coordinator_pb2.QueryEvent, None]:
        """The events of a WatchQuery or RunQuery stream until the query ends (the stream
        closed then, not left to the garbage collector)."""
        async with aclosing(self._stream(query_id, open_call)) as responses:
            async for response in responses:
                yield response.event
                if is_terminal(response.event):
                    return

    # ---------------------------------------------------------------------------- errors

    def _error(self, exc: grpc.aio.AioRpcError, address: str) -> CoordinatorError:
        code = exc.code()
        details = exc.details() or ""
        channel = self._channels.get(address)
        connected = channel is not None and channel.get_state() not in _UNREACHABLE_STATES
        if code == grpc.StatusCode.CANCELLED:
            # Not this client's cancel (that raises asyncio.CancelledError): the coordinator
            # cancelled its calls as it stopped (a restart, a shard handed over).
            return CoordinatorUnavailableError(address, details)
        if code == grpc.StatusCode.UNAVAILABLE or (
            code == grpc.StatusCode.DEADLINE_EXCEEDED and not connected
        ):
            # Connected: the coordinator itself said UNAVAILABLE (it runs; its Redis or
            # its shard's takeover), which routing tells from a coordinator gone away.
            return CoordinatorUnavailableError(address, details, answered=connected)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" not in details:
            # (gRPC's own refusal of a request over the door's receive limit says "Received
            # message larger than max": no wait helps, so it is no overload.)
            return CoordinatorOverloadedError(address, details, _retry_after(exc))
        return CoordinatorError(address, code, details)


def _retry_after(exc: grpc.aio.AioRpcError) -> float | None:
    """The ``retry-after-s`` trailer of a refusal, None when absent or unreadable."""
    for key, value in exc.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                seconds = float(value)
            except (TypeError, ValueError):
                return None
            return seconds if seconds >= 0 else None
    return None
