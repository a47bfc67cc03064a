"""Latency of LLM calls per (model, GPU type): `LatencyModel`, and `latency_model`, which
builds it from a calibration and checks it against the physical floors.

Where the numbers come from is a calibration (`hexgen_flow.calibration`, docs/hardware.md
"Calibrations"): ``chess-measured`` by default (the measured vLLM tables, aiconfigurator
ratios for the GPUs they lack, aiconfigurator alone for models without tables),
``aiconfigurator``, or a profile file (``measured:FILE``). A `LatencyModel` answers, for one
instance: the single-request latency, its prefill part, the per-token decode slowdown at
batch size B, and the KV-cache capacity in tokens. The GPUs and models themselves are the
catalogues of `hexgen_flow.hardware`. Before a model is used, `hexgen_flow.roofline`
compares it with the floors of its hardware: one below a floor is refused unless its source
was measured with prefix caching.
"""

from __future__ import annotations

import functools

import numpy as np

from hexgen_flow.calibration import (
    DEFAULT_CALIBRATION,
    Calibration,
    CalibrationCoverageError,
    resolve_calibration,
)
from hexgen_flow.calibration.chess_measured import PROFILED_PRECISION
from hexgen_flow.errors import ConfigError, UnknownNameError
from hexgen_flow.hardware import (
    GpuCatalogue,
    InstanceHardware,
    gpu_catalogue,
    known_models,
    parse_precision,
    resolve_model,
)
from hexgen_flow.latency_parameters import LatencyParameters, LatencySource, SingleRequestTable
from hexgen_flow.roofline import check_floors

__all__ = [
    "MAX_NUM_SEQS",
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


def known_gpus(model: str | None = None, calibration: str | None = None) -> list[str]:
    """Every GPU name and alias of the catalogue; with `model`, the GPUs it has latency
    data for in `calibration` (default: the default calibration)."""
    if model is None:
        return gpu_catalogue().names()
    return resolve_calibration(calibration).covered_gpus(resolve_model(model))


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
        decode_per_context_token_s: float = 0.0,
        prefill_points: tuple[tuple[int, float], ...] = (),
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
        self._decode_per_context_token_s = decode_per_context_token_s
        if len(prefill_points) == 1:
            raise ValueError("prefill_points needs two or more points (or none)")
        self._prefill_points = prefill_points
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
        if self._prefill_points:
            prefill = self._prefill_through_points(input_tokens)
        else:
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
            per_token = self._decode_per_token_s + self._decode_per_context_token_s * input_tokens
            decode = output_tokens * per_token
        result = (prefill * self._prefill_scale, decode * self._decode_scale)
        self._cache[key] = result
        # On a measured GPU the single latency is the table's value itself: prefill + decode
        # can round one ulp away from it, and measured pairs must come back exactly.
        self._single[key] = measured if measured is not None else result[0] + result[1]
        return result

    def _prefill_through_points(self, input_tokens: int) -> float:
        points = self._prefill_points
        tokens = [n for n, _ in points]
        seconds = [s for _, s in points]
        if tokens[0] <= input_tokens <= tokens[-1]:
            return float(np.interp(input_tokens, tokens, seconds))
        # Outside the points: continue the nearest end segment (never below zero).
        (n0, s0), (n1, s1) = points[:2] if input_tokens < tokens[0] else points[-2:]
        return max(s1 + (s1 - s0) / (n1 - n0) * (input_tokens - n1), 0.0)

    def single_s(self, input_tokens: int, output_tokens: int) -> float:
        key = (input_tokens, output_tokens)
        single = self._single.get(key)
        if single is None:
            self.split(input_tokens, output_tokens)
            single = self._single[key]
        return single

    def prefill_s(self, input_tokens: int, output_tokens: int) -> float:
        return self.split(input_tokens, output_tokens)[0]

    @classmethod
    def of(
        cls, hardware: InstanceHardware, parts: LatencyParameters, gpu_label: str | None = None
    ) -> LatencyModel:
        """The model of `hardware` from what a calibration says about it."""
        return cls(
            hardware,
            parts.table,
            parts.prefill_line,
            parts.decode_per_token_s,
            parts.prefill_scale,
            parts.decode_scale,
            parts.slowdown_points,
            parts.source,
            gpu_label,
            parts.decode_per_context_token_s,
            parts.prefill_points,
        )

    def __repr__(self) -> str:
        return f"LatencyModel({self.model!r}, {self.gpu!r})"


def has_latency_data(hardware: InstanceHardware, calibration: str | None = None) -> bool:
    """Whether `calibration` (default: the default one) covers this instance: its model on
    its GPU type, at a tensor-parallel degree and the precision the data was taken at."""
    source = resolve_calibration(calibration)
    covered = source.coverage(hardware.model, hardware.gpu)
    return (
        covered is not None
        and covered.precision == hardware.precision
        and hardware.tensor_parallel in source.tensor_parallel_degrees(hardware.model, hardware.gpu)
    )


def latency_model(
    model: str,
    gpu: str,
    tp: int | None = None,
    precision: str | None = None,
    catalogue: GpuCatalogue | None = None,
    calibration: str | None = None,
) -> LatencyModel:
    """The latency model of `model` on GPU type `gpu` (resolved in `catalogue`, by default
    the shipped one) at tensor-parallel degree `tp` and `precision` (default: those of the
    calibration's data), from `calibration` (default: ``chess-measured``).

    Unknown names, and a (model, GPU) pair without data in the calibration, list the known
    ones; a tp or precision the data was not taken at is refused rather than guessed; a model
    below a physical floor is refused unless its source was measured with prefix caching.
    """
    source = resolve_calibration(calibration)
    default = source.name == DEFAULT_CALIBRATION
    spec = resolve_model(model)
    gpu_spec, label = (catalogue or gpu_catalogue()).lookup(gpu)
    covered = source.coverage(spec, gpu_spec)
    if covered is None:
        models = source.covered_models()
        if spec.name not in models:
            kind = "model with latency data" + ("" if default else f" in calibration {source.name}")
            raise UnknownNameError(kind, model, models)
        if default:  # the message every earlier release gave
            raise UnknownNameError(f"GPU type for {spec.name}", gpu, source.covered_gpus(spec))
        reason = source.uncovered_reason(spec, gpu_spec)
        raise CalibrationCoverageError(
            source.name, spec.name, label, source.covered_gpus(spec), reason
        )
    if tp is not None and tp < 1:
        raise ConfigError(f"tp must be >= 1, got {tp}")
    hardware = InstanceHardware(
        spec,
        gpu_spec,
        covered.tensor_parallel if tp is None else tp,
        parse_precision(
            covered.precision if precision is None else precision, f"{spec.name} on {label}"
        ),
    )
    degrees = source.tensor_parallel_degrees(spec, gpu_spec)
    if hardware.tensor_parallel not in degrees or hardware.precision != covered.precision:
        where = "its tables were" if default else f"calibration {source.name}'s data was"
        raise ConfigError(
            f"no latency data for {spec.name} on {label} at tp {hardware.tensor_parallel}, "
            f"{hardware.precision}: {where} taken at tp {', '.join(map(str, degrees))}, "
            f"{covered.precision} (`hexgen-flow estimate` shows the floors of any tp)"
        )
    return _checked_model(source, hardware, label)


@functools.cache
def _checked_model(source: Calibration, hardware: InstanceHardware, label: str) -> LatencyModel:
    # One model per (calibration, instance, spelling): every cluster of a process shares it,
    # and the floors are checked once, before anything runs on it.
    model = LatencyModel.of(hardware, source.parameters(hardware), label)
    check_floors(model)
    return model
