"""Latency of LLM calls per (model, GPU type): `LatencyModel`, and `latency_model`, which
builds it from a calibration and checks it against the physical floors.

Where the numbers come from is a calibration (`hexgen_flow.calibration`, docs/hardware.md
"Calibrations"): ``aiconfigurator`` by default (NVIDIA's kernel database; GPUs it lacks
derived from a stand-in), ``chess-measured`` (the measured vLLM tables, aiconfigurator
ratios for the GPUs they lack, aiconfigurator alone for models without tables), or a
profile file (``measured:FILE``). A `LatencyModel` answers, for one
instance: the single-request latency, its prefill part, the per-token decode slowdown at
batch size B, and the KV-cache capacity in tokens. The GPUs and models themselves are the
catalogues of `hexgen_flow.hardware`. Before a model is used, `hexgen_flow.roofline`
compares it with the floors of its hardware: one below a floor is refused unless its source
was measured with prefix caching.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

from hexgen_flow.calibration import (
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
from hexgen_flow.latency_parameters import (
    LatencyParameters,
    LatencySource,
    SingleRequestTable,
    decode_steps,
)
from hexgen_flow.roofline import check_floors

__all__ = [
    "DECODE_REFERENCE_TOKENS",
    "MAX_NUM_SEQS",
    "PROFILED_PRECISION",
    "DecodeStepFit",
    "LatencyModel",
    "LatencySource",
    "SingleRequestTable",
    "decode_steps",
    "has_latency_data",
    "known_gpus",
    "known_models",
    "latency_model",
    "monotone_slowdown",
    "resolve_model",
]

# vLLM's default --max-num-seqs.
MAX_NUM_SEQS = 256

# Output tokens over which `LatencyModel.decode_step_s` averages a call's batch-1 decode: long
# enough that a table's constant terms and its residual corrections near measured pairs (which
# can make a 4-token call's decode negative) average out, and inside the traces' outputs.
DECODE_REFERENCE_TOKENS = 512

# The grid `LatencyModel.decode_step_fit` fits over (states with batch x context above the
# KV capacity are left out: no engine reaches them).
CACHE_MAX = 1 << 16
"""Entries a latency model's memo tables hold before they start over (a service runs for
weeks over arbitrary token counts; a simulation's distinct counts fit many times over)."""
CURVE_TABLE_TOKENS = 1 << 14
"""Prompt tokens up to which `LatencyModel.prefill_curve_table` holds the prefill curve."""
_FIT_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
_FIT_CONTEXTS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True, slots=True)
class DecodeStepFit:
    """A decode step's seconds as a + b x batch + c x KV tokens read, fitted by relative least
    squares (coefficients kept >= 0) to `LatencyModel.decode_step_s` over a batch x context
    grid: what a step-level engine model charges for the decodes of one step."""

    a_s: float
    """Seconds per step (weights read, launch overhead)."""
    b_s: float
    """Seconds per sequence in the step."""
    c_s: float
    """Seconds per KV-cache token read (the sum of the sequences' contexts)."""
    max_rel_error: float
    """Largest |fit / decode_step_s - 1| over the grid."""
    rms_rel_error: float
    """Root mean square of fit / decode_step_s - 1 over the grid."""
    points: int
    """Grid points fitted."""

    def step_s(self, batch: int, kv_tokens: int) -> float:
        """Seconds of one decode step of `batch` sequences reading `kv_tokens` KV tokens."""
        return self.a_s + self.b_s * batch + self.c_s * kv_tokens


def known_gpus(model: str | None = None, calibration: str | None = None) -> list[str]:
    """Every GPU name and alias of the catalogue; with `model`, the GPUs it has latency
    data for in `calibration` (default: the default calibration)."""
    if model is None:
        return gpu_catalogue().names()
    return resolve_calibration(calibration).covered_gpus(resolve_model(model))


# --------------------------------------------------------------------------- the model


def monotone_slowdown(ys: list[float]) -> list[float]:
    """The batch slowdown points (batch 1 first, at 1.0) made non-decreasing by pooling
    adjacent violators (the least-squares monotone fit), batch 1 kept at 1.0.

    A decode step of one more sequence reads the same weights and more KV, so it cannot be
    faster; a database that says so is noise (aiconfigurator's H100 step at batch 4 is 1.6 %
    faster than at batch 2). Left in, the noise told the dispatcher that joining a batch of
    three was quicker than joining a batch of one, and that it sped the others up.
    """
    blocks: list[tuple[float, int]] = []  # (mean, points pooled)
    for y in ys[1:]:
        total, count = y, 1
        while blocks and blocks[-1][0] > total / count:
            mean, n = blocks.pop()
            total, count = total + mean * n, count + n
        blocks.append((total / count, count))
    pooled = [max(mean, ys[0]) for mean, n in blocks for _ in range(n)]
    return [ys[0], *pooled] if ys else []


class LatencyModel:
    """Latency of one model on one GPU type (one serving instance of it).

    `single_s` is the end-to-end latency of a request alone on the instance. The batching
    engine splits it into `prefill_s` (serial, compute-bound; it samples the first output
    token) and batch-1 decode seconds (`single_s - prefill_s`, over `decode_steps` steps: one
    per output token after the first), which stretch by `slowdown(B)` when B requests decode
    together.
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
        self._curve: dict[int, float] = {}
        self.kv_capacity_tokens = hardware.kv_capacity_tokens
        """KV-cache slots of the instance (vLLM's default 0.9 memory utilisation)."""
        self.max_batch = MAX_NUM_SEQS
        """vLLM's default --max-num-seqs."""
        xs = sorted(slowdown_points)
        self._slowdown_xs = xs
        ratios = [slowdown_points[x] / slowdown_points[xs[0]] for x in xs]
        self._slowdown_ys = monotone_slowdown(ratios)

    def slowdown(self, batch: float) -> float:
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

    def decode_step_s(self, batch: float, context: int) -> float:
        """Seconds of one decode step of `batch` sequences holding `context` KV tokens each:
        the batch-1 decode time per step of a call with a `context`-token prompt (averaged
        over the steps of `DECODE_REFERENCE_TOKENS` outputs) stretched by `slowdown(batch)`."""
        steps = decode_steps(DECODE_REFERENCE_TOKENS)
        per_step = self.split(context, DECODE_REFERENCE_TOKENS)[1] / steps
        return per_step * self.slowdown(batch)

    @functools.lru_cache(maxsize=16)  # noqa: B019 - a handful of models live for the process
    def decode_step_fit(self, max_batch: int, kv_capacity: int) -> DecodeStepFit:
        """`decode_step_s` fitted as a + b x batch + c x (batch x context) over batches up to
        `max_batch` and contexts whose batch x context fits `kv_capacity` tokens."""
        batches = sorted({b for b in _FIT_BATCHES if b <= max_batch} | {max_batch})
        grid = [(b, n) for b in batches for n in _FIT_CONTEXTS if b * n <= max(kv_capacity, n)]
        target = np.array([self.decode_step_s(b, n) for b, n in grid])
        design = np.array([(1.0, b, b * n) for b, n in grid])
        # Relative least squares, so that batch-1 steps (25 ms) weigh as much as full ones;
        # negative coefficients are dropped in turn (a tiny non-negative least squares), since
        # a negative per-token cost would make huge batches cheaper than small ones.
        weighted = design / target[:, None]
        ones = np.ones(len(grid))
        best: tuple[float, np.ndarray] | None = None
        for size in (3, 2, 1):
            for columns in itertools.combinations(range(3), size):
                sub, *_ = np.linalg.lstsq(weighted[:, columns], ones, rcond=None)
                if (sub < 0).any():
                    continue
                coef = np.zeros(3)
                coef[list(columns)] = sub
                error = float(((weighted @ coef - 1.0) ** 2).sum())
                if best is None or error < best[0]:
                    best = (error, coef)
            if best is not None:
                break
        assert best is not None  # a single column with positive targets fits with coef > 0
        coef = best[1]
        rel = design @ coef / target - 1.0
        return DecodeStepFit(
            float(coef[0]),
            float(coef[1]),
            float(coef[2]),
            float(np.abs(rel).max()),
            float(np.sqrt((rel**2).mean())),
            len(grid),
        )

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
            per_step = self._decode_per_token_s + self._decode_per_context_token_s * input_tokens
            decode = decode_steps(output_tokens) * per_step
        result = (prefill * self._prefill_scale, decode * self._decode_scale)
        if len(self._cache) >= CACHE_MAX:  # a long-running service sees endless token counts
            self._cache.clear()
            self._single.clear()
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

    @functools.cached_property
    def prefill_curve_table(self) -> tuple[float, ...]:
        """`prefill_curve_s(n)` for n = 0 .. `CURVE_TABLE_TOKENS` (or the last prefill
        point, if beyond), computed once: a chunked-prefill engine reads the curve at every
        chunk end. The points are interpolated by `np.interp` over the whole range at once
        (the same arithmetic as one point at a time), the ends extrapolated as one point."""
        if self._prefill_points:
            tokens = [n for n, _ in self._prefill_points]
            seconds = [s for _, s in self._prefill_points]
            last = max(tokens[-1], CURVE_TABLE_TOKENS)
            inside = np.arange(tokens[0], tokens[-1] + 1)
            middle = (np.interp(inside, tokens, seconds) * self._prefill_scale).tolist()
            below = [self._curve_point(n) for n in range(tokens[0])]
            above = [self._curve_point(n) for n in range(tokens[-1] + 1, last + 1)]
            return (*below, *middle, *above)
        return tuple(self._curve_point(n) for n in range(CURVE_TABLE_TOKENS + 1))

    def _curve_point(self, input_tokens: int) -> float:
        if self._prefill_points:
            prefill = self._prefill_through_points(input_tokens)
        else:
            intercept, slope = self._prefill_line
            prefill = max(intercept + slope * input_tokens, 0.0)
        return prefill * self._prefill_scale

    def prefill_curve_s(self, input_tokens: int) -> float:
        """Prefill seconds of an `input_tokens` prompt by the prefill points or line alone
        (scaled, without a table's cap at the single latency): the curve a chunked-prefill
        engine charges a chunk from n to m tokens by, as curve(m) - curve(n)."""
        table = self.prefill_curve_table
        if 0 <= input_tokens < len(table):
            return table[input_tokens]
        cached = self._curve.get(input_tokens)
        if cached is None:
            if len(self._curve) >= CACHE_MAX:
                self._curve.clear()
            cached = self._curve[input_tokens] = self._curve_point(input_tokens)
        return cached

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

    def rescaled(self, prefill: float, decode: float) -> LatencyModel:
        """This model with its prefill times `prefill` x and its decode times `decode` x
        what they are (the slowdown curve kept): what an online learner believes of the
        instance (`hexgen_flow.learning`). No floor check: the learner keeps its own."""
        if not (prefill > 0 and decode > 0 and math.isfinite(prefill + decode)):
            raise ValueError(f"scale factors must be finite and > 0, got {prefill}, {decode}")
        if prefill == decode == 1.0:
            return self
        model = copy.copy(self)
        model._prefill_scale = self._prefill_scale * prefill
        model._decode_scale = self._decode_scale * decode
        model._cache = {}
        model._single = {}
        model._curve = {}
        model.__dict__.pop("prefill_curve_table", None)  # a cached_property of the old scale
        return model

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
    calibration's data), from `calibration` (default: ``aiconfigurator``).

    Unknown names, and a (model, GPU) pair without data in the calibration, list the known
    ones; a tp or precision the data was not taken at is refused rather than guessed; a model
    below a physical floor is refused unless its source was measured with prefix caching.
    """
    source = resolve_calibration(calibration)
    spec = resolve_model(model)
    gpu_spec, label = (catalogue or gpu_catalogue()).lookup(gpu)
    covered = source.coverage(spec, gpu_spec)
    if covered is None:
        models = source.covered_models()
        if spec.name not in models:
            kind = f"model with latency data in calibration {source.name}"
            raise UnknownNameError(kind, model, models)
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
        where = f"calibration {source.name}'s data was"
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
