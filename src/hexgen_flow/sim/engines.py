"""The simulated engine models by name: what `SimConfig.engine`, ``--engine`` and the
worker's ``--engine-model`` choose between.

- ``prefill-first`` (`BatchingEngineModel`): KV reserved for input + output at admission,
  serial prefills that pause decoding, decode slowed by the profiled batch slowdown.
- ``vllm-v1`` (`VllmV1EngineModel`): vLLM V1's scheduler: token-budgeted steps, chunked
  prefill mixed with decodes, KV blocks on demand, preemption by recompute, optional prefix
  caching.

Both are driven the same way (`EngineModel`), so the simulator and the worker's simulated
engine take either.
"""

from __future__ import annotations

from typing import Protocol

from hexgen_flow.cluster import InstanceSpec
from hexgen_flow.errors import ConfigError
from hexgen_flow.runtime import CallTicket
from hexgen_flow.sim.engine import BatchingEngineModel
from hexgen_flow.sim.vllm_v1 import VllmV1EngineModel

__all__ = [
    "DEFAULT_ENGINE_MODEL",
    "ENGINE_MODELS",
    "EngineModel",
    "check_engine_model",
    "create_engine_model",
]


class EngineModel(Protocol):
    """An instance's execution model, driven with times its caller chooses."""

    kv_capacity: int
    max_batch: int
    running: int
    """Calls handed to the engine and not yet finished."""
    preemptions: int
    """Requests preempted so far (0 for a model that never preempts)."""

    @property
    def kv_used(self) -> int: ...

    def fits(self, ticket: CallTicket) -> bool: ...

    def admit(self, ticket: CallTicket, now: float) -> None: ...

    def abort(self, ticket: CallTicket, now: float) -> bool: ...

    def next_event_s(self) -> float:
        """When the state next changes by itself; a model may plan its next step here, so
        a driver asks once every call of the instant has been handed over."""
        ...

    def peek_event_s(self) -> float:
        """`next_event_s` without planning anything (an unplanned step's start)."""
        ...

    def advance(self, now: float) -> list[CallTicket]: ...


ENGINE_MODELS: dict[str, type[BatchingEngineModel] | type[VllmV1EngineModel]] = {
    "prefill-first": BatchingEngineModel,
    "vllm-v1": VllmV1EngineModel,
}
"""Engine models by name."""

DEFAULT_ENGINE_MODEL = "vllm-v1"


def check_engine_model(name: str, *, prefix_caching: bool = False) -> str:
    """`name` if it is a known engine model (and supports `prefix_caching` when asked),
    else `ConfigError` naming the known ones."""
    if name not in ENGINE_MODELS:
        raise ConfigError(
            f"unknown engine model {name!r}; known: {', '.join(sorted(ENGINE_MODELS))}"
        )
    if prefix_caching and ENGINE_MODELS[name] is not VllmV1EngineModel:
        raise ConfigError(f"engine model {name!r} has no prefix cache; use vllm-v1")
    return name


def prefix_caching_of(name: str, prefix_caching: bool | None) -> bool:
    """Whether engine model `name` caches prefixes: `prefix_caching`, or when None the
    engine's default: on for `vllm-v1`, as vLLM V1 serves by default; `prefill-first` has
    no prefix cache. `ConfigError` when asked for a cache the engine lacks."""
    check_engine_model(name, prefix_caching=bool(prefix_caching))
    if prefix_caching is None:
        return ENGINE_MODELS[name] is VllmV1EngineModel
    return prefix_caching


def create_engine_model(
    name: str, spec: InstanceSpec, *, prefix_caching: bool | None = None
) -> EngineModel:
    """A fresh engine model `name` for the instance `spec` (`prefix_caching`: None for the
    engine's default, `prefix_caching_of`)."""
    caching = prefix_caching_of(name, prefix_caching)
    cls = ENGINE_MODELS[name]
    if cls is VllmV1EngineModel:
        return VllmV1EngineModel(spec, enable_prefix_caching=caching)
    return cls(spec)
