"""The engines a worker can put behind its local queue, by ``--engine`` name."""

from __future__ import annotations

from collections.abc import Callable

from hexgen_worker.config import EngineKind, WorkerConfig
from hexgen_worker.engines.base import Engine, EngineLoad, EngineUnavailableError
from hexgen_worker.engines.openai import OpenAIEngine
from hexgen_worker.engines.simulated import SimulatedEngine
from hexgen_worker.engines.vllm import VllmEngine

__all__ = [
    "ENGINES",
    "Engine",
    "EngineLoad",
    "EngineUnavailableError",
    "OpenAIEngine",
    "SimulatedEngine",
    "VllmEngine",
    "create_engine",
]


def _simulated(config: WorkerConfig) -> Engine:
    return SimulatedEngine(
        config.instance_spec(), config.engine_model, prefix_caching=config.prefix_caching
    )


def _openai(config: WorkerConfig) -> Engine:
    return OpenAIEngine(
        url=config.openai_url,
        model=config.openai_model,
        max_concurrency=config.max_concurrency or config.max_batch or 1,
        kv_cache_tokens=config.kv_cache_tokens or 0,
        api=config.openai_api,
        ignore_eos=config.ignore_eos,
        send_priority=config.openai_priority,
        request_timeout_s=config.request_timeout_s,
        max_context_tokens=config.max_context_tokens,
    )


def _vllm(config: WorkerConfig) -> Engine:
    return VllmEngine(
        model=config.vllm_model,
        max_batch=config.max_batch or 256,
        max_concurrency=config.max_concurrency,
        kv_cache_tokens=config.kv_cache_tokens or 0,
        engine_args=config.vllm_engine_args,
        ignore_eos=config.ignore_eos,
        max_context_tokens=config.max_context_tokens,
    )


ENGINES: dict[EngineKind, Callable[[WorkerConfig], Engine]] = {
    "simulated": _simulated,
    "openai": _openai,
    "vllm": _vllm,
}
"""Engine builders by ``--engine`` name; each takes a resolved `WorkerConfig`."""


def create_engine(config: WorkerConfig) -> Engine:
    """The engine `config` names (not started: the caller awaits `Engine.start`)."""
    config = config.resolved()
    return ENGINES[config.engine](config)
