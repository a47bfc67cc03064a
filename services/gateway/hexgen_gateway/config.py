"""The gateway's settings: one typed tree, every field with a default, its option and its
check. They live in `hexgen_service.gateway_config`, where the launchers can render a
gateway's command line from them too; this module keeps the gateway's name."""

from __future__ import annotations

from hexgen_service.gateway_config import (
    DEFAULT_GATEWAY,
    DEFAULT_MAX_BODY_BYTES,
    GatewayConfig,
    add_gateway_options,
    gateway_argv,
    gateway_config_from_args,
)

__all__ = [
    "DEFAULT_GATEWAY",
    "DEFAULT_MAX_BODY_BYTES",
    "GatewayConfig",
    "add_gateway_options",
    "gateway_argv",
    "gateway_config_from_args",
]
