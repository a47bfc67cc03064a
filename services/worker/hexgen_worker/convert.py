"""Protobuf <-> worker values: the one place where the worker meets `worker_pb2`."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from hexgen_api.v1 import worker_pb2, workflow_pb2
from hexgen_service.clock import ClusterClock
from hexgen_service.errors import InvalidFieldError
from hexgen_worker.config import EngineKind, WorkerConfig
from hexgen_worker.engines.base import NO_OPTIONS, CallOptions, ChatMessage
from hexgen_worker.events import (
    CallFinished,
    CallReport,
    CallStarted,
    CallTokens,
    Heartbeat,
    ToolCall,
)
from hexgen_worker.welcome import WelcomeSettings

__all__ = [
    "DEFAULT_HEARTBEAT_INTERVAL_S",
    "ENGINE_KIND_PB",
    "dispatch_messages",
    "dispatch_options",
    "event_request",
    "heartbeat_request",
    "hello_request",
    "welcome_from_proto",
]

DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
"""Heartbeat interval when the welcome leaves it at 0."""

ENGINE_KIND_PB: dict[EngineKind, worker_pb2.EngineKind.ValueType] = {
    "simulated": worker_pb2.ENGINE_KIND_SIMULATED,
    "openai": worker_pb2.ENGINE_KIND_OPENAI,
    "vllm": worker_pb2.ENGINE_KIND_VLLM,
}


def hello_request(
    config: WorkerConfig,
    *,
    slot: int,
    resident_call_ids: Iterable[str],
    unacked_call_ids: Iterable[str],
) -> worker_pb2.ConnectRequest:
    """The first message of a connection (`config` resolved)."""
    return worker_pb2.ConnectRequest(
        hello=worker_pb2.WorkerHello(
            worker_id=config.worker_id,
            slot=slot,
            gpu=config.gpu,
            model=config.model,
            engine=ENGINE_KIND_PB[config.engine],
            kv_cache_tokens=config.kv_cache_tokens or 0,
            max_batch=config.max_batch or 0,
            resident_call_ids=list(resident_call_ids),
            unacked_call_ids=list(unacked_call_ids),
        )
    )


def welcome_from_proto(pb: worker_pb2.WorkerWelcome) -> WelcomeSettings:
    """Validate a welcome; a bad field raises `InvalidFieldError` naming it."""
    if pb.slot < 0:
        raise InvalidFieldError("welcome.slot", f"must be >= 0, got {pb.slot}")
    if not (math.isfinite(pb.epoch_unix_s) and pb.epoch_unix_s > 0):
        raise InvalidFieldError("welcome.epoch_unix_s", f"must be > 0, got {pb.epoch_unix_s}")
    if not (math.isfinite(pb.time_scale) and pb.time_scale > 0):
        raise InvalidFieldError("welcome.time_scale", f"must be > 0, got {pb.time_scale}")
    if not pb.cluster:
        raise InvalidFieldError("welcome.cluster", "must not be empty")
    if not pb.queue_policy:
        raise InvalidFieldError("welcome.queue_policy", "must not be empty")
    interval = pb.heartbeat_interval_s or DEFAULT_HEARTBEAT_INTERVAL_S
    if not (math.isfinite(interval) and interval > 0):
        raise InvalidFieldError(
            "welcome.heartbeat_interval_s", f"must be > 0, got {pb.heartbeat_interval_s}"
        )
    try:
        params = json.loads(pb.queue_params_json) if pb.queue_params_json else {}
    except json.JSONDecodeError as exc:
        raise InvalidFieldError("welcome.queue_params_json", f"not JSON: {exc}") from None
    if not isinstance(params, dict):
        raise InvalidFieldError("welcome.queue_params_json", "must be a JSON object")
    return WelcomeSettings(
        slot=pb.slot,
        instance=pb.instance,
        clock=ClusterClock(pb.epoch_unix_s, pb.time_scale),
        cluster=pb.cluster,
        queue_policy=pb.queue_policy,
        queue_params=params,
        heartbeat_interval_s=interval,
        drop_call_ids=tuple(pb.drop_call_ids),
        shard=pb.shard,
    )


def dispatch_messages(pb: worker_pb2.DispatchCall) -> tuple[ChatMessage, ...]:
    """A dispatched chat call's messages (empty for a plain prompt)."""
    return tuple(
        ChatMessage(
            m.role,
            m.content,
            tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
            m.tool_call_id,
            m.name,
        )
        for m in pb.messages
    )


def dispatch_options(pb: worker_pb2.DispatchCall) -> CallOptions:
    """A dispatched call's options (`NO_OPTIONS` without any); `InvalidFieldError` naming a
    JSON field that does not hold what OpenAI's field does."""
    if not pb.HasField("options"):
        return NO_OPTIONS
    o = pb.options
    tools = _json_field(o.tools_json, "options.tools_json", list)
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise InvalidFieldError("options.tools_json", "must be a JSON list of objects")
    choice = _json_field(o.tool_choice_json, "options.tool_choice_json", (str, dict))
    response_format = _json_field(o.response_format_json, "options.response_format_json", dict)
    return CallOptions(
        temperature=o.temperature if o.HasField("temperature") else None,
        top_p=o.top_p if o.HasField("top_p") else None,
        stop=tuple(o.stop),
        seed=o.seed if o.HasField("seed") else None,
        presence_penalty=o.presence_penalty if o.HasField("presence_penalty") else None,
        frequency_penalty=o.frequency_penalty if o.HasField("frequency_penalty") else None,
        tools=tuple(tools or ()),
        tool_choice=choice,
        response_format=response_format,
        parallel_tool_calls=o.parallel_tool_calls if o.HasField("parallel_tool_calls") else None,
    )


def _json_field(text: str, field: str, kind: type | tuple[type, ...]) -> Any:
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidFieldError(field, f"not JSON: {exc}") from None
    if not isinstance(value, kind):
        shape = type(value).__name__
        raise InvalidFieldError(field, f"must be JSON of OpenAI's shape, got {shape}")
    return value


def event_request(event: CallReport) -> worker_pb2.ConnectRequest:
    """A call event as the message the worker sends."""
    if isinstance(event, CallStarted):
        return worker_pb2.ConnectRequest(started=worker_pb2.CallStarted(call_id=event.call_id))
    if isinstance(event, CallTokens):
        return worker_pb2.ConnectRequest(
            tokens=worker_pb2.CallTokens(call_id=event.call_id, text=event.text)
        )
    return worker_pb2.ConnectRequest(finished=finished_message(event))


def finished_message(event: CallFinished) -> worker_pb2.CallFinished:
    return worker_pb2.CallFinished(
        call_id=event.call_id,
        output_tokens=event.output_tokens,
        text=event.text,
        started_s=event.started_s,
        finished_s=event.finished_s,
        error=event.error,
        attempt=event.attempt,
        cached_tokens=event.cached_tokens,
        finish_reason=event.finish_reason,
        tool_calls=[
            workflow_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
            for c in event.tool_calls
        ],
        prompt_tokens=event.prompt_tokens,
        first_token_s=event.first_token_s,
    )


def heartbeat_request(heartbeat: Heartbeat) -> worker_pb2.ConnectRequest:
    return worker_pb2.ConnectRequest(
        heartbeat=worker_pb2.WorkerHeartbeat(
            running=heartbeat.running,
            queued=heartbeat.queued,
            kv_used_tokens=heartbeat.kv_used_tokens,
            others_in_flight=heartbeat.others_in_flight,
            others_outstanding_s=heartbeat.others_outstanding_s,
            others_tokens=heartbeat.others_tokens,
            others_weight=heartbeat.others_weight,
            others_weighted_outstanding_s=heartbeat.others_weighted_outstanding_s,
        )
    )
