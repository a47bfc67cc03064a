"""`CoordinatorClient`: an asyncio wrapper over the generated CoordinatorService stubs.

It takes and returns the core's `Query` on the way in (converted by
`hexgen_service.convert`) and the API's own messages on the way out (`QueryEvent`,
`QueryInfo`, `ClusterStatusResponse`), and turns gRPC errors into `CoordinatorError` (or
`CoordinatorUnavailableError` when nothing answers), so callers see one exception type::

    async with CoordinatorClient() as client:
        async for event in client.run(query):
            print(event.kind, event.time_s)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from hexgen_api.v1 import coordinator_pb2, coordinator_pb2_grpc, workflow_pb2
from hexgen_client.addresses import DEFAULT_COORDINATOR
from hexgen_client.convert import is_terminal, submit_request
from hexgen_client.credentials import open_channel
from hexgen_client.errors import (
    CoordinatorError,
    CoordinatorOverloadedError,
    CoordinatorUnavailableError,
)
from hexgen_flow.workload import Query
from hexgen_service.convert import workflow_to_proto
from hexgen_service.errors import RETRY_AFTER_KEY

__all__ = ["RETRY_AFTER_KEY", "CoordinatorClient"]

_UNREACHABLE_STATES = (
    grpc.ChannelConnectivity.IDLE,
    grpc.ChannelConnectivity.CONNECTING,
    grpc.ChannelConnectivity.TRANSIENT_FAILURE,
    grpc.ChannelConnectivity.SHUTDOWN,
)


class CoordinatorClient:
    """One channel to the coordinator at `address`; use it as an async context manager (or
    call `close`). The channel is opened on first use, inside the running event loop."""

    def __init__(
        self,
        address: str = DEFAULT_COORDINATOR,
        *,
        timeout_s: float = 10.0,
        interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
        api_key: str | None = None,
        tls_ca: str | Path | None = None,
    ) -> None:
        self.address = address
        self.api_key = api_key
        """Sent as ``authorization: Bearer`` on every RPC; None: ``$HEXGEN_FLOW_API_KEY``."""
        self.tls_ca = tls_ca
        """The CA to verify a TLS coordinator with; None: ``$HEXGEN_FLOW_TLS_CA``, else
        plaintext."""
        self.timeout_s = timeout_s
        """Deadline of every unary RPC (streams have none: a query may run for minutes)."""
        self._interceptors = list(interceptors) if interceptors else None
        self._channel: grpc.aio.Channel | None = None
        self._stub: coordinator_pb2_grpc.CoordinatorServiceAsyncStub | None = None

    # ------------------------------------------------------------------------- lifecycle

    @property
    def stub(self) -> coordinator_pb2_grpc.CoordinatorServiceAsyncStub:
        if self._stub is None:
            self._channel = open_channel(
                self.address,
                api_key=self.api_key,
                tls_ca=self.tls_ca,
                interceptors=self._interceptors or (),
            )
            self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = None
        self._stub = None

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
        try:
            return await self.stub.SubmitQuery(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None

    async def watch(self, query_id: str) -> AsyncIterator[coordinator_pb2.QueryEvent]:
        """The query's events, past ones first, until it succeeds, fails or is cancelled."""
        call = self.stub.WatchQuery(coordinator_pb2.WatchQueryRequest(query_id=query_id))
        async for event in self._until_terminal(call):
            yield event

    async def run(
        self,
        query: Query,
        *,
        slo_scale: float | None = None,
        prompts: Sequence[Sequence[str]] | None = None,
    ) -> AsyncIterator[coordinator_pb2.QueryEvent]:
        """Submit `query` and stream its events until it ends (RunQuery); `prompts` as for
        `submit`."""
        request = coordinator_pb2.RunQueryRequest(query=submit_request(query, slo_scale, prompts))
        async for event in self._until_terminal(self.stub.RunQuery(request)):
            yield event

    async def _until_terminal(
        self,
        call: grpc.aio.UnaryStreamCall[Any, Any],
    ) -> AsyncIterator[coordinator_pb2.QueryEvent]:
        """The events of a WatchQuery or RunQuery stream until the query ends."""
        try:
            async for response in call:
                yield response.event
                if is_terminal(response.event):
                    return
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        finally:
            call.cancel()

    async def cancel(self, query_id: str) -> coordinator_pb2.QueryInfo:
        request = coordinator_pb2.CancelQueryRequest(query_id=query_id)
        try:
            response = await self.stub.CancelQuery(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        return response.query

    async def get(self, query_id: str) -> coordinator_pb2.GetQueryResponse:
        """The query's state (`.query`) and its events so far (`.events`)."""
        request = coordinator_pb2.GetQueryRequest(query_id=query_id)
        try:
            return await self.stub.GetQuery(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None

    async def status(self) -> coordinator_pb2.ClusterStatusResponse:
        try:
            return await self.stub.ClusterStatus(
                coordinator_pb2.ClusterStatusRequest(), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None

    async def set_alpha(self, alpha: float, reason: str = "") -> coordinator_pb2.SetAlphaResponse:
        request = coordinator_pb2.SetAlphaRequest(alpha=alpha, reason=reason)
        try:
            return await self.stub.SetAlpha(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None

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
        try:
            return await self.stub.OpenWorkflow(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None

    async def run_call(
        self,
        workflow_id: str,
        stage: str,
        prompt: str,
        *,
        max_tokens: int = 0,
        input_tokens: int = 0,
        step: str = "",
        messages: Sequence[tuple[str, str]] = (),
    ) -> AsyncGenerator[coordinator_pb2.RunCallResponse, None]:
        """Give one call of an open session's `stage` and stream its events: the first
        response names the call (``call_id``) and its stage deadline (``deadline_s``);
        the stream ends with the call's CALL_FINISHED (or the query's end). 0 tokens: the
        coordinator estimates the prompt's, and takes the expected call's max tokens. A chat
        request gives its `messages` (role, content) too, `prompt` being their rendering."""
        request = coordinator_pb2.RunCallRequest(
            workflow_id=workflow_id,
            stage=stage,
            call=workflow_pb2.LLMCall(
                step=step,
                prompt=prompt,
                input_tokens=input_tokens,
                output_tokens=max_tokens,
                messages=[workflow_pb2.ChatMessage(role=r, content=c) for r, c in messages],
            ),
        )
        call = self.stub.RunCall(request)
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        finally:
            call.cancel()

    async def close_workflow(self, workflow_id: str) -> coordinator_pb2.QueryInfo:
        """Close a session: the calls it expected and was not given are skipped; it ends
        when its last given call finishes."""
        request = coordinator_pb2.CloseWorkflowRequest(workflow_id=workflow_id)
        try:
            response = await self.stub.CloseWorkflow(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        return response.workflow

    # ---------------------------------------------------------------------------- errors

    def _error(self, exc: grpc.aio.AioRpcError) -> CoordinatorError:
        code = exc.code()
        details = exc.details() or ""
        unreachable = code == grpc.StatusCode.UNAVAILABLE or (
            code == grpc.StatusCode.DEADLINE_EXCEEDED
            and self._channel is not None
            and self._channel.get_state() in _UNREACHABLE_STATES
        )
        if unreachable:
            return CoordinatorUnavailableError(self.address, details)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return CoordinatorOverloadedError(self.address, details, _retry_after(exc))
        return CoordinatorError(self.address, code, details)


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
