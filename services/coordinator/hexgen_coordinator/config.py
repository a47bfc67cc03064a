"""The coordinator's settings: one typed tree, every field with a default, its option and
its check. They live in `hexgen_service.coordinator_config`, where the launchers can render
a coordinator's command line from them too; this module keeps the coordinator's name."""

from __future__ import annotations

from hexgen_service.coordinator_config import (
    DEFAULT_LISTEN,
    CoordinatorConfig,
    add_coordinator_options,
    coordinator_argv,
)

__all__ = ["DEFAULT_LISTEN", "CoordinatorConfig", "add_coordinator_options", "coordinator_argv"]
