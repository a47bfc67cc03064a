"""The coordinator's service edge (`hexgen_coordinator.edge.statuses`) on a real gRPC server:
a bug reaches the client as INTERNAL with an incident id, never with its text, and the log
keeps the traceback under that id."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from hexgen_coordinator.edge import statuses
from hexgen_launch.processes import free_port
from hexgen_service.errors import InvalidFieldError
from hexgen_service.server import GrpcServer


async def _buggy(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    async with statuses(context):
        raise RuntimeError("tenant b's prompt: the secret plan")
    raise AssertionError("unreachable")


async def test_a_bug_is_internal_with_an_incident_id_and_no_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    address = f"127.0.0.1:{free_port()}"

    def register(server: grpc.aio.Server) -> None:
        handler: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(_buggy)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Buggy", {"Call": handler}),)
        )

    server = GrpcServer(address, register, ["test.Buggy"], grace_s=0.1)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
                "/test.Buggy/Call"
            )
            with caplog.at_level(logging.ERROR), pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(b"", timeout=10)
    finally:
        await server.stop()
    error = caught.value
    details = error.details() or ""
    assert error.code() == grpc.StatusCode.INTERNAL
    assert details.startswith("internal error ") and "secret" not in details, details
    incident = details.split()[2].rstrip(":")
    logged = [r for r in caplog.records if incident in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the traceback, under that id
    assert "the secret plan" in str(logged[0].exc_info[1])


# ------------------------------------------------------------- a client that left first


class _Late:
    """Handlers whose work outlives their client: each answers its first response (the
    stream) or nothing (the unary call), then waits for `go` shielded from cancellation, as
    the coordinator's Redis writes are, and answers after the client has left."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.ended: list[str] = []

    async def _work(self) -> None:
        try:
            await asyncio.shield(self.go.wait())
        except asyncio.CancelledError:
            await self.go.wait()  # the shielded work goes on

    async def stream(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        try:
            async with statuses(context):
                yield b"first"
                await self._work()
                await context.write(b"second")  # the client is gone
        finally:
            self.ended.append("stream")

    async def refused(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        try:
            async with statuses(context):
                await self._work()
                raise InvalidFieldError("slo_s", "must be positive")  # its status: too late
            raise AssertionError("unreachable")
        finally:
            self.ended.append("refused")

    async def fine(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        return b"ok"


async def test_a_client_that_left_first_is_no_bug_and_gets_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A stream's client cancels after its first response; a unary call's deadline passes.
    # The handlers then send (a response, an INVALID_ARGUMENT): gRPC refuses both sends
    # (ExecuteBatchError), which `statuses` once logged as an internal error with a
    # traceback, and then failed again aborting. Now: nothing at WARNING or above, from
    # any logger, and the server serves the next call.
    late = _Late()
    address = f"127.0.0.1:{free_port()}"

    def register(server: grpc.aio.Server) -> None:
        handlers: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {
            "Stream": grpc.unary_stream_rpc_method_handler(late.stream),
            "Refused": grpc.unary_unary_rpc_method_handler(late.refused),
            "Fine": grpc.unary_unary_rpc_method_handler(late.fine),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Late", handlers),)
        )

    server = GrpcServer(address, register, ["test.Late"], grace_s=0.1)
    await server.start()
    try:
        with caplog.at_level(logging.DEBUG):
            async with grpc.aio.insecure_channel(address) as channel:
                streams: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(
                    "/test.Late/Stream"
                )
                refused: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
                    "/test.Late/Refused"
                )
                fine: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
                    "/test.Late/Fine"
                )
                stream = streams(b"")
                assert await stream.read() == b"first"
                stream.cancel()
                with pytest.raises(grpc.aio.AioRpcError) as expired:
                    await refused(b"", timeout=0.3)
                assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                late.go.set()
                for _ in range(100):
                    if len(late.ended) == 2:
                        break
                    await asyncio.sleep(0.02)
                assert sorted(late.ended) == ["refused", "stream"]
                assert await fine(b"", timeout=10) == b"ok"
    finally:
        await server.stop()
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, [f"{r.name}: {r.getMessage()}" for r in loud]
    gone = [r.getMessage() for r in caplog.records if "the client left" in r.getMessage()]
    assert len(gone) == 2, gone
    assert any("INVALID_ARGUMENT" in m for m in gone) and any("a response" in m for m in gone)
