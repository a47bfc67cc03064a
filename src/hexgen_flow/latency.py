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
"""

from __future__ import annotations

import csv
import functools
import math
from dataclasses import dataclass
from importlib import resources

import numpy as np

from hexgen_flow.errors import UnknownNameError

__all__ = [
    "GPU_SPECS",
    "MODEL_SPECS",
    "GpuSpec",
    "LatencyModel",
    "ModelSpec",
    "SingleRequestTable",
    "known_gpus",
    "known_models",
    "latency_model",
    "resolve_model",
]


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """A GPU type as far as capacity planning needs it."""

    name: str
    memory_gib: float
    """Device memory of one GPU."""
    aiconfigurator_system: str | None
    """Name of this GPU in the aiconfigurator tables, if it is there."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """An LLM as far as latency and KV-cache sizing need it."""

    name: str
    weight_bytes: float
    """Bytes of weights (bf16) over the whole tensor-parallel group."""
    kv_bytes_per_token: int
    """2 (K and V) x layers x KV heads x head dim x 2 bytes."""
    tensor_parallel: dict[str, int]
    """GPUs per instance, per GPU type (as profiled)."""
    measured_profile: str | None
    """Folder of measured vLLM tables, when there is one."""
    aiconfigurator_model: str
    """Model name in the aiconfigurator tables."""
    aliases: tuple[str, ...] = ()


GPU_SPECS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("A100", 80, "a100_sxm"),
        GpuSpec("A6000", 48, None),
        GpuSpec("L40S", 48, "l40s"),
        GpuSpec("H100", 80, "h100_sxm"),
        GpuSpec("H200", 141, "h200_sxm"),
    )
}

MODEL_SPECS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(
            name="llama-3.1-70b",
            weight_bytes=70.6e9 * 2,
            kv_bytes_per_token=2 * 80 * 8 * 128 * 2,
            # tp as in the aiconfigurator rows; A6000 is not there and needs 4 x 48 GiB too.
            tensor_parallel={"A100": 4, "A6000": 4, "L40S": 4, "H100": 4, "H200": 2},
            measured_profile="vllm-llama3.1-70b",
            aiconfigurator_model="meta-llama/Meta-Llama-3.1-70B",
            aliases=("meta-llama/meta-llama-3.1-70b", "meta-llama/llama-3.1-70b-instruct"),
        ),
        ModelSpec(
            name="qwen3-30b-a3b",
            weight_bytes=30.5e9 * 2,
            kv_bytes_per_token=2 * 48 * 4 * 128 * 2,
            tensor_parallel={"A100": 1, "L40S": 2, "H100": 1, "H200": 1},
            measured_profile=None,
            aiconfigurator_model="Qwen/Qwen3-30B-A3B",
            aliases=("qwen/qwen3-30b-a3b",),
        ),
    )
}

# vLLM's default --gpu-memory-utilization and --max-num-seqs.
GPU_MEMORY_UTILIZATION = 0.9
MAX_NUM_SEQS = 256
# The GPU whose measured table anchors the GPUs that only aiconfigurator knows.
ANCHOR_GPU = "A100"
# A6000 is not in aiconfigurator; its batch slowdown is taken from the other 48 GiB
# PCIe-class card, the L40S.
SLOWDOWN_STAND_IN = {"A6000": "L40S"}


def known_models() -> list[str]:
    return sorted(MODEL_SPECS)


def known_gpus(model: str | None = None) -> list[str]:
    if model is None:
        return sorted(GPU_SPECS)
    return sorted(resolve_model(model).tensor_parallel)


def resolve_model(name: str) -> ModelSpec:
    key = name.strip().lower()
    for spec in MODEL_SPECS.values():
        if key == spec.name or key in spec.aliases:
            return spec
    raise UnknownNameError("model", name, known_models())


def _resolve_gpu(name: str) -> GpuSpec:
    for spec in GPU_SPECS.values():
        if spec.name.lower() == name.strip().lower():
            return spec
    raise UnknownNameError("GPU type", name, known_gpus())


# --------------------------------------------------------------------------- profile data


def _data_text(*parts: str) -> str:
    return resources.files("hexgen_flow").joinpath("data", "profiles", *parts).read_text()


@functools.cache
def _aiconfigurator(model: str) -> dict[tuple[str, int], tuple[float, float]]:
    """(system, batch) -> (TTFT s, TPOT s) from the SILICON rows of the aiconfigurator table."""
    spec = resolve_model(model)
    stem = {"llama-3.1-70b": "llama3.1-70b", "qwen3-30b-a3b": "qwen3-30b-a3b"}[spec.name]
    rows: dict[tuple[str, int], tuple[float, float]] = {}
    for row in csv.DictReader(
        _data_text(f"aiconfigurator-{stem}.tsv").splitlines(), delimiter="\t"
    ):
        if row.get("model") != spec.aiconfigurator_model or row.get("mode") != "SILICON":
            continue
        if not row.get("TTFT_ms") or not row.get("TPOT_ms"):
            continue
        rows[(row["system"], int(row["bs"]))] = (
            float(row["TTFT_ms"]) / 1e3,
            float(row["TPOT_ms"]) / 1e3,
        )
    return rows


def _read_csv(folder: str, name: str) -> np.ndarray:
    lines = _data_text(folder, name).splitlines()
    reader = csv.reader(lines[1:])
    return np.array([[float(x) for x in row] for row in reader if row], dtype=float)


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
        model: ModelSpec,
        gpu: GpuSpec,
        table: SingleRequestTable | None,
        prefill_line: tuple[float, float],
        decode_per_token_s: float,
        prefill_scale: float,
        decode_scale: float,
        slowdown_points: dict[int, float],
    ) -> None:
        self.model = model.name
        self.gpu = gpu.name
        self._table = table
        self._prefill_line = prefill_line
        self._decode_per_token_s = decode_per_token_s
        self._prefill_scale = prefill_scale
        self._decode_scale = decode_scale
        self._cache: dict[tuple[int, int], tuple[float, float]] = {}
        self._single: dict[tuple[int, int], float] = {}
        tp = model.tensor_parallel[gpu.name]
        usable = tp * gpu.memory_gib * 2**30 * GPU_MEMORY_UTILIZATION - model.weight_bytes
        self.kv_capacity_tokens = max(int(usable / model.kv_bytes_per_token), 0)
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
def _measured(profile: str, gpu: str) -> tuple[SingleRequestTable, tuple[float, float]]:
    single = _read_csv(profile, f"{gpu}-single.csv")
    ttft = _read_csv(profile, f"{gpu}-ttft-tpot.csv")
    table = SingleRequestTable(single[:, 0], single[:, 1], single[:, 2])
    intercept, slope = _robust_line(ttft[:, 0], ttft[:, 3])
    return table, (max(intercept, 0.0), max(slope, 0.0))


@functools.cache
def latency_model(model: str, gpu: str) -> LatencyModel:
    """The latency model of `model` on GPU type `gpu`; unknown names list the known ones."""
    spec = resolve_model(model)
    gpu_spec = _resolve_gpu(gpu)
    if gpu_spec.name not in spec.tensor_parallel:
        raise UnknownNameError(f"GPU type for {spec.name}", gpu, known_gpus(spec.name))
    ai = _aiconfigurator(spec.name)
    slowdown_gpu = GPU_SPECS[SLOWDOWN_STAND_IN.get(gpu_spec.name, gpu_spec.name)]
    system = slowdown_gpu.aiconfigurator_system
    slowdown = {bs: tpot for (sys_, bs), (_, tpot) in ai.items() if sys_ == system}

    measured_gpus = {"A100", "A6000", "L40S"} if spec.measured_profile else set()
    if spec.measured_profile and gpu_spec.name in measured_gpus:
        table, line = _measured(spec.measured_profile, gpu_spec.name)
        return LatencyModel(spec, gpu_spec, table, line, 0.0, 1.0, 1.0, slowdown)
    if spec.measured_profile:
        # No measured table: scale the anchor GPU's table by aiconfigurator's batch-1 ratios,
        # so a GPU type only ever differs from a measured one by what NVIDIA's data says.
        table, line = _measured(spec.measured_profile, ANCHOR_GPU)
        anchor_ttft, anchor_tpot = ai[(GPU_SPECS[ANCHOR_GPU].aiconfigurator_system or "", 1)]
        ttft, tpot = ai[(gpu_spec.aiconfigurator_system or "", 1)]
        return LatencyModel(
            spec, gpu_spec, table, line, 0.0, ttft / anchor_ttft, tpot / anchor_tpot, slowdown
        )
    # Model known only to aiconfigurator: prefill linear in input tokens through its TTFT at
    # 4,000 tokens, decode at its batch-1 TPOT.
    ttft, tpot = ai[(gpu_spec.aiconfigurator_system or "", 1)]
    return LatencyModel(spec, gpu_spec, None, (0.0, ttft / 4000), tpot, 1.0, 1.0, slowdown)
