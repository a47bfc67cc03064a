"""The coordinator's service edge (`hexgen_coordinator.edge.statuses`) on a real gRPC server:
a bug reaches the client as INTERNAL with an incident id, never with its text, and the log
keeps the traceback under that id."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest

from hexgen_coordinator.edge import statuses
from hexgen_launch.processes import free_port
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
