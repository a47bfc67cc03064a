"""Latency of LLM calls per (model, GPU type), built from the measured profiles.

Three sources, in order of trust (docs/algorithm.md §2, profiles/ in the package data):

1. ``vllm-llama3.1-70b/<GPU>-single.csv``: measured end-to-end latency of a single request
   for 484 (input, output) pairs on A100, A6000 and L40S. `SingleRequestTable` returns these
   values exactly at measured pairs and interpolates between them.
2. ``vllm-llama3.1-70b/<GPU>-ttft-tpot.csv``: time to first token per input length, used only
   to split a single-request latency into prefill and decode for the batching engine.
3. ``aiconfigurator-*.tsv``: NVIDIA aiconfigurator TTFT/TPOT at batch 1, 8 and 32. They give
   the decode slowdown with batch size, and the GPUs without a measured table (H100, H200,
   and every GPU for Qwen3-30B-A3B).

A `LatencyModel` answers, for one (model, GPU type): the single-request latency, its prefill
part, the per-token decode slowdown at batch size B, and the KV-cache capacity in tokens.
The GPUs and models themselves, and which GPUs a model has data for at which tensor-parallel
degree, are the catalogues of `hexgen_flow.hardware`; `hexgen_flow.profiles` reads the data,
including each measured folder's ``source.yaml``: which GPUs it covers and whether it was
measured with prefix caching (what the floor check of `hexgen_flow.roofline` reads).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from hexgen_flow.errors import ConfigError, UnknownNameError
from hexgen_flow.hardware import (
    GpuCatalogue,
    InstanceHardware,
    Precision,
    gpu_catalogue,
    known_models,
    model_catalogue,
    parse_precision,
    profiled_tensor_parallel,
    resolve_model,
)
from hexgen_flow.profiles import aiconfigurator_rows, measured_profile, read_table

__all__ = [
    "PROFILED_PRECISION",
    "LatencyModel",
    "LatencySource",
    "SingleRequestTable",
    "has_latency_data",
    "known_gpus",
    "known_models",
    "latency_model",
    "resolve_model",
]

# vLLM's default --max-num-seqs.
MAX_NUM_SEQS = 256
# Every shipped latency table was taken with bf16 weights.
PROFILED_PRECISION: Precision = "bf16"
# The GPU whose measured table anchors the GPUs that only aiconfigurator knows.
ANCHOR_GPU = "A100"
# A6000 is not in aiconfigurator; its batch slowdown is taken from the other 48 GiB
# PCIe-class card, the L40S (catalogue names).
SLOWDOWN_STAND_IN = {"A6000": "L40S"}


@dataclass(frozen=True, slots=True)
class LatencySource:
    """Where a latency model's numbers come from, for reports and the floor check."""

    description: str
    prefix_cached: bool
    """Measured with prefix-cache hits (or scaled from such a table): its prefill may sit
    below the physical floor, and the floor check reports that instead of refusing it."""


def known_gpus(model: str | None = None) -> list[str]:
    """Every GPU name and alias of the catalogue; with `model`, the GPUs it has latency
    data for."""
    if model is None:
        return gpu_catalogue().names()
    return sorted(name for name, _ in resolve_model(model).tensor_parallel)


def _models_with_latency_data() -> list[str]:
    return sorted(m.name for m in model_catalogue() if m.tensor_parallel)


class SingleRequestTable:
    """Measured single-request latency over scattered (input, output) token pairs.

    At a measured pair it returns the measurement (the mean, if a pair was measured more
    than once). Elsewhere it returns a smooth fit ``a + b*in + (c + d*in)*out`` (prefill plus
    a per-token decode time growing with context) corrected by the residuals of the nearest
    measured pairs, weighted by inverse squared distance in log-token space; the correction
    fades out away from measured points, so extrapolation follows the fit alone.
    """

    _NEIGHBOURS = 6
    _FADE = 0.05  # log-distance (about 5 % in tokens) at which the residual weight halves

    def __init__(self, inputs: np.ndarray, outputs: np.ndarray, latencies: np.ndarray) -> None:
        grouped: dict[tuple[int, int], list[float]] = {}
        for i, o, lat in zip(inputs, outputs, latencies, strict=True):
            grouped.setdefault((int(i), int(o)), []).append(float(lat))
        self.exact: dict[tuple[int, int], float] = {
            k: float(np.mean(v)) for k, v in grouped.items()
        }
        keys = np.array(list(self.exact), dtype=float)
        lat = np.array(list(self.exact.values()))
        design = self._design(keys[:, 0], keys[:, 1])
        # Relative least squares: short calls (0.2 s) matter as much as long ones (40 s).
        self.coef, *_ = np.linalg.lstsq(design / lat[:, None], np.ones(len(lat)), rcond=None)
        self._points = np.log(keys)
        self._residuals = lat - design @ self.coef
        self.input_range = (int(keys[:, 0].min()), int(keys[:, 0].max()))
        self.output_range = (int(keys[:, 1].min()), int(keys[:, 1].max()))

    @staticmethod
    def _design(inputs: np.ndarray, outputs: np.ndarray) -> np.ndarray:
        return np.column_stack([np.ones_like(inputs), inputs, outputs, inputs * outputs])

    def fit(self, input_tokens: int, output_tokens: int) -> float:
        a, b, c, d = self.coef
        return float(a + b * input_tokens + (c + d * input_tokens) * output_tokens)

    def latency(self, input_tokens: int, output_tokens: int) -> float:
        exact = self.exact.get((input_tokens, output_tokens))
        if exact is not None:
            return exact
        base = self.fit(input_tokens, output_tokens)
        query = np.array([math.log(input_tokens), math.log(output_tokens)])
        d2 = ((self._points - query) ** 2).sum(axis=1)
        nearest = np.argpartition(d2, self._NEIGHBOURS)[: self._NEIGHBOURS]
        weights = 1.0 / d2[nearest]
        residual = float((weights * self._residuals[nearest]).sum() / weights.sum())
        fade = 1.0 / (1.0 + float(d2[nearest].min()) / self._FADE**2)
        # The residual correction never more than halves the fitted latency.
        return max(base + fade * residual, 0.5 * base)


def _robust_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares line after dropping points more than 3 MADs off a first fit."""
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (slope * x + intercept)
    mad = float(np.median(np.abs(resid - np.median(resid)))) or 1e-12
    keep = np.abs(resid) <= 3 * 1.4826 * mad
    slope, intercept = np.polyfit(x[keep], y[keep], 1)
    return float(intercept), float(slope)


# --------------------------------------------------------------------------- the model


class LatencyModel:
    """Latency of one model on one GPU type (one serving instance of it).

    `single_s` is the end-to-end latency of a request alone on the instance. The batching
    engine splits it into `prefill_s` (serial, compute-bound) and batch-1 decode seconds
    (`single_s - prefill_s`), which stretch by `slowdown(B)` when B requests decode together.
    """

    def __init__(
        self,
        hardware: InstanceHardware,
        table: SingleRequestTable | None,
        prefill_line: tuple[float, float],
        decode_per_token_s: float,
        prefill_scale: float,
        decode_scale: float,
        slowdown_points: dict[int, float],
        source: LatencySource,
        gpu_label: str | None = None,
    ) -> None:
        self.model = hardware.model.name
        self.gpu = hardware.gpu.name if gpu_label is None else gpu_label
        """The GPU type as the cluster spells it ("A100"), or its catalogue name."""
        self.hardware = hardware
        """Model, GPU, tensor-parallel degree and precision of the instance."""
        self.source = source
        self._table = table
        self._prefill_line = prefill_line
        self._decode_per_token_s = decode_per_token_s
        self._prefill_scale = prefill_scale
        self._decode_scale = decode_scale
        self._cache: dict[tuple[int, int], tuple[float, float]] = {}
        self._single: dict[tuple[int, int], float] = {}
        self.kv_capacity_tokens = hardware.kv_capacity_tokens
        """KV-cache slots of the instance (vLLM's default 0.9 memory utilisation)."""
        self.max_batch = MAX_NUM_SEQS
        """vLLM's default --max-num-seqs."""
        xs = sorted(slowdown_points)
        self._slowdown_xs = xs
        self._slowdown_ys = [slowdown_points[x] / slowdown_points[xs[0]] for x in xs]

    def slowdown(self, batch: int) -> float:
        """Per-token decode time at batch `batch` over batch 1 (piecewise linear in B)."""
        xs, ys = self._slowdown_xs, self._slowdown_ys
        if batch <= xs[-1]:
            return float(np.interp(max(batch, 1), xs, ys))
        # Beyond the last profiled batch: continue the last segment's slope.
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + slope * (batch - xs[-1])

    @functools.lru_cache(maxsize=8)  # noqa: B019 - a handful of models live for the process
    def slowdown_table(self, up_to: int) -> tuple[float, ...]:
        """`slowdown(B)` for B = 0..up_to, for O(1) lookups on the hot path (B = 0 -> 1.0)."""
        return (1.0, *(self.slowdown(b) for b in range(1, up_to + 1)))

    def split(self, input_tokens: int, output_tokens: int) -> tuple[float, float]:
        """(prefill seconds, batch-1 decode seconds); their sum is `single_s` (up to rounding)."""
        key = (input_tokens, output_tokens)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        intercept, slope = self._prefill_line
        prefill = max(intercept + slope * input_tokens, 0.0)
        measured: float | None = None
        if self._table is not None:
            single = self._table.latency(input_tokens, output_tokens)
            prefill = min(prefill, single)
            decode = single - prefill
            if self._prefill_scale == self._decode_scale == 1.0:
                measured = single
        else:
            decode = output_tokens * self._decode_per_token_s
        result = (prefill * self._prefill_scale, decode * self._decode_scale)
        self._cache[key] = result
        # On a measured GPU the single latency is the table's value itself: prefill + decode
        # can round one ulp away from it, and measured pairs must come back exactly.
        self._single[key] = measured if measured is not None else result[0] + result[1]
        return result

    def single_s(self, input_tokens: int, output_tokens: int) -> float:
        key = (input_tokens, output_tokens)
        single = self._single.get(key)
        if single is None:
            self.split(input_tokens, output_tokens)
            single = self._single[key]
        return single

    def prefill_s(self, input_tokens: int, output_tokens: int) -> float:
        return self.split(input_tokens, output_tokens)[0]

    def __repr__(self) -> str:
        return f"LatencyModel({self.model!r}, {self.gpu!r})"


@functools.cache
def _measured(folder: str, stem: str) -> tuple[SingleRequestTable, tuple[float, float]]:
    single = read_table(folder, f"{stem}-single.csv")
    ttft = read_table(folder, f"{stem}-ttft-tpot.csv")
    table = SingleRequestTable(single[:, 0], single[:, 1], single[:, 2])
    intercept, slope = _robust_line(ttft[:, 0], ttft[:, 3])
    return table, (max(intercept, 0.0), max(slope, 0.0))


def has_latency_data(hardware: InstanceHardware) -> bool:
    """Whether the shipped tables cover this instance: its model on its GPU type, at the
    tensor-parallel degree and precision they were taken at."""
    profiled = profiled_tensor_parallel(hardware.model, hardware.gpu)
    return profiled == hardware.tensor_parallel and hardware.precision == PROFILED_PRECISION


def latency_model(
    model: str,
    gpu: str,
    tp: int | None = None,
    precision: str = PROFILED_PRECISION,
    catalogue: GpuCatalogue | None = None,
) -> LatencyModel:
    """The latency model of `model` on GPU type `gpu` (resolved in `catalogue`, by default
    the shipped one) at tensor-parallel degree `tp` (default: the profiled one).

    Unknown names, and a (model, GPU) pair without latency data, list the known ones; a tp
    or precision the tables were not taken at is refused rather than guessed.
    """
    spec = resolve_model(model)
    gpu_spec, label = (catalogue or gpu_catalogue()).lookup(gpu)
    profiled = profiled_tensor_parallel(spec, gpu_spec)
    if profiled is None:
        if not spec.tensor_parallel:
            raise UnknownNameError("model with latency data", model, _models_with_latency_data())
        raise UnknownNameError(f"GPU type for {spec.name}", gpu, known_gpus(spec.name))
    if tp is not None and tp < 1:
        raise ConfigError(f"tp must be >= 1, got {tp}")
    hardware = InstanceHardware(
        spec,
        gpu_spec,
        profiled if tp is None else tp,
        parse_precision(precision, f"{spec.name} on {label}"),
    )
    if not has_latency_data(hardware):
        raise ConfigError(
            f"no latency data for {spec.name} on {label} at tp {hardware.tensor_parallel}, "
            f"{hardware.precision}: its tables were taken at tp {profiled}, "
            f"{PROFILED_PRECISION} (`hexgen-flow estimate` shows the floors of any tp)"
        )
    return _latency_model(spec.name, label, profiled)


@functools.cache
def _latency_model(model: str, gpu_label: str, tp: int) -> LatencyModel:
    spec = resolve_model(model)
    catalogue = gpu_catalogue()
    gpu = catalogue.resolve(gpu_label)
    hardware = InstanceHardware(spec, gpu, tp, PROFILED_PRECISION)
    ai = aiconfigurator_rows(spec.name)
    system = catalogue.resolve(SLOWDOWN_STAND_IN.get(gpu.name, gpu.name)).aiconfigurator_system
    slowdown = {bs: tpot for (sys_, bs), (_, tpot) in ai.items() if sys_ == system}

    if spec.measured_profile:
        profile = measured_profile(spec.measured_profile)
        stem = profile.file_stem(gpu)
        if stem is not None:
            table, line = _measured(profile.folder, stem)
            source = LatencySource(
                f"measured: {profile.folder}/{stem} ({profile.description})",
                profile.prefix_caching,
            )
            return LatencyModel(hardware, table, line, 0.0, 1.0, 1.0, slowdown, source, gpu_label)
        # No measured table: scale the anchor GPU's table by aiconfigurator's batch-1 ratios,
        # so a GPU type only ever differs from a measured one by what NVIDIA's data says.
        anchor = catalogue.resolve(ANCHOR_GPU)
        anchor_stem = profile.file_stem(anchor) or ANCHOR_GPU
        table, line = _measured(profile.folder, anchor_stem)
        anchor_ttft, anchor_tpot = ai[(anchor.aiconfigurator_system or "", 1)]
        ttft, tpot = ai[(gpu.aiconfigurator_system or "", 1)]
        source = LatencySource(
            f"scaled: {profile.folder}/{anchor_stem} x aiconfigurator batch-1 ratios "
            f"{gpu.aiconfigurator_system}/{anchor.aiconfigurator_system}",
            # The scaled table keeps the measured one's prefix-cache hits.
            profile.prefix_caching,
        )
        return LatencyModel(
            hardware,
            table,
            line,
            0.0,
            ttft / anchor_ttft,
            tpot / anchor_tpot,
            slowdown,
            source,
            gpu_label,
        )
    # Model known only to aiconfigurator: prefill linear in input tokens through its TTFT at
    # 4,000 tokens, decode at its batch-1 TPOT.
    ttft, tpot = ai[(gpu.aiconfigurator_system or "", 1)]
    source = LatencySource(f"aiconfigurator: {gpu.aiconfigurator_system} batch 1", False)
    return LatencyModel(
        hardware, None, (0.0, ttft / 4000), tpot, 1.0, 1.0, slowdown, source, gpu_label
    )
