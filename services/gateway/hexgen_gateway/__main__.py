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

from hexgen_flow.errors import ConfigError, HexgenFlowError
from hexgen_gateway.config import GatewayConfig, add_gateway_options, gateway_config_from_args
from hexgen_service.auth import API_KEY_ENV, read_secret
from hexgen_service.exposure import is_loopback
from hexgen_service.gateway_config import address
from hexgen_service.telemetry import setup_logging
from hexgen_service.tls import TlsFiles, add_tls_options, ca_from_env, channel_credentials

PROG = "hexgen-gateway"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{PROG}: error: {message}\n")
        sys.exit(2)


def parse_config(argv: Sequence[str] | None = None) -> tuple[GatewayConfig, str]:
    """The gateway's settings and its log level. Every option but the TLS ones
    (`hexgen_service.tls`, shared with the other services) is a `GatewayConfig` setting,
    declared, parsed and checked there; the files the security options name are read here
    once (`check_files`)."""
    parser = _Parser(
        prog="python -m hexgen_gateway",
        description="The OpenAI-compatible API of a HexGen-Flow mesh: each chat or "
        "completion request becomes a workflow of the coordinator.",
    )
    add_gateway_options(parser)
    add_tls_options(parser, serves="HTTPS")
    args = parser.parse_args(argv)
    try:
        config = gateway_config_from_args(args)
        check_files(config)
    except HexgenFlowError as exc:
        parser.error(str(exc))
    return config, config.log_level


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

    host, port = address(config.listen)
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
