"""``measured:FILE``: latency a user measured, in a small YAML format (docs/hardware.md,
"Calibrations"; what a ``hexgen-flow profile`` command is to write).

One instance per profile: a model on a GPU type at one tp and precision, its prefill times by
prompt length and its decode step times by batch and context::

    model: llama-3.1-70b
    gpu: A100                 # a catalogue name or alias
    tp: 4
    precision: bf16           # bf16 or fp8
    prefix_cached: false      # were the prompts prefix-cache hits? (required)
    source: vLLM 0.8.5, random prompts, 2025-06-01   # optional: printed with the figures
    prefill:                  # a request alone: time to first token
      - {input_tokens: 1000, ttft_s: 0.181}
      - {input_tokens: 4000, ttft_s: 0.702}
    decode:                   # one decode step = TPOT at that batch (tpot_s is accepted too)
      - {batch: 1, context_tokens: 1000, decode_step_s: 0.0271}
      - {batch: 8, context_tokens: 1000, decode_step_s: 0.0312}

A file holds one profile, or several under ``profiles:`` (a list of the above), one per
(model, GPU type). The latency model takes:

- prefill: a least-squares line in prompt tokens (through the origin with one prompt length,
  or when the line would start below zero);
- a decode step at batch 1 (one per output token after the first: the time to first token
  includes the first): a line in the prompt's tokens through the batch-1 rows
  (flat at their mean with one context, or if the line would fall with context);
- the batch slowdown f(B): the mean over the rows at batch B of the step time over the
  batch-1 line at their context; the rows need batch 1 and at least one more batch size.
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from hexgen_flow.calibration.base import Calibration, Coverage
from hexgen_flow.catalogue_fields import EntryFields
from hexgen_flow.errors import ConfigError
from hexgen_flow.hardware import (
    PRECISIONS,
    GpuSpec,
    InstanceHardware,
    ModelSpec,
    Precision,
    gpu_catalogue,
    resolve_model,
)
from hexgen_flow.latency_parameters import LatencyParameters, LatencySource

__all__ = ["MEASURED_PREFIX", "InstanceProfile", "ProfileFile", "read_profile_file"]

MEASURED_PREFIX = "measured:"

_PROFILE_FIELDS = (
    "model",
    "gpu",
    "tp",
    "precision",
    "prefix_cached",
    "source",
    "prefill",
    "decode",
)
_PREFILL_FIELDS = ("input_tokens", "ttft_s")
_DECODE_FIELDS = ("batch", "context_tokens", "decode_step_s", "tpot_s")


@dataclass(frozen=True, slots=True)
class InstanceProfile:
    """One profile of the file, checked: an instance's measured prefill and decode."""

    model: ModelSpec
    gpu: str
    """The GPU as the file spells it (matched against the catalogue's names, any case)."""
    coverage: Coverage
    prefix_cached: bool
    description: str
    prefill: tuple[tuple[int, float], ...]
    """(prompt tokens, time to first token s)."""
    decode: tuple[tuple[int, int, float], ...]
    """(batch, context tokens, decode step s)."""

    def covers(self, model: ModelSpec, gpu: GpuSpec) -> bool:
        spellings = {s.lower() for s in (gpu.name, *gpu.aliases)}
        return model == self.model and self.gpu.lower() in spellings


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) by least squares; through the origin with one x or when the
    intercept would be negative (a time below zero at no tokens is a bad fit, not physics)."""
    x, y = np.array(xs), np.array(ys)
    if len(set(xs)) > 1:
        slope, intercept = np.polyfit(x, y, 1)
        if intercept >= 0:
            return float(intercept), float(slope)
    return 0.0, float(x @ y / (x @ x))


def _rows(doc: EntryFields, key: str, known: tuple[str, ...]) -> list[EntryFields]:
    rows = doc.doc.get(key)
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"{doc.where}: {key} must be a non-empty list of rows")
    return [EntryFields(row, f"{doc.where}: {key}[{n}]", known) for n, row in enumerate(rows)]


def _decode_row(row: EntryFields) -> tuple[int, int, float]:
    given = [k for k in ("decode_step_s", "tpot_s") if k in row.doc]
    if len(given) != 1:
        raise ConfigError(f"{row.where}: give decode_step_s (or tpot_s), once")
    return row.count("batch"), row.count("context_tokens"), row.number(given[0])


def _read_profile(doc: object, where: str) -> InstanceProfile:
    fields = EntryFields(doc, where, _PROFILE_FIELDS)
    prefix_cached = fields.doc.get("prefix_cached")
    if not isinstance(prefix_cached, bool):
        raise ConfigError(
            f"{fields.where}: prefix_cached must be true or false (were the measured prompts "
            f"prefix-cache hits?), got {prefix_cached!r}"
        )
    precision: Precision = "fp8" if fields.choice("precision", PRECISIONS) == "fp8" else "bf16"
    prefill = tuple(
        (r.count("input_tokens"), r.number("ttft_s"))
        for r in _rows(fields, "prefill", _PREFILL_FIELDS)
    )
    decode = tuple(_decode_row(r) for r in _rows(fields, "decode", _DECODE_FIELDS))
    batches = {b for b, _, _ in decode}
    if 1 not in batches or len(batches) < 2:
        raise ConfigError(
            f"{fields.where}: decode needs rows at batch 1 and at least one larger batch "
            f"(the batch slowdown), got batches {sorted(batches)}"
        )
    return InstanceProfile(
        model=resolve_model(fields.text("model")),
        gpu=fields.text("gpu"),
        coverage=Coverage(fields.count("tp"), precision),
        prefix_cached=prefix_cached,
        description=fields.optional_text("source") or "no source given",
        prefill=prefill,
        decode=decode,
    )


class ProfileFile(Calibration):
    """The profiles of one file, as a calibration."""

    caveats = (
        "as good as the measurement: the file's own source line says what was measured",
        "one line per phase: prefill linear in prompt tokens, decode per token linear in "
        "the prompt's tokens, and a slowdown per batch size averaged over contexts",
    )

    def __init__(self, path: Path, given: str, profiles: tuple[InstanceProfile, ...]) -> None:
        self.path = path
        self.name = f"{MEASURED_PREFIX}{given}"
        self.profiles = profiles
        self.source = f"profiles measured by the user, read from {given}: " + "; ".join(
            f"{p.model.name} on {p.gpu} x{p.coverage.tensor_parallel} "
            f"{p.coverage.precision} ({p.description}"
            f"{', prefix-cache hits' if p.prefix_cached else ''})"
            for p in profiles
        )

    @property
    def argument(self) -> str:
        return f"{MEASURED_PREFIX}{self.path}"

    def _profile(self, model: ModelSpec, gpu: GpuSpec) -> InstanceProfile | None:
        return next((p for p in self.profiles if p.covers(model, gpu)), None)

    def coverage(self, model: ModelSpec, gpu: GpuSpec) -> Coverage | None:
        profile = self._profile(model, gpu)
        return None if profile is None else profile.coverage

    def covered_gpus(self, model: ModelSpec) -> list[str]:
        return sorted(p.gpu for p in self.profiles if p.model == model)

    def parameters(self, hardware: InstanceHardware) -> LatencyParameters:
        profile = self._profile(hardware.model, hardware.gpu)
        assert profile is not None  # latency_model asks only for covered instances
        line = _line([n for n, _ in profile.prefill], [t for _, t in profile.prefill])
        alone = [(c, s) for b, c, s in profile.decode if b == 1]
        base, per_context = float(np.mean([s for _, s in alone])), 0.0
        if len({c for c, _ in alone}) > 1:
            fitted = _line([c for c, _ in alone], [s for _, s in alone])
            if fitted[1] >= 0:  # a step cannot get faster with more KV cache to read
                base, per_context = fitted
        ratios: dict[int, list[float]] = defaultdict(list)
        for batch, context, step_s in profile.decode:
            ratios[batch].append(step_s / (base + per_context * context))
        slowdown = {1: 1.0} | {b: float(np.mean(r)) for b, r in ratios.items() if b != 1}
        source = LatencySource(
            f"measured: {self.path.name} ({profile.description})", profile.prefix_cached
        )
        return LatencyParameters(
            source,
            dict(sorted(slowdown.items())),
            line,
            decode_per_token_s=base,
            decode_per_context_token_s=per_context,
        )


def read_profile_file(path: Path, given: str) -> ProfileFile:
    """The profiles of `path` (`given`: as the user wrote it), checked."""
    return _read_cached(path.resolve(), given, *_stamp(path))


def _stamp(path: Path) -> tuple[int, int]:
    # Keyed on the file's size and modification time: a profile rewritten in place is read
    # again, one unchanged is the same calibration (and so the same cached latency models).
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"calibration {MEASURED_PREFIX}{path}: no such file") from None
    return stat.st_size, stat.st_mtime_ns


@functools.cache
def _read_cached(path: Path, given: str, size: int, mtime_ns: int) -> ProfileFile:
    del size, mtime_ns  # the cache key only
    where = f"profile {given}"
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where} is not valid YAML: {exc}") from None
    if isinstance(doc, dict) and "profiles" in doc:
        if set(doc) != {"profiles"} or not isinstance(doc["profiles"], list):
            raise ConfigError(f"{where}: profiles: must be the only key, a list of profiles")
        entries = [(e, f"{where}: profiles[{n}]") for n, e in enumerate(doc["profiles"])]
    else:
        entries = [(doc, where)]
    profiles = tuple(_read_profile(entry, at) for entry, at in entries)
    if not profiles:
        raise ConfigError(f"{where}: no profiles")
    catalogue = gpu_catalogue()
    seen: set[tuple[str, str]] = set()
    for profile in profiles:
        # A GPU of the shipped catalogue counts once whichever of its names the file uses.
        gpu = profile.gpu.lower()
        if gpu in {s.lower() for s in catalogue.names()}:
            gpu = catalogue.resolve(profile.gpu).name
        if (profile.model.name, gpu) in seen:
            raise ConfigError(f"{where}: two profiles of {profile.model.name} on {profile.gpu}")
        seen.add((profile.model.name, gpu))
    return ProfileFile(path, given, profiles)
