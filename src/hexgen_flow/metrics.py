"""Run metrics: end-to-end latency percentiles, SLO attainment, throughput."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["QueryOutcome", "RunMetrics", "json_safe", "percentile"]


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default); NaN for no values."""
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=float), q))


@dataclass(frozen=True, slots=True)
class QueryOutcome:
    query_id: str
    tenant: str
    arrival_s: float
    finished_s: float
    slo_s: float

    @property
    def latency_s(self) -> float:
        return self.finished_s - self.arrival_s

    @property
    def met_slo(self) -> bool:
        return self.latency_s <= self.slo_s


@dataclass(frozen=True)
class RunMetrics:
    """What a run measured; `to_json` is the CLI's stable output contract."""

    policy: str
    alpha: float | None
    qps: float
    num_queries: int
    slo_s: float
    """The run's SLO: scale x SLO_base (queries may override theirs)."""
    outcomes: tuple[QueryOutcome, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def completed(self) -> int:
        return len(self.outcomes)

    @property
    def latencies(self) -> list[float]:
        return [o.latency_s for o in self.outcomes]

    @property
    def slo_attainment(self) -> float:
        """Share of all submitted queries that finished within their SLO."""
        if not self.num_queries:
            return float("nan")
        return sum(o.met_slo for o in self.outcomes) / self.num_queries

    @property
    def makespan_s(self) -> float:
        if not self.outcomes:
            return 0.0
        return max(o.finished_s for o in self.outcomes) - min(o.arrival_s for o in self.outcomes)

    @property
    def throughput_qps(self) -> float:
        span = self.makespan_s
        return self.completed / span if span > 0 else float("nan")

    def latency_summary(self) -> dict[str, float]:
        lat = self.latencies
        return {
            "mean": float(np.mean(lat)) if lat else float("nan"),
            "p50": percentile(lat, 50),
            "p95": percentile(lat, 95),
            "p99": percentile(lat, 99),
        }

    @property
    def p95_s(self) -> float:
        return percentile(self.latencies, 95)

    def tenant_attainment(self) -> dict[str, float]:
        counts: dict[str, list[int]] = {}
        for o in self.outcomes:
            met_total = counts.setdefault(o.tenant, [0, 0])
            met_total[0] += o.met_slo
            met_total[1] += 1
        return {t: met / total for t, (met, total) in sorted(counts.items())}

    def to_json(self, per_query: bool = True) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "policy": self.policy,
            "alpha": self.alpha,
            "qps": self.qps,
            "num_queries": self.num_queries,
            "completed": self.completed,
            "slo_s": self.slo_s,
            "slo_attainment": self.slo_attainment,
            "throughput_qps": self.throughput_qps,
            "makespan_s": self.makespan_s,
            "latency_s": self.latency_summary(),
        }
        tenants = self.tenant_attainment()
        if len(tenants) > 1:
            doc["tenant_attainment"] = tenants
        doc.update(self.extra)
        if per_query:
            doc["queries"] = [
                {
                    "query_id": o.query_id,
                    "tenant": o.tenant,
                    "arrival_s": o.arrival_s,
                    "latency_s": o.latency_s,
                    "slo_s": o.slo_s,
                }
                for o in self.outcomes
            ]
        return doc
