"""Reading the shipped latency data under ``data/profiles/`` (docs/algorithm.md §2).

- ``aiconfigurator-*.tsv``: NVIDIA aiconfigurator TTFT/TPOT rows at 4,000 tokens, per model,
  by (system, batch) (`aiconfigurator_rows`, what the ``chess-measured`` calibration reads).
- ``aiconfigurator/<model>.tsv``: the dense aiconfigurator sweep, prefill over 128-16k prompt
  tokens and decode steps over batch x context, per system and tp (`aiconfigurator_sweep`,
  what the ``aiconfigurator`` calibration fits).
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
    "SWEEP_FOLDER",
    "MeasuredProfile",
    "SweepRow",
    "aiconfigurator_rows",
    "aiconfigurator_sweep",
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


SWEEP_FOLDER = "aiconfigurator"
"""The dense aiconfigurator sweep under ``data/profiles/``: one ``<model>.tsv`` per catalogue
model (its README gives the columns)."""


@dataclass(frozen=True, slots=True)
class SweepRow:
    """One timed SILICON row of the dense aiconfigurator sweep: a prefill of `tokens` prompt
    tokens at batch 1, or one decode step of `batch` sequences of `tokens` context each."""

    system: str
    tensor_parallel: int
    phase: str
    """``prefill`` or ``decode``."""
    batch: int
    tokens: int
    seconds: float


@functools.cache
def aiconfigurator_sweep(model: str) -> tuple[SweepRow, ...]:
    """The timed SILICON rows of `model`'s dense sweep, in file order; () when the sweep has
    no file for it. SOL rows (aiconfigurator's own roofline) and skipped rows are left out."""
    spec = resolve_model(model)
    path = resources.files("hexgen_flow").joinpath("data", "profiles", SWEEP_FOLDER)
    path = path.joinpath(f"{spec.name}.tsv")
    if not path.is_file():
        return ()
    lines = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
    rows: list[SweepRow] = []
    for row in csv.DictReader(lines, delimiter="\t"):
        if row["mode"] != "SILICON" or row["status"] != "ok":
            continue
        time_ms = row["TTFT_ms"] if row["phase"] == "prefill" else row["TPOT_ms"]
        rows.append(
            SweepRow(
                system=row["system"],
                tensor_parallel=int(row["tp"]),
                phase=row["phase"],
                batch=int(row["bs"]),
                tokens=int(row["isl"]),
                seconds=float(time_ms) / 1e3,
            )
        )
    return tuple(rows)


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
