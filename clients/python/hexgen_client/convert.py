"""The client's conversions between the API's messages and the core's objects.

Pure functions (no I/O), shared by the client, `replay`, the CLI and the tuner:

- what a replay submits (`submit_request`) and when (`arrival_schedule`: exactly the
  simulator's arrival process for the same seed);
- what a finished query measured (`outcome_from_info`) and a run's metrics from them
  (`run_metrics`), in cluster seconds, so they compare directly with ``hexgen-flow
  simulate``;
- the coordinator's cluster and preset as the simulator needs them (`cluster_from_status`,
  `preset_from_status`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence

from hexgen_api.v1 import coordinator_pb2
from hexgen_flow.cluster import Cluster
from hexgen_flow.errors import HexgenFlowError, WorkloadError
from hexgen_flow.metrics import QueryOutcome, RunMetrics
from hexgen_flow.policies.presets import Preset, resolve_policy
from hexgen_flow.sim.arrivals import arrival_times
from hexgen_flow.workload import Query
from hexgen_service.convert import submit_from_query

__all__ = [
    "TERMINAL_EVENTS",
    "TERMINAL_STATES",
    "arrival_schedule",
    "cluster_from_status",
    "default_slo_s",
    "is_terminal",
    "outcome_from_info",
    "policy_alpha",
    "preset_from_status",
    "run_metrics",
    "submit_request",
]

TERMINAL_EVENTS = frozenset(
    {
        coordinator_pb2.QUERY_EVENT_KIND_SUCCEEDED,
        coordinator_pb2.QUERY_EVENT_KIND_CANCELLED,
        coordinator_pb2.QUERY_EVENT_KIND_FAILED,
    }
)
"""Event kinds after which a query has no more events."""
TERMINAL_STATES = frozenset(
    {
        coordinator_pb2.QUERY_STATE_SUCCEEDED,
        coordinator_pb2.QUERY_STATE_CANCELLED,
        coordinator_pb2.QUERY_STATE_FAILED,
    }
)
"""Query states that do not change any more."""


def is_terminal(event: coordinator_pb2.QueryEvent) -> bool:
    return event.kind in TERMINAL_EVENTS


def submit_request(
    query: Query,
    slo_scale: float | None = None,
    prompts: Sequence[Sequence[str]] | None = None,
) -> coordinator_pb2.SubmitQueryRequest:
    """The submission of `query`; `slo_scale` applies when it carries no SLO of its own
    (as ``simulate --slo-scale`` does). The query's `arrival_s` is not sent: the coordinator
    stamps the arrival when the submission reaches it.

    `prompts`, for real engines: per stage of the workflow, the prompt of each of its calls
    (``""``: none, the engine makes one up of the call's input tokens); `WorkloadError` unless
    it has the workflow's shape. Without it the calls carry no prompt."""
    request = submit_from_query(query)
    if slo_scale is not None and query.slo_s is None and query.slo_scale is None:
        request.slo_scale = slo_scale
    if prompts is not None:
        stages = request.workflow.stages
        shape = [len(stage.calls) for stage in stages]
        if [len(p) for p in prompts] != shape:
            raise WorkloadError(
                f"query {query.query_id}: prompts must give one per call of each stage "
                f"(calls per stage: {shape}), got {[len(p) for p in prompts]}"
            )
        for stage, texts in zip(stages, prompts, strict=True):
            for call, text in zip(stage.calls, texts, strict=True):
                call.prompt = text
    return request


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


def cluster_from_status(
    status: coordinator_pb2.ClusterStatusResponse, calibration: str | None = None
) -> Cluster:
    """The coordinator's cluster as the simulator builds it: each slot's GPU and model, and
    its KV-cache size where the coordinator reports one, with latency from `calibration`
    (the coordinator's; the status does not carry it; None: ``aiconfigurator``)."""
    entries: list[dict[str, object]] = []
    for inst in sorted(status.instances, key=lambda i: i.index):
        entry: dict[str, object] = {"gpu": inst.gpu, "model": inst.model}
        if inst.kv_capacity_tokens > 0:
            entry["kv_cache_tokens"] = int(inst.kv_capacity_tokens)
        entries.append(entry)
    gpus = ",".join(inst.gpu for inst in sorted(status.instances, key=lambda i: i.index))
    return Cluster.build(entries, gpus, calibration=calibration)


def preset_from_status(status: coordinator_pb2.ClusterStatusResponse) -> Preset:
    """The coordinator's policy, with its current α when the policy has one."""
    preset = resolve_policy(status.policy)
    return preset.with_alpha(status.alpha) if preset.has_alpha else preset
