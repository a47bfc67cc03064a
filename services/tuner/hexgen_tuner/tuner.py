"""`AlphaTuner`: one tuning run, and the loop that runs one every period.

A run (docs/algorithm.md §6, online):

1. read the last `window` finished queries from Redis (`read_window`);
2. ask the coordinator for its cluster, policy and α (ClusterStatus);
3. with at least `min_queries` of them and a policy that has an α, replay the window in the
   simulator for every α of the grid (plus the current α, so the comparison is exact, and
   the refining midpoints): `hexgen_flow.tuning.tune_alpha`, in a worker thread;
4. push the best α with SetAlpha (reason: the run id) when it beats the current one;
5. record the run (and any α change) in Redis (`TunerStore`).

Every run is recorded, including those that changed nothing, with the reason why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from opentelemetry import trace

from hexgen_client.client import CoordinatorClient
from hexgen_client.convert import cluster_from_status
from hexgen_client.errors import CoordinatorError, CoordinatorUnavailableError
from hexgen_flow.cluster import Cluster
from hexgen_flow.errors import HexgenFlowError
from hexgen_flow.policies.presets import Preset, resolve_policy
from hexgen_flow.sim.simulator import SimConfig
from hexgen_flow.tuning import ALPHA_GRID, AlphaPoint, TuningResult, tune_alpha
from hexgen_tuner.config import TunerConfig
from hexgen_tuner.store import AlphaChange, TunerStore, TuningRunRecord
from hexgen_tuner.window import TrafficWindow, read_window

__all__ = ["OBSERVED", "AlphaTuner", "Decision", "decide", "tuning_grid"]

log = logging.getLogger(__name__)

OBSERVED = "observed at the coordinator"
"""Reason of an α change the tuner did not make (the coordinator's initial α, or one set by
someone else)."""

_SAME = 1e-9


@dataclass(frozen=True, slots=True)
class Decision:
    """What a tuning result means for the coordinator's α."""

    alpha: float
    """The α to run with: the best one, or the current one when it is as good."""
    change: bool
    """Whether to push `alpha` to the coordinator."""
    reason: str


def _point(curve: tuple[AlphaPoint, ...], alpha: float) -> AlphaPoint | None:
    return next((p for p in curve if abs(p.alpha - alpha) < _SAME), None)


def decide(result: TuningResult, current: float) -> Decision:
    """Change α only when the replays found one strictly better than the current α (lower
    P95, then higher SLO attainment): a tie keeps the current α."""
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
    was = f"P95 {now.p95_s:.1f} s -> " if now is not None else ""
    return Decision(
        best.alpha,
        True,
        f"alpha {current:g} -> {best.alpha:g}: {was}P95 {best.p95_s:.1f} s {over}",
    )


def tuning_grid(current: float) -> tuple[float, ...]:
    """The paper's grid, plus the current α when it is off the grid."""
    grid = set(ALPHA_GRID)
    if math.isfinite(current) and 0.0 <= current <= 1.0:
        grid.add(round(current, 6))
    return tuple(sorted(grid))


class AlphaTuner:
    """Runs tuning runs, one at a time, against one coordinator and one Redis."""

    def __init__(
        self,
        config: TunerConfig,
        redis_client: aioredis.Redis[bytes],
        coordinator: CoordinatorClient,
        *,
        tracer: trace.Tracer | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.redis = redis_client
        self.coordinator = coordinator
        self.store = TunerStore(
            redis_client,
            config.redis_prefix,
            runs_kept=config.runs_kept,
            history_kept=config.history_kept,
        )
        self.tracer = tracer or trace.get_tracer("hexgen-tuner")
        self.clock = clock
        self._lock = asyncio.Lock()

    # --------------------------------------------------------------------------- α

    async def current_alpha(self) -> float:
        """The coordinator's α; the last one recorded when the coordinator cannot be asked.
        Raises `CoordinatorError` when neither is known."""
        try:
            status = await self.coordinator.status()
        except CoordinatorError:
            last = await self.store.last_alpha()
            if last is None:
                raise
            return last.alpha
        await self._observe(status.alpha)
        return status.alpha

    async def _observe(self, alpha: float) -> None:
        last = await self.store.last_alpha()
        if last is None or abs(last.alpha - alpha) >= _SAME:
            await self.store.record_alpha(AlphaChange(self.clock(), alpha, OBSERVED))

    # ------------------------------------------------------------------------ runs

    async def tune_once(self) -> TuningRunRecord:
        """One tuning run, recorded (runs never overlap: a second caller waits)."""
        async with self._lock:
            with self.tracer.start_as_current_span("tuning_run") as span:
                run = await self._run()
                span.set_attributes(
                    {
                        "hexgen.run_id": run.run_id,
                        "hexgen.window_queries": run.window_queries,
                        "hexgen.previous_alpha": run.previous_alpha,
                        "hexgen.best_alpha": run.best_alpha,
                        "hexgen.applied": run.applied,
                        "hexgen.reason": run.reason,
                    }
                )
            log.info("%s: %s", run.run_id, run.reason)
            return run

    async def _run(self) -> TuningRunRecord:
        config = self.config
        run_id = await self.store.next_run_id()
        started = self.clock()
        window = await read_window(self.redis, config.redis_prefix, config.window)

        async def finish(
            reason: str,
            previous: float,
            *,
            best: float | None = None,
            result: TuningResult | None = None,
            applied: bool = False,
        ) -> TuningRunRecord:
            if window.skipped:
                reason += f" ({window.skipped} unreadable entries skipped)"
            run = TuningRunRecord(
                run_id=run_id,
                started_s=started,
                finished_s=self.clock(),
                window_queries=result.window if result is not None else 0,
                qps=window.qps,
                curve=result.curve if result is not None else (),
                best_alpha=previous if best is None else best,
                previous_alpha=previous,
                applied=applied,
                reason=reason,
            )
            await self.store.record_run(run)
            return run

        try:
            status = await self.coordinator.status()
        except CoordinatorUnavailableError as exc:
            return await finish(
                f"cannot reach the coordinator at {exc.address} ({exc.details or 'UNAVAILABLE'})",
                math.nan,
            )
        except CoordinatorError as exc:
            return await finish(f"ClusterStatus failed: {exc}", math.nan)
        previous = status.alpha
        await self._observe(previous)
        try:
            preset = resolve_policy(status.policy)
        except HexgenFlowError as exc:
            return await finish(f"the coordinator's policy is not known here: {exc}", previous)
        if not preset.has_alpha:
            return await finish(f"policy {preset.name!r} has no alpha: nothing to tune", previous)
        if len(window.queries) < config.min_queries:
            return await finish(
                f"too few queries in the window ({len(window.queries)} < {config.min_queries})",
                previous,
            )
        try:
            cluster = cluster_from_status(status, config.calibration)
            result = await asyncio.to_thread(self.replay_window, window, cluster, preset, previous)
        except HexgenFlowError as exc:
            return await finish(f"cannot replay the window: {exc}", previous)

        decision = decide(result, previous)
        if not decision.change:
            return await finish(decision.reason, previous, best=decision.alpha, result=result)
        try:
            await self.coordinator.set_alpha(decision.alpha, reason=run_id)
        except CoordinatorError as exc:
            return await finish(
                f"{decision.reason}; SetAlpha failed: {exc}",
                previous,
                best=decision.alpha,
                result=result,
            )
        await self.store.record_alpha(AlphaChange(self.clock(), decision.alpha, run_id))
        return await finish(
            decision.reason, previous, best=decision.alpha, result=result, applied=True
        )

    def replay_window(
        self, window: TrafficWindow, cluster: Cluster, preset: Preset, current: float
    ) -> TuningResult:
        """The replays (CPU work: runs in a worker thread). Every replayed query carries its
        own arrival time and SLO: the config's rate and scale fill in nothing."""
        sim_config = SimConfig(qps=window.qps or 1.0, seed=self.config.seed)
        return tune_alpha(window.queries, cluster, preset, sim_config, grid=tuning_grid(current))

    # ------------------------------------------------------------------------ loop

    async def run_periodically(self, stop: asyncio.Event) -> None:
        """A tuning run every `period_s` until `stop` is set; a failed run is logged and the
        loop goes on."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.period_s)
            if stop.is_set():
                return
            try:
                await self.tune_once()
            except Exception:
                log.exception("tuning run failed")
