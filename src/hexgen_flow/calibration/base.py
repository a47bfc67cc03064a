"""What a calibration is: a named, documented source of latency numbers (docs/hardware.md,
"Calibrations").

A `Calibration` says which (model, GPU type) pairs it has data for, at which tensor-parallel
degree and precision (`coverage`), and hands the latency model of a covered instance its
numbers (`parameters`). `hexgen_flow.latency.latency_model` builds the model from them and
runs the floor check of `hexgen_flow.roofline` on it before anything uses it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from hexgen_flow.errors import UnknownNameError
from hexgen_flow.hardware import (
    GpuSpec,
    InstanceHardware,
    ModelSpec,
    Precision,
    gpu_catalogue,
    model_catalogue,
)
from hexgen_flow.latency_parameters import LatencyParameters

__all__ = ["Calibration", "CalibrationCoverageError", "Coverage", "cluster_spelling"]


@dataclass(frozen=True, slots=True)
class Coverage:
    """The one configuration a calibration's data for a (model, GPU type) was taken at."""

    tensor_parallel: int
    precision: Precision


class CalibrationCoverageError(UnknownNameError):
    """A (model, GPU type) a calibration has no data for: one line naming the calibration,
    why when it is known, and the GPU types it covers (`known`)."""

    def __init__(
        self,
        calibration: str,
        model: str,
        gpu: str,
        known: Sequence[str],
        reason: str | None = None,
    ) -> None:
        super().__init__(f"GPU type for {model} in calibration {calibration}", gpu, tuple(known))
        why = f" ({reason})" if reason else ""
        covers = ", ".join(sorted(known)) or "no GPU type"
        # UnknownNameError's "unknown ..." reads wrong for a GPU the catalogue knows.
        self.args = (
            f"calibration {calibration!r} has no latency data for {model} on {gpu}{why}; "
            f"it covers: {covers}",
        )


def cluster_spelling(gpu: GpuSpec) -> str:
    """The GPU's shortest name (A100 for A100-80GB-SXM): how clusters are written."""
    return min((gpu.name, *gpu.aliases), key=lambda s: (len(s), s))


class Calibration(ABC):
    """A named source of latency numbers. Subclasses set `name`, `source` and `caveats`."""

    name: str
    """What ``--calibration`` takes."""
    source: str
    """Where the numbers come from, in one sentence."""
    caveats: tuple[str, ...]
    """What to keep in mind when quoting a figure made with it."""

    @property
    def argument(self) -> str:
        """The ``--calibration`` value that selects this calibration from any working
        directory (what a local mesh hands its services)."""
        return self.name

    @abstractmethod
    def coverage(self, model: ModelSpec, gpu: GpuSpec) -> Coverage | None:
        """The tp and precision of the data for `model` on `gpu`; None: no data."""

    @abstractmethod
    def parameters(self, hardware: InstanceHardware) -> LatencyParameters:
        """The numbers of a covered instance (at its `coverage`)."""

    def tensor_parallel_degrees(self, model: ModelSpec, gpu: GpuSpec) -> tuple[int, ...]:
        """Every tp the data for `model` on `gpu` was taken at, ascending (empty: no data).
        A cluster may ask for any of them; `coverage`'s is the default. Most sources have
        one; a sweep over tp has several."""
        covered = self.coverage(model, gpu)
        return () if covered is None else (covered.tensor_parallel,)

    def uncovered_reason(self, model: ModelSpec, gpu: GpuSpec) -> str | None:
        """Why `model` on `gpu` has no data, when the calibration knows; for the error."""
        del model, gpu
        return None

    def covered_gpus(self, model: ModelSpec) -> list[str]:
        """The catalogue's GPU types with data for `model`, as clusters spell them."""
        return sorted(
            cluster_spelling(gpu)
            for gpu in gpu_catalogue().gpus
            if self.coverage(model, gpu) is not None
        )

    def covered_models(self) -> list[str]:
        """The catalogue's models with data on at least one of its GPU types."""
        return sorted(m.name for m in model_catalogue() if self.covered_gpus(m))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
