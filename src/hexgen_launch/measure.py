"""A replay's measurements as the simulator's: pure functions (no I/O) from the
coordinator's messages to the core's metrics, shared by `hexgen_launch.replay` and the
benchmarks.

- when a replay submits (`arrival_schedule`: exactly the simulator's arrival process for
  the same seed);
- what a finished query measured (`outcome_from_info`) and a run's metrics from them
  (`run_metrics`), in cluster seconds, so they compare directly with ``hexgen-flow
  simulate``; the α to report (`policy_alpha`) and the SLO a run had (`default_slo_s`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence

from hexgen_api.v1 import coordinator_pb2
from hexgen_flow.errors import HexgenFlowError
from hexgen_flow.metrics import QueryOutcome, RunMetrics
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.sim.arrivals import arrival_times
from hexgen_flow.workload import Query

__all__ = [
    "arrival_schedule",
    "default_slo_s",
    "outcome_from_info",
    "policy_alpha",
    "run_metrics",
]


def arrival_schedule(
    queries: Sequence[Query], qps: float, arrival_cv: float = 1.0, seed: int = 0
) -> list[tuple[float, int]]:
    """``(arrival_s, index)`` of every query in arrival order: the simulator's arrival process
    for the same seed (`Simulation` draws from ``random.Random(seed)`` the same way), explicit
    `Query.arrival_s` included. Times are seconds from the run's start, cluster time."""
    times = arrival_times(queries, qps, arrival_cv, random.Random(seed))
    return sorted((t, i) for i, t in enumerate(times))


def outcome_from_info(info: coordinator_pb2.QueryInfo) -> QueryOutcome | None:
    """What a query measured (cluster seconds), or None unless it succeeded."""
    if info.state != coordinator_pb2.QUERY_STATE_SUCCEEDED:
        return None
    return QueryOutcome(
        query_id=info.query_id,
        tenant=info.tenant or "default",
        arrival_s=info.arrival_s,
        finished_s=info.finished_s,
        slo_s=info.slo_s,
    )


def policy_alpha(policy: str, alpha: float) -> float | None:
    """The α to report for `policy`: None when its dispatcher has none (as `simulate`
    reports), `alpha` when it has one or when the policy name is unknown here."""
    try:
        preset = resolve_policy(policy)
    except HexgenFlowError:
        return alpha
    return alpha if preset.has_alpha else None


def run_metrics(
    infos: Iterable[coordinator_pb2.QueryInfo],
    *,
    policy: str,
    alpha: float | None,
    qps: float,
    num_queries: int,
    slo_s: float,
    extra: dict[str, object] | None = None,
) -> RunMetrics:
    """A replay's `RunMetrics` from the coordinator's final `QueryInfo` of each query:
    succeeded queries are the outcomes (ordered as the simulator orders them), the others
    count as submitted but not completed."""
    outcomes = [o for o in map(outcome_from_info, infos) if o is not None]
    outcomes.sort(key=lambda o: (o.arrival_s, o.query_id))
    return RunMetrics(
        policy=policy,
        alpha=alpha,
        qps=qps,
        num_queries=num_queries,
        slo_s=slo_s,
        outcomes=tuple(outcomes),
        extra=dict(extra or {}),
    )


def default_slo_s(queries: Sequence[Query], infos: Sequence[coordinator_pb2.QueryInfo]) -> float:
    """The SLO the coordinator gave queries without one of their own (its default scale x
    SLO_base): the run's SLO when the replay did not choose a scale. NaN if every query
    carried its own."""
    own = {q.query_id for q in queries if q.slo_s is not None or q.slo_scale is not None}
    for info in infos:
        if info.query_id not in own and info.slo_s > 0:
            return info.slo_s
    return math.nan
