"""Who a request comes from: its ``Authorization: Bearer <key>``, passed on to the
coordinator with every RPC made for the request (`CallerKey`), and a digest of it that keys
what the gateway remembers per caller (`caller_id`)."""

from __future__ import annotations

import hashlib

from starlette.types import ASGIApp, Receive, Scope, Send

from hexgen_client.credentials import request_api_key
from hexgen_service.auth import bearer_key

__all__ = ["CallerKey", "caller_id"]


def caller_id() -> str:
    """Who the current request is, for the gateway's per-caller memory: a digest of its
    key (never the key itself); ``""`` without one."""
    key = request_api_key.get()
    return hashlib.sha256(key.encode()).hexdigest()[:32] if key else ""


class CallerKey:
    """ASGI middleware: the request's bearer key is `request_api_key` while it is served
    (streamed answers included), so every RPC made for it carries the caller's key."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        authorization = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        token = request_api_key.set(bearer_key(authorization))
        try:
            await self.app(scope, receive, send)
        finally:
            request_api_key.reset(token)
