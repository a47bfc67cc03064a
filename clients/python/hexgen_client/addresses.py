"""Default addresses of the mesh's services (one place, used by the client, the CLI, the
tuner, the gateway and `hexgen_launch.LocalCluster`)."""

from __future__ import annotations

from collections.abc import Sequence

from hexgen_flow.errors import ConfigError

__all__ = [
    "DEFAULT_COORDINATOR",
    "DEFAULT_GATEWAY",
    "DEFAULT_METRICS",
    "DEFAULT_REDIS_PREFIX",
    "DEFAULT_REDIS_URL",
    "DEFAULT_TUNER",
    "split_addresses",
]

DEFAULT_COORDINATOR = "127.0.0.1:50051"
"""Where the coordinator listens unless told otherwise (CoordinatorService + WorkerService)."""
DEFAULT_TUNER = "127.0.0.1:50053"
"""Where the tuner listens unless told otherwise (TunerService)."""
DEFAULT_GATEWAY = "127.0.0.1:8000"
"""Where `hexgen-flow up` serves the OpenAI-compatible gateway (HTTP)."""
DEFAULT_METRICS = "127.0.0.1:9464"
"""Where `hexgen-flow up`'s coordinator serves Prometheus metrics (HTTP, /metrics)."""
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
"""The Redis the services share unless told otherwise."""
DEFAULT_REDIS_PREFIX = "hf:"
"""Prefix of every Redis key the mesh writes."""


def split_addresses(addresses: str | Sequence[str]) -> tuple[str, ...]:
    """The addresses of ``HOST:PORT``, of a comma list ``HOST:PORT,HOST:PORT`` (a sharded
    mesh's coordinators), or of a sequence of either (a repeated flag's values): each once,
    in the order given. `ConfigError` when that leaves none."""
    pieces = [addresses] if isinstance(addresses, str) else list(addresses)
    found = [a.strip() for piece in pieces for a in piece.split(",") if a.strip()]
    if not found:
        raise ConfigError(f"no coordinator address in {addresses!r}")
    return tuple(dict.fromkeys(found))
