"""Reading the shipped latency data under ``data/profiles/`` (docs/algorithm.md §2).

- ``aiconfigurator-*.tsv``: NVIDIA aiconfigurator TTFT/TPOT rows, per model: by (system, batch)
  (`aiconfigurator_rows`, what the ``chess-measured`` calibration reads) and as points with
  their tp and token counts (`aiconfigurator_points`, what the ``aiconfigurator`` calibration
  fits, so that a denser sweep in the same columns is a change of data only).
- ``vllm-*/``: measured vLLM tables (`read_table`), and the folder's ``source.yaml``: which
  GPUs it covers and whether it was measured with prefix caching (`MeasuredProfile`).
"""

from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from importlib import resources

import numpy as np
import yaml

from hexgen_flow.errors import ConfigError
from hexgen_flow.hardware import GpuSpec, gpu_catalogue, resolve_model

__all__ = [
    "AiconfiguratorPoint",
    "MeasuredProfile",
    "aiconfigurator_points",
    "aiconfigurator_rows",
    "measured_profile",
    "profile_text",
    "read_table",
]


def profile_text(*parts: str) -> str:
    return resources.files("hexgen_flow").joinpath("data", "profiles", *parts).read_text()


@functools.cache
def aiconfigurator_rows(model: str) -> dict[tuple[str, int], tuple[float, float]]:
    """(system, batch) -> (TTFT s, TPOT s) from the SILICON rows of the aiconfigurator table."""
    spec = resolve_model(model)
    rows: dict[tuple[str, int], tuple[float, float]] = {}
    if spec.aiconfigurator_table is None:
        return rows
    for row in csv.DictReader(profile_text(spec.aiconfigurator_table).splitlines(), delimiter="\t"):
        if row.get("model") != spec.aiconfigurator_model or row.get("mode") != "SILICON":
            continue
        if not row.get("TTFT_ms") or not row.get("TPOT_ms"):
            continue
        rows[(row["system"], int(row["bs"]))] = (
            float(row["TTFT_ms"]) / 1e3,
            float(row["TPOT_ms"]) / 1e3,
        )
    return rows


@dataclass(frozen=True, slots=True)
class AiconfiguratorPoint:
    """One SILICON row of an aiconfigurator table: a GPU system at one tp, batch size and
    (input, output) length, with its time to first token and time per output token."""

    system: str
    tensor_parallel: int
    batch: int
    input_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float


@functools.cache
def aiconfigurator_points(model: str) -> tuple[AiconfiguratorPoint, ...]:
    """Every SILICON row with both times of `model`'s aiconfigurator table (its
    ``aiconfigurator_table`` in models.yaml), in file order."""
    spec = resolve_model(model)
    if spec.aiconfigurator_table is None:
        return ()
    points: list[AiconfiguratorPoint] = []
    text = profile_text(spec.aiconfigurator_table)
    for row in csv.DictReader(text.splitlines(), delimiter="\t"):
        if row.get("model") != spec.aiconfigurator_model or row.get("mode") != "SILICON":
            continue
        if not row.get("TTFT_ms") or not row.get("TPOT_ms"):
            continue
        points.append(
            AiconfiguratorPoint(
                system=row["system"],
                tensor_parallel=int(row["tp"]),
                batch=int(row["bs"]),
                input_tokens=int(row["isl"]),
                output_tokens=int(row["osl"]),
                ttft_s=float(row["TTFT_ms"]) / 1e3,
                tpot_s=float(row["TPOT_ms"]) / 1e3,
            )
        )
    return tuple(points)


@dataclass(frozen=True, slots=True)
class MeasuredProfile:
    """A folder of measured tables and its ``source.yaml``: what they are and which GPUs."""

    folder: str
    description: str
    prefix_caching: bool
    """Measured with prefix-cache hits: first-token times below a real prompt's."""
    gpus: tuple[str, ...]
    """GPU names as the tables' files spell them (<GPU>-single.csv)."""

    def file_stem(self, gpu: GpuSpec) -> str | None:
        """How the files spell `gpu`, or None when the folder has no table for it."""
        for stem in self.gpus:
            if gpu_catalogue().resolve(stem) == gpu:
                return stem
        return None


@functools.cache
def measured_profile(folder: str) -> MeasuredProfile:
    doc = yaml.safe_load(profile_text(folder, "source.yaml"))
    where = f"profiles/{folder}/source.yaml"
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected a mapping")
    prefix_caching = doc.get("prefix_caching")
    gpus = doc.get("gpus")
    if not isinstance(prefix_caching, bool):
        raise ConfigError(f"{where}: prefix_caching must be true or false")
    if not isinstance(gpus, list) or not all(isinstance(g, str) for g in gpus):
        raise ConfigError(f"{where}: gpus must be a list of GPU names")
    return MeasuredProfile(folder, str(doc.get("description", folder)), prefix_caching, tuple(gpus))


def read_table(folder: str, name: str) -> np.ndarray:
    lines = profile_text(folder, name).splitlines()
    reader = csv.reader(lines[1:])
    return np.array([[float(x) for x in row] for row in reader if row], dtype=float)
