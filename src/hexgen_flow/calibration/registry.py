"""The calibrations by name: ``--calibration NAME`` (docs/hardware.md, "Calibrations")."""

from __future__ import annotations

from pathlib import Path

from hexgen_flow.calibration.aiconfigurator import AICONFIGURATOR
from hexgen_flow.calibration.base import Calibration
from hexgen_flow.calibration.chess_measured import CHESS_MEASURED
from hexgen_flow.calibration.profile_file import MEASURED_PREFIX, read_profile_file
from hexgen_flow.errors import ConfigError, UnknownNameError

__all__ = [
    "CALIBRATIONS",
    "DEFAULT_CALIBRATION",
    "MEASURED_FILE",
    "calibration_names",
    "resolve_calibration",
]

DEFAULT_CALIBRATION = AICONFIGURATOR.name
"""The calibration of every figure made without ``--calibration``: the one whose every
latency passes the roofline check (docs/hardware.md). ``chess-measured``, the published
results' calibration, sits below the prefill floor and stays selectable by name."""
MEASURED_FILE = f"{MEASURED_PREFIX}FILE"
"""How `calibration_names` lists the profile files a user supplies."""

CALIBRATIONS: dict[str, Calibration] = {c.name: c for c in (AICONFIGURATOR, CHESS_MEASURED)}
"""The named calibrations that ship with the package."""


def calibration_names() -> list[str]:
    """What ``--calibration`` takes: the shipped names, then ``measured:FILE``."""
    return [*CALIBRATIONS, MEASURED_FILE]


def resolve_calibration(name: str | None = None) -> Calibration:
    """The calibration `name` selects (None: the default). ``measured:FILE`` reads and checks
    the profile file; an unknown name lists the known ones."""
    if name is None:
        return CALIBRATIONS[DEFAULT_CALIBRATION]
    text = name.strip()
    if text.startswith(MEASURED_PREFIX):
        path = text[len(MEASURED_PREFIX) :]
        if not path:
            raise ConfigError(f"calibration {text!r}: write {MEASURED_FILE}, a profile's path")
        return read_profile_file(Path(path), path)
    calibration = CALIBRATIONS.get(text.lower())
    if calibration is None:
        raise UnknownNameError("calibration", name, calibration_names())
    return calibration
