"""The client API's translation (`hexgen_coordinator.client_wire`): the bytes a client gets,
and those of a query's event log in Redis, are those the coordinator wrote before its parts
spoke `client_messages` (each test builds the old message as the old code did), and a
stored event read back is the event that was written. A session's chat call, kept as a
`worker_messages.Chat` (`client_wire.chat_part`), is what the ``LLMCall`` kept before; the
prompts, given calls and session shapes Redis keeps are the bytes they were, and read back
as they were."""

from __future__ import annotations

import base64
from typing import Any, cast

import pytest

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import workflow_pb2 as wfpb
from hexgen_coordinator.client_messages import (
    AlphaChange,
    AlphaHistory,
    CallSubmitted,
    ClusterStatus,
    EventKind,
    GivenCall,
    InstanceStatus,
    LatencySummary,
    Overhead,
    QueryDetail,
    QueryEvent,
    QueryInfo,
    QueryState,
    RecentOutcomes,
    StageInfo,
    ToolCall,
)
from hexgen_coordinator.client_wire import (
    call_from_bytes,
    call_to_bytes,
    chat_part,
    decode_event,
    decode_open_workflow,
    decode_run_call,
    decode_submit,
    encode_alpha_history,
    encode_call_update,
    encode_detail,
    encode_event,
    encode_info,
    encode_status,
    event_from_bytes,
    event_to_bytes,
    prompt_to_bytes,
    shape_to_bytes,
    submission_from_bytes,
)
from hexgen_coordinator.ledger import chat_bytes
from hexgen_coordinator.session_store import stored_workflow
from hexgen_coordinator.store import StoredQuery
from hexgen_coordinator.worker_messages import Chat, Run
from hexgen_coordinator.worker_wire import encode_command
from hexgen_flow.runtime import CallTicket
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow
from hexgen_service import redis_schema as schema
from hexgen_service.convert import (
    SubmitLimits,
    parse_submit,
    stage_names,
    submit_from_query,
    template_to_proto,
    without_prompts,
)
from hexgen_service.errors import InvalidFieldError
from hexgen_service.redis_schema import F, S

# ------------------------------------------------------------------ enums


@pytest.mark.parametrize("kind", list(cpb.QueryEventKind.values()))
def test_every_event_kind_is_the_wires_number_and_name(kind: cpb.QueryEventKind.ValueType) -> None:
    assert EventKind(kind).value == kind
    assert "QUERY_EVENT_KIND_" + EventKind(kind).name == cpb.QueryEventKind.Name(kind)


def test_the_event_kinds_are_the_wires_all() -> None:
    assert sorted(k.value for k in EventKind) == sorted(cpb.QueryEventKind.values())


@pytest.mark.parametrize("state", list(cpb.QueryState.values()))
def test_every_query_state_is_the_wires_number_and_name(state: cpb.QueryState.ValueType) -> None:
    assert "QUERY_STATE_" + QueryState(state).name == cpb.QueryState.Name(state)
    assert len(QueryState) == len(cpb.QueryState.values())


# ------------------------------------------------------------------ events

FINISHED = QueryEvent(
    query_id="q",
    kind=EventKind.CALL_FINISHED,
    time_s=12.5,
    sequence=7,
    stage=1,
    call_id="q/1.0",
    instance="A100#0",
    text="done",
    finish_reason="tool_calls",
    tool_calls=(ToolCall("c1", "weather", '{"city":"Oslo"}'), ToolCall("c2", "", "")),
    prompt_tokens=31,
    output_tokens=9,
)


def _old_event(
    kind: int,
    *,
    stage: int = -1,
    call_id: str = "",
    instance: str = "",
    text: str = "",
    finished: tuple[str, list[tuple[str, str, str]], int, int] | None = None,
) -> cpb.QueryEvent:
    """`events.record_event`'s construction before `client_messages`."""
    event = cpb.QueryEvent(
        query_id="q",
        kind=kind,  # type: ignore[arg-type]
        time_s=12.5,
        stage=stage,
        call_id=call_id,
        instance=instance,
        text=text,
        sequence=7,
    )
    if finished is not None:
        event.finish_reason = finished[0]
        for id_, name, arguments in finished[1]:
            event.tool_calls.add(id=id_, name=name, arguments=arguments)
        event.prompt_tokens = finished[2]
        event.output_tokens = finished[3]
    return event


def test_a_finished_event_is_the_bytes_it_was() -> None:
    old = _old_event(
        cpb.QUERY_EVENT_KIND_CALL_FINISHED,
        stage=1,
        call_id="q/1.0",
        instance="A100#0",
        text="done",
        finished=("tool_calls", [("c1", "weather", '{"city":"Oslo"}'), ("c2", "", "")], 31, 9),
    )
    assert event_to_bytes(FINISHED) == old.SerializeToString()
    assert encode_event(FINISHED) == old


def test_a_finished_event_with_the_zeros_is_the_bytes_it_was() -> None:
    """A report that says nothing more (proto3's zeros): the fields stay off the wire."""
    event = QueryEvent("q", EventKind.CALL_FINISHED, 12.5, 7, stage=0, call_id="q/0.0")
    old = _old_event(
        cpb.QUERY_EVENT_KIND_CALL_FINISHED, stage=0, call_id="q/0.0", finished=("", [], 0, 0)
    )
    assert event_to_bytes(event) == old.SerializeToString()


@pytest.mark.parametrize("kind", [k for k in EventKind if k != EventKind.CALL_FINISHED])
def test_every_other_event_is_the_bytes_it_was(kind: EventKind) -> None:
    event = QueryEvent("q", kind, 12.5, 7, text="why")
    assert event_to_bytes(event) == _old_event(kind.value, text="why").SerializeToString()
    assert event.stage == -1  # "not about a stage", as record_event's default was


@pytest.mark.parametrize(
    "event",
    [
        FINISHED,
        QueryEvent("q", EventKind.SUBMITTED, 0.0, 0),
        QueryEvent("", EventKind.UNSPECIFIED, 0.0, 0, stage=0),
        QueryEvent("q", EventKind.DEADLINE_UPDATED, 3.0, 2**40, stage=4, call_id="q/4.1"),
    ],
)
def test_a_logged_event_reads_back_as_it_was_written(event: QueryEvent) -> None:
    raw = event_to_bytes(event)
    assert event_from_bytes(raw) == event
    assert event_to_bytes(event_from_bytes(raw)) == raw


def test_a_logged_event_of_a_kind_not_named_keeps_its_number() -> None:
    """A log written by a newer coordinator: replayed to a client as it was written."""
    old = cpb.QueryEvent(query_id="q", kind=99, time_s=1.0, stage=-1, sequence=3)  # type: ignore[arg-type]
    event = event_from_bytes(old.SerializeToString())
    assert event.kind == 99 and isinstance(event.kind, EventKind)
    assert event.kind != EventKind.CALL_TOKENS
    assert encode_event(event).SerializeToString() == old.SerializeToString()


def test_a_decoded_event_without_tool_calls_shares_the_empty_tuple() -> None:
    """The replay path builds one object per event (no list when there is no tool call)."""
    event = decode_event(cpb.QueryEvent(query_id="q", kind=cpb.QUERY_EVENT_KIND_SUBMITTED))
    assert event.tool_calls == ()


def test_run_calls_answers_are_the_bytes_they_were() -> None:
    submitted = QueryEvent("w", EventKind.CALL_SUBMITTED, 2.0, 4, stage=0, call_id="w/0.1")
    old_event = _old_event(cpb.QUERY_EVENT_KIND_CALL_SUBMITTED, stage=0, call_id="w/0.1")
    old_event.query_id, old_event.time_s, old_event.sequence = "w", 2.0, 4
    old_first = cpb.RunCallResponse(
        call_id="w/0.1", deadline_s=9.5, event=old_event, traceparent="00-ab-cd-01"
    )
    first = encode_call_update(CallSubmitted(submitted, 9.5, "00-ab-cd-01"))
    assert first.SerializeToString() == old_first.SerializeToString()
    old_next = cpb.RunCallResponse(
        event=_old_event(
            cpb.QUERY_EVENT_KIND_CALL_FINISHED,
            stage=1,
            call_id="q/1.0",
            instance="A100#0",
            text="done",
            finished=("tool_calls", [("c1", "weather", '{"city":"Oslo"}'), ("c2", "", "")], 31, 9),
        )
    )
    assert encode_call_update(FINISHED).SerializeToString() == old_next.SerializeToString()


# ------------------------------------------------------------------ what clients read

INFO = QueryInfo(
    query_id="q",
    tenant="t",
    state=QueryState.FAILED,
    arrival_s=1.0,
    slo_s=30.0,
    deadline_s=31.0,
    finished_s=0.0,
    stages_total=3,
    stages_done=1,
    calls_total=5,
    calls_done=2,
    failure_reason="boom",
    best_effort=True,
    session=True,
    session_open=False,
    traceparent="00-ab-cd-01",
)
OLD_INFO = cpb.QueryInfo(
    query_id="q",
    tenant="t",
    state=cpb.QUERY_STATE_FAILED,
    arrival_s=1.0,
    slo_s=30.0,
    deadline_s=31.0,
    finished_s=0.0,
    stages_total=3,
    stages_done=1,
    calls_total=5,
    calls_done=2,
    failure_reason="boom",
    best_effort=True,
    session=True,
    session_open=False,
    traceparent="00-ab-cd-01",
)


def test_a_query_info_is_the_bytes_it_was() -> None:
    assert encode_info(INFO).SerializeToString() == OLD_INFO.SerializeToString()
    running = QueryInfo("q", "t", QueryState.RUNNING, 1.0, 30.0, 31.0, 0.0, 1, 0, 1, 0)
    old = cpb.QueryInfo(
        query_id="q",
        tenant="t",
        state=cpb.QUERY_STATE_RUNNING,
        arrival_s=1.0,
        slo_s=30.0,
        deadline_s=31.0,
        stages_total=1,
        calls_total=1,
    )
    assert encode_info(running).SerializeToString() == old.SerializeToString()


def test_get_querys_answer_is_the_bytes_it_was() -> None:
    stage = StageInfo(
        index=0,
        step="plan",
        name="planner",
        after=(),
        calls_total=2,
        calls_done=1,
        calls_skipped=0,
        calls_given=2,
        released_s=1.5,
        finished_s=0.0,
        deadline_s=9.0,
    )
    later = StageInfo(1, "act", "act", (0,), 1, 0, 0, 1, 0.0, 0.0, 0.0)
    detail = QueryDetail(INFO, (FINISHED,), (stage, later))
    old_finished = encode_event(FINISHED)  # its bytes are the old ones (above)
    old = cpb.GetQueryResponse(
        query=OLD_INFO,
        events=[old_finished],
        stages=[
            cpb.StageInfo(
                index=0,
                step="plan",
                name="planner",
                after=[],
                calls_total=2,
                calls_done=1,
                calls_skipped=0,
                calls_given=2,
                released_s=1.5,
                finished_s=0.0,
                deadline_s=9.0,
            ),
            cpb.StageInfo(index=1, step="act", name="act", after=[0], calls_total=1, calls_given=1),
        ],
    )
    assert encode_detail(detail).SerializeToString() == old.SerializeToString()


def _instance(worker_id: str) -> InstanceStatus:
    return InstanceStatus(
        index=1,
        name="A100#1",
        gpu="A100",
        model="m",
        worker_id=worker_id,
        connected=bool(worker_id),
        engine="ENGINE_KIND_SIMULATED" if worker_id else "",
        in_flight=3,
        running=2,
        queued=1,
        kv_used_tokens=2**33,
        kv_capacity_tokens=2**34,
        outstanding_s=4.5,
        others_in_flight=0,
        others_weight=0.0,
        learned_prefill_factor=1.1,
        learned_decode_factor=0.9,
        learned_calls=12,
    )


def test_the_cluster_status_is_the_bytes_it_was() -> None:
    """Empty latency summaries stay present on the wire (`views._summary` gave an empty
    message), and the zeros of an instance nobody holds stay off it."""
    summary = LatencySummary(count=4, p50=1.0, p99=2.0, max=3.0)
    status = ClusterStatus(
        instances=(_instance("w1"), _instance("")),
        policy="hexgen",
        alpha=0.5,
        time_scale=1.0,
        now_s=100.0,
        queries_running=2,
        queries_finished=10,
        queries_failed=1,
        queries_rejected=0,
        retention_s=3600.0,
        recent=RecentOutcomes(300.0, 10, 9, 1, 0, summary),
        slo_base_s=20.0,
        cluster="A100:2",
        overhead=Overhead(LatencySummary(), summary, 50),
    )

    def old_instance(worker_id: str) -> cpb.InstanceStatus:
        return cpb.InstanceStatus(
            index=1,
            name="A100#1",
            gpu="A100",
            model="m",
            worker_id=worker_id,
            connected=bool(worker_id),
            engine="ENGINE_KIND_SIMULATED" if worker_id else "",
            in_flight=3,
            running=2,
            queued=1,
            kv_used_tokens=2**33,
            kv_capacity_tokens=2**34,
            outstanding_s=4.5,
            others_in_flight=0,
            others_weight=0.0,
            learned_prefill_factor=1.1,
            learned_decode_factor=0.9,
            learned_calls=12,
        )

    old_summary = cpb.LatencySummary(count=4, p50=1.0, p99=2.0, max=3.0)
    old = cpb.ClusterStatusResponse(
        instances=[old_instance("w1"), old_instance("")],
        policy="hexgen",
        alpha=0.5,
        time_scale=1.0,
        now_s=100.0,
        queries_running=2,
        queries_finished=10,
        queries_failed=1,
        queries_rejected=0,
        retention_s=3600.0,
        recent=cpb.RecentOutcomes(
            window_s=300.0, succeeded=10, slo_met=9, failed=1, cancelled=0, latency_s=old_summary
        ),
        slo_base_s=20.0,
        cluster="A100:2",
        overhead=cpb.CoordinatorOverhead(
            completion_to_dispatch_ms=cpb.LatencySummary(),
            submit_to_dispatch_ms=old_summary,
            completions=50,
        ),
    )
    encoded = encode_status(status)
    assert encoded.SerializeToString() == old.SerializeToString()
    assert encoded.overhead.HasField("completion_to_dispatch_ms")


def test_the_alpha_history_is_the_bytes_it_was() -> None:
    history = AlphaHistory(
        0.3, (AlphaChange(1.0, 1.7e9, 0.5, "start"), AlphaChange(2.0, 1.7e9 + 1, 0.3, ""))
    )
    old = cpb.GetAlphaHistoryResponse(
        alpha=0.3,
        changes=[
            cpb.AlphaHistoryEntry(time_s=1.0, unix_s=1.7e9, alpha=0.5, reason="start"),
            cpb.AlphaHistoryEntry(time_s=2.0, unix_s=1.7e9 + 1, alpha=0.3, reason=""),
        ],
    )
    assert encode_alpha_history(history).SerializeToString() == old.SerializeToString()
    assert encode_alpha_history(AlphaHistory(0.0, ())).SerializeToString() == b""


def test_a_tool_call_is_the_client_apis_own() -> None:
    """The event's tool calls are the worker report's `ToolCall`s, the wire's field for field."""
    pb = encode_event(FINISHED).tool_calls[0]
    assert pb == wfpb.ToolCall(id="c1", name="weather", arguments='{"city":"Oslo"}')


# ------------------------------------------------------------------ stored submissions


def _submission() -> cpb.SubmitQueryRequest:
    return cpb.SubmitQueryRequest(
        query_id="q",
        tenant="t",
        slo_s=30.0,
        workflow=wfpb.Workflow(
            stages=[
                wfpb.Stage(
                    id="plan",
                    step="planner",
                    calls=[wfpb.LLMCall(prompt="hi", input_tokens=10, output_tokens=5)],
                ),
                wfpb.Stage(
                    step="act",
                    after=["plan"],
                    calls=[
                        wfpb.LLMCall(prompt="a", input_tokens=3, output_tokens=2),
                        wfpb.LLMCall(input_tokens=4, output_tokens=1),
                    ],
                ),
            ]
        ),
    )


def test_a_stored_submission_reads_back_as_parse_submit_reads_it() -> None:
    request = _submission()
    query, prompts, names = submission_from_bytes(request.SerializeToString())
    assert (query, prompts) == parse_submit(request)
    assert names == stage_names(request.workflow) == ["plan", "act"]
    assert prompts == [("hi",), ("a", "")]


def test_a_stored_shape_reads_back_without_its_prompts() -> None:
    """What admission stores since prompts are kept apart (`without_prompts`): the same
    query, every prompt empty."""
    request = _submission()
    query, prompts, _ = submission_from_bytes(without_prompts(request))
    assert query == parse_submit(request)[0]
    assert prompts == [("",), ("", "")]


# ------------------------------------------------------------------ a session's chat calls


def _old_chat_part(call: wfpb.LLMCall) -> wfpb.LLMCall | None:
    """What the ledger kept of a chat call before `Chat` (its old ``chat_part``)."""
    options = call.options if call.HasField("options") else None
    if not call.messages and options is None:
        return None
    return wfpb.LLMCall(messages=call.messages, options=options)


def _old_chat_bytes(call: wfpb.LLMCall | None) -> int:
    if call is None:
        return 0
    return sum(m.ByteSize() for m in call.messages) + call.options.ByteSize()


_MESSAGES = [
    wfpb.ChatMessage(role="system", content="Be brief."),
    wfpb.ChatMessage(role="user", content="Weather in Oslo?", name="ann"),
    wfpb.ChatMessage(
        role="assistant",
        tool_calls=[wfpb.ToolCall(id="c1", name="weather", arguments='{"city":"Oslo"}')],
    ),
    wfpb.ChatMessage(role="tool", content="3 °C", tool_call_id="c1"),
]
_OPTIONS = wfpb.CallOptions(temperature=0.0, stop=["\n\n"], seed=7, tools_json="[]")

CHAT_CALLS = [
    wfpb.LLMCall(prompt="p", step="s", input_tokens=9, messages=_MESSAGES, options=_OPTIONS),
    wfpb.LLMCall(prompt="p", messages=_MESSAGES),  # no options: absent, not empty
    wfpb.LLMCall(options=_OPTIONS),  # options only
    wfpb.LLMCall(prompt="p", options=wfpb.CallOptions()),  # options present, every field unset
    wfpb.LLMCall(messages=[wfpb.ChatMessage()]),  # one message, every field unset
]


def _ticket() -> CallTicket:
    return CallTicket.detached(
        seq=41,
        call_id="q/0.0",
        query_id="q",
        query_seq=7,
        tenant="t",
        stage=0,
        call=LLMCall("planner", 10, 5),
        released_s=10.5,
        deadline_s=20.25,
        query_deadline_s=60.0,
        remaining_after_s=4.5,
        attempt=1,
    )


@pytest.mark.parametrize("call", CHAT_CALLS)
def test_a_chat_part_is_what_the_ledger_kept_before(call: wfpb.LLMCall) -> None:
    """The same messages and options (an empty options message stays present, absent ones
    absent), the same bytes counted against the tenant."""
    old, chat = _old_chat_part(call), chat_part(call)
    assert old is not None and chat is not None
    assert (chat.options is not None) == old.HasField("options")
    again = wfpb.LLMCall(messages=chat.messages, options=chat.options)
    assert again.SerializeToString() == old.SerializeToString()
    assert chat_bytes(chat) == _old_chat_bytes(old)


@pytest.mark.parametrize("call", CHAT_CALLS)
def test_a_chat_calls_dispatch_is_the_bytes_it_was(call: wfpb.LLMCall) -> None:
    """What a worker gets for the call: dispatch passed the kept LLMCall's messages, and
    its options when it had them."""
    old, chat = _old_chat_part(call), chat_part(call)
    assert old is not None and chat is not None
    before = Run.of(
        _ticket(), "p", "tp", old.messages, old.options if old.HasField("options") else None
    )
    now = Run.of(_ticket(), "p", "tp", chat.messages, chat.options)
    assert encode_command(now).SerializeToString() == encode_command(before).SerializeToString()


def test_a_call_without_messages_or_options_has_no_chat() -> None:
    plain = wfpb.LLMCall(prompt="p", step="s", input_tokens=9, output_tokens=3)
    assert chat_part(plain) is None and _old_chat_part(plain) is None
    assert chat_bytes(None) == 0


def test_a_chat_part_is_a_copy_of_the_call() -> None:
    """As the LLMCall kept before, the chat holds copies: the request it came in with can
    go (or change) without it."""
    call = wfpb.LLMCall(prompt="p", messages=_MESSAGES, options=_OPTIONS)
    chat = chat_part(call)
    assert chat is not None
    del call.messages[:]
    call.options.seed = 8
    assert list(chat.messages) == _MESSAGES and chat.options == _OPTIONS


def test_a_stored_chat_call_reads_back_as_it_was_kept() -> None:
    """A session's given call in Redis (its sizes in ``g:{id}``, its prompt, messages and
    options kept apart in ``pr:{id}``): `stored_workflow`'s chat is the old one."""
    given = wfpb.LLMCall(step="planner", input_tokens=10, output_tokens=5)
    kept = wfpb.LLMCall(prompt="hi", messages=_MESSAGES, options=_OPTIONS)
    stored = StoredQuery(
        query_id="q",
        fields={
            F.SESSION: S.OPEN,
            schema.call_field(schema.GIVEN, "q/0.0"): base64.b64encode(
                given.SerializeToString()
            ).decode(),
        },
        submit=without_prompts(_submission()),
        prompts={"q/0.0": kept.SerializeToString()},
    )
    built = stored_workflow(stored)
    merged = wfpb.LLMCall()
    merged.CopyFrom(given)
    merged.MergeFrom(kept)
    old = _old_chat_part(merged)
    assert old is not None
    assert built.chats == {"q/0.0": Chat(tuple(old.messages), old.options)}
    assert built.prompts[0] == ("hi",)


def _old_stored_call(given: wfpb.LLMCall, held: wfpb.LLMCall | None) -> wfpb.LLMCall:
    """`stored_workflow`'s merge of a given call (``g:{id}``) and its prompt kept apart
    (``pr:{id}``) before `GivenCall`."""
    pb = wfpb.LLMCall()
    pb.CopyFrom(given)
    if held is not None:
        pb.prompt = held.prompt
        del pb.messages[:]
        pb.messages.extend(held.messages)
        if held.HasField("options"):
            pb.options.CopyFrom(held.options)
    return pb


_GIVEN = [
    wfpb.LLMCall(step="planner", input_tokens=10, output_tokens=5),
    wfpb.LLMCall(input_tokens=3, output_tokens=1),  # no step: the stage's
    # the layout before prompts were kept apart: all in g:{id}
    wfpb.LLMCall(step="s", input_tokens=9, output_tokens=2, prompt="p", messages=_MESSAGES),
    wfpb.LLMCall(step="s", input_tokens=9, output_tokens=2, prompt="p", options=_OPTIONS),
]
_HELD = [
    None,
    wfpb.LLMCall(prompt="hi"),
    wfpb.LLMCall(prompt="hi", messages=_MESSAGES, options=_OPTIONS),
    wfpb.LLMCall(messages=_MESSAGES),
    wfpb.LLMCall(options=wfpb.CallOptions()),
]


@pytest.mark.parametrize("given", _GIVEN)
@pytest.mark.parametrize("held", _HELD)
def test_a_stored_given_call_reads_back_as_it_did(
    given: wfpb.LLMCall, held: wfpb.LLMCall | None
) -> None:
    """Every layout of a session's given call (its prompt and chat kept apart or not, with
    options or messages on either side): the call, prompt and chat of the old merge."""
    fields = {
        F.SESSION: S.OPEN,
        schema.call_field(schema.GIVEN, "q/0.0"): base64.b64encode(
            given.SerializeToString()
        ).decode(),
    }
    stored = StoredQuery(
        query_id="q",
        fields=fields,
        submit=without_prompts(_submission()),
        prompts={} if held is None else {"q/0.0": held.SerializeToString()},
    )
    built = stored_workflow(stored)
    old = _old_stored_call(given, held)
    call = built.query.workflow.stages[0].calls[0]
    assert call == LLMCall(old.step or "planner", old.input_tokens, old.output_tokens)
    assert built.prompts[0] == (old.prompt,)
    part = _old_chat_part(old)
    if part is None:
        assert built.chats == {}
    else:
        options = part.options if part.HasField("options") else None
        assert built.chats == {"q/0.0": Chat(tuple(part.messages), options)}


@pytest.mark.parametrize("prompt", ["", "hi", "ünïcödé " * 100])
def test_a_kept_prompt_is_the_bytes_it_was(prompt: str) -> None:
    """A query's prompt in ``pr:{id}`` (admission's ``LLMCall(prompt=...)``)."""
    assert prompt_to_bytes(prompt) == wfpb.LLMCall(prompt=prompt).SerializeToString()
    assert call_from_bytes(prompt_to_bytes(prompt)).prompt == prompt


@pytest.mark.parametrize("call", [*CHAT_CALLS, wfpb.LLMCall(prompt="p", step="s")])
def test_a_kept_chat_call_is_the_bytes_it_was(call: wfpb.LLMCall) -> None:
    """A session's call in ``pr:{id}``: its prompt with its messages, and its options when
    it has them (sessions' old construction), and it reads back as its chat part."""
    old = wfpb.LLMCall(
        prompt=call.prompt,
        messages=call.messages,
        options=call.options if call.HasField("options") else None,
    )
    chat = chat_part(call)
    assert prompt_to_bytes(call.prompt, chat) == old.SerializeToString()
    back = call_from_bytes(prompt_to_bytes(call.prompt, chat))
    assert (back.prompt, back.chat) == (call.prompt, chat)


@pytest.mark.parametrize(
    "call", [LLMCall("planner", 10, 5), LLMCall("x", 1, 1), LLMCall("ünï", 10**7, 2**31 - 1)]
)
def test_a_given_calls_sizes_are_the_bytes_they_were(call: LLMCall) -> None:
    """A session's ``g:{id}`` (before base64): sessions' old ``LLMCall`` of step and sizes."""
    old = wfpb.LLMCall(
        step=call.step, input_tokens=call.input_tokens, output_tokens=call.output_tokens
    )
    assert call_to_bytes(call) == old.SerializeToString()
    back = call_from_bytes(call_to_bytes(call))
    assert back == GivenCall(call.step, call.input_tokens, call.output_tokens)


@pytest.mark.parametrize(
    "query",
    [
        Query("w", Workflow((Stage("plan", (LLMCall("plan", 10, 5),)),)), tenant="t", slo_s=30.0),
        Query(
            "w",
            Workflow(
                (
                    Stage("plan", (LLMCall("plan", 10, 5),)),
                    Stage("act", (LLMCall("act", 3, 2), LLMCall("tool", 4, 1)), after=(0,)),
                )
            ),
            slo_scale=2.5,
        ),
    ],
)
def test_a_sessions_shape_is_the_bytes_it_was(query: Query) -> None:
    """A session's ``shape`` (sessions' old ``submit_from_query(...).SerializeToString()``)."""
    assert shape_to_bytes(query) == submit_from_query(query).SerializeToString()
    assert submission_from_bytes(shape_to_bytes(query))[0] == query


# ------------------------------------------------------------------ requests

LIMITS = SubmitLimits(
    max_calls=50,
    max_stages=20,
    max_prompt_bytes=1 << 20,
    max_id_bytes=64,
    max_tenant_bytes=16,
    max_slo_s=1000.0,
    allow_control_characters=False,
)


def _old_shape(request: cpb.SubmitQueryRequest) -> bytes:
    """What admission stored of a submission (`without_prompts`, as it was written)."""
    shape = cpb.SubmitQueryRequest()
    shape.CopyFrom(request)
    for stage in shape.workflow.stages:
        for call in stage.calls:
            call.prompt = ""
    return shape.SerializeToString()


def test_a_decoded_submission_is_what_admission_parsed() -> None:
    """The query and prompts `parse_submit` gave admission, and the shape it stored."""
    request = _submission()
    submission = decode_submit(request, LIMITS)
    assert (submission.query, submission.prompts) == parse_submit(request, LIMITS)
    assert submission.shape() == _old_shape(request) == without_prompts(request)


def test_a_submissions_shape_is_read_when_it_is_stored() -> None:
    """The shape is the request as it is when admission stores it (no copy before)."""
    request = _submission()
    submission = decode_submit(request, LIMITS)
    request.tenant = "other"
    assert submission.shape() == _old_shape(request)


def _bad(field: str, value: object) -> cpb.SubmitQueryRequest:
    request = _submission()
    if field == "prompt":
        request.workflow.stages[0].calls[0].prompt = cast(str, value)
    elif field == "stages":
        del request.workflow.stages[:]
    else:
        setattr(request, field, value)
    return request


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (_bad("query_id", ""), "query_id: must not be empty (it is the idempotency key)"),
        (_bad("slo_s", 5000.0), "slo_s: must be at most 1000 s, got 5000"),
        (_bad("slo_scale", -1.0), "slo_scale: must be a finite number >= 0, got -1.0"),
        (_bad("stages", None), "workflow.stages: a workflow needs at least one stage"),
        (
            _bad("prompt", "x" * ((1 << 20) + 1)),
            "workflow.stages[0].calls[0].prompt: must be at most 1048576 bytes, got 1048577",
        ),
    ],
)
def test_a_bad_submission_is_refused_as_admission_refused_it(
    request_: cpb.SubmitQueryRequest, message: str
) -> None:
    with pytest.raises(InvalidFieldError) as parsed:
        parse_submit(request_, LIMITS)
    with pytest.raises(InvalidFieldError) as decoded:
        decode_submit(request_, LIMITS)
    assert str(decoded.value) == str(parsed.value) == message
    assert decoded.value.field == parsed.value.field


def _expected() -> wfpb.Workflow:
    workflow = wfpb.Workflow()
    workflow.CopyFrom(_submission().workflow)
    for stage in workflow.stages:
        for call in stage.calls:
            call.prompt = ""
    return workflow


def test_an_opened_workflow_is_the_submission_sessions_made() -> None:
    """The expected workflow as the submission `Sessions.open` built and admission parsed
    and stored, with the stage names and idle timeout admission kept."""
    request = cpb.OpenWorkflowRequest(
        workflow_id="w", tenant="t", slo_s=30.0, expected=_expected(), idle_timeout_s=7.0
    )
    old = cpb.SubmitQueryRequest(
        query_id="w", tenant="t", workflow=request.expected, slo_s=30.0, slo_scale=0.0
    )
    opened = decode_open_workflow(request, LIMITS, 60.0)
    assert (opened.expected.query, opened.expected.prompts) == parse_submit(old, LIMITS)
    assert opened.expected.shape() == _old_shape(old)
    assert list(opened.names) == stage_names(old.workflow) == ["plan", "act"]
    assert opened.idle_timeout_s == 7.0
    by_default = decode_open_workflow(
        cpb.OpenWorkflowRequest(workflow_id="w", template="chess"), LIMITS, 60.0
    )
    assert by_default.idle_timeout_s == 60.0
    template = cpb.SubmitQueryRequest(query_id="w", workflow=template_to_proto("chess"))
    assert by_default.expected.shape() == _old_shape(template)
    assert list(by_default.names) == stage_names(template.workflow)


def _open(**fields: Any) -> cpb.OpenWorkflowRequest:
    return cpb.OpenWorkflowRequest(**{"workflow_id": "w", "expected": _expected(), **fields})


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (
            _open(template="chess"),
            "template: give a template name or the expected stages (exactly one)",
        ),
        (
            cpb.OpenWorkflowRequest(workflow_id="w"),
            "template: give a template name or the expected stages (exactly one)",
        ),
        (
            cpb.OpenWorkflowRequest(workflow_id="w", template="x" * 65),
            "template: must be at most 64 bytes, got 65",
        ),
        (
            _open(expected=_submission().workflow),
            "expected.stages[0].calls[0].prompt: an expected call has no prompt: give it with "
            "RunCall",
        ),
        (_open(idle_timeout_s=-1.0), "idle_timeout_s: must be in (0, 1000] s, got -1"),
        (  # a bad idle timeout is named before a bad workflow
            _open(idle_timeout_s=5000.0, expected=wfpb.Workflow(stages=[wfpb.Stage()])),
            "idle_timeout_s: must be in (0, 1000] s, got 5000",
        ),
        (_open(workflow_id=""), "workflow_id: must not be empty (it is the idempotency key)"),
        (_open(expected=wfpb.Workflow()), "expected.stages: a workflow needs at least one stage"),
        (_open(slo_s=5000.0), "slo_s: must be at most 1000 s, got 5000"),
    ],
)
def test_a_bad_open_workflow_is_refused_as_sessions_refused_it(
    request_: cpb.OpenWorkflowRequest, message: str
) -> None:
    """The checks, their order and their messages are those `Sessions.open` made (the
    submission's fields named as the request names them)."""
    with pytest.raises(InvalidFieldError) as refused:
        decode_open_workflow(request_, LIMITS, 60.0)
    assert str(refused.value) == message


@pytest.mark.parametrize("call", [*CHAT_CALLS, wfpb.LLMCall(), wfpb.LLMCall(prompt="p", step="s")])
def test_a_run_call_is_the_call_as_given(call: wfpb.LLMCall) -> None:
    request = cpb.RunCallRequest(workflow_id="w", stage="plan", call=call)
    decoded = decode_run_call(request)
    assert (decoded.workflow_id, decoded.stage) == ("w", "plan")
    given = decoded.call
    assert (given.step, given.input_tokens, given.output_tokens, given.prompt) == (
        call.step,
        call.input_tokens,
        call.output_tokens,
        call.prompt,
    )
    assert given.chat == chat_part(call)
