"""The worker's settings: one typed, frozen tree, every field with its default, its
command-line option and its check (`hexgen_service.settings`).

It lives here, beside the services' shared plumbing, rather than in `hexgen_worker`, so
that the launchers (`hexgen_launch`, which starts workers as processes and may not import
them: tests/test_layers.py) render a worker's command line from the same fields that
``python -m hexgen_worker`` parses; `hexgen_worker.config` re-exports it.

Two options are spelled by hand here, in forms `hexgen_service.settings` has no type for:
``--coordinator`` (given once per coordinator: `coordinator`, then `extra_coordinators`)
and ``--vllm-arg KEY=VALUE`` (given once per `vllm_engine_args` entry). The TLS options are
`hexgen_service.tls`'s. The reconnect and shutdown timings are set from code only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hexgen_flow.cluster import DEFAULT_MODEL, Cluster, InstanceSpec, cluster_file_catalogue
from hexgen_flow.errors import ConfigError
from hexgen_flow.hardware import GpuCatalogue
from hexgen_flow.latency import latency_model, resolve_model
from hexgen_flow.sim.engines import DEFAULT_ENGINE_MODEL, ENGINE_MODELS, prefix_caching_of
from hexgen_service.auth import read_secret
from hexgen_service.eos_script import EosScript
from hexgen_service.exposure import refuse_open_metrics
from hexgen_service.settings import (
    LOG_LEVELS,
    Check,
    add_options,
    check_settings,
    from_args,
    setting,
    setting_factory,
    to_argv,
)

__all__ = [
    "ENGINE_KINDS",
    "LOG_LEVELS",
    "EngineKind",
    "WorkerConfig",
    "add_worker_options",
    "worker_argv",
    "worker_config_from_args",
]

EngineKind = Literal["simulated", "openai", "vllm"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("simulated", "openai", "vllm")


def _at_least_got(low: int, note: str = "") -> Check:
    def check(value: int | None) -> str | None:
        return None if value is None or value >= low else f"must be >= {low}{note}, got {value}"

    return check


def _slot(value: int) -> str | None:
    return None if value >= -1 else f"must be >= 0, or -1 for any slot, got {value}"


def _positive_finite(value: float) -> str | None:
    fine = math.isfinite(value) and value > 0
    return None if fine else f"must be a finite number > 0, got {value}"


def _not_negative_finite(value: float) -> str | None:
    return None if math.isfinite(value) and value >= 0 else f"must be >= 0, got {value}"


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything one worker process needs; `resolved()` fills the derived defaults."""

    coordinator: str = setting("localhost:50051", flag="--coordinator", by_hand=True)
    """Address (HOST:PORT) of the coordinator's WorkerService (the first, with several)."""
    extra_coordinators: tuple[str, ...] = setting((), flag="--coordinator", by_hand=True)
    """More coordinators (shards) this worker serves at the same time (``--coordinator``
    given again): one link each, every call in the one local queue (`coordinators`)."""
    worker_id: str = setting("", "stable across restarts", metavar="ID", required=True)
    """Identity of this worker, stable across its restarts (required)."""
    slot: int = setting(-1, "cluster slot; -1: any of my GPU type", check=_slot)
    """Slot of the coordinator's cluster to take; -1: any free slot of this GPU type."""
    gpu: str = setting("A100", "GPU type, e.g. A100, A6000, L40S, H100", required=True)
    """GPU type this instance runs on (a latency-model name, e.g. A100, A6000, L40S, H100)."""
    model: str = setting(DEFAULT_MODEL, "latency-model name")
    """Model served (a latency-model name): the simulated engine's latency model."""
    calibration: str | None = setting(
        None,
        "where the simulated engine's and the local queue's latency numbers come from "
        "(default chess-measured; in a mesh, the coordinator's)",
        metavar="NAME|measured:FILE",
    )
    """Where the latency numbers of the simulated engine and the local queue's estimates
    come from (``--calibration``); None: ``chess-measured``. The coordinator's, in a mesh."""
    gpus_file: str | None = setting(
        None,
        "a cluster file whose gpus: entries define GPU types the shipped catalogue lacks "
        "(the coordinator's --cluster file)",
        metavar="FILE",
    )
    """A cluster file whose ``gpus:`` entries define GPU types the shipped catalogue lacks
    (``--gpus-file``): ``--gpu`` is resolved in the catalogue they extend. A launcher gives
    a mesh's workers the coordinator's ``--cluster`` file when it defines any."""
    engine: EngineKind = setting("simulated", choices=ENGINE_KINDS)  # noqa: RUF009 (a Literal)
    """Engine behind the local queue: simulated, openai or vllm."""
    engine_model: str = setting(
        DEFAULT_ENGINE_MODEL,
        "simulated engine: the engine model it runs, as the simulator's --engine "
        "(default %(default)s)",
        choices=tuple(sorted(ENGINE_MODELS)),
    )
    """simulated engine: the core's engine model it runs (``--engine-model``; the name the
    simulator's ``--engine`` takes), so that the mesh and the simulator share it."""
    prefix_caching: bool | None = setting(
        None,
        "simulated engine: prefix caching in the engine model (default: the engine "
        "model's; vllm-v1 caches, as vLLM V1 does)",
    )
    """simulated engine: prefix caching in the engine model; None: the engine model's
    default (vllm-v1: on, as vLLM V1 serves; `hexgen_flow.sim.engines.prefix_caching_of`)."""
    kv_cache_tokens: int | None = setting(None, "default: the latency model's KV capacity")
    """KV-cache tokens declared to the coordinator; None: the latency model's capacity."""
    max_batch: int | None = setting(
        None, "default: the latency model's (256)", check=_at_least_got(1)
    )
    """Most calls running together; None: the latency model's (vLLM's max_num_seqs, 256)."""
    max_concurrency: int | None = setting(
        None, "real engines: calls in flight (default max batch)", check=_at_least_got(1)
    )
    """Real engines: most calls in flight at once; None: max_batch."""
    max_context_tokens: int = setting(
        0, "real engines: shrink calls to this context (0: no limit)", check=_at_least_got(0)
    )
    """Real engines: shrink calls to this many input + output tokens; 0: no limit (vllm:
    the model's context length)."""
    openai_url: str = setting("", metavar="URL")
    """openai engine: base URL of the server, e.g. http://localhost:8000 (or .../v1)."""
    openai_model: str = setting("", metavar="NAME")
    """openai engine: model name to request; empty: the first model the server lists."""
    openai_api: Literal["completions", "chat"] = setting(
        "completions", choices=("completions", "chat")
    )
    """openai engine: /v1/completions or /v1/chat/completions."""
    openai_priority: bool = setting(
        False, "send the queue order as vLLM's priority (server: --scheduling-policy priority)"
    )
    """openai engine: send the local queue order as vLLM's `priority` (the server must run
    with --scheduling-policy priority)."""
    ignore_eos: bool = setting(
        True,
        "real engines: generate exactly the calls' output tokens (--no-ignore-eos: let the "
        "model stop at end-of-sequence)",
    )
    """Real engines: generate exactly the call's output tokens (vLLM's ignore_eos)."""
    eos_script: str | None = setting(
        None,
        "a JSON object of call id to the output tokens its model writes before stopping: "
        "each named call is generated that long, at most its cap (a replay's stand-in for "
        "a model's end of sequence; the coordinator is not told)",
        metavar="FILE",
    )
    """A scripted end of sequence (``--eos-script``, `hexgen_service.eos_script`): each
    named call generates its scripted tokens, at most its cap; None: every call its cap."""
    request_timeout_s: float = setting(600.0, code_only=True, check=_positive_finite)
    """openai engine: seconds one streaming request may take."""
    vllm_model: str = setting("", metavar="PATH")
    """vllm engine: model name or local path given to AsyncEngineArgs(model=...)."""
    vllm_engine_args: Mapping[str, Any] = setting_factory(dict, flag="--vllm-arg", by_hand=True)
    """vllm engine: extra AsyncEngineArgs fields, e.g. {"enforce_eager": True}."""
    backoff_initial_s: float = setting(0.1, code_only=True, check=_positive_finite)
    """First reconnect delay (wall seconds); doubles after every failed attempt."""
    backoff_max_s: float = setting(2.0, code_only=True, check=_positive_finite)
    """Largest reconnect delay (wall seconds)."""
    jitter_seed: int | None = setting(None, code_only=True)
    """Seed of the reconnect jitter; None: from the OS, so that workers spread out."""
    welcome_timeout_s: float = setting(30.0, code_only=True, check=_positive_finite)
    """Wall seconds to wait for the welcome after the hello before reconnecting."""
    shutdown_grace_s: float = setting(2.0, code_only=True, check=_not_negative_finite)
    """On SIGTERM: wall seconds to wait for the coordinator to acknowledge what finished."""
    log_level: str = setting("INFO", choices=LOG_LEVELS, parse=str.upper)
    """Python logging level name."""
    metrics_listen: str = setting(
        "",
        "serve Prometheus metrics on http://HOST:PORT/metrics (default: not served); "
        "beyond loopback only with --metrics-tls-cert/--metrics-tls-key and --api-keys-file, "
        "or --insecure",
        metavar="HOST:PORT",
    )
    """Where to serve Prometheus metrics (``HOST:PORT``, at /metrics); empty: nowhere.
    Beyond loopback only over HTTPS (`metrics_tls_cert`) to API keys (`api_keys_file`),
    or `insecure` (`hexgen_service.exposure.refuse_open_metrics`)."""
    metrics_tls_cert: str = setting(
        "",
        "serve the metrics over HTTPS with this server certificate (PEM; not --tls-cert, "
        "the worker's client certificate)",
        metavar="FILE",
    )
    """The server certificate (PEM) the metrics are served over HTTPS with; empty: plain
    HTTP. Not `tls_cert`: that is the worker's client certificate for the workers' door."""
    metrics_tls_key: str = setting(
        "", "the private key of --metrics-tls-cert (PEM)", metavar="FILE"
    )
    """Its private key."""
    api_keys_file: str = setting(
        "",
        "answer a scrape of the metrics only with an API key of this keys file "
        "(any role: a worker's metrics name no tenant), else 401",
        metavar="FILE",
    )
    """The keys file (`hexgen_service.auth.KeyStore`) whose keys, of any role, may scrape
    the metrics (they name no tenant); empty: anyone may."""
    insecure: bool = setting(
        False, "serve --metrics-listen beyond loopback without HTTPS and API keys"
    )
    """Serve the metrics beyond loopback without HTTPS and keys (protected mode off)."""
    worker_token: str = setting(
        "",
        "send the token in FILE with the stream (a coordinator with a token requires it)",
        flag="--worker-token-file",
        secret_file=read_secret,
    )
    """The token its Connect carries (`hexgen_service.worker_token`); empty: none."""
    tls_ca: str = setting("", declared_elsewhere=True)  # hexgen_service.tls.add_tls_options
    """The CA to verify a TLS coordinator with; empty with no certificate: plaintext."""
    tls_cert: str = setting("", declared_elsewhere=True)
    """The worker's client certificate (PEM), for a workers' door with mutual TLS."""
    tls_key: str = setting("", declared_elsewhere=True)
    """Its private key."""

    def __post_init__(self) -> None:
        """Every setting's own check (`ConfigError` naming the flag); those between
        settings and those that need the latency model are `resolved()`'s."""
        check_settings(self)

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
        try:
            prefix_caching_of(self.engine_model, self.prefix_caching)
        except ConfigError as exc:
            raise ConfigError(f"--engine-model: {exc}") from None
        model = resolve_model(self.model).name
        lat = latency_model(model, self.gpu, catalogue=self.catalogue, calibration=self.calibration)
        kv = lat.kv_capacity_tokens if self.kv_cache_tokens is None else self.kv_cache_tokens
        max_batch = lat.max_batch if self.max_batch is None else self.max_batch
        if kv <= 0:
            raise ConfigError(
                f"--kv-cache-tokens must be > 0 ({model} on {lat.gpu} leaves no KV cache "
                "unless you give it)"
            )
        concurrency = max_batch if self.max_concurrency is None else self.max_concurrency
        if self.engine == "openai" and not self.openai_url:
            raise ConfigError("--engine openai needs --openai-url (e.g. http://localhost:8000)")
        if self.eos_script is not None:
            EosScript.read(self.eos_script)  # a bad file fails here, named
        if self.engine == "vllm" and not self.vllm_model:
            raise ConfigError("--engine vllm needs --vllm-model (a model name or local path)")
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
        cluster = Cluster.build(
            [entry], f"worker {config.worker_id}", self.catalogue, calibration=self.calibration
        )
        return cluster.instances[0]

    @property
    def catalogue(self) -> GpuCatalogue | None:
        """What ``--gpu`` is resolved in: the shipped catalogue plus ``--gpus-file``'s GPU
        types (None: the shipped catalogue alone)."""
        return None if self.gpus_file is None else cluster_file_catalogue(self.gpus_file)


# ------------------------------------------------------------------------------ the options


def _vllm_arg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed: Any = json.loads(value)
    except json.JSONDecodeError:
        parsed = value  # a bare string, e.g. dtype=bfloat16
    return key.strip(), parsed


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    """Every `WorkerConfig` option but the TLS ones (`hexgen_service.tls`)."""
    parser.add_argument(
        "--coordinator",
        required=True,
        action="append",
        metavar="HOST:PORT",
        help="the coordinator's worker door; repeat it to serve several coordinator shards "
        "at once (one queue for all of their calls)",
    )
    add_options(parser, WorkerConfig)
    parser.add_argument(
        "--vllm-arg",
        type=_vllm_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra AsyncEngineArgs field, VALUE as JSON (repeatable), e.g. enforce_eager=true",
    )


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """The configuration (not yet `resolved`) of a command line parsed by
    `add_worker_options`' and the TLS options (`ConfigError` naming the flag)."""
    coordinators = list(args.coordinator or ())
    by_hand: dict[str, Any] = {"vllm_engine_args": dict(args.vllm_arg or ())}
    if coordinators:
        by_hand["coordinator"] = coordinators[0]
        by_hand["extra_coordinators"] = tuple(coordinators[1:])
    return from_args(WorkerConfig, args, by_hand)


def worker_argv(
    config: WorkerConfig, only_changed: bool = True, also: tuple[str, ...] = ()
) -> list[str]:
    """``python -m hexgen_worker``'s options that give `config`: every coordinator, the
    required options, those of the settings that differ from the defaults (all of them
    without `only_changed`, and those named in `also` in any case) and the vLLM engine
    arguments. The token is given as a file by the caller: `ValueError` when it is set."""
    argv = [arg for address in config.coordinators for arg in ("--coordinator", address)]
    argv += to_argv(config, only_changed=only_changed, also=also)
    for key, value in config.vllm_engine_args.items():
        argv += ["--vllm-arg", f"{key}={json.dumps(value)}"]
    return argv
