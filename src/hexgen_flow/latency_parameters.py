"""The parts a `LatencyModel` (latency.py) is built from, as a calibration hands them over.

A calibration (`hexgen_flow.calibration`) says where the numbers come from; what it gives the
latency model of one instance is a `LatencyParameters`: a measured single-request table or a
prefill line and a decode time per token, scales, the batch slowdown points and the
`LatencySource` (what the numbers are, and whether they were measured with prefix-cache
hits, which the floor check of `hexgen_flow.roofline` reads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "LatencyParameters",
    "LatencySource",
    "SingleRequestTable",
    "decode_steps",
    "robust_line",
]


def decode_steps(output_tokens: int) -> int:
    """The decode steps a call of `output_tokens` output tokens takes: one fewer than its
    tokens, since the step that finishes its prompt's prefill samples the first (vLLM's and
    every engine's; a time to first token is that step). A call of one output token is its
    prefill alone."""
    return output_tokens - 1 if output_tokens > 1 else 0


@dataclass(frozen=True, slots=True)
class LatencySource:
    """Where a latency model's numbers come from, for reports and the floor check."""

    description: str
    prefix_cached: bool
    """Measured with prefix-cache hits (or scaled from such a table): its prefill may sit
    below the physical floor, and the floor check reports that instead of refusing it."""


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


def robust_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares line after dropping points more than 3 MADs off a first fit."""
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (slope * x + intercept)
    mad = float(np.median(np.abs(resid - np.median(resid)))) or 1e-12
    keep = np.abs(resid) <= 3 * 1.4826 * mad
    slope, intercept = np.polyfit(x[keep], y[keep], 1)
    return float(intercept), float(slope)


@dataclass(frozen=True, slots=True)
class LatencyParameters:
    """What one calibration says about one instance: the arguments of `LatencyModel`.

    With a `table`, a call's single-request latency is the table's and `prefill_line` splits
    it; without one, prefill (the time to first token) follows `prefill_points` (or else
    `prefill_line`) and decode takes `decode_per_token_s` + `decode_per_context_token_s` x
    prompt tokens per decode step, one per output token after the first (`decode_steps`).
    Prefill and decode are then scaled by `prefill_scale` and `decode_scale`.
    """

    source: LatencySource
    slowdown_points: dict[int, float]
    """Batch size -> decode time per token at that batch (only the ratios to the smallest
    batch are used: the slowdown f(B))."""
    prefill_line: tuple[float, float]
    """(intercept s, slope s per prompt token)."""
    prefill_points: tuple[tuple[int, float], ...] = ()
    """(prompt tokens, prefill s), ascending: when given (two or more), prefill is the
    piecewise-linear curve through them, continued by the first and last segments outside
    their range, and `prefill_line` is not used. A dense sweep rises faster than linearly
    (attention is quadratic in the prompt), which no single line holds over 128-16k tokens."""
    table: SingleRequestTable | None = None
    decode_per_token_s: float = 0.0
    decode_per_context_token_s: float = 0.0
    """How the decode step's time grows with the prompt (its KV cache is read at
    every step); 0 keeps it flat."""
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
