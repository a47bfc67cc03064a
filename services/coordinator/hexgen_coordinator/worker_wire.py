"""The worker protocol's wire: `worker_pb2` to `hexgen_coordinator.worker_messages` and
back, both directions of the `Connect` stream.

Only the gRPC servicer (`hexgen_coordinator.service`) imports this module, and no other
module of the coordinator imports `worker_pb2` (tests/test_layers.py checks both): the
protobuf of the worker stream stops here. Each translation is one object built field by
field (a report's zeros kept as zeros: `worker_messages` says why), so the bytes on the
wire are those the coordinator sent before the translation existed.

The servicer needs one direction of each: it decodes what workers send and encodes what
it sends them. The other direction (`encode_message`, `decode_command`) is what a worker
would do; it is here so that the round trip ``decode(encode(x)) == x`` is tested for every
type, the proof that nothing is lost or added on the way.
"""

from __future__ import annotations

from hexgen_api.v1 import worker_pb2 as wpb
from hexgen_api.v1 import workflow_pb2 as wfpb
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

__all__ = [
    "decode_command",
    "decode_finished",
    "decode_heartbeat",
    "decode_hello",
    "decode_message",
    "decode_started",
    "decode_tokens",
    "encode_command",
    "encode_message",
    "hello_problem",
]


# ------------------------------------------------------------------ worker -> coordinator


def hello_problem(hello: wpb.WorkerHello) -> str | None:
    """What makes a hello unusable, as ``field: why`` (INVALID_ARGUMENT); None: nothing.
    Proto3 keeps an enum value that the enum does not name (a newer or hostile worker), so
    `engine` is checked before it is named; `slot_for` checks the slot's range, GPU and
    model. The hello's other fields are strings and ids that the coordinator only compares."""
    if hello.engine not in wpb.EngineKind.values():
        known = ", ".join(f"{wpb.EngineKind.Name(v)} ({v})" for v in wpb.EngineKind.values())
        return f"hello.engine: unknown engine kind {hello.engine} (known: {known})"
    if hello.slot < -1:
        return f"hello.slot: must be >= 0, or -1 for any free slot, got {hello.slot}"
    return None


def decode_hello(pb: wpb.WorkerHello) -> Hello:
    """A hello that `hello_problem` passed (an engine kind the enum does not name raises
    ValueError here)."""
    return Hello(
        worker_id=pb.worker_id,
        slot=pb.slot,
        gpu=pb.gpu,
        model=pb.model,
        engine=wpb.EngineKind.Name(pb.engine),
        kv_cache_tokens=pb.kv_cache_tokens,
        max_batch=pb.max_batch,
        resident_call_ids=tuple(pb.resident_call_ids),
        unacked_call_ids=tuple(pb.unacked_call_ids),
    )


def decode_heartbeat(pb: wpb.WorkerHeartbeat) -> Heartbeat:
    return Heartbeat(
        running=pb.running,
        queued=pb.queued,
        kv_used_tokens=pb.kv_used_tokens,
        others_in_flight=pb.others_in_flight,
        others_outstanding_s=pb.others_outstanding_s,
        others_tokens=pb.others_tokens,
        others_weight=pb.others_weight,
        others_weighted_outstanding_s=pb.others_weighted_outstanding_s,
    )


def decode_started(pb: wpb.CallStarted) -> Started:
    return Started(pb.call_id)


def decode_tokens(pb: wpb.CallTokens) -> Tokens:
    return Tokens(pb.call_id, pb.text)


def decode_finished(pb: wpb.CallFinished) -> Finished:
    """Every completion passes here: one object, and a tuple only when the model called
    tools."""
    return Finished(
        call_id=pb.call_id,
        output_tokens=pb.output_tokens,
        text=pb.text,
        started_s=pb.started_s,
        finished_s=pb.finished_s,
        error=pb.error,
        attempt=pb.attempt,
        cached_tokens=pb.cached_tokens,
        finish_reason=pb.finish_reason,
        tool_calls=(
            tuple(ToolCall(t.id, t.name, t.arguments) for t in pb.tool_calls)
            if pb.tool_calls
            else ()
        ),
        prompt_tokens=pb.prompt_tokens,
    )


def decode_message(pb: wpb.ConnectRequest) -> Message | None:
    """What a worker sent; None: an empty message (no field of the oneof set)."""
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
    """A worker's side of `decode_message`."""
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


# ------------------------------------------------------------------ coordinator -> worker


def encode_command(cmd: Command) -> wpb.ConnectResponse:
    """The message the servicer's writer sends for a command of `WorkerLink.outbox`."""
    if isinstance(cmd, Run):
        return wpb.ConnectResponse(
            dispatch=wpb.DispatchCall(
                messages=cmd.messages,
                options=cmd.options,
                call_id=cmd.call_id,
                query_id=cmd.query_id,
                tenant=cmd.tenant,
                stage=cmd.stage,
                step=cmd.step,
                input_tokens=cmd.input_tokens,
                output_tokens=cmd.output_tokens,
                expected_output_tokens=cmd.expected_output_tokens,
                prompt=cmd.prompt,
                sequence=cmd.sequence,
                query_sequence=cmd.query_sequence,
                released_s=cmd.released_s,
                deadline_s=cmd.deadline_s,
                query_deadline_s=cmd.query_deadline_s,
                remaining_after_s=cmd.remaining_after_s,
                traceparent=cmd.traceparent,
                attempt=cmd.attempt,
                weight=cmd.weight,
            )
        )
    if isinstance(cmd, Ack):
        return wpb.ConnectResponse(ack=wpb.AckFinished(call_ids=cmd.call_ids))
    if isinstance(cmd, NewDeadline):
        return wpb.ConnectResponse(
            deadline=wpb.UpdateDeadline(call_id=cmd.call_id, deadline_s=cmd.deadline_s)
        )
    if isinstance(cmd, CancelRun):
        return wpb.ConnectResponse(cancel=wpb.CancelCall(call_id=cmd.call_id))
    return wpb.ConnectResponse(
        welcome=wpb.WorkerWelcome(
            slot=cmd.slot,
            instance=cmd.instance,
            epoch_unix_s=cmd.epoch_unix_s,
            time_scale=cmd.time_scale,
            cluster=cmd.cluster,
            queue_policy=cmd.queue_policy,
            queue_params_json=cmd.queue_params_json,
            heartbeat_interval_s=cmd.heartbeat_interval_s,
            drop_call_ids=cmd.drop_call_ids,
            shard=cmd.shard,
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
