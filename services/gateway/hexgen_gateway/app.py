"""The OpenAI-compatible HTTP API (FastAPI on uvicorn), in front of the coordinator.

- ``POST /v1/chat/completions``, ``POST /v1/completions``: a request becomes a call of a
  workflow session through `hexgen_gateway.mapping`; with
  ``"stream": true`` the answer is server-sent events (``data: {chunk}``, ending with
  ``data: [DONE]``), chunks in OpenAI's format;
- ``GET /v1/models``: the models of the cluster's instances (ClusterStatus);
  ``GET /v1/models/{id}``: one of them, 404 (``model_not_found``) for another;
- ``GET /health``: 200 when the coordinator answers ClusterStatus, 503 otherwise;
- ``GET /metrics``: the gateway's own Prometheus metrics (`hexgen_gateway.metrics`:
  requests by route and status, 429s, latency, finish reasons; ``--no-metrics``: 404);
- ``POST /v1/workflows/{id}/close``: close a workflow (HexGen-Flow's own): it ends when
  its last call finishes, instead of after the coordinator's idle timeout.

Every request's ``Authorization: Bearer <key>`` is the caller's API key: the RPCs made for
the request carry it to the coordinator (`hexgen_client.credentials.request_api_key`), which
checks it; the gateway lends nobody a key of its own. The coordinator's UNAUTHENTICATED is
401, its PERMISSION_DENIED 403. Its own key (``--api-key-file``), if any, serves only
``/health``.

Every answer to a completion carries ``X-Hexgen-Workflow`` and ``X-Hexgen-Query`` (the
workflow's id), ``X-Hexgen-Call`` (the call's id) and ``X-Hexgen-Deadline-S`` (the call's
stage deadline on the cluster clock, from the time the workflow has left); an error from
the coordinator's side of a request (its call refused, its workflow failed) carries the
first two. Errors are OpenAI's error bodies (`hexgen_gateway.errors`), a bug's too (500,
``server_error``; its traceback is logged). A body over ``--max-body-bytes`` is 413 before
it is read; a body that is no JSON, or JSON nested too deeply, is 400 (``invalid_json``).
Each completion request is a span (kind SERVER, ``POST /v1/chat/completions``) with the
GenAI attributes of the call (`hexgen_service.genai`). A workflow is one trace whatever
the client sends: the coordinator gives the traceparent of the workflow's root span when
the gateway opens the workflow or gives it a call (QueryInfo, RunCall's first answer), and
the span of each later request of the workflow is its child. A client's ``traceparent`` is
the parent of the first request's span (the workflow's trace is then the client's), and
of a later request's when it is in the workflow's trace; one in another trace is a link.
(A gateway that sees a running workflow for the first time, after a restart or behind a
load balancer, learns its trace only from that request's answer: that one span is linked
to the workflow's root, the later ones are its children.) The RPCs to the coordinator
carry the span's context in their metadata without spans of their own
(`hexgen_service.telemetry.propagating_interceptors`): the coordinator's server span of the
RPC is the request span's child.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.context import Context
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hexgen_api.v1 import coordinator_pb2
from hexgen_client.client import CoordinatorClient
from hexgen_client.credentials import request_api_key
from hexgen_client.errors import CoordinatorError
from hexgen_gateway.callers import CallerKey, caller_id
from hexgen_gateway.config import GatewayConfig
from hexgen_gateway.errors import OpenAIError, bad_request, from_coordinator
from hexgen_gateway.mapping import (
    HEADER_CALL,
    HEADER_DEADLINE,
    HEADER_QUERY,
    HEADER_WORKFLOW,
    StartedCall,
    WorkflowContext,
    WorkflowMapper,
)
from hexgen_gateway.metrics import GatewayMetrics, RequestMetrics
from hexgen_gateway.openai_api import (
    ParsedRequest,
    chunk,
    completion_body,
    new_id,
    parse_body,
    parse_chat,
    parse_completion,
    usage,
)
from hexgen_service import genai
from hexgen_service.auth import read_secret
from hexgen_service.telemetry import (
    context_from_traceparent,
    propagating_interceptors,
    setup_tracing,
)

__all__ = ["SERVICE_NAME", "Gateway", "create_app"]

log = logging.getLogger(__name__)

SERVICE_NAME = "hexgen-gateway"
HEALTH_TIMEOUT_S = 2.0
OWNER = "hexgen-flow"
_STATUS_KEPT = 1024
"""Callers whose ClusterStatus answer is reused (the most recent ones)."""
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class Gateway:
    """The app's state: the coordinator's client, the request mapper, the models cache."""

    def __init__(self, config: GatewayConfig, client: CoordinatorClient | None = None) -> None:
        self.config = config
        self.tracer = setup_tracing(SERVICE_NAME)
        # No key of its own: every RPC carries the key of the request it is made for.
        self.client = client or CoordinatorClient(
            config.coordinator,
            timeout_s=config.rpc_timeout_s,
            interceptors=propagating_interceptors(),
            tls_ca=config.tls_ca,
        )
        self.health_client: CoordinatorClient | None = None
        """A client with the gateway's own key (``--api-key-file``), for ``/health`` only."""
        if config.api_key_file:
            self.health_client = CoordinatorClient(
                config.coordinator,
                timeout_s=HEALTH_TIMEOUT_S,
                api_key=read_secret(config.api_key_file, "--api-key-file"),
                tls_ca=config.tls_ca,
            )
        self.mapper = WorkflowMapper(
            self.client,
            request_timeout_s=config.request_timeout_s,
            session_idle_s=config.session_idle_s,
        )
        self.metrics = GatewayMetrics()
        self._status: OrderedDict[str, tuple[float, coordinator_pb2.ClusterStatusResponse]] = (
            OrderedDict()
        )
        """ClusterStatus answers by caller (`caller_id`): one caller's is never another's."""
        self._background: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        await self.client.close()
        if self.health_client is not None:
            await self.health_client.close()

    # ----------------------------------------------------------------------- cluster

    async def status(self, *, fresh: bool = False) -> coordinator_pb2.ClusterStatusResponse:
        """ClusterStatus with the caller's key, reused for `models_ttl_s` for the same
        caller; `OpenAIError` 503 when unreachable, 401/403 when the key is refused."""
        now = time.monotonic()
        caller = caller_id()
        cached = self._status.get(caller)
        if fresh or cached is None or now - cached[0] > self.config.models_ttl_s:
            try:
                status = await self.client.status()
            except CoordinatorError as exc:
                self._status.pop(caller, None)
                raise from_coordinator(exc, {}) from None
            cached = (now, status)
            self._status[caller] = cached
            while len(self._status) > _STATUS_KEPT:
                self._status.popitem(last=False)
        self._status.move_to_end(caller)
        return cached[1]

    async def models(self) -> list[str]:
        """The instances' models, each once, in slot order."""
        status = await self.status()
        names: list[str] = []
        for inst in sorted(status.instances, key=lambda i: i.index):
            if inst.model and inst.model not in names:
                names.append(inst.model)
        return names

    async def check_model(self, model: str | None) -> None:
        """404 when `model` is given and no instance of the cluster serves it. A caller
        whose key may not see the cluster (403) is not checked here: the coordinator
        decides about its request."""
        if model is None:
            return
        try:
            models = await self.models()
        except OpenAIError as exc:
            if exc.status == 403:
                return
            raise
        if models and model not in models:
            raise OpenAIError(
                404,
                f"the model {model!r} does not exist: the cluster serves {', '.join(models)}",
                param="model",
                code="model_not_found",
            )

    async def model_of(self, asked: str | None, instance: str = "") -> str:
        """The model to name in an answer: the one asked for, else `instance`'s, else the
        cluster's first; ``hexgen-flow`` when the coordinator cannot say."""
        if asked:
            return asked
        try:
            status = await self.status()
        except OpenAIError:  # the answer is ready; its model name is not worth failing it
            return OWNER
        ordered = sorted(status.instances, key=lambda i: (i.name != instance, i.index))
        return next((inst.model for inst in ordered if inst.model), OWNER)

    # ---------------------------------------------------------------------- requests

    async def read_body(self, request: Request) -> bytes:
        """The request's body; 413 when its ``Content-Length`` says it is larger than
        `max_body_bytes` (before any of it is read) or as soon as it grows past it; 400 when
        the client goes away before it is sent (nobody reads that answer: nothing to log)."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "").strip()
        if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
            raise _too_large(limit, f"this one is {declared} bytes")
        pieces: list[bytes] = []
        size = 0
        try:
            async for piece in request.stream():
                size += len(piece)
                if size > limit:
                    raise _too_large(limit, "this one is larger")
                pieces.append(piece)
        except ClientDisconnect:
            raise bad_request(
                f"the client went away after {size} bytes of its body", None, "client_disconnected"
            ) from None
        return b"".join(pieces)

    async def complete(self, request: Request, chat: bool) -> Response:
        body = parse_body(await self.read_body(request))
        default = self.config.default_max_tokens
        parsed = parse_chat(body, default) if chat else parse_completion(body, default)
        context = WorkflowContext.from_headers(request.headers, self.config.default_stage)
        parent, links = self._parent(request.headers.get("traceparent", ""), context)
        sampling, json_output = genai.proto_sampling(parsed.call.options)
        attributes = genai.request_attributes(
            operation=genai.operation_of(parsed.chat),
            provider=genai.PROVIDER,
            model=parsed.model or "",
            max_tokens=parsed.call.output_tokens,
            sampling=sampling,
            json_output=json_output,
            conversation_id=context.workflow,
        )
        attributes.update(
            {
                "http.request.method": "POST",
                "http.route": request.url.path,
                "hexgen.workflow": context.workflow,
                "hexgen.stage": context.stage,
                "hexgen.template": context.template or "",
                "hexgen.stream": parsed.stream,
            }
        )
        span = self.tracer.start_span(
            f"POST {request.url.path}",
            context=parent,
            kind=trace.SpanKind.SERVER,
            links=links,
            attributes=attributes,
        )
        try:
            with trace.use_span(span, end_on_exit=False):  # its RPCs are the span's children
                await self.check_model(parsed.model)
        except BaseException as exc:
            if isinstance(exc, OpenAIError):
                _failed(span, exc)
            span.end()
            raise
        named = {HEADER_WORKFLOW: context.workflow, HEADER_QUERY: context.workflow}
        try:
            with trace.use_span(span, end_on_exit=False):
                started = await self.mapper.start(context, parsed.call)
        except BaseException as exc:
            if isinstance(exc, OpenAIError):
                _failed(span, exc)
                exc.headers.update(named)  # so that the caller can find the workflow
            span.end()
            raise
        span.set_attribute("hexgen.call_id", started.call_id)
        _link_to_workflow(span, started.traceparent)
        headers = {
            HEADER_WORKFLOW: context.workflow,
            HEADER_QUERY: started.query_id,
            HEADER_CALL: started.call_id,
            HEADER_DEADLINE: f"{started.deadline_s:.3f}",
        }
        if parsed.stream:
            return StreamingResponse(
                self._events(parsed, started, span),
                media_type="text/event-stream",
                headers={**headers, "Cache-Control": "no-cache"},
            )
        try:
            text = await started.collect()
        except BaseException as exc:
            if isinstance(exc, OpenAIError):
                _failed(span, exc)
                exc.headers.update(named)
            else:  # cancelled: the query is not wanted any more
                self._cancel_later(started)
            span.end()
            raise
        with trace.use_span(span, end_on_exit=False):
            model = await self.model_of(parsed.model, started.instance)
        use = usage(started.prompt_tokens, started.completion_tokens)
        self._finished(span, started, model)
        span.end()
        body = completion_body(
            parsed,
            new_id(parsed),
            model,
            text,
            use,
            started.finish_reason or "stop",
            started.tool_calls,
        )
        return JSONResponse(body, headers=headers)

    def _parent(
        self, traceparent: str, context: WorkflowContext
    ) -> tuple[Context | None, list[trace.Link]]:
        """The parent of a request's span and its links (see the module docstring): the
        client's ``traceparent`` where the workflow's trace is not known yet or it is in that
        trace; else the workflow's root span, linked to the client's span if it sent one."""
        client = context_from_traceparent(traceparent)
        root = context_from_traceparent(self.mapper.trace_of(context))
        if root is None:
            return client, []
        asked = trace.get_current_span(client).get_span_context() if client is not None else None
        if asked is None or not asked.is_valid:
            return root, []
        if asked.trace_id == trace.get_current_span(root).get_span_context().trace_id:
            return client, []
        return root, [trace.Link(asked)]

    def _finished(self, span: trace.Span, started: StartedCall, model: str) -> None:
        """A call's answer is complete: its usage and finish reason on the request's span
        and in the metrics."""
        reason = started.finish_reason or "stop"
        span.set_attributes(
            genai.response_attributes(
                model=model,
                finish_reason=reason,
                input_tokens=started.prompt_tokens,
                output_tokens=started.completion_tokens,
            )
        )
        span.set_attribute("http.response.status_code", 200)
        self.metrics.finished(reason, started.prompt_tokens, started.completion_tokens)

    async def _events(
        self, parsed: ParsedRequest, started: StartedCall, span: trace.Span
    ) -> AsyncIterator[str]:
        ident = new_id(parsed)
        finished = False
        try:
            with trace.use_span(span, end_on_exit=False):
                model = await self.model_of(parsed.model)
            yield _sse(chunk(parsed, ident, model, text="" if parsed.chat else None, role=True))
            async for piece in started.deltas():
                yield _sse(chunk(parsed, ident, model, text=piece))
            if started.tool_calls and parsed.chat:
                yield _sse(chunk(parsed, ident, model, tool_calls=started.tool_calls))
            yield _sse(chunk(parsed, ident, model, finish=started.finish_reason or "stop"))
            self._finished(span, started, model)
            if parsed.include_usage:
                use = usage(started.prompt_tokens, started.completion_tokens)
                yield _sse(chunk(parsed, ident, model, use=use))
            finished = True
        except OpenAIError as exc:  # the status line is sent: the error is a chunk
            _failed(span, exc)
            finished = True
            yield _sse(exc.body())
        finally:
            if not finished:  # the client went away: nobody wants the answer any more
                self._cancel_later(started)
            span.end()
        yield "data: [DONE]\n\n"

    def _cancel_later(self, started: StartedCall) -> None:
        task = asyncio.get_running_loop().create_task(started.cancel())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close_workflow(self, workflow_id: str) -> Response:
        """Close a workflow: the stages it expected and was not given are skipped; it ends
        when its last call finishes. Answers its state (HexGen-Flow's own endpoint)."""
        info = await self.mapper.close(workflow_id)
        return JSONResponse(
            {
                "id": info.query_id,
                "object": "hexgen.workflow",
                "state": coordinator_pb2.QueryState.Name(info.state)
                .removeprefix("QUERY_STATE_")
                .lower(),
                "slo_s": info.slo_s,
                "deadline_s": info.deadline_s,
                "arrival_s": info.arrival_s,
                "finished_s": info.finished_s,
                "calls_done": info.calls_done,
                "calls_total": info.calls_total,
            },
            headers={HEADER_WORKFLOW: info.query_id},
        )

    async def health(self) -> Response:
        """200 when the coordinator answers (asked with the gateway's own key, else the
        caller's); a refusal of the key is an answer too (200 without the instances)."""
        try:
            status = await asyncio.wait_for(self._health_status(), HEALTH_TIMEOUT_S)
        except CoordinatorError as exc:
            if exc.code in _REFUSED:
                return JSONResponse(
                    {
                        "status": "ok",
                        "coordinator": self.config.coordinator,
                        "detail": "the coordinator answers; it shows its instances only to "
                        f"a key that may see them ({exc.code.name})",
                    }
                )
            return self._unhealthy(exc)
        except TimeoutError as exc:
            return self._unhealthy(exc)
        connected = sum(inst.connected for inst in status.instances)
        return JSONResponse(
            {
                "status": "ok",
                "coordinator": self.config.coordinator,
                "instances": len(status.instances),
                "connected": connected,
            }
        )

    async def _health_status(self) -> coordinator_pb2.ClusterStatusResponse:
        if self.health_client is None:
            return await self.client.status()
        token = request_api_key.set(None)  # the gateway's own key, not the caller's
        try:
            return await self.health_client.status()
        finally:
            request_api_key.reset(token)

    def _unhealthy(self, exc: Exception) -> Response:
        error = OpenAIError(
            503,
            f"the coordinator at {self.config.coordinator} does not answer: {exc}",
            type="service_unavailable",
            code="unavailable",
        )
        return JSONResponse(error.body(), status_code=503)

    async def models_response(self) -> Response:
        models = await self.models()
        return JSONResponse({"object": "list", "data": [_model(name) for name in models]})

    async def model_response(self, model_id: str) -> Response:
        """One model of the cluster (``GET /v1/models/{id}``); 404 for any other."""
        models = await self.models()
        if model_id not in models:
            raise OpenAIError(
                404,
                f"the model {model_id!r} does not exist: the cluster serves "
                f"{', '.join(models) or 'no model yet'}",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(_model(model_id))


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": OWNER}


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _too_large(limit: int, which: str) -> OpenAIError:
    return OpenAIError(
        413,
        f"the gateway reads a body of at most {limit} bytes (--max-body-bytes): {which}",
        code="request_too_large",
    )


def _link_to_workflow(span: trace.Span, traceparent: str) -> None:
    """A request span outside its workflow's trace (the gateway learnt the trace from this
    request's answer) links to the workflow's root span."""
    root = context_from_traceparent(traceparent)
    if root is None:
        return
    workflow = trace.get_current_span(root).get_span_context()
    if workflow.is_valid and workflow.trace_id != span.get_span_context().trace_id:
        span.add_link(workflow, {"hexgen.link": "workflow root"})


def _failed(span: trace.Span, exc: OpenAIError) -> None:
    span.set_attribute("http.response.status_code", exc.status)
    span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))


def create_app(config: GatewayConfig | None = None) -> FastAPI:
    """The ASGI app; the coordinator's channel is opened on first use and closed at
    shutdown."""
    gateway = Gateway(config or GatewayConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await gateway.close()

    app = FastAPI(
        title="HexGen-Flow gateway",
        description="OpenAI-compatible API over the HexGen-Flow coordinator",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        # FastAPI's own HTTP span (recent releases trace every request once a tracer
        # provider is set) would be a second `POST /v1/...` span per request, parented to
        # the client's traceparent and not to the workflow: the gateway's span is the
        # request's. (An older FastAPI keeps this unknown argument as an extra.)
        telemetry={"tracing": False},
    )
    app.state.gateway = gateway
    app.add_middleware(CallerKey)
    app.add_middleware(RequestMetrics, metrics=gateway.metrics)

    async def openai_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpenAIError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        error = OpenAIError(exc.status_code, str(exc.detail), code=None)
        return JSONResponse(error.body(), status_code=exc.status_code)

    async def server_error(request: Request, exc: Exception) -> Response:
        # A bug, not the client's doing: Starlette logs its traceback after this answer.
        error = OpenAIError(500, f"the gateway failed: {type(exc).__name__}", type="server_error")
        return JSONResponse(error.body(), status_code=500)

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, server_error)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gateway.complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gateway.complete(request, chat=False)

    @app.get("/v1/models")
    async def models() -> Response:
        return await gateway.models_response()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return await gateway.model_response(model_id)

    if gateway.config.metrics:

        @app.get("/metrics")
        async def metrics() -> Response:
            body, content_type = gateway.metrics.exposition()
            return Response(body, media_type=content_type)

    @app.get("/health")
    async def health() -> Response:
        return await gateway.health()

    @app.post("/v1/workflows/{workflow_id:path}/close")
    async def close_workflow(workflow_id: str) -> Response:
        return await gateway.close_workflow(workflow_id)

    return app
