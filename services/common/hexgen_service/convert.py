"""Protobuf <-> domain conversion: the one place where messages meet the core's objects.

Requests are validated here, and a bad field raises `InvalidFieldError` naming its path,
which the services turn into INVALID_ARGUMENT. No protobuf message goes past this module
into a policy.
"""

from __future__ import annotations

import math

from hexgen_api.v1 import coordinator_pb2, worker_pb2, workflow_pb2
from hexgen_flow.errors import WorkloadError
from hexgen_flow.runtime import CallTicket
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow, canonical_step
from hexgen_service.errors import InvalidFieldError

__all__ = [
    "MAX_CALLS_PER_QUERY",
    "MAX_TOKENS_PER_CALL",
    "dispatch_to_ticket",
    "expand_workflow",
    "parse_submit",
    "query_from_submit",
    "submit_from_query",
    "ticket_to_dispatch",
    "workflow_from_proto",
    "workflow_to_proto",
]

# Guards against a request that would take the coordinator down rather than be served.
MAX_CALLS_PER_QUERY = 10_000
MAX_TOKENS_PER_CALL = 10_000_000


def workflow_to_proto(workflow: Workflow) -> workflow_pb2.Workflow:
    """A workflow as the proto expresses it: stages with explicit ids and `after` lists."""
    return workflow_pb2.Workflow(
        stages=[
            workflow_pb2.Stage(
                id=f"s{k}",
                step=stage.step,
                after=[f"s{j}" for j in stage.after],
                calls=[
                    workflow_pb2.LLMCall(
                        step=call.step if call.step != stage.step else "",
                        input_tokens=call.input_tokens,
                        output_tokens=call.output_tokens,
                    )
                    for call in stage.calls
                ],
            )
            for k, stage in enumerate(workflow.stages)
        ]
    )


def workflow_from_proto(pb: workflow_pb2.Workflow, field: str = "workflow") -> Workflow:
    """Validate and expand a proto workflow (repeats unrolled) into the domain model."""
    return expand_workflow(pb, field)[0]


def expand_workflow(
    pb: workflow_pb2.Workflow, field: str = "workflow"
) -> tuple[Workflow, list[tuple[str, ...]]]:
    """The domain workflow and, per expanded stage, the prompts of its calls ("" if none)."""
    if not pb.stages:
        raise InvalidFieldError(f"{field}.stages", "a workflow needs at least one stage")
    stages: list[Stage] = []
    prompts: list[tuple[str, ...]] = []
    last_of: dict[str, int] = {}
    total_calls = 0
    for n, spb in enumerate(pb.stages):
        where = f"{field}.stages[{n}]"
        sid = spb.id or f"#{n}"
        if sid in last_of:
            raise InvalidFieldError(f"{where}.id", f"duplicate stage id {sid!r}")
        if not spb.step:
            raise InvalidFieldError(f"{where}.step", "must not be empty")
        if not spb.calls:
            raise InvalidFieldError(f"{where}.calls", "a stage needs at least one call")
        if spb.repeat < 0:
            raise InvalidFieldError(f"{where}.repeat", f"must be >= 0, got {spb.repeat}")
        step = canonical_step(spb.step)
        calls = []
        for c, cpb in enumerate(spb.calls):
            cwhere = f"{where}.calls[{c}]"
            for name in ("input_tokens", "output_tokens"):
                value = getattr(cpb, name)
                if not 1 <= value <= MAX_TOKENS_PER_CALL:
                    raise InvalidFieldError(
                        f"{cwhere}.{name}", f"must be in [1, {MAX_TOKENS_PER_CALL}], got {value}"
                    )
            calls.append(
                LLMCall(
                    canonical_step(cpb.step) if cpb.step else step,
                    cpb.input_tokens,
                    cpb.output_tokens,
                )
            )
        after = []
        for a, dep in enumerate(spb.after):
            if dep not in last_of:
                raise InvalidFieldError(
                    f"{where}.after[{a}]", f"{dep!r} is not the id of an earlier stage"
                )
            after.append(last_of[dep])
        deps = tuple(sorted(set(after)))
        for _ in range(max(spb.repeat, 1)):
            total_calls += len(calls)
            if total_calls > MAX_CALLS_PER_QUERY:
                raise InvalidFieldError(
                    f"{where}.repeat", f"the workflow exceeds {MAX_CALLS_PER_QUERY} calls"
                )
            stages.append(Stage(step=step, calls=tuple(calls), after=deps))
            prompts.append(tuple(cpb.prompt for cpb in spb.calls))
            deps = (len(stages) - 1,)
        last_of[sid] = len(stages) - 1
    try:
        return Workflow(tuple(stages)), prompts
    except WorkloadError as exc:
        raise InvalidFieldError(field, str(exc)) from None


def query_from_submit(request: coordinator_pb2.SubmitQueryRequest) -> Query:
    """The domain query of a submission (its SLO is resolved by the coordinator)."""
    return parse_submit(request)[0]


def parse_submit(
    request: coordinator_pb2.SubmitQueryRequest,
) -> tuple[Query, list[tuple[str, ...]]]:
    """The domain query of a submission and, per expanded stage, its calls' prompts."""
    if not request.query_id:
        raise InvalidFieldError("query_id", "must not be empty (it is the idempotency key)")
    if len(request.query_id) > 256:
        raise InvalidFieldError("query_id", "must be at most 256 characters")
    for name in ("slo_s", "slo_scale"):
        value = getattr(request, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidFieldError(name, f"must be a finite number >= 0, got {value}")
    if request.slo_s and request.slo_scale:
        raise InvalidFieldError("slo_s", "give slo_s or slo_scale, not both")
    if not request.HasField("workflow"):
        raise InvalidFieldError("workflow", "is required")
    workflow, prompts = expand_workflow(request.workflow)
    query = Query(
        query_id=request.query_id,
        workflow=workflow,
        tenant=request.tenant or "default",
        slo_s=request.slo_s or None,
        slo_scale=request.slo_scale or None,
    )
    return query, prompts


def submit_from_query(query: Query) -> coordinator_pb2.SubmitQueryRequest:
    return coordinator_pb2.SubmitQueryRequest(
        query_id=query.query_id,
        tenant=query.tenant,
        workflow=workflow_to_proto(query.workflow),
        slo_s=query.slo_s or 0.0,
        slo_scale=query.slo_scale or 0.0,
    )


def ticket_to_dispatch(
    ticket: CallTicket, prompt: str = "", traceparent: str = ""
) -> worker_pb2.DispatchCall:
    call = ticket.call
    return worker_pb2.DispatchCall(
        call_id=ticket.call_id,
        query_id=ticket.query_id,
        tenant=ticket.tenant,
        stage=ticket.stage,
        step=call.step,
        input_tokens=call.input_tokens,
        output_tokens=call.output_tokens,
        prompt=prompt,
        sequence=ticket.seq,
        query_sequence=ticket.query_seq,
        released_s=ticket.released_s,
        deadline_s=ticket.deadline_s,
        query_deadline_s=ticket.query_deadline_s,
        remaining_after_s=ticket.remaining_after_s,
        traceparent=traceparent,
    )


def dispatch_to_ticket(pb: worker_pb2.DispatchCall) -> CallTicket:
    """The worker-side ticket of a dispatched call."""
    return CallTicket.detached(
        seq=pb.sequence,
        call_id=pb.call_id,
        query_id=pb.query_id,
        query_seq=pb.query_sequence,
        tenant=pb.tenant,
        stage=pb.stage,
        call=LLMCall(pb.step, pb.input_tokens, pb.output_tokens),
        released_s=pb.released_s,
        deadline_s=pb.deadline_s,
        query_deadline_s=pb.query_deadline_s,
        remaining_after_s=pb.remaining_after_s,
    )
