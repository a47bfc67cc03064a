"""How the Python client proves who it is and checks whom it talks to.

- An API key goes in every RPC's ``authorization: Bearer <key>`` metadata. It is the
  client's own (`api_key=`, else ``$HEXGEN_FLOW_API_KEY``), or, in a server that acts for
  many callers (the gateway), the one its current request carries: set `request_api_key`
  for the duration of that request and every RPC made meanwhile sends it.
- A CA file (`tls_ca=`, else ``$HEXGEN_FLOW_TLS_CA``) makes the channel TLS, verifying the
  coordinator's certificate against it. Without one the channel is plaintext.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from hexgen_wire.metadata import API_KEY_ENV, AUTH_METADATA
from hexgen_wire.tls import TlsFiles, ca_from_env, channel_credentials

__all__ = [
    "api_key_from_env",
    "api_key_interceptors",
    "open_channel",
    "request_api_key",
]

request_api_key: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "hexgen_request_api_key", default=None
)
"""The key of the request being served, sent in place of the client's own when set."""


def api_key_from_env(key: str | None) -> str | None:
    """`key`, else ``$HEXGEN_FLOW_API_KEY`` (empty counts as unset)."""
    return key or os.environ.get(API_KEY_ENV) or None


def _with_key(details: Any, key: str | None) -> Any:
    current = request_api_key.get() or key
    if not current:
        return details
    metadata = [(k, v) for k, v in (details.metadata or ()) if k != AUTH_METADATA]
    metadata.append((AUTH_METADATA, f"Bearer {current}"))
    return details._replace(metadata=metadata)


class _WithKey:
    def __init__(self, key: str | None) -> None:
        self.key = key


class _UnaryUnary(_WithKey, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_key(details, self.key), request)


class _UnaryStream(_WithKey, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_key(details, self.key), request)


class _StreamUnary(_WithKey, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_key(details, self.key), requests)


class _StreamStream(_WithKey, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_key(details, self.key), requests)


def api_key_interceptors(key: str | None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add the API key (`request_api_key`, else `key`) to every RPC's
    metadata: one per kind of RPC, as grpc.aio files an interceptor under one kind only."""
    return [_UnaryUnary(key), _UnaryStream(key), _StreamUnary(key), _StreamStream(key)]


def open_channel(
    address: str,
    *,
    api_key: str | None = None,
    tls_ca: str | Path | None = None,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """A channel to `address`: TLS when a CA is given (or in the environment), the API key
    (given, from the environment, or per request) on every RPC."""
    chain = [*interceptors, *api_key_interceptors(api_key_from_env(api_key))]
    ca = ca_from_env(str(tls_ca) if tls_ca else None)
    if ca is None:
        return grpc.aio.insecure_channel(address, interceptors=chain, options=list(options))
    return grpc.aio.secure_channel(
        address,
        channel_credentials(TlsFiles(ca=Path(ca))),
        interceptors=chain,
        options=list(options),
    )
