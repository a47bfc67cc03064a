"""The mesh as local processes, and the tools that drive it: server-side tooling, not the
SDK (`hexgen_client`).

- `LocalCluster` (`cluster`, `cluster_config`): a whole mesh (Redis, coordinator, tuner,
  gateway, simulated workers) as supervised local processes, for ``hexgen-flow up``, tests
  and benchmarks; `LocalShardedMesh` (`sharded_mesh`): several coordinator shards;
- `processes`: child processes (`ManagedProcess`, `RedisServer`), free ports, supervision;
- `replay` and `measure`: drive a running cluster with a workload the way ``hexgen-flow
  simulate`` does, and its metrics as the simulator's;
- `security`: a secured mesh's credentials for the command line.

It starts the services by module name and imports their shared plumbing
(`hexgen_service`), never a service itself (tests/test_layers.py). The names below are
imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hexgen_launch.cluster import LocalCluster, LocalClusterConfig
    from hexgen_launch.errors import ClusterError
    from hexgen_launch.processes import RedisServer
    from hexgen_launch.replay import replay

__all__ = ["ClusterError", "LocalCluster", "LocalClusterConfig", "RedisServer", "replay"]

_HOMES = {
    "ClusterError": "errors",
    "LocalCluster": "cluster",
    "LocalClusterConfig": "cluster",
    "RedisServer": "processes",
    "replay": "replay",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hexgen_launch' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hexgen_launch.{home}"), name)
