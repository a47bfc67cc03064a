"""Default addresses of the mesh's services (one place, used by the client, the CLI, the
tuner and `LocalCluster`)."""

from __future__ import annotations

from hexgen_service.redis_keys import CLUSTER_PREFIX as DEFAULT_CLUSTER_PREFIX

__all__ = [
    "DEFAULT_CLUSTER_PREFIX",
    "DEFAULT_COORDINATOR",
    "DEFAULT_GATEWAY",
    "DEFAULT_METRICS",
    "DEFAULT_REDIS_PREFIX",
    "DEFAULT_REDIS_URL",
    "DEFAULT_TUNER",
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
