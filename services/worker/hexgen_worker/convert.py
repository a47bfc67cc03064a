"""Protobuf <-> worker values: the one place where the worker meets `worker_pb2`."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

from hexgen_api.v1 import worker_pb2
from hexgen_service.clock import ClusterClock
from hexgen_service.errors import InvalidFieldError
from hexgen_worker.config import EngineKind, WorkerConfig
from hexgen_worker.engines.base import ChatMessage
from hexgen_worker.events import CallFinished, CallReport, CallStarted, CallTokens, Heartbeat
from hexgen_worker.welcome import WelcomeSettings

__all__ = [
    "DEFAULT_HEARTBEAT_INTERVAL_S",
    "ENGINE_KIND_PB",
    "dispatch_messages",
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
    return tuple(ChatMessage(m.role, m.content) for m in pb.messages)


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
