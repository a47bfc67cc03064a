"""The client API's wire: ``coordinator_pb2`` to and from
`hexgen_coordinator.client_messages` (the requests a client sends, the answers and the
events it gets), and the stored forms of the client API's messages to and from their bytes.

The gRPC servicer (`hexgen_coordinator.service`) decodes every request here
(`decode_submit`, `decode_open_workflow`, `decode_run_call`: a submission is checked against
the coordinator's input limits as it is decoded) and encodes every answer. Redis is the
other edge: it keeps the client API's messages as bytes (a coordinator of another version
reads them), so the module that owns each stored form uses this module too:

- a query's event log, ``QueryEvent`` bytes: `hexgen_coordinator.write_behind` writes it
  (`event_to_bytes`), `hexgen_coordinator.views` reads it back (`event_from_bytes`);
- a query's submission without its prompts, ``SubmitQueryRequest`` bytes:
  `hexgen_coordinator.admission` writes it (`Submission.shape`, which `decode_submit`
  binds to the request), `hexgen_coordinator.session_store`, which rebuilds a stored
  query, reads it (`submission_from_bytes`) for recovery, admission and views;
- a query's prompts until their calls complete, ``LLMCall`` bytes:
  `hexgen_coordinator.admission` writes a submission's (`prompt_to_bytes`),
  `hexgen_coordinator.session_store` a session's given call's, with its chat part, and
  reads them all back (`call_from_bytes`);
- a session's given calls (``LLMCall`` bytes: `call_to_bytes`, `call_from_bytes`) and
  its shape (``SubmitQueryRequest`` bytes: `shape_to_bytes`): `session_store` writes both
  and reads the calls back.

No other module of the coordinator imports this one, and those that are free of the
client API's protobuf stay so (tests/test_layers.py checks both).

Each translation builds one message field by field (a zero kept as a zero, an enum as its
number; a submission's shape is the request with its prompts emptied, as it always was), so
the bytes are those the coordinator wrote before the translation existed
(tests/test_client_wire.py compares them with the old constructions), and a request is
checked as it was, each error naming the field of the request the client sent.
"""

from __future__ import annotations

import math
import time
from functools import partial
from typing import cast

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import workflow_pb2 as wfpb
from hexgen_coordinator.client_messages import (
    AlphaHistory,
    CallSubmitted,
    ClusterStatus,
    EventKind,
    GivenCall,
    LatencySummary,
    OpenWorkflow,
    QueryDetail,
    QueryEvent,
    QueryInfo,
    RunCall,
    StageInfo,
    Submission,
    ToolCall,
    opened_fields,
)
from hexgen_coordinator.worker_messages import Chat
from hexgen_flow.workload import LLMCall, Query
from hexgen_service.convert import (
    SubmitLimits,
    check_text,
    parse_submit,
    stage_names,
    submit_from_query,
    template_to_proto,
    without_prompts,
)
from hexgen_service.errors import InvalidFieldError

__all__ = [
    "call_from_bytes",
    "call_to_bytes",
    "chat_part",
    "decode_event",
    "decode_open_workflow",
    "decode_run_call",
    "decode_submit",
    "encode_alpha_history",
    "encode_call_update",
    "encode_detail",
    "encode_event",
    "encode_info",
    "encode_status",
    "event_from_bytes",
    "event_to_bytes",
    "prompt_to_bytes",
    "shape_to_bytes",
    "submission_from_bytes",
]


# ------------------------------------------------------------------ requests


def decode_submit(request: cpb.SubmitQueryRequest, limits: SubmitLimits) -> Submission:
    """A submission (SubmitQuery's request, RunQuery's query) as admission takes it;
    `InvalidFieldError` naming the first field outside `limits` (`parse_submit`). Its
    stored shape is the request without its prompts (`without_prompts`), encoded only when
    admission stores it; the prompts are those `parse_submit` read, not copied again."""
    received = time.perf_counter()
    query, prompts = parse_submit(request, limits)
    return Submission(query, prompts, partial(without_prompts, request), received)


def decode_open_workflow(
    request: cpb.OpenWorkflowRequest, limits: SubmitLimits, idle_timeout_s: float
) -> OpenWorkflow:
    """An OpenWorkflow's request: the workflow it expects (a named template's, or the stages
    given) as a submission of the workflow's id, closed after `idle_timeout_s` wall seconds
    without a call unless the request says otherwise.

    `InvalidFieldError` names the first bad field of the request, in this order: the
    template (exactly one of it and the expected stages, a known name), a prompt of an
    expected call (it has none), the idle timeout (at most `limits.max_slo_s`), then the
    submission's fields as the request names them (``workflow_id``, ``expected...``), which
    is how `Sessions.open` names admission's own refusals too."""
    if bool(request.template) == request.HasField("expected"):
        raise InvalidFieldError(
            "template", "give a template name or the expected stages (exactly one)"
        )
    if request.template:  # a name; its error repeats it, so it is held to an id's size
        check_text("template", request.template, limits.max_id_bytes, limits)
    expected = template_to_proto(request.template) if request.template else request.expected
    for k, stage in enumerate(expected.stages):
        for c, call in enumerate(stage.calls):
            if call.prompt:
                raise InvalidFieldError(
                    f"expected.stages[{k}].calls[{c}].prompt",
                    "an expected call has no prompt: give it with RunCall",
                )
    idle = request.idle_timeout_s or idle_timeout_s
    if not (math.isfinite(idle) and 0 < idle <= limits.max_slo_s):
        raise InvalidFieldError(
            "idle_timeout_s", f"must be in (0, {limits.max_slo_s:g}] s, got {idle:g}"
        )
    submit = cpb.SubmitQueryRequest(
        query_id=request.workflow_id,
        tenant=request.tenant,
        workflow=expected,
        slo_s=request.slo_s,
        slo_scale=request.slo_scale,
    )
    with opened_fields():
        submission = decode_submit(submit, limits)
    return OpenWorkflow(submission, tuple(stage_names(submit.workflow)), idle)


def decode_run_call(request: cpb.RunCallRequest) -> RunCall:
    """A RunCall's request as a session takes it, the call's chat part copied out of it
    (`chat_part`); checked by the session (`hexgen_coordinator.sessions`)."""
    call = request.call
    given = GivenCall(
        call.step, call.input_tokens, call.output_tokens, call.prompt, chat_part(call)
    )
    return RunCall(request.workflow_id, request.stage, given)


# ------------------------------------------------------------------ events


def encode_event(e: QueryEvent) -> cpb.QueryEvent:
    """An event as watchers and GetQuery get it, and as Redis keeps it."""
    return cpb.QueryEvent(
        query_id=e.query_id,
        kind=cast("cpb.QueryEventKind.ValueType", e.kind),  # its number (an int)
        time_s=e.time_s,
        stage=e.stage,
        call_id=e.call_id,
        instance=e.instance,
        text=e.text,
        sequence=e.sequence,
        finish_reason=e.finish_reason,
        tool_calls=[
            wfpb.ToolCall(id=t.id, name=t.name, arguments=t.arguments) for t in e.tool_calls
        ],
        prompt_tokens=e.prompt_tokens,
        output_tokens=e.output_tokens,
    )


def decode_event(pb: cpb.QueryEvent) -> QueryEvent:
    """A logged event read back; a kind the enum does not name keeps its number
    (`EventKind` says why)."""
    return QueryEvent(
        query_id=pb.query_id,
        kind=EventKind(pb.kind),
        time_s=pb.time_s,
        sequence=pb.sequence,
        stage=pb.stage,
        call_id=pb.call_id,
        instance=pb.instance,
        text=pb.text,
        finish_reason=pb.finish_reason,
        tool_calls=(
            tuple(ToolCall(t.id, t.name, t.arguments) for t in pb.tool_calls)
            if pb.tool_calls
            else ()
        ),
        prompt_tokens=pb.prompt_tokens,
        output_tokens=pb.output_tokens,
    )


def event_to_bytes(e: QueryEvent) -> bytes:
    """An event as the query's log in Redis keeps it (``ev:{id}``, redis_schema)."""
    return encode_event(e).SerializeToString()


def event_from_bytes(raw: bytes) -> QueryEvent:
    """An event of the query's log in Redis."""
    return decode_event(cpb.QueryEvent.FromString(raw))


def encode_call_update(update: CallSubmitted | QueryEvent) -> cpb.RunCallResponse:
    """One message of RunCall's stream: the first (`CallSubmitted`) carries the call's id,
    deadline and the workflow's traceparent with its event; the others the event alone."""
    if isinstance(update, CallSubmitted):
        return cpb.RunCallResponse(
            call_id=update.event.call_id,
            deadline_s=update.deadline_s,
            event=encode_event(update.event),
            traceparent=update.traceparent,
        )
    return cpb.RunCallResponse(event=encode_event(update))


# ------------------------------------------------------------------ what clients read


def encode_info(info: QueryInfo) -> cpb.QueryInfo:
    return cpb.QueryInfo(
        query_id=info.query_id,
        tenant=info.tenant,
        state=cast("cpb.QueryState.ValueType", info.state),
        arrival_s=info.arrival_s,
        slo_s=info.slo_s,
        deadline_s=info.deadline_s,
        finished_s=info.finished_s,
        stages_total=info.stages_total,
        stages_done=info.stages_done,
        calls_total=info.calls_total,
        calls_done=info.calls_done,
        failure_reason=info.failure_reason,
        best_effort=info.best_effort,
        session=info.session,
        session_open=info.session_open,
        traceparent=info.traceparent,
    )


def _encode_stage(s: StageInfo) -> cpb.StageInfo:
    return cpb.StageInfo(
        index=s.index,
        step=s.step,
        name=s.name,
        after=s.after,
        calls_total=s.calls_total,
        calls_done=s.calls_done,
        calls_skipped=s.calls_skipped,
        calls_given=s.calls_given,
        released_s=s.released_s,
        finished_s=s.finished_s,
        deadline_s=s.deadline_s,
    )


def encode_detail(detail: QueryDetail) -> cpb.GetQueryResponse:
    return cpb.GetQueryResponse(
        query=encode_info(detail.query),
        events=[encode_event(e) for e in detail.events],
        stages=[_encode_stage(s) for s in detail.stages],
    )


def _encode_summary(s: LatencySummary) -> cpb.LatencySummary:
    """Always a message, all zeros too: the field is present on the wire either way."""
    return cpb.LatencySummary(count=s.count, p50=s.p50, p99=s.p99, max=s.max)


def encode_status(status: ClusterStatus) -> cpb.ClusterStatusResponse:
    recent, overhead = status.recent, status.overhead
    return cpb.ClusterStatusResponse(
        instances=[
            cpb.InstanceStatus(
                index=i.index,
                name=i.name,
                gpu=i.gpu,
                model=i.model,
                worker_id=i.worker_id,
                connected=i.connected,
                engine=i.engine,
                in_flight=i.in_flight,
                running=i.running,
                queued=i.queued,
                kv_used_tokens=i.kv_used_tokens,
                kv_capacity_tokens=i.kv_capacity_tokens,
                outstanding_s=i.outstanding_s,
                others_in_flight=i.others_in_flight,
                others_weight=i.others_weight,
                learned_prefill_factor=i.learned_prefill_factor,
                learned_decode_factor=i.learned_decode_factor,
                learned_calls=i.learned_calls,
            )
            for i in status.instances
        ],
        policy=status.policy,
        alpha=status.alpha,
        time_scale=status.time_scale,
        now_s=status.now_s,
        queries_running=status.queries_running,
        queries_finished=status.queries_finished,
        queries_failed=status.queries_failed,
        queries_rejected=status.queries_rejected,
        retention_s=status.retention_s,
        recent=cpb.RecentOutcomes(
            window_s=recent.window_s,
            succeeded=recent.succeeded,
            slo_met=recent.slo_met,
            failed=recent.failed,
            cancelled=recent.cancelled,
            latency_s=_encode_summary(recent.latency_s),
        ),
        slo_base_s=status.slo_base_s,
        cluster=status.cluster,
        overhead=cpb.CoordinatorOverhead(
            completion_to_dispatch_ms=_encode_summary(overhead.completion_to_dispatch_ms),
            submit_to_dispatch_ms=_encode_summary(overhead.submit_to_dispatch_ms),
            completions=overhead.completions,
        ),
    )


def encode_alpha_history(history: AlphaHistory) -> cpb.GetAlphaHistoryResponse:
    return cpb.GetAlphaHistoryResponse(
        alpha=history.alpha,
        changes=[
            cpb.AlphaHistoryEntry(time_s=c.time_s, unix_s=c.unix_s, alpha=c.alpha, reason=c.reason)
            for c in history.changes
        ],
    )


# ------------------------------------------------------------------ stored submissions


def submission_from_bytes(raw: bytes) -> tuple[Query, list[tuple[str, ...]], list[str]]:
    """A stored submission (the ``submit`` field of a query in Redis): the query as
    submitted, its prompts per expanded stage ("" where the submission does not hold one:
    since prompts are kept apart, none), and each expanded stage's name. Parsed without a
    submission's limits (it passed them when it was stored); what `parse_submit` raises on
    an unreadable one is raised."""
    request = cpb.SubmitQueryRequest.FromString(raw)
    query, prompts = parse_submit(request)
    return query, prompts, stage_names(request.workflow)


def shape_to_bytes(query: Query) -> bytes:
    """A workflow session's ``shape``: the workflow as it runs (its calls given, and those of
    stages still open), as a submission of `query` (what the `finished` stream keeps for
    the tuner's replays)."""
    return submit_from_query(query).SerializeToString()


# ------------------------------------------------------------------ prompts and given calls


def prompt_to_bytes(prompt: str, chat: Chat | None = None) -> bytes:
    """A call's prompt as Redis keeps it until the call completes (``pr:{id}``): an
    ``LLMCall`` with the prompt alone, or with a session's chat call's messages and options
    beside it (its options only when it has them: absent is not empty)."""
    if chat is None:
        return wfpb.LLMCall(prompt=prompt).SerializeToString()
    return wfpb.LLMCall(
        prompt=prompt, messages=chat.messages, options=chat.options
    ).SerializeToString()


def call_to_bytes(call: LLMCall) -> bytes:
    """A session's given call as its ``g:{call_id}`` keeps it (before base64): an ``LLMCall``
    with its step and token counts (its prompt is kept apart: `prompt_to_bytes`)."""
    return wfpb.LLMCall(
        step=call.step, input_tokens=call.input_tokens, output_tokens=call.output_tokens
    ).SerializeToString()


def call_from_bytes(raw: bytes) -> GivenCall:
    """A call kept in Redis, its sizes (``g:{call_id}``) or its prompt (``pr:{id}``):
    whatever of a given call the ``LLMCall`` holds, its chat part copied out
    (`chat_part`)."""
    pb = wfpb.LLMCall.FromString(raw)
    return GivenCall(pb.step, pb.input_tokens, pb.output_tokens, pb.prompt, chat_part(pb))


def chat_part(call: wfpb.LLMCall) -> Chat | None:
    """What a session's call was given beside its prompt and sizes: its chat messages and
    its options (sampling, tools, response_format); None when it has neither.

    Read from a RunCall's call or from one kept in Redis (`call_from_bytes`). The messages
    and options are copied out of `call` into a message of their own, as the ``LLMCall``
    this kept before: the `Chat` then holds those only, not the request (or the stored
    call) they came in with, prompt and all. Options are kept only when `call` has them
    (`Chat.options`: absent is not empty)."""
    options = call.options if call.HasField("options") else None
    if not call.messages and options is None:
        return None
    part = wfpb.LLMCall(messages=call.messages, options=options)
    return Chat(tuple(part.messages), part.options if options is not None else None)
