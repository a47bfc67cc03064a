"""Calibrations: named, documented sources of the latency numbers (docs/hardware.md,
"Calibrations").

- ``aiconfigurator`` (the default, `registry.DEFAULT_CALIBRATION`): NVIDIA aiconfigurator's
  TTFT and TPOT alone.
- ``chess-measured``: the paper authors' measured vLLM tables, aiconfigurator ratios for the
  GPUs they lack, aiconfigurator alone for models without tables.
- ``measured:FILE``: a profile file the user measured (`profile_file`).

Every latency model a calibration gives is checked against the physical floors before use
(`hexgen_flow.latency.latency_model`).
"""

from __future__ import annotations

from hexgen_flow.calibration.base import (
    Calibration,
    CalibrationCoverageError,
    Coverage,
    cluster_spelling,
)
from hexgen_flow.calibration.profile_file import MEASURED_PREFIX, ProfileFile
from hexgen_flow.calibration.registry import (
    CALIBRATIONS,
    DEFAULT_CALIBRATION,
    MEASURED_FILE,
    calibration_names,
    resolve_calibration,
)

__all__ = [
    "CALIBRATIONS",
    "DEFAULT_CALIBRATION",
    "MEASURED_FILE",
    "MEASURED_PREFIX",
    "Calibration",
    "CalibrationCoverageError",
    "Coverage",
    "ProfileFile",
    "calibration_names",
    "cluster_spelling",
    "resolve_calibration",
]
