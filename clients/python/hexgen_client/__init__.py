"""The Python SDK of the HexGen-Flow service mesh: what a program needs to submit queries.

- `CoordinatorClient`: asyncio wrapper over the coordinator's gRPC API (submit, watch, run,
  cancel, get, status, set_alpha), for one coordinator or a sharded mesh's (`routing`);
- its errors (`CoordinatorError` and kin), credentials (`credentials`: API key, TLS CA),
  the services' default addresses (`addresses`) and plain-text renderings (`report`).

It imports the generated API (`hexgen_api`), the wire contract (`hexgen_wire`) and the
core's plain data types only: never a service package, Redis, numpy or matplotlib
(tests/test_layers.py). Running a mesh as local processes (`LocalCluster`) and replaying a
workload against one are `hexgen_launch`'s; the Text-to-SQL agent is `hexgen_sql`.

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
    from hexgen_client.errors import CoordinatorError, CoordinatorUnavailableError

__all__ = [
    "DEFAULT_COORDINATOR",
    "DEFAULT_REDIS_PREFIX",
    "DEFAULT_REDIS_URL",
    "DEFAULT_TUNER",
    "CoordinatorClient",
    "CoordinatorError",
    "CoordinatorUnavailableError",
]

_HOMES = {
    "DEFAULT_COORDINATOR": "addresses",
    "DEFAULT_REDIS_PREFIX": "addresses",
    "DEFAULT_REDIS_URL": "addresses",
    "DEFAULT_TUNER": "addresses",
    "CoordinatorClient": "client",
    "CoordinatorError": "errors",
    "CoordinatorUnavailableError": "errors",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hexgen_client' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hexgen_client.{home}"), name)
