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

from hexgen_service.telemetry import server_interceptors
from hexgen_service.tls import TlsFiles, server_credentials

__all__ = ["GrpcServer"]

log = logging.getLogger(__name__)


class GrpcServer:
    """A grpc.aio server with the standard health service and reflection.

    `register` receives the server to add servicers to; `service_names` are the fully
    qualified names reported by health checking and reflection. With `tls` (a certificate
    and key) it serves TLS only; `require_client_cert` makes it mutual (peers need a
    certificate signed by `tls.ca`). `interceptors` run after tracing (`AuthInterceptor`).
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
    ) -> None:
        self.address = address
        self.grace_s = grace_s
        self.service_names = tuple(service_names)
        self.server = grpc.aio.server(
            interceptors=[*server_interceptors(), *interceptors],
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
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

    async def start(self) -> None:
        await self.server.start()
        for name in (*self.service_names, ""):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("listening on %s (%s)", self.address, "TLS" if self.tls else "plaintext")

    async def stop(self) -> None:
        """Report NOT_SERVING, let in-flight RPCs finish for `grace_s`, then stop."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.grace_s)
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
