"""The worker's configuration: one typed, frozen tree that the command line fills."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from hexgen_flow.cluster import DEFAULT_MODEL, Cluster, InstanceSpec
from hexgen_flow.errors import ConfigError
from hexgen_flow.latency import latency_model, resolve_model
from hexgen_flow.sim.engines import DEFAULT_ENGINE_MODEL, prefix_caching_of
from hexgen_service.exposure import refuse_open_metrics

__all__ = ["ENGINE_KINDS", "EngineKind", "WorkerConfig"]

EngineKind = Literal["simulated", "openai", "vllm"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("simulated", "openai", "vllm")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything one worker process needs; `resolved()` fills the derived defaults."""

    coordinator: str = "localhost:50051"
    """Address (HOST:PORT) of the coordinator's WorkerService (the first, with several)."""
    extra_coordinators: tuple[str, ...] = ()
    """More coordinators (shards) this worker serves at the same time (``--coordinator``
    given again): one link each, every call in the one local queue (`coordinators`)."""
    worker_id: str = ""
    """Identity of this worker, stable across its restarts (required)."""
    slot: int = -1
    """Slot of the coordinator's cluster to take; -1: any free slot of this GPU type."""
    gpu: str = "A100"
    """GPU type this instance runs on (a latency-model name, e.g. A100, A6000, L40S, H100)."""
    model: str = DEFAULT_MODEL
    """Model served (a latency-model name): the simulated engine's latency model."""
    calibration: str | None = None
    """Where the latency numbers of the simulated engine and the local queue's estimates
    come from (``--calibration``); None: ``chess-measured``. The coordinator's, in a mesh."""
    engine: EngineKind = "simulated"
    """Engine behind the local queue: simulated, openai or vllm."""
    engine_model: str = DEFAULT_ENGINE_MODEL
    """simulated engine: the core's engine model it runs (``--engine-model``; the name the
    simulator's ``--engine`` takes), so that the mesh and the simulator share it."""
    prefix_caching: bool | None = None
    """simulated engine: prefix caching in the engine model; None: the engine model's
    default (vllm-v1: on, as vLLM V1 serves; `hexgen_flow.sim.engines.prefix_caching_of`)."""
    kv_cache_tokens: int | None = None
    """KV-cache tokens declared to the coordinator; None: the latency model's capacity."""
    max_batch: int | None = None
    """Most calls running together; None: the latency model's (vLLM's max_num_seqs, 256)."""
    max_concurrency: int | None = None
    """Real engines: most calls in flight at once; None: max_batch."""
    max_context_tokens: int = 0
    """Real engines: shrink calls to this many input + output tokens; 0: no limit (vllm:
    the model's context length)."""
    openai_url: str = ""
    """openai engine: base URL of the server, e.g. http://localhost:8000 (or .../v1)."""
    openai_model: str = ""
    """openai engine: model name to request; empty: the first model the server lists."""
    openai_api: Literal["completions", "chat"] = "completions"
    """openai engine: /v1/completions or /v1/chat/completions."""
    openai_priority: bool = False
    """openai engine: send the local queue order as vLLM's `priority` (the server must run
    with --scheduling-policy priority)."""
    ignore_eos: bool = True
    """Real engines: generate exactly the call's output tokens (vLLM's ignore_eos)."""
    request_timeout_s: float = 600.0
    """openai engine: seconds one streaming request may take."""
    vllm_model: str = ""
    """vllm engine: model name or local path given to AsyncEngineArgs(model=...)."""
    vllm_engine_args: Mapping[str, Any] = field(default_factory=dict)
    """vllm engine: extra AsyncEngineArgs fields, e.g. {"enforce_eager": True}."""
    backoff_initial_s: float = 0.1
    """First reconnect delay (wall seconds); doubles after every failed attempt."""
    backoff_max_s: float = 2.0
    """Largest reconnect delay (wall seconds)."""
    jitter_seed: int | None = None
    """Seed of the reconnect jitter; None: from the OS, so that workers spread out."""
    welcome_timeout_s: float = 30.0
    """Wall seconds to wait for the welcome after the hello before reconnecting."""
    shutdown_grace_s: float = 2.0
    """On SIGTERM: wall seconds to wait for the coordinator to acknowledge what finished."""
    log_level: str = "INFO"
    """Python logging level name."""
    metrics_listen: str = ""
    """Where to serve Prometheus metrics (``HOST:PORT``, at /metrics); empty: nowhere.
    Beyond loopback only over HTTPS (`metrics_tls_cert`) to API keys (`api_keys_file`),
    or `insecure` (`hexgen_service.exposure.refuse_open_metrics`)."""
    metrics_tls_cert: str = ""
    """The server certificate (PEM) the metrics are served over HTTPS with; empty: plain
    HTTP. Not `tls_cert`: that is the worker's client certificate for the workers' door."""
    metrics_tls_key: str = ""
    """Its private key."""
    api_keys_file: str = ""
    """The keys file (`hexgen_service.auth.KeyStore`) whose keys, of any role, may scrape
    the metrics (they name no tenant); empty: anyone may."""
    insecure: bool = False
    """Serve the metrics beyond loopback without HTTPS and keys (protected mode off)."""
    worker_token: str = ""
    """The token its Connect carries (`hexgen_service.worker_token`); empty: none."""
    tls_ca: str = ""
    """The CA to verify a TLS coordinator with; empty with no certificate: plaintext."""
    tls_cert: str = ""
    """The worker's client certificate (PEM), for a workers' door with mutual TLS."""
    tls_key: str = ""
    """Its private key."""

    def resolved(self) -> WorkerConfig:
        """A validated copy with the model's name canonical and the None defaults filled.

        Raises `ConfigError` (one line naming the option) on a bad setting.
        """
        if not self.worker_id:
            raise ConfigError("--worker-id is required (a name stable across restarts)")
        for address in self.coordinators:
            if ":" not in address:
                raise ConfigError(f"--coordinator: expected HOST:PORT, got {address!r}")
        if len(set(self.coordinators)) != len(self.coordinators):
            twice = next(a for a in self.coordinators if self.coordinators.count(a) > 1)
            raise ConfigError(f"--coordinator: {twice} is given twice")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key: give both or neither")
        if bool(self.metrics_tls_cert) != bool(self.metrics_tls_key):
            raise ConfigError("--metrics-tls-cert and --metrics-tls-key: give both or neither")
        refuse_open_metrics(
            self.metrics_listen,
            tls=bool(self.metrics_tls_cert),
            keys=bool(self.api_keys_file),
            insecure=self.insecure,
            tls_flags="--metrics-tls-cert/--metrics-tls-key",
        )
        if self.slot < -1:
            raise ConfigError(f"--slot must be >= 0, or -1 for any slot, got {self.slot}")
        if self.engine not in ENGINE_KINDS:
            raise ConfigError(
                f"--engine: unknown engine {self.engine!r}; known: {', '.join(ENGINE_KINDS)}"
            )
        try:
            prefix_caching_of(self.engine_model, self.prefix_caching)
        except ConfigError as exc:
            raise ConfigError(f"--engine-model: {exc}") from None
        model = resolve_model(self.model).name
        lat = latency_model(model, self.gpu, calibration=self.calibration)
        kv = lat.kv_capacity_tokens if self.kv_cache_tokens is None else self.kv_cache_tokens
        max_batch = lat.max_batch if self.max_batch is None else self.max_batch
        if kv <= 0:
            raise ConfigError(
                f"--kv-cache-tokens must be > 0 ({model} on {lat.gpu} leaves no KV cache "
                "unless you give it)"
            )
        if max_batch < 1:
            raise ConfigError(f"--max-batch must be >= 1, got {max_batch}")
        concurrency = max_batch if self.max_concurrency is None else self.max_concurrency
        if concurrency < 1:
            raise ConfigError(f"--max-concurrency must be >= 1, got {concurrency}")
        if self.max_context_tokens < 0:
            raise ConfigError(f"--max-context-tokens must be >= 0, got {self.max_context_tokens}")
        if self.engine == "openai" and not self.openai_url:
            raise ConfigError("--engine openai needs --openai-url (e.g. http://localhost:8000)")
        if self.engine == "vllm" and not self.vllm_model:
            raise ConfigError("--engine vllm needs --vllm-model (a model name or local path)")
        for name in (
            "request_timeout_s",
            "backoff_initial_s",
            "backoff_max_s",
            "welcome_timeout_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {value}")
        if not (math.isfinite(self.shutdown_grace_s) and self.shutdown_grace_s >= 0):
            raise ConfigError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        return dataclasses.replace(
            self,
            model=model,
            gpu=lat.gpu,
            kv_cache_tokens=kv,
            max_batch=max_batch,
            max_concurrency=concurrency,
        )

    @property
    def coordinators(self) -> tuple[str, ...]:
        """Every coordinator this worker links to, in link order (link 0 first)."""
        return (self.coordinator, *self.extra_coordinators)

    def instance_spec(self) -> InstanceSpec:
        """The instance this worker declares (what the simulated engine models)."""
        config = self.resolved()
        entry = {
            "gpu": config.gpu,
            "model": config.model,
            "kv_cache_tokens": config.kv_cache_tokens,
            "max_batch": config.max_batch,
        }
        cluster = Cluster.build([entry], f"worker {config.worker_id}", calibration=self.calibration)
        return cluster.instances[0]
