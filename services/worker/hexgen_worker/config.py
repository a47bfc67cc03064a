"""The worker's configuration: one typed, frozen tree that the command line fills.

Declared in `hexgen_service.worker_config` (its fields, options and checks), where the
launchers that start workers may import it too; re-exported here under its old names.
"""

from __future__ import annotations

from hexgen_service.worker_config import (
    ENGINE_KINDS,
    LOG_LEVELS,
    EngineKind,
    WorkerConfig,
    add_worker_options,
    worker_argv,
    worker_config_from_args,
)

__all__ = [
    "ENGINE_KINDS",
    "LOG_LEVELS",
    "EngineKind",
    "WorkerConfig",
    "add_worker_options",
    "worker_argv",
    "worker_config_from_args",
]
