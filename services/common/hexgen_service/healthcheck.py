"""A gRPC health probe for containers and scripts::

    python -m hexgen_service.healthcheck 127.0.0.1:50051 [--service NAME] [--timeout-s 3]
        [--tls-ca CA.pem]

Exit 0 when the server reports SERVING (for `--service`, default the whole server ""),
1 otherwise with one line on stderr saying why. `check` is the same probe as a function.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

__all__ = ["check", "main"]


def check(
    address: str, service: str = "", timeout_s: float = 3.0, tls_ca: Path | None = None
) -> str | None:
    """None when `address` reports `service` SERVING; otherwise why not, in a few words.
    `tls_ca`: the server speaks TLS, with a certificate this CA signed."""
    channel = (
        grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_ca.read_bytes()))
        if tls_ca is not None
        else grpc.insecure_channel(address)
    )
    with channel:
        # The method by name: types-grpcio-health-checking's HealthStub declares no methods.
        check_rpc = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        try:
            response: health_pb2.HealthCheckResponse = check_rpc(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            name = code.name if code is not None else "error"
            return f"{address}: {name}"
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        return f"{address}: {status}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hexgen_service.healthcheck",
        description="Exit 0 when a gRPC server reports SERVING, 1 otherwise.",
    )
    parser.add_argument("address", help="HOST:PORT of the gRPC server")
    parser.add_argument("--service", default="", help='service name (default "": the server)')
    parser.add_argument("--timeout-s", type=float, default=3.0, help="RPC deadline (default 3)")
    parser.add_argument(
        "--tls-ca", type=Path, default=None, help="the server speaks TLS: verify it with this CA"
    )
    args = parser.parse_args(argv)
    problem = check(args.address, args.service, args.timeout_s, args.tls_ca)
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
