"""The worker protocol's wire: `worker_pb2` to `hexgen_coordinator.worker_messages` and
back, both directions of the `Connect` stream.

Only the gRPC servicer (`hexgen_coordinator.service`) imports this module, and no other
module of the coordinator imports `worker_pb2` (tests/test_layers.py checks both): the
protobuf of the worker stream stops here. Each translation is one object built field by
field (a report's zeros kept as zeros: `worker_messages` says why), so the bytes on the
wire are those the coordinator sent before the translation existed.

The servicer needs one direction of each: it decodes what workers send and encodes what
it sends them. The other direction, what a worker does, lives in tests/test_worker_wire.py,
which checks the round trip ``decode(encode(x)) == x`` for every type: nothing is lost or
added on the way.
"""

from __future__ import annotations

from hexgen_api.v1 import worker_pb2 as wpb
from hexgen_coordinator.worker_messages import (
    Ack,
    CancelRun,
    Command,
    Finished,
    Heartbeat,
    Hello,
    NewDeadline,
    Run,
    Started,
    Tokens,
    ToolCall,
)

__all__ = [
    "decode_finished",
    "decode_heartbeat",
    "decode_hello",
    "decode_started",
    "decode_tokens",
    "encode_command",
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
        first_token_s=pb.first_token_s,
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
