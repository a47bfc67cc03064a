"""``python -m hexgen_gateway``: serve the OpenAI-compatible API until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from hexgen_flow.errors import HexgenFlowError
from hexgen_gateway.config import GatewayConfig
from hexgen_service.telemetry import setup_logging

PROG = "hexgen-gateway"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{PROG}: error: {message}\n")
        sys.exit(2)


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def parse_config(argv: Sequence[str] | None = None) -> tuple[GatewayConfig, str]:
    """The gateway's settings and its log level."""
    d = GatewayConfig()
    parser = _Parser(
        prog="python -m hexgen_gateway",
        description="The OpenAI-compatible API of a HexGen-Flow mesh: each chat or "
        "completion request becomes a workflow of the coordinator.",
    )
    parser.add_argument("--listen", default=d.listen, help=f"HOST:PORT (default {d.listen})")
    parser.add_argument(
        "--coordinator", default=d.coordinator, help=f"HOST:PORT (default {d.coordinator})"
    )
    parser.add_argument(
        "--default-stage",
        default=d.default_stage,
        help=f"the stage of a request without X-Hexgen-Stage (default {d.default_stage})",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=d.default_max_tokens,
        help=f"output tokens of a request without max_tokens (default {d.default_max_tokens})",
    )
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=d.request_timeout_s,
        help="wall seconds a request may take before it is cancelled and answered 504 "
        f"(default {d.request_timeout_s:g})",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    args = parser.parse_args(argv)
    for name in ("listen", "coordinator"):
        try:
            _address(getattr(args, name))
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--{name}: {exc}")
    try:
        config = GatewayConfig(
            listen=args.listen,
            coordinator=args.coordinator,
            default_stage=args.default_stage,
            default_max_tokens=args.default_max_tokens,
            request_timeout_s=args.request_timeout_s,
        )
    except HexgenFlowError as exc:
        parser.error(str(exc))
    return config, args.log_level.upper()


def main(argv: Sequence[str] | None = None) -> int:
    config, level = parse_config(argv)
    setup_logging(level)
    import uvicorn  # noqa: PLC0415 - after the arguments are checked

    from hexgen_gateway.app import create_app  # noqa: PLC0415

    host, port = _address(config.listen)
    try:
        uvicorn.run(
            create_app(config),
            host=host,
            port=port,
            log_level=level.lower(),
            access_log=False,
            timeout_graceful_shutdown=2,
        )
    except OSError as exc:  # the listen address is taken or invalid
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
