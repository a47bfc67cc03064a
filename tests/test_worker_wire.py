"""The worker stream's translation at the coordinator's edge (`hexgen_coordinator.worker_wire`).

Every message a worker sends and every command the coordinator sends survives the round trip
``decode(encode(x)) == x``, the zeros that mean "not given" included (they stay zeros: the
coordinator reads them as the wire defines them); a proto from the wire survives the other
way round; and what the servicer writes for a dispatch, an ack, a cancel and a new deadline is
byte for byte what the coordinator wrote before it spoke domain types.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import worker_pb2 as wpb
from hexgen_api.v1 import workflow_pb2 as wfpb
from hexgen_coordinator.client_messages import EventKind, QueryEvent
from hexgen_coordinator.client_wire import encode_event
from hexgen_coordinator.worker_messages import (
    Ack,
    CancelRun,
    Command,
    Finished,
    Heartbeat,
    Hello,
    Message,
    NewDeadline,
    Run,
    Started,
    Tokens,
    ToolCall,
    Welcome,
)
from hexgen_coordinator.worker_wire import (
    decode_finished,
    decode_heartbeat,
    decode_hello,
    decode_started,
    decode_tokens,
    encode_command,
    hello_problem,
)
from hexgen_flow.runtime import CallTicket
from hexgen_flow.workload import LLMCall
from hexgen_worker.convert import finished_message
from hexgen_worker.events import CallFinished as WorkerFinished
from hexgen_worker.events import ToolCall as WorkerToolCall

MESSAGES: list[Message] = [
    Hello(worker_id="w1", slot=-1, gpu="A100", model="", engine="ENGINE_KIND_SIMULATED"),
    Hello(
        worker_id="w2",
        slot=3,
        gpu="H100",
        model="llama-3-8b",
        engine="ENGINE_KIND_VLLM",
        kv_cache_tokens=1 << 40,
        max_batch=256,
        resident_call_ids=("q/0.0", "q/1.2"),
        unacked_call_ids=("q/0.1",),
    ),
    Hello(worker_id="w3", slot=0, gpu="L4", model="m", engine="ENGINE_KIND_UNSPECIFIED"),
    Heartbeat(),  # a worker of one coordinator, older than the others_* fields
    Heartbeat(
        running=3,
        queued=7,
        kv_used_tokens=123_456_789_012,
        others_in_flight=2,
        others_outstanding_s=1.25,
        others_tokens=4096,
        others_weight=2.5,
        others_weighted_outstanding_s=3.125,
    ),
    Started("q/0.0"),
    Started(""),
    Tokens("q/0.0", "Hello, wo"),
    Tokens("q/0.0", ""),
    # Every "not given": no count, no times, no attempt echoed, no reason.
    Finished("q/0.0"),
    Finished(
        call_id="q/1.2",
        output_tokens=17,
        text="ok ✓",
        started_s=12.5,
        finished_s=13.75,
        attempt=2,
        cached_tokens=64,
        finish_reason="tool_calls",
        tool_calls=(
            ToolCall("call_1", "weather", '{"city": "Oslo"}'),
            ToolCall("call_2", "time", "not json"),
        ),
        prompt_tokens=100,
        first_token_s=12.875,
    ),
    Finished("q/2.0", error="engine error: out of memory", attempt=1),
    Finished("q/3.0", output_tokens=5, finished_s=2.0),  # an engine with no start time
]


# ------------------------------------------------------------------ a worker's side
# The other direction of `hexgen_coordinator.worker_wire`, what a worker does: the round
# trips below go through it.


def decode_message(pb: wpb.ConnectRequest) -> Message | None:
    """What a worker sent (the servicer decodes each kind as it reads it); None: an empty
    message (no field of the oneof set)."""
    kind = pb.WhichOneof("message")
    if kind == "finished":
        return decode_finished(pb.finished)
    if kind == "started":
        return decode_started(pb.started)
    if kind == "tokens":
        return decode_tokens(pb.tokens)
    if kind == "heartbeat":
        return decode_heartbeat(pb.heartbeat)
    if kind == "hello":
        return decode_hello(pb.hello)
    return None


def encode_message(msg: Message) -> wpb.ConnectRequest:
    """A worker's side: the message it sends for `msg`."""
    if isinstance(msg, Finished):
        return wpb.ConnectRequest(
            finished=wpb.CallFinished(
                call_id=msg.call_id,
                output_tokens=msg.output_tokens,
                text=msg.text,
                started_s=msg.started_s,
                finished_s=msg.finished_s,
                error=msg.error,
                attempt=msg.attempt,
                cached_tokens=msg.cached_tokens,
                finish_reason=msg.finish_reason,
                tool_calls=[
                    wfpb.ToolCall(id=t.id, name=t.name, arguments=t.arguments)
                    for t in msg.tool_calls
                ],
                prompt_tokens=msg.prompt_tokens,
                first_token_s=msg.first_token_s,
            )
        )
    if isinstance(msg, Started):
        return wpb.ConnectRequest(started=wpb.CallStarted(call_id=msg.call_id))
    if isinstance(msg, Tokens):
        return wpb.ConnectRequest(tokens=wpb.CallTokens(call_id=msg.call_id, text=msg.text))
    if isinstance(msg, Heartbeat):
        return wpb.ConnectRequest(
            heartbeat=wpb.WorkerHeartbeat(
                running=msg.running,
                queued=msg.queued,
                kv_used_tokens=msg.kv_used_tokens,
                others_in_flight=msg.others_in_flight,
                others_outstanding_s=msg.others_outstanding_s,
                others_tokens=msg.others_tokens,
                others_weight=msg.others_weight,
                others_weighted_outstanding_s=msg.others_weighted_outstanding_s,
            )
        )
    return wpb.ConnectRequest(
        hello=wpb.WorkerHello(
            worker_id=msg.worker_id,
            slot=msg.slot,
            gpu=msg.gpu,
            model=msg.model,
            engine=wpb.EngineKind.Value(msg.engine),
            kv_cache_tokens=msg.kv_cache_tokens,
            max_batch=msg.max_batch,
            resident_call_ids=msg.resident_call_ids,
            unacked_call_ids=msg.unacked_call_ids,
        )
    )


def decode_command(pb: wpb.ConnectResponse) -> Command | None:
    """A worker's side of `encode_command`; None: an empty message."""
    kind = pb.WhichOneof("message")
    if kind == "dispatch":
        d = pb.dispatch
        return Run(
            call_id=d.call_id,
            query_id=d.query_id,
            tenant=d.tenant,
            stage=d.stage,
            step=d.step,
            input_tokens=d.input_tokens,
            output_tokens=d.output_tokens,
            expected_output_tokens=d.expected_output_tokens,
            prompt=d.prompt,
            sequence=d.sequence,
            query_sequence=d.query_sequence,
            released_s=d.released_s,
            deadline_s=d.deadline_s,
            query_deadline_s=d.query_deadline_s,
            remaining_after_s=d.remaining_after_s,
            traceparent=d.traceparent,
            attempt=d.attempt,
            weight=d.weight,
            messages=tuple(d.messages),
            options=d.options if d.HasField("options") else None,
        )
    if kind == "ack":
        return Ack(tuple(pb.ack.call_ids))
    if kind == "deadline":
        return NewDeadline(pb.deadline.call_id, pb.deadline.deadline_s)
    if kind == "cancel":
        return CancelRun(pb.cancel.call_id)
    if kind == "welcome":
        w = pb.welcome
        return Welcome(
            slot=w.slot,
            instance=w.instance,
            epoch_unix_s=w.epoch_unix_s,
            time_scale=w.time_scale,
            cluster=w.cluster,
            queue_policy=w.queue_policy,
            queue_params_json=w.queue_params_json,
            heartbeat_interval_s=w.heartbeat_interval_s,
            drop_call_ids=tuple(w.drop_call_ids),
            shard=w.shard,
        )
    return None


def ticket(
    *, believed: int = 200, asked: int | None = None, attempt: int = 2, weight: float = 1.75
) -> CallTicket:
    """A dispatched call's ticket: `believed` output tokens, `asked` of the engine (None:
    the same)."""
    return CallTicket.detached(
        seq=41,
        call_id="query-7/1.2",
        query_id="query-7",
        query_seq=7,
        tenant="acme",
        stage=1,
        call=LLMCall("summarize", 1000, believed),
        released_s=10.5,
        deadline_s=20.25,
        query_deadline_s=60.0,
        remaining_after_s=4.5,
        attempt=attempt,
        weight=weight,
        output_tokens=asked,
    )


def chat() -> wfpb.LLMCall:
    return wfpb.LLMCall(
        messages=[
            wfpb.ChatMessage(role="system", content="Be brief."),
            wfpb.ChatMessage(role="user", content="Weather in Oslo?", name="ann"),
            wfpb.ChatMessage(
                role="assistant",
                tool_calls=[wfpb.ToolCall(id="c1", name="weather", arguments='{"city":"Oslo"}')],
            ),
            wfpb.ChatMessage(role="tool", content="3 °C", tool_call_id="c1"),
        ],
        options=wfpb.CallOptions(temperature=0.0, stop=["\n\n"], seed=7, tools_json="[]"),
    )


COMMANDS: list[Command] = [
    Welcome(
        slot=0,
        instance="A100#0",
        epoch_unix_s=1_765_000_000.125,
        time_scale=1.0,
        cluster="A100:2,H100",
        queue_policy="edf",
        queue_params_json="{}",
        heartbeat_interval_s=0.5,
    ),
    Welcome(
        slot=2,
        instance="H100#0",
        epoch_unix_s=0.0,
        time_scale=100.0,
        cluster="A100:2,H100",
        queue_policy="wfq",
        queue_params_json='{"quantum": 2}',
        heartbeat_interval_s=1.0,
        drop_call_ids=("a/0.0", "b/1.1"),
        shard="hf:{s0}:",
    ),
    Run.of(ticket()),  # no belief apart from the declared count: expected 0
    Run.of(ticket(believed=120, asked=512), "Summarize this.", "00-ab-cd-01"),
    Run.of(ticket(weight=0.0, attempt=0)),  # an older coordinator's zeros
    Run.of(ticket(), "", "", chat().messages, chat().options),
    Run.of(ticket(), "", "", (), wfpb.CallOptions()),  # options present, every field unset
    CancelRun("q/0.0"),
    NewDeadline("q/0.0", 42.125),
    NewDeadline("q/0.0", 0.0),
    Ack(("a/0.0",)),
    Ack(("a/0.0", "b/1.1", "c/2.2")),
    Ack(()),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_message_survives_the_wire(message: Message) -> None:
    pb = encode_message(message)
    assert decode_message(pb) == message
    # and through bytes, as the stream carries it
    assert decode_message(wpb.ConnectRequest.FromString(pb.SerializeToString())) == message


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: type(c).__name__)
def test_a_command_survives_the_wire(command: Command) -> None:
    pb = encode_command(command)
    assert decode_command(pb) == command
    assert decode_command(wpb.ConnectResponse.FromString(pb.SerializeToString())) == command


def test_zeros_stay_zeros() -> None:
    """A proto3 scalar a worker left out arrives as its zero, and the domain type keeps the
    zero (not None): ``msg.output_tokens or ticket.output_tokens``, ``msg.finished_s or
    now``, ``msg.attempt if ticket.attempt else 0`` and ``started_s > 0`` read it so."""
    finished = decode_finished(wpb.CallFinished(call_id="q/0.0"))
    assert finished == Finished("q/0.0")
    assert (finished.output_tokens, finished.started_s, finished.finished_s) == (0, 0.0, 0.0)
    assert (finished.attempt, finished.cached_tokens, finished.prompt_tokens) == (0, 0, 0)
    assert finished.first_token_s == 0.0  # an older worker, or an engine that does not say
    assert (finished.error, finished.finish_reason, finished.tool_calls) == ("", "", ())
    heartbeat = decode_message(wpb.ConnectRequest(heartbeat=wpb.WorkerHeartbeat()))
    assert heartbeat == Heartbeat()
    run = decode_command(wpb.ConnectResponse(dispatch=wpb.DispatchCall(call_id="q/0.0")))
    assert isinstance(run, Run)
    assert (run.expected_output_tokens, run.weight, run.attempt) == (0, 0.0, 0)
    assert run.options is None and run.messages == ()


def test_absent_options_are_not_empty_options() -> None:
    """Options the client did not give are absent on the wire (the engine's defaults);
    options given with every field unset are present: the translation keeps the two apart."""
    absent = encode_command(Run.of(ticket()))
    empty = encode_command(Run.of(ticket(), options=wfpb.CallOptions()))
    assert not absent.dispatch.HasField("options")
    assert empty.dispatch.HasField("options")
    assert decode_command(absent) != decode_command(empty)


@pytest.mark.parametrize(
    "pb",
    [
        wpb.ConnectRequest(hello=wpb.WorkerHello(worker_id="w", slot=-1, gpu="A100")),
        wpb.ConnectRequest(
            finished=wpb.CallFinished(
                call_id="q/0.0",
                output_tokens=3,
                started_s=1.0,
                finished_s=2.0,
                attempt=4,
                first_token_s=1.5,
                tool_calls=[wfpb.ToolCall(id="x", name="f", arguments="{}")],
            )
        ),
        wpb.ConnectRequest(tokens=wpb.CallTokens(call_id="q/0.0", text="abc")),
        wpb.ConnectRequest(started=wpb.CallStarted(call_id="q/0.0")),
        wpb.ConnectRequest(heartbeat=wpb.WorkerHeartbeat(running=1, others_weight=0.5)),
    ],
    ids=lambda pb: pb.WhichOneof("message"),
)
def test_a_report_from_the_wire_is_encoded_back_to_itself(pb: wpb.ConnectRequest) -> None:
    message = decode_message(pb)
    assert message is not None
    assert encode_message(message) == pb


def test_an_empty_message_decodes_to_none() -> None:
    assert decode_message(wpb.ConnectRequest()) is None
    assert decode_command(wpb.ConnectResponse()) is None


# ------------------------------------------------------------------ the bytes did not change


@pytest.mark.parametrize(
    ("made", "prompt", "traceparent", "with_chat"),
    [
        (ticket, "", "", False),
        (lambda: ticket(believed=120, asked=512), "Summarize this.", "00-ab-cd-01", False),
        (lambda: ticket(weight=0.0, attempt=0), "", "", False),
        (ticket, "", "", True),
    ],
    ids=["plain", "belief", "zeros", "chat"],
)
def test_a_dispatch_is_the_bytes_it_was(
    made: Callable[[], CallTicket], prompt: str, traceparent: str, with_chat: bool
) -> None:
    """What the servicer writes for a `Run` is what `Dispatch.send` queued before
    (a ``DispatchCall`` built from the ticket field by field), to the byte."""
    call = chat() if with_chat else None
    messages = call.messages if call is not None else ()
    options = call.options if call is not None else None
    t = made()
    before = wpb.ConnectResponse(
        dispatch=wpb.DispatchCall(
            messages=messages,
            options=options,
            call_id=t.call_id,
            query_id=t.query_id,
            tenant=t.tenant,
            stage=t.stage,
            step=t.call.step,
            input_tokens=t.call.input_tokens,
            output_tokens=t.output_tokens,
            expected_output_tokens=(
                t.call.output_tokens if t.call.output_tokens != t.output_tokens else 0
            ),
            prompt=prompt,
            sequence=t.seq,
            query_sequence=t.query_seq,
            released_s=t.released_s,
            deadline_s=t.deadline_s,
            query_deadline_s=t.query_deadline_s,
            remaining_after_s=t.remaining_after_s,
            traceparent=traceparent,
            attempt=t.attempt,
            weight=t.weight,
        )
    )
    now = encode_command(Run.of(made(), prompt, traceparent, messages, options))
    assert now.SerializeToString() == before.SerializeToString()
    assert now.SerializeToString(deterministic=True) == before.SerializeToString(deterministic=True)


def test_the_small_commands_are_the_bytes_they_were() -> None:
    pairs: list[tuple[Command, wpb.ConnectResponse]] = [
        (
            Ack(("a/0.0", "b/1.1")),
            wpb.ConnectResponse(ack=wpb.AckFinished(call_ids=["a/0.0", "b/1.1"])),
        ),
        (CancelRun("a/0.0"), wpb.ConnectResponse(cancel=wpb.CancelCall(call_id="a/0.0"))),
        (
            NewDeadline("a/0.0", 3.5),
            wpb.ConnectResponse(deadline=wpb.UpdateDeadline(call_id="a/0.0", deadline_s=3.5)),
        ),
    ]
    for command, before in pairs:
        assert encode_command(command).SerializeToString() == before.SerializeToString()


def test_a_run_is_the_ticket_as_it_was_sent() -> None:
    """The ticket goes on changing while its `Run` waits in the outbox (a redispatch's
    attempt, a revised deadline): the worker gets the dispatch as it was sent."""
    t = ticket()
    run = Run.of(t)
    t.attempt += 1
    t.deadline_s = 99.0
    assert (run.attempt, run.deadline_s) == (2, 20.25)


def test_a_finished_events_tool_calls_are_the_ones_reported() -> None:
    """A report's tool calls reach the CALL_FINISHED event as the worker sent them: decoded
    into the domain type, carried by the event (`events.record_event`) and encoded by
    `client_wire.encode_event`, they are the bytes of the wire's own messages copied."""
    pb = wpb.CallFinished(
        call_id="q/0.0",
        tool_calls=[
            wfpb.ToolCall(id="c1", name="weather", arguments='{"city":"Oslo"}'),
            wfpb.ToolCall(id="c2", name="", arguments=""),
        ],
    )
    before = cpb.QueryEvent(call_id="q/0.0")
    before.tool_calls.extend(pb.tool_calls)
    event = QueryEvent(
        query_id="",
        kind=EventKind.UNSPECIFIED,
        time_s=0.0,
        sequence=0,
        stage=0,
        call_id="q/0.0",
        tool_calls=decode_finished(pb).tool_calls,
    )
    assert encode_event(event).SerializeToString() == before.SerializeToString()


def test_a_workers_report_is_the_bytes_it_sent() -> None:
    """A worker's `CallFinished` (``hexgen_worker.convert.finished_message``), decoded at the
    coordinator's edge and encoded back, is the bytes the worker sent: every field, the
    engine's time to first token included, reaches `Finished`."""
    event = WorkerFinished(
        call_id="q/1.2",
        output_tokens=17,
        text="ok",
        started_s=12.5,
        finished_s=13.75,
        attempt=2,
        cached_tokens=64,
        finish_reason="tool_calls",
        tool_calls=(WorkerToolCall("call_1", "weather", '{"city": "Oslo"}'),),
        prompt_tokens=100,
        first_token_s=12.875,
    )
    sent = wpb.ConnectRequest(finished=finished_message(event)).SerializeToString()
    finished = decode_finished(wpb.ConnectRequest.FromString(sent).finished)
    assert (finished.started_s, finished.first_token_s, finished.finished_s) == (
        12.5,
        12.875,
        13.75,
    )
    assert encode_message(finished).SerializeToString() == sent
    # an engine that does not say: nothing on the wire, 0.0 at the coordinator
    quiet = finished_message(WorkerFinished("q/0.0", 1, "", 1.0, 2.0))
    assert not quiet.first_token_s and decode_finished(quiet).first_token_s == 0.0


# ------------------------------------------------------------------ a hello's checks


def test_a_hello_the_enum_cannot_name_is_refused_before_decoding() -> None:
    hello = wpb.WorkerHello(worker_id="w", slot=0, gpu="A100")
    hello.engine = 7  # type: ignore[assignment]  # proto3 keeps a value it cannot name
    problem = hello_problem(hello)
    assert problem is not None
    assert problem.startswith("hello.engine: unknown engine kind 7 (known: ")
    with pytest.raises(ValueError):
        decode_hello(hello)
    hello.engine, hello.slot = wpb.ENGINE_KIND_SIMULATED, -2
    assert hello_problem(hello) == ("hello.slot: must be >= 0, or -1 for any free slot, got -2")
    hello.slot = -1
    assert hello_problem(hello) is None
    assert decode_hello(hello).engine == "ENGINE_KIND_SIMULATED"
