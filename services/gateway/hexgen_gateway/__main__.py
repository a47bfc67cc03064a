"""``python -m hexgen_gateway``: serve the OpenAI-compatible API until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from hexgen_client.addresses import split_addresses
from hexgen_flow.errors import ConfigError, HexgenFlowError
from hexgen_gateway.config import GatewayConfig
from hexgen_service.auth import API_KEY_ENV, read_secret
from hexgen_service.exposure import is_loopback
from hexgen_service.telemetry import setup_logging
from hexgen_service.tls import TlsFiles, add_tls_options, ca_from_env, channel_credentials

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
        "--coordinator",
        action="append",
        metavar="HOST:PORT",
        help=f"the coordinator (default {d.coordinator}); a sharded mesh's coordinators: "
        "repeat it or give a comma list (each workflow goes to its shard's owner)",
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
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help="largest request body; a larger one is answered 413 before it is read "
        f"(default {d.max_body_bytes}, 8 MiB: the coordinator's --max-prompt-bytes must fit)",
    )
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=d.request_timeout_s,
        help="wall seconds a request may take before it is cancelled and answered 504 "
        f"(default {d.request_timeout_s:g})",
    )
    parser.add_argument(
        "--session-idle-s",
        type=float,
        default=d.session_idle_s,
        help="wall seconds without a call after which a workflow this gateway opened is "
        "closed (a request's X-Hexgen-Idle-S overrides it; 0: the coordinator's "
        f"--session-idle-s) (default {d.session_idle_s:g})",
    )
    parser.add_argument(
        "--no-metrics",
        dest="metrics",
        action="store_false",
        help="do not serve GET /metrics (the gateway's Prometheus metrics)",
    )
    security = parser.add_argument_group("security (docs/security.md)")
    add_tls_options(security, serves="HTTPS")
    security.add_argument(
        "--api-key-file",
        default=d.api_key_file,
        metavar="FILE",
        help="the gateway's own API key, for its /health only; requests always carry their "
        "caller's Authorization: Bearer key (default: none)",
    )
    security.add_argument(
        "--insecure",
        action="store_true",
        help="listen beyond loopback over plain HTTP (without --tls-cert/--tls-key)",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    args = parser.parse_args(argv)
    try:
        coordinators = split_addresses(args.coordinator or d.coordinator)
    except ConfigError as exc:
        parser.error(f"--coordinator: {exc}")
    for name, value in (("listen", args.listen), *(("coordinator", c) for c in coordinators)):
        try:
            _address(value)
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--{name}: {exc}")
    try:
        config = GatewayConfig(
            listen=args.listen,
            coordinator=",".join(coordinators),
            default_stage=args.default_stage,
            default_max_tokens=args.default_max_tokens,
            max_body_bytes=args.max_body_bytes,
            request_timeout_s=args.request_timeout_s,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_ca=args.tls_ca,
            api_key_file=args.api_key_file,
            insecure=args.insecure,
            session_idle_s=args.session_idle_s or None,
            metrics=args.metrics,
        )
        check_files(config)
    except HexgenFlowError as exc:
        parser.error(str(exc))
    return config, args.log_level.upper()


def check_files(config: GatewayConfig) -> None:
    """Read every file the security flags name once, so that a missing or malformed one is
    a ConfigError naming its flag before anything starts."""
    if config.tls_cert is not None and config.tls_key is not None:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                config.tls_cert, config.tls_key
            )
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"--tls-cert/--tls-key: cannot load {config.tls_cert} with {config.tls_key}: "
                f"{getattr(exc, 'strerror', None) or exc}"
            ) from None
    ca = ca_from_env(config.tls_ca)
    if ca is not None:
        channel_credentials(TlsFiles(ca=Path(ca)))
    if config.api_key_file:
        read_secret(config.api_key_file, "--api-key-file")


def main(argv: Sequence[str] | None = None) -> int:
    config, level = parse_config(argv)
    setup_logging(level)
    # The gateway acts for its callers: a key in its environment would be lent to every
    # request that comes without one. Its own key, if any, is --api-key-file (for /health).
    os.environ.pop(API_KEY_ENV, None)
    if not config.https and not is_loopback(config.listen):  # allowed by --insecure
        logging.getLogger(__name__).warning(
            "--insecure: serving plain HTTP on %s: callers' API keys cross the network in "
            "the clear",
            config.listen,
        )
    import uvicorn  # noqa: PLC0415 - after the arguments are checked

    from hexgen_gateway.app import create_app  # noqa: PLC0415 - loads fastapi

    host, port = _address(config.listen)
    try:
        uvicorn.run(
            create_app(config),
            host=host,
            port=port,
            log_level=level.lower(),
            access_log=False,
            timeout_graceful_shutdown=2,
            ssl_certfile=config.tls_cert,
            ssl_keyfile=config.tls_key,
        )
    except OSError as exc:  # the listen address is taken or invalid
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
