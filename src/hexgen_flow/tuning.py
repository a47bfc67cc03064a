"""α tuning (docs/algorithm.md §6): replay a window of recent queries in the simulator for each α
and keep the one with the lowest P95 latency, ties broken by higher SLO attainment (then by
the smaller α, so the answer is deterministic).

The search is the paper's grid {0.0, 0.1, ..., 1.0} followed by a refinement: the two
midpoints next to the best grid value are tried as well, so a narrow optimum between grid
points is not missed.

Online tuning, one implementation for the mesh and the simulator: `retune` is one tuning run
on a `TuningWindow` of recently admitted queries (replays from an empty cluster at the
window's own arrival times, then `decide`); the mesh's tuner service calls it on the window it
reads from Redis, and `OnlineTuner` calls it from inside a running `Simulation` every period
(`Simulation.every`) on the simulation's own admitted queries, and sets the live α.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from hexgen_flow.cluster import Cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.estimate import Estimator
from hexgen_flow.metrics import RunMetrics
from hexgen_flow.policies.presets import Preset
from hexgen_flow.protocol import AlphaChanged
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.workload import Query

__all__ = [
    "ALPHA_GRID",
    "AUTO_WINDOW",
    "AlphaPoint",
    "AlphaStep",
    "Decision",
    "OnlineSettings",
    "OnlineTuner",
    "Retune",
    "TuningResult",
    "TuningWindow",
    "auto_tune",
    "decide",
    "replay_window",
    "retune",
    "run_online",
    "tune_alpha",
    "tuning_grid",
]

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
    truth: Cluster | None = None,
) -> TuningResult:
    """Best α for `preset` on the last `window` queries (all when None) under `config`.

    `truth`: the engines run its latency models while the policy plans with `cluster`'s
    (`Simulation`): the curve of what each α really gives under that belief. An online
    tuner has no truth to replay with (it replays its belief: leave it None)."""
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
            sim = Simulation(
                replay, cluster, preset.with_alpha(alpha), config, estimator, truth=truth
            )
            tried[alpha] = AlphaPoint.of(alpha, sim.run())
            if progress is not None:
                progress(tried[alpha])
        return tried[alpha]

    best = min((trial(a) for a in grid), key=AlphaPoint.rank)
    if refine:
        ordered = sorted(grid)
        centre = best.alpha  # both midpoints flank the best grid value, whichever of them wins
        pos = min(range(len(ordered)), key=lambda k: abs(ordered[k] - centre))
        for neighbour in (pos - 1, pos + 1):
            if 0 <= neighbour < len(ordered):
                best = min(best, trial((centre + ordered[neighbour]) / 2), key=AlphaPoint.rank)
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
    # Everything else of the run's settings (engine model, prefix caching) stays.
    tuning_config = replace(config, seed=config.seed + 1)
    return tune_alpha(replay, cluster, preset, tuning_config, progress=progress)


# ------------------------------------------------------------------------------ online tuning

_SAME = 1e-9
"""Two α closer than this are the same α."""


@dataclass(frozen=True, slots=True)
class TuningWindow:
    """Recent traffic, ready to replay."""

    queries: tuple[Query, ...]
    """In arrival order; ``arrival_s`` from the first arrival (0), ``slo_s`` explicit."""
    qps: float
    """Arrival rate over the window: (n - 1) / (last arrival - first); 0 when undefined."""

    @property
    def span_s(self) -> float:
        """Seconds from the first arrival to the last."""
        if not self.queries:
            return 0.0
        return self.queries[-1].arrival_s or 0.0

    @classmethod
    def of(cls, records: Iterable[tuple[Query, float, float]]) -> TuningWindow:
        """The window of (query, arrival_s, slo_s) records, in any order: each query with the
        SLO it was given and its arrival relative to the window's first, so a replay sees the
        traffic as it came, at the rate it came (ties in arrival: by query id)."""
        ordered = sorted(records, key=lambda r: (r[1], r[0].query_id))
        if not ordered:
            return cls((), 0.0)
        first = ordered[0][1]
        queries = tuple(
            replace(q, arrival_s=arrival - first, slo_s=slo, slo_scale=None)
            for q, arrival, slo in ordered
        )
        span = ordered[-1][1] - first
        return cls(queries, (len(ordered) - 1) / span if span > 0 else 0.0)


def tuning_grid(current: float) -> tuple[float, ...]:
    """The paper's grid, plus the current α when it is off the grid (so that the current α
    is always replayed and the comparison with it is exact)."""
    grid = set(ALPHA_GRID)
    if math.isfinite(current) and 0.0 <= current <= 1.0:
        grid.add(round(current, 6))
    return tuple(sorted(grid))


@dataclass(frozen=True, slots=True)
class Decision:
    """What a tuning result means for the live α."""

    alpha: float
    """The α to run with: the best one, or the current one when it is as good."""
    change: bool
    """Whether to set `alpha`."""
    reason: str


def _point(curve: tuple[AlphaPoint, ...], alpha: float) -> AlphaPoint | None:
    return next((p for p in curve if abs(p.alpha - alpha) < _SAME), None)


def decide(result: TuningResult, current: float, *, tolerance: float = 0.0) -> Decision:
    """Change α only when the replays found one strictly better than the current α (lower
    P95, then higher SLO attainment): a tie keeps the current α.

    With a `tolerance` > 0, every α whose replayed P95 is within that fraction of the best
    counts as as good as the best (a window's P95 is noisy: see
    docs/online-tuning.md): the current α is kept when it is among them, and otherwise the
    median α among them is taken, the middle of the flat bottom of the curve rather than
    its noisiest edge."""
    best = result.best
    over = f"over {result.window} queries"
    if abs(best.alpha - current) < _SAME:
        return Decision(
            current, False, f"alpha {current:g} is already the best (P95 {best.p95_s:.1f} s {over})"
        )
    now = _point(result.curve, current)
    if now is not None and now.rank()[:2] == best.rank()[:2]:
        return Decision(
            current,
            False,
            f"alpha {best.alpha:g} only ties the current alpha {current:g} "
            f"(P95 {best.p95_s:.1f} s {over}): kept",
        )
    target = best
    if tolerance > 0:
        bound = (1 + tolerance) * best.p95_s
        if now is not None and now.p95_s <= bound:
            return Decision(
                current,
                False,
                f"alpha {current:g} is within {100 * tolerance:g} % of the best alpha "
                f"{best.alpha:g} (P95 {now.p95_s:.1f} s vs {best.p95_s:.1f} s {over}): kept",
            )
        near = [p for p in result.curve if p.p95_s <= bound]  # sorted by α
        target = near[(len(near) - 1) // 2]
    was = f"P95 {now.p95_s:.1f} s -> " if now is not None else ""
    return Decision(
        target.alpha,
        True,
        f"alpha {current:g} -> {target.alpha:g}: {was}P95 {target.p95_s:.1f} s {over}",
    )


def replay_window(
    window: TuningWindow,
    cluster: Cluster,
    preset: Preset,
    current: float,
    *,
    seed: int = 0,
    base: SimConfig | None = None,
) -> TuningResult:
    """Every α of `tuning_grid(current)` (and the refining midpoints) replayed on `window`
    from an empty cluster. Every replayed query carries its own arrival time and SLO: the
    config's rate and scale fill in nothing. `base` supplies the rest of the replays' config
    (the engine model: a simulation's tuner replays on its own engine model)."""
    qps = window.qps or 1.0
    config = SimConfig(qps=qps, seed=seed) if base is None else replace(base, qps=qps, seed=seed)
    return tune_alpha(window.queries, cluster, preset, config, grid=tuning_grid(current))


@dataclass(frozen=True, slots=True)
class Retune:
    """One tuning run of a live system."""

    decision: Decision
    result: TuningResult | None
    """The replays; None when the window was too small to replay."""


def retune(
    window: TuningWindow,
    cluster: Cluster,
    preset: Preset,
    current: float,
    *,
    min_queries: int = 1,
    seed: int = 0,
    tolerance: float = 0.0,
    base: SimConfig | None = None,
) -> Retune:
    """One tuning run: replay `window` for every α (`replay_window`) and `decide` against
    the `current` α; with fewer than `min_queries` queries in the window, keep the current α
    and say why. `preset` must have an α (ConfigError otherwise)."""
    if len(window.queries) < min_queries:
        reason = f"too few queries in the window ({len(window.queries)} < {min_queries})"
        return Retune(Decision(current, False, reason), None)
    result = replay_window(window, cluster, preset, current, seed=seed, base=base)
    return Retune(decide(result, current, tolerance=tolerance), result)


@dataclass(frozen=True, slots=True)
class OnlineSettings:
    """How the simulator's online tuner runs: the mesh tuner's settings (`TunerConfig`), in
    simulated seconds."""

    period_s: float = 120.0
    """Simulated seconds between tuning runs (the first one a period after the start). The
    mesh's period is 30 wall seconds: 30 to 600 cluster seconds at time scales 1 to 20."""
    window: int = 200
    """How many of the most recently admitted queries a run replays."""
    min_queries: int = 20
    """Fewer admitted queries than this: the run changes nothing."""
    seed: int = 0
    """Seed of the replays (the policies' random choices)."""
    tolerance: float = 0.05
    """`decide`'s tolerance: α within this fraction of the best P95 count as the best (0:
    any strictly better α wins; docs/online-tuning.md measures why 0.05)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.period_s) and self.period_s > 0):
            raise ConfigError(f"the tuning period must be finite and > 0, got {self.period_s}")
        if not (math.isfinite(self.tolerance) and 0 <= self.tolerance < 1):
            raise ConfigError(f"tolerance must be in [0, 1), got {self.tolerance}")
        if self.window < 1 or self.min_queries < 1:
            raise ConfigError("the tuning window and min-queries must be >= 1")
        if self.min_queries > self.window:
            raise ConfigError(
                f"min-queries ({self.min_queries}) must not exceed the window ({self.window})"
            )


@dataclass(frozen=True, slots=True)
class AlphaStep:
    """One tuning run of the online tuner."""

    time_s: float
    """Simulated time of the run."""
    alpha: float
    """The α in force after it."""
    changed: bool
    window: int
    """Queries replayed (0: none, the window was too small)."""
    window_qps: float
    """The window's arrival rate."""
    reason: str


class OnlineTuner:
    """The mesh tuner's loop inside a `Simulation`: every `settings.period_s` of simulated
    time it takes the last `settings.window` admitted queries, finished or not (as the mesh's
    tuner reads the coordinator's ``admitted`` stream: a workflow is declared whole when it
    arrives, so its shape is known before it finishes), calls `retune` with the simulation's
    cluster (as learned, where the scheduler learns costs) and preset, and sets the α the
    simulation's dispatcher uses from then on."""

    def __init__(self, settings: OnlineSettings | None = None) -> None:
        self.settings = settings or OnlineSettings()
        self.steps: list[AlphaStep] = []

    def attach(self, sim: Simulation) -> None:
        """Run on `sim` (its preset must have an α, and its query ids must be distinct)."""
        if sim.scheduler.alpha is None:
            raise ConfigError(f"policy {sim.preset.name!r} has no alpha to tune")
        if len({q.query_id for q in sim.queries}) != len(sim.queries):
            raise ConfigError("online tuning needs distinct query ids")
        sim.every(self.settings.period_s, self._tick)

    def _tick(self, now: float, sim: Simulation) -> None:
        settings = self.settings
        current = sim.scheduler.alpha
        assert current is not None  # attach checked that the policy has an α
        window = TuningWindow.of(sim.admitted[-settings.window :])
        run = retune(
            window,
            sim.scheduler.believed_cluster(),  # as learned, where it learns: as the mesh's
            sim.preset,
            current,
            min_queries=settings.min_queries,
            seed=settings.seed,
            tolerance=settings.tolerance,
            base=sim.config,
        )
        decision = run.decision
        if decision.change:
            sim.core.handle(AlphaChanged(decision.alpha))
        replayed = run.result.window if run.result is not None else 0
        self.steps.append(
            AlphaStep(now, decision.alpha, decision.change, replayed, window.qps, decision.reason)
        )


def run_online(
    queries: Sequence[Query],
    cluster: Cluster,
    preset: Preset,
    config: SimConfig,
    settings: OnlineSettings | None = None,
) -> tuple[RunMetrics, tuple[AlphaStep, ...]]:
    """One simulation of `queries` with the online tuner attached, starting at
    `preset.alpha`; its metrics and the tuner's runs."""
    sim = Simulation(queries, cluster, preset, config)
    tuner = OnlineTuner(settings)
    tuner.attach(sim)
    return sim.run(), tuple(tuner.steps)
