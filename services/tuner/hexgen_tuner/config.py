"""The tuner's settings: one typed tree, every field with a default, its option and its
check. They live in `hexgen_service.tuner_config`, where the launchers can render a tuner's
command line from them too; this module keeps the tuner's name."""

from __future__ import annotations

from hexgen_service.tuner_config import (
    DEFAULT_TUNER,
    TunerConfig,
    add_tuner_options,
    tuner_argv,
    tuner_config_from_args,
)

__all__ = [
    "DEFAULT_TUNER",
    "TunerConfig",
    "add_tuner_options",
    "tuner_argv",
    "tuner_config_from_args",
]
