"""The tuner's Prometheus metrics (``--metrics-listen``): its runs, what they found, what
they pushed."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hexgen_tuner.store import TuningRunRecord

__all__ = ["TunerMetrics"]


class TunerMetrics:
    """Every metric of one tuner, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.runs = Counter(
            "hexgen_flow_tuner_runs",
            "Tuning runs by outcome: applied (a new alpha pushed), kept (the alpha in force "
            "is among the best), skipped (too few queries, or nothing to replay or reach).",
            ["outcome"],
            registry=r,
        )
        self.run_seconds = Histogram(
            "hexgen_flow_tuner_run_seconds",
            "Wall seconds of a tuning run (the window's replays at every alpha).",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120),
            registry=r,
        )
        self.best_alpha = Gauge(
            "hexgen_flow_tuner_best_alpha", "The alpha the latest run found best.", registry=r
        )
        self.window_queries = Gauge(
            "hexgen_flow_tuner_window_queries",
            "Finished queries the latest run replayed.",
            registry=r,
        )
        self.best_p95 = Gauge(
            "hexgen_flow_tuner_replayed_p95_seconds",
            "The replayed P95 latency at the best alpha of the latest run (cluster s).",
            registry=r,
        )

    def observe(self, run: TuningRunRecord, wall_s: float) -> None:
        """Count a finished run."""
        outcome = "applied" if run.applied else "kept" if run.curve else "skipped"
        self.runs.labels(outcome).inc()
        self.run_seconds.observe(wall_s)
        if not run.curve:
            return
        self.best_alpha.set(run.best_alpha)
        self.window_queries.set(run.window_queries)
        best = [p.p95_s for p in run.curve if abs(p.alpha - run.best_alpha) < 1e-9]
        self.best_p95.set(best[0] if best else math.nan)
