"""`AlphaTuner`: one tuning run, and the loop that runs one every period.

A run (docs/algorithm.md §6, online):

1. read the last `window` admitted queries from Redis (`read_window`: workflows declared
   whole from the moment they are admitted, sessions once they finished);
2. ask the coordinator for its cluster, policy and α (ClusterStatus); where it learns
   instances' costs (``--learn-costs``), the replay runs each instance as learned
   (`hexgen_service.status.cluster_from_status`), the model its dispatcher plans with;
3. with a policy that has an α, `hexgen_flow.tuning.retune` (in a worker thread): with at
   least `min_queries` queries, replay the window in the simulator for every α of the grid
   (plus the current α, so the comparison is exact, and the refining midpoints) and decide
   (`hexgen_flow.tuning.decide`) whether the best one beats the current α;
4. push the new α with SetAlpha (reason: the run id) when it does;
5. record the run in Redis (`TunerStore`).

The α history is the coordinator's alone: it records every change it applies (a SetAlpha
with its reason, so the tuner's say which run set them, and the α it started with), and the
tuner reads it with GetAlphaHistory (`alpha_history`, what ``GetAlpha`` shows).

Every run is recorded, including those that changed nothing, with the reason why. The
tuning run itself (`retune`, `decide`, `tuning_grid`) is the core's: the simulator's online
tuner (`hexgen_flow.tuning.OnlineTuner`) runs the very same code on its own windows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

import grpc
import redis.asyncio as aioredis
from opentelemetry import trace

from hexgen_api.v1 import coordinator_pb2
from hexgen_client.addresses import split_addresses
from hexgen_client.client import CoordinatorClient
from hexgen_client.errors import CoordinatorError, CoordinatorUnavailableError
from hexgen_flow.cluster import Cluster
from hexgen_flow.errors import HexgenFlowError
from hexgen_flow.policies.presets import Preset, resolve_policy
from hexgen_flow.tuning import (
    Decision,
    Retune,
    TuningResult,
    decide,
    replay_window,
    retune,
    tuning_grid,
)
from hexgen_service.status import cluster_from_status
from hexgen_tuner.config import TunerConfig
from hexgen_tuner.metrics import TunerMetrics
from hexgen_tuner.store import TunerStore, TuningRunRecord
from hexgen_tuner.window import TrafficWindow, read_sharded_window, read_window

__all__ = ["AlphaTuner", "Decision", "decide", "tuning_grid"]

log = logging.getLogger(__name__)


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
        )
        self.tracer = tracer or trace.get_tracer("hexgen-tuner")
        self.clock = clock
        self.metrics = TunerMetrics()
        """The tuner's Prometheus metrics (served with ``--metrics-listen``)."""
        self._lock = asyncio.Lock()

    # --------------------------------------------------------------------------- α

    async def alpha_history(self) -> coordinator_pb2.GetAlphaHistoryResponse:
        """The coordinator's α and its one α history, oldest first (GetAlphaHistory; with
        shards, the first coordinator's that answers: each keeps its own, and every one
        holds the changes the tuner pushed to all). A coordinator older than
        GetAlphaHistory: its α (ClusterStatus) and no history. Raises `CoordinatorError`
        when none can be asked."""
        try:
            return await self.coordinator.alpha_history()
        except CoordinatorError as exc:
            if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
        status = await self.coordinator.status()
        return coordinator_pb2.GetAlphaHistoryResponse(alpha=status.alpha)

    # ------------------------------------------------------------------------ runs

    async def tune_once(self) -> TuningRunRecord:
        """One tuning run, recorded (runs never overlap: a second caller waits)."""
        async with self._lock:
            with self.tracer.start_as_current_span("tuning_run") as span:
                started = time.monotonic()
                run = await self._run()
                self.metrics.observe(run, time.monotonic() - started)
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
        if config.shards:
            window = await read_sharded_window(self.redis, config.shards, config.window)
        else:
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
        try:
            preset = resolve_policy(status.policy)
        except HexgenFlowError as exc:
            return await finish(f"the coordinator's policy is not known here: {exc}", previous)
        if not preset.has_alpha:
            return await finish(f"policy {preset.name!r} has no alpha: nothing to tune", previous)
        try:
            cluster = cluster_from_status(status, config.calibration)
            learned = [i.name for i in status.instances if i.learned_calls > 0]
            if learned:  # the coordinator learns costs: replayed as it believes them
                log.info("replaying with the learned costs of %s", ", ".join(learned))
            run = await asyncio.to_thread(self.retune_window, window, cluster, preset, previous)
        except HexgenFlowError as exc:
            return await finish(f"cannot replay the window: {exc}", previous)

        decision, result = run.decision, run.result
        if result is None:  # too few queries to replay
            return await finish(decision.reason, previous)
        if not decision.change:
            return await finish(decision.reason, previous, best=decision.alpha, result=result)
        try:
            await self.push_alpha(decision.alpha, run_id)
        except CoordinatorError as exc:
            return await finish(
                f"{decision.reason}; SetAlpha failed: {exc}",
                previous,
                best=decision.alpha,
                result=result,
            )
        return await finish(
            decision.reason, previous, best=decision.alpha, result=result, applied=True
        )

    async def push_alpha(self, alpha: float, reason: str) -> None:
        """SetAlpha at the coordinator; with shards at every coordinator given (each keeps
        its shard's α in Redis, so a spare that takes a shard over starts with it). A
        coordinator that does not answer (a spare, a dead one) is skipped; CoordinatorError
        when none took it."""
        if not self.config.shards:
            await self.coordinator.set_alpha(alpha, reason=reason)
            return
        took: list[str] = []
        failures: list[str] = []
        for address in split_addresses(self.config.coordinator):
            one = self.coordinator.one(address)
            try:
                await one.set_alpha(alpha, reason=reason)
                took.append(address)
            except CoordinatorUnavailableError as exc:
                failures.append(f"{address}: {exc}")
            finally:
                await one.close()
        if not took:
            raise CoordinatorUnavailableError(
                self.config.coordinator,
                "; ".join(failures),
                message="no coordinator answered SetAlpha: " + "; ".join(failures),
            )
        log.info("alpha %g set at %s", alpha, ", ".join(took))

    def retune_window(
        self, window: TrafficWindow, cluster: Cluster, preset: Preset, current: float
    ) -> Retune:
        """One tuning run on `window` (`hexgen_flow.tuning.retune`; CPU work: runs in a
        worker thread)."""
        return retune(
            window.tuning,
            cluster,
            preset,
            current,
            min_queries=self.config.min_queries,
            seed=self.config.seed,
            tolerance=self.config.tolerance,
        )

    def replay_window(
        self, window: TrafficWindow, cluster: Cluster, preset: Preset, current: float
    ) -> TuningResult:
        """The replays alone (`hexgen_flow.tuning.replay_window`). Every replayed query
        carries its own arrival time and SLO: the config's rate and scale fill in nothing."""
        return replay_window(window.tuning, cluster, preset, current, seed=self.config.seed)

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
