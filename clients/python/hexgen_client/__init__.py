"""Python client of the HexGen-Flow service mesh.

- `CoordinatorClient`: asyncio wrapper over the coordinator's gRPC API (submit, watch, run,
  cancel, get, status, set_alpha), for one coordinator or a sharded mesh's (`routing`);
- `replay`: drive a running cluster with a workload, the simulator's arrivals and metrics;
- `LocalCluster`: a whole mesh (Redis, coordinator, tuner, simulated workers) as local
  processes, for ``hexgen-flow up``, tests and benchmarks.

See clients/README.md. The names are imported on first use, so that
``from hexgen_client.addresses import DEFAULT_COORDINATOR`` (the CLI's parser) does not load
grpc.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hexgen_client.addresses import (
        DEFAULT_COORDINATOR,
        DEFAULT_REDIS_PREFIX,
        DEFAULT_REDIS_URL,
        DEFAULT_TUNER,
    )
    from hexgen_client.client import CoordinatorClient
    from hexgen_client.cluster import LocalCluster, LocalClusterConfig
    from hexgen_client.errors import ClusterError, CoordinatorError, CoordinatorUnavailableError
    from hexgen_client.processes import RedisServer
    from hexgen_client.replay import replay

__all__ = [
    "DEFAULT_COORDINATOR",
    "DEFAULT_REDIS_PREFIX",
    "DEFAULT_REDIS_URL",
    "DEFAULT_TUNER",
    "ClusterError",
    "CoordinatorClient",
    "CoordinatorError",
    "CoordinatorUnavailableError",
    "LocalCluster",
    "LocalClusterConfig",
    "RedisServer",
    "replay",
]

_HOMES = {
    "DEFAULT_COORDINATOR": "addresses",
    "DEFAULT_REDIS_PREFIX": "addresses",
    "DEFAULT_REDIS_URL": "addresses",
    "DEFAULT_TUNER": "addresses",
    "ClusterError": "errors",
    "CoordinatorClient": "client",
    "CoordinatorError": "errors",
    "CoordinatorUnavailableError": "errors",
    "LocalCluster": "cluster",
    "LocalClusterConfig": "cluster",
    "RedisServer": "processes",
    "replay": "replay",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hexgen_client' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hexgen_client.{home}"), name)
