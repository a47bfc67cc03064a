"""The SDK's conversions between the API's messages and the core's objects: pure functions
(no I/O) for what a client submits (`submit_request`) and when a query's events end
(`is_terminal`, `TERMINAL_EVENTS`, `TERMINAL_STATES`, `STATE_AFTER`).

A replay's metrics (`hexgen_launch.measure`) and the coordinator's cluster as the simulator
builds it (`hexgen_service.status`) live outside the SDK: they need the simulator's numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

from hexgen_api.v1 import coordinator_pb2
from hexgen_flow.errors import WorkloadError
from hexgen_flow.workload import Query
from hexgen_wire.convert import submit_from_query

__all__ = [
    "STATE_AFTER",
    "TERMINAL_EVENTS",
    "TERMINAL_STATES",
    "is_terminal",
    "submit_request",
]

STATE_AFTER: dict[
    coordinator_pb2.QueryEventKind.ValueType, coordinator_pb2.QueryState.ValueType
] = {
    coordinator_pb2.QUERY_EVENT_KIND_SUCCEEDED: coordinator_pb2.QUERY_STATE_SUCCEEDED,
    coordinator_pb2.QUERY_EVENT_KIND_CANCELLED: coordinator_pb2.QUERY_STATE_CANCELLED,
    coordinator_pb2.QUERY_EVENT_KIND_FAILED: coordinator_pb2.QUERY_STATE_FAILED,
}
"""The state a query is in after each of its terminal events."""
TERMINAL_EVENTS = frozenset(STATE_AFTER)
"""Event kinds after which a query has no more events."""
TERMINAL_STATES = frozenset(STATE_AFTER.values())
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
