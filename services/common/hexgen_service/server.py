"""gRPC server bootstrap shared by every service: health checking, reflection, tracing
interceptors and a graceful shutdown that flips health to NOT_SERVING first."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hexgen_service.heap import watch_heap
from hexgen_service.telemetry import server_interceptors
from hexgen_service.tls import TlsFiles, server_credentials

__all__ = ["DEFAULT_MAX_RECEIVE_BYTES", "MAX_PENDING_CALLS", "GrpcServer"]

DEFAULT_MAX_RECEIVE_BYTES = 16 << 20
"""The largest message a service reads unless told otherwise (the coordinator sizes its
doors to its own limits: `hexgen_coordinator.edge.request_limits`)."""

log = logging.getLogger(__name__)

MAX_PENDING_CALLS = 10_000
"""Calls a server holds that arrived but were not accepted yet; beyond, gRPC core refuses
new ones (CANCELLED, unseen by the service)."""


class GrpcServer:
    """A grpc.aio server with the standard health service and reflection.

    `register` receives the server to add servicers to; `service_names` are the fully
    qualified names reported by health checking and reflection. With `tls` (a certificate
    and key) it serves TLS only; `require_client_cert` makes it mutual (peers need a
    certificate signed by `tls.ca`). `interceptors` run after tracing (`AuthInterceptor`).
    `max_receive_bytes`: the largest message it reads; gRPC refuses a larger one
    (RESOURCE_EXHAUSTED, "Received message larger than max") from its length prefix, before
    reading it, so a flood of huge requests costs neither memory nor parsing.
    """

    def __init__(
        self,
        address: str,
        register: Callable[[grpc.aio.Server], None],
        service_names: Iterable[str],
        *,
        grace_s: float = 2.0,
        tls: TlsFiles | None = None,
        require_client_cert: bool = False,
        interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
        max_receive_bytes: int | None = None,
    ) -> None:
        self.address = address
        self.grace_s = grace_s
        self.service_names = tuple(service_names)
        self.server = grpc.aio.server(
            interceptors=[*server_interceptors(), *interceptors],
            options=[
                ("grpc.so_reuseport", 0),
                # Calls that arrived but that the asyncio server has not accepted yet:
                # gRPC core refuses them at random above 1,000 and all above 3,000 (its
                # defaults), with CANCELLED and before any handler or log sees them. A
                # burst of streams (3,000 WatchQuery at once) is accepted more slowly
                # than it arrives; let the backlog hold it (docs/mesh.md, "Watch limits").
                ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
                (
                    "grpc.max_receive_message_length",
                    max_receive_bytes or DEFAULT_MAX_RECEIVE_BYTES,
                ),
            ],
        )
        register(self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        self.tls = tls if tls is not None and tls.cert is not None else None
        if self.tls is not None:
            credentials = server_credentials(self.tls, require_client_cert=require_client_cert)
            self.port = self.server.add_secure_port(address, credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        self._stopped = asyncio.Event()
        self._trimmer: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.server.start()
        # What a burst of large requests leaves in the allocator goes back to the system.
        self._trimmer = watch_heap()
        for name in (*self.service_names, ""):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("listening on %s (%s)", self.address, "TLS" if self.tls else "plaintext")

    async def stop(self) -> None:
        """Report NOT_SERVING, let in-flight RPCs finish for `grace_s`, then stop."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.grace_s)
        if self._trimmer is not None:
            self._trimmer.cancel()
        self._stopped.set()

    async def serve_until_signalled(self, on_stop: Callable[[], object] | None = None) -> None:
        """Run until SIGTERM or SIGINT, then stop gracefully."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        if on_stop is not None:
            result = on_stop()
            if asyncio.iscoroutine(result):
                await result
        await self.stop()
