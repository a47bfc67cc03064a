"""A worker's Prometheus metrics (``--metrics-listen``): its engine's figures.

Counters and histograms are updated where the worker learns of a call's end; the engine's
load (running, queued, KV cache) is read at scrape time, so scraping costs the engine's
event loop nothing. Every sample carries the worker's id (``worker``), stable across
restarts, and the engine kind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["WorkerMetrics"]

_SECONDS = (0.1, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000)


class WorkerMetrics:
    """Every metric of one worker, in a registry of its own."""

    def __init__(self, worker_id: str, engine: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = (worker_id, engine)
        r, names = self.registry, ["worker", "engine"]
        self.calls = Counter(
            "hexgen_flow_worker_calls",
            "Calls that ended here, by outcome: finished, failed (an engine error).",
            [*names, "outcome"],
            registry=r,
        )
        self.generated_tokens = Counter(
            "hexgen_flow_worker_generated_tokens", "Tokens generated.", names, registry=r
        )
        self.queue_wait = Histogram(
            "hexgen_flow_worker_queue_wait_seconds",
            "A call's wait in the local queue, dispatch to start (cluster s).",
            names,
            buckets=_SECONDS,
            registry=r,
        )
        self.execution = Histogram(
            "hexgen_flow_worker_execution_seconds",
            "A call's time in the engine, start to finish (cluster s).",
            names,
            buckets=_SECONDS,
            registry=r,
        )

        # Every series from the start, at 0: one that first appears with a count in it
        # shows Prometheus's rate() no increase.
        for outcome in ("finished", "failed"):
            self.calls.labels(*self.labels, outcome)
        for metric in (self.generated_tokens, self.queue_wait, self.execution):
            metric.labels(*self.labels)

    def call_ended(
        self, queue_wait_s: float, execution_s: float, tokens: int, *, failed: bool
    ) -> None:
        self.calls.labels(*self.labels, "failed" if failed else "finished").inc()
        if failed:
            return
        self.generated_tokens.labels(*self.labels).inc(tokens)
        self.queue_wait.labels(*self.labels).observe(max(queue_wait_s, 0.0))
        self.execution.labels(*self.labels).observe(max(execution_s, 0.0))

    def watch(self, load: Callable[[], tuple[int, int, int, int]]) -> None:
        """Report `load()` = (running, queued, KV used, KV capacity) at every scrape."""
        self.registry.register(_Load(self.labels, load))


class _Load(Collector):
    def __init__(
        self, labels: tuple[str, str], load: Callable[[], tuple[int, int, int, int]]
    ) -> None:
        self.labels = list(labels)
        self.load = load

    def collect(self) -> Iterator[Metric]:
        values = self.load()
        docs = (
            ("running_calls", "Calls in the engine."),
            ("queued_calls", "Calls in the local queue."),
            ("kv_used_tokens", "KV-cache tokens in use."),
            ("kv_capacity_tokens", "KV-cache tokens the engine holds."),
        )
        for (name, doc), value in zip(docs, values, strict=True):
            family = GaugeMetricFamily(
                f"hexgen_flow_worker_{name}", doc, labels=["worker", "engine"]
            )
            family.add_metric(self.labels, float(value))
            yield family
