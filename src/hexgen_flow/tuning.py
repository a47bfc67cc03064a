"""α tuning (docs/algorithm.md §6): replay a window of recent queries in the simulator for each α
and keep the one with the lowest P95 latency, ties broken by higher SLO attainment (then by
the smaller α, so the answer is deterministic).

The search is the paper's grid {0.0, 0.1, ..., 1.0} followed by a refinement: the two
midpoints next to the best grid value are tried as well, so a narrow optimum between grid
points is not missed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hexgen_flow.cluster import Cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.estimate import Estimator
from hexgen_flow.metrics import RunMetrics
from hexgen_flow.policies.presets import Preset
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.workload import Query

__all__ = ["ALPHA_GRID", "AUTO_WINDOW", "AlphaPoint", "TuningResult", "auto_tune", "tune_alpha"]

AUTO_WINDOW = 400

ALPHA_GRID: tuple[float, ...] = tuple(i / 10 for i in range(11))


@dataclass(frozen=True, slots=True)
class AlphaPoint:
    alpha: float
    p95_s: float
    mean_s: float
    slo_attainment: float

    @classmethod
    def of(cls, alpha: float, metrics: RunMetrics) -> AlphaPoint:
        summary = metrics.latency_summary()
        return cls(alpha, summary["p95"], summary["mean"], metrics.slo_attainment)

    def rank(self) -> tuple[float, float, float]:
        return (round(self.p95_s, 9), -self.slo_attainment, self.alpha)


@dataclass(frozen=True, slots=True)
class TuningResult:
    best: AlphaPoint
    curve: tuple[AlphaPoint, ...]
    """Every α tried, sorted by α."""
    window: int
    """How many queries were replayed per α."""

    @property
    def alpha(self) -> float:
        return self.best.alpha


def tune_alpha(
    queries: Sequence[Query],
    cluster: Cluster,
    preset: Preset,
    config: SimConfig,
    *,
    window: int | None = None,
    grid: Sequence[float] = ALPHA_GRID,
    refine: bool = True,
    progress: Callable[[AlphaPoint], None] | None = None,
) -> TuningResult:
    """Best α for `preset` on the last `window` queries (all when None) under `config`."""
    if not preset.has_alpha:
        raise ConfigError(f"policy {preset.name!r} has no alpha to tune")
    if not grid:
        raise ConfigError("the alpha grid is empty")
    replay = list(queries[-window:]) if window else list(queries)
    estimator = Estimator(cluster)  # shared: its caches make every replay after the first cheap
    tried: dict[float, AlphaPoint] = {}

    def trial(alpha: float) -> AlphaPoint:
        alpha = round(alpha, 6)
        if alpha not in tried:
            sim = Simulation(replay, cluster, preset.with_alpha(alpha), config, estimator)
            tried[alpha] = AlphaPoint.of(alpha, sim.run())
            if progress is not None:
                progress(tried[alpha])
        return tried[alpha]

    best = min((trial(a) for a in grid), key=AlphaPoint.rank)
    if refine:
        ordered = sorted(grid)
        pos = min(range(len(ordered)), key=lambda k: abs(ordered[k] - best.alpha))
        for neighbour in (pos - 1, pos + 1):
            if 0 <= neighbour < len(ordered):
                best = min(best, trial((best.alpha + ordered[neighbour]) / 2), key=AlphaPoint.rank)
    curve = tuple(sorted(tried.values(), key=lambda p: p.alpha))
    return TuningResult(best, curve, len(replay))


def auto_tune(
    queries: Sequence[Query],
    cluster: Cluster,
    preset: Preset,
    config: SimConfig,
    *,
    progress: Callable[[AlphaPoint], None] | None = None,
) -> TuningResult:
    """What ``--alpha auto`` does: tune on the run's own traffic mix, as the online tuner
    would on recent traffic, but on a different arrival sample (seed + 1) and at most the
    first `AUTO_WINDOW` queries, so the α is never fitted to the very arrivals it is then
    judged on."""
    replay = list(queries[:AUTO_WINDOW])
    tuning_config = SimConfig(
        qps=config.qps,
        slo_scale=config.slo_scale,
        seed=config.seed + 1,
        arrival_cv=config.arrival_cv,
    )
    return tune_alpha(replay, cluster, preset, tuning_config, progress=progress)
