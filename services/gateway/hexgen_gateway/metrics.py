"""The gateway's own Prometheus metrics, served at ``GET /metrics`` on the API's port
(prometheus_client, a registry of the gateway's own, as every service of the mesh keeps):

| metric | labels | what |
|---|---|---|
| ``hexgen_flow_gateway_requests_total`` | route, method, status | answers, by route template |
| ``hexgen_flow_gateway_rate_limited_total`` | route | 429s (the coordinator refused) |
| ``hexgen_flow_gateway_request_seconds`` | route | request to the answer's last byte |
| ``hexgen_flow_gateway_finish_reasons_total`` | reason | completions by finish_reason |
| ``hexgen_flow_gateway_tokens_total`` | kind (prompt, completion) | tokens, as engines count |

``route`` is the route's template (``/v1/chat/completions``, ``/v1/models/{model_id}``), or
``other`` for a path no route serves, so that a client cannot grow the label's values. A
streamed answer's latency runs to its last chunk. A request whose client went away before
its answer began is counted with status ``499`` (nginx's "client closed request").
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from prometheus_client.registry import CollectorRegistry
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["GatewayMetrics", "RequestMetrics"]

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_CLIENT_CLOSED = 499


class GatewayMetrics:
    """Every metric of one gateway, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "hexgen_flow_gateway_requests",
            "HTTP answers, by route template, method and status.",
            ["route", "method", "status"],
            registry=r,
        )
        self.rate_limited = Counter(
            "hexgen_flow_gateway_rate_limited",
            "Requests answered 429 (the coordinator refused them for now).",
            ["route"],
            registry=r,
        )
        self.latency = Histogram(
            "hexgen_flow_gateway_request_seconds",
            "Wall seconds from a request to its answer's last byte (a stream's last chunk).",
            ["route"],
            buckets=_SECONDS,
            registry=r,
        )
        self.finish_reasons = Counter(
            "hexgen_flow_gateway_finish_reasons",
            "Completions by finish_reason (stop, length, tool_calls), as engines say.",
            ["reason"],
            registry=r,
        )
        self.tokens = Counter(
            "hexgen_flow_gateway_tokens",
            "Tokens of the completions answered, as engines counted them (prompt, completion).",
            ["kind"],
            registry=r,
        )

    def answered(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        if status == 429:
            self.rate_limited.labels(route).inc()
        self.latency.labels(route).observe(max(seconds, 0.0))

    def finished(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.finish_reasons.labels(reason).inc()
        self.tokens.labels("prompt").inc(max(prompt_tokens, 0))
        self.tokens.labels("completion").inc(max(completion_tokens, 0))

    def exposition(self) -> tuple[bytes, str]:
        """The Prometheus text of the metrics, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestMetrics:
    """ASGI middleware: every HTTP answer counted by its route's template and status, and
    timed to its last byte."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = _CLIENT_CLOSED

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except BaseException:
            if status == _CLIENT_CLOSED:
                status = 500
            raise
        finally:
            self.metrics.answered(
                _route(scope), str(scope.get("method", "")), status, time.perf_counter() - start
            )


def _route(scope: Scope) -> str:
    """The template of the route that served `scope`, else ``other``."""
    route: Any = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str):
        return path
    app = scope.get("app")
    for candidate in getattr(getattr(app, "router", None), "routes", ()):
        match, _ = candidate.matches(scope)
        if match == Match.FULL:
            return str(getattr(candidate, "path", "other"))
    return "other"
