"""What `LocalCluster` runs: its settings (`LocalClusterConfig`, `WorkerLaunch`) and the
command lines of the services it starts (coordinator, tuner, gateway, workers)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from hexgen_client.addresses import (
    DEFAULT_COORDINATOR,
    DEFAULT_GATEWAY,
    DEFAULT_REDIS_PREFIX,
    DEFAULT_TUNER,
)
from hexgen_flow.calibration import DEFAULT_CALIBRATION
from hexgen_flow.cluster import DEFAULT_CLUSTER
from hexgen_service.auth_dir import AuthDir
from hexgen_service.coordinator_config import CoordinatorConfig
from hexgen_service.coordinator_config import coordinator_argv as render_coordinator_argv
from hexgen_service.gateway_config import GatewayConfig
from hexgen_service.gateway_config import gateway_argv as render_gateway_argv
from hexgen_service.redis_keys import CLUSTER_PREFIX as DEFAULT_CLUSTER_PREFIX
from hexgen_service.redis_keys import cluster_prefix
from hexgen_service.tuner_config import TunerConfig
from hexgen_service.tuner_config import tuner_argv as render_tuner_argv
from hexgen_service.worker_config import EngineKind, WorkerConfig
from hexgen_service.worker_config import worker_argv as render_worker_argv

__all__ = [
    "DEFAULT_CLUSTER_PREFIX",
    "DEFAULT_GATEWAY",
    "SHARDED_ADMISSION",
    "LocalClusterConfig",
    "WorkerLaunch",
    "coordinator_argv",
    "coordinator_config",
    "gateway_argv",
    "redis_login",
    "secure_argv",
    "secure_settings",
    "sharded_coordinator_args",
    "tuner_argv",
    "worker_argv",
]


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    """How `LocalCluster` starts the worker of one slot. The default is what it always
    runs: a simulated engine under the cluster's interpreter."""

    engine: str = "simulated"
    """The worker's ``--engine``: simulated, openai or vllm."""
    args: tuple[str, ...] = ()
    """More worker options, e.g. ``("--vllm-model", PATH, "--max-batch", "8")``."""
    python: str | None = None
    """The interpreter that runs this worker (for the vllm engine, one with vLLM and this
    project installed); None: `LocalClusterConfig.python`."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment of this worker (e.g. VLLM_CPU_KVCACHE_SPACE), over the cluster's."""


@dataclass(frozen=True, slots=True)
class LocalClusterConfig:
    """What `LocalCluster` runs (``hexgen-flow up``'s options)."""

    cluster: str = DEFAULT_CLUSTER
    """Instances, as ``--cluster`` takes them (``A100,A100,A6000,L40S`` or a YAML file)."""
    calibration: str | None = None
    """Where the latency numbers come from, for the coordinator's estimator, the workers'
    simulated engines and local queues, and the tuner's replays alike (``--calibration``);
    None: the cluster file's ``calibration:``, else ``aiconfigurator``."""
    policy: str = "hexgen-flow"
    """The coordinator's policy: a preset or ``DISPATCH+QUEUE[+BUDGET]``."""
    alpha: float | None = None
    """The coordinator's initial α; None: its default."""
    slo_scale: float = 3.0
    """The coordinator's default SLO scale (SLO = scale x SLO_base)."""
    admission: str | None = None
    """The coordinator's ``--admission``: reject, best-effort or off; None: its default."""
    learn_costs: bool = False
    """The coordinator's ``--learn-costs``: learn each instance's costs online."""
    output_lengths: str | None = None
    """The coordinator's ``--output-lengths`` (known, learned); None: its default."""
    retention_s: float | None = None
    """The coordinator's ``--retention-s`` (how long a finished query stays in Redis);
    None: its default."""
    max_call_attempts: int | None = None
    """The coordinator's ``--max-call-attempts``; None: its default."""
    coordinator_args: tuple[str, ...] = ()
    """More coordinator options, as ``python -m hexgen_coordinator --help`` lists them
    (``("--max-tenant-prompt-bytes", "8388608")``), passed on as they are."""
    time_scale: float = 1.0
    """Cluster seconds per wall second (simulated engines run this much faster)."""
    listen: str = DEFAULT_COORDINATOR
    """The coordinator's address; port 0 picks a free port."""
    redis_url: str | None = None
    """A running Redis to use; None starts a private ``redis-server``."""
    redis_prefix: str = DEFAULT_REDIS_PREFIX
    """Prefix of the mesh's Redis keys; with `redis_cluster`, left at the default: the
    services' cluster default (``hf:{0}:``), else one with a hash tag."""
    redis_cluster: bool = False
    """`redis_url` is a node of a Redis Cluster (the coordinator's and the tuner's
    ``--redis-cluster``); needs `redis_url`."""
    redis_binary: str = "redis-server"
    """The Redis server program for the private Redis (looked up on PATH)."""
    redis_maxmemory: str | None = "1gb"
    """The private Redis's ``maxmemory`` (with ``noeviction``; the coordinator refuses new
    work above 90 % of it); None: unbounded."""
    redis_appendfsync: str | None = "always"
    """The private Redis's append-only file: ``always`` (every write on disk before it is
    acknowledged, so a restarted Redis has all of the mesh's state), ``everysec`` or
    ``no``; None: no persistence."""
    tuner: bool = True
    """Whether to run the α tuner."""
    tuner_listen: str = DEFAULT_TUNER
    """The tuner's address; port 0 picks a free port."""
    tuner_period_s: float = 30.0
    """Wall seconds between the tuner's runs."""
    gateway: bool = False
    """Whether to run the OpenAI-compatible gateway (``hexgen-flow up`` does by default)."""
    gateway_listen: str = DEFAULT_GATEWAY
    """The gateway's HTTP address; port 0 picks a free port."""
    metrics_listen: str | None = None
    """Where the coordinator serves Prometheus metrics (``hexgen-flow up``: 127.0.0.1:9464);
    None: not served; port 0 picks a free port."""
    tuner_metrics_listen: str | None = None
    """Where the tuner serves Prometheus metrics; None: not served; port 0: a free port."""
    worker_listen: str = "127.0.0.1:0"
    """The coordinator's door for workers (its WorkerService, apart from the clients');
    port 0 picks a free port."""
    auth_dir: Path | None = None
    """Run secured (``hexgen-flow up --secure``): the credentials in this folder (made, or
    completed, by `hexgen_service.auth_dir.AuthDir.init`): API keys on the coordinator and
    the tuner, TLS on every link, workers with client certificates (mutual TLS), and a
    private Redis with one ACL user per service. None: open, on loopback only."""
    tenants: tuple[str, ...] = ()
    """With `auth_dir`: the tenants to make keys for (``DIR/tenants/NAME.key``)."""
    worker_token: bool = True
    """Make the coordinator take only workers that show a fresh random token, written to
    ``worker-token`` in the log folder (mode 0600) and passed to the workers it starts
    (`hexgen_service.worker_token`)."""
    worker_metrics_listen: str | None = None
    """Where the workers serve Prometheus metrics: HOST:PORT for slot 0, PORT + n for slot
    n (port 0: a free port each); None: not served."""
    python: str = sys.executable
    """The interpreter that runs the services."""
    log_dir: Path | None = None
    """Where the services' logs go; None: a temporary folder."""
    keep_logs: bool = False
    """Keep a temporary log folder after `stop` (a given `log_dir` is always kept)."""
    start_timeout_s: float = 60.0
    """How long each service may take to come up (and the workers to connect)."""
    stop_grace_s: float = 5.0
    """How long services may take to stop after SIGTERM before SIGKILL."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment of the services (e.g. OTEL_EXPORTER_OTLP_ENDPOINT)."""
    restart_delay_s: float = 0.5
    """`LocalCluster.supervise`: wall seconds before a dead service is restarted; doubles
    with each restart of that service."""
    restart_max_delay_s: float = 10.0
    """The longest restart delay."""
    restart_reset_s: float = 10.0
    """A service that stayed up this long is restarted after `restart_delay_s` again."""
    workers: tuple[WorkerLaunch, ...] = ()
    """How to start the worker of each slot, in slot order; slots past the end get
    ``WorkerLaunch()`` (a simulated engine)."""


SHARDED_ADMISSION = "off"
"""The ``--admission`` of `up --shards`' coordinators when none is given: they have
always admitted everything (`hexgen_launch.sharded_mesh.ShardedMeshConfig`), while
``hexgen-flow up``'s coordinator keeps its own default (reject). The one place the two
launchers' coordinator settings differ."""


def coordinator_config(config: LocalClusterConfig, *, sharded: bool = False) -> CoordinatorConfig:
    """The coordinator settings that `up`'s options (`config`) ask for, every other one at
    the coordinator's default; `sharded`: for `up --shards`' coordinators (the launcher
    gives the addresses, the cluster and the time scale, these the rest)."""
    given: dict[str, Any] = {
        "policy": config.policy,
        "slo_scale": config.slo_scale,
        "learn_costs": config.learn_costs,
    }
    # Options left at None go unsaid: the coordinator's own defaults apply.
    for name in ("alpha", "admission", "retention_s", "max_call_attempts", "output_lengths"):
        if getattr(config, name) is not None:
            given[name] = getattr(config, name)
    if sharded:
        given.setdefault("admission", SHARDED_ADMISSION)
        given["calibration"] = config.calibration
    return CoordinatorConfig(**given)


def sharded_coordinator_args(config: LocalClusterConfig) -> tuple[str, ...]:
    """The options `up --shards` gives its coordinators besides those the sharded mesh
    gives (addresses, shards, cluster, time scale): `coordinator_config`'s (sharded) that
    differ from the coordinator's defaults."""
    return tuple(render_coordinator_argv(coordinator_config(config, sharded=True)))


def coordinator_argv(
    config: LocalClusterConfig,
    listen: str,
    redis_url: str,
    calibration: str | None = None,
    metrics: str | None = None,
    worker_token_file: Path | None = None,
    worker_listen: str | None = None,
) -> list[str]:
    """The coordinator's command line: the options of the settings (`coordinator_config`)
    that differ from its defaults, the workers' token file and `config.coordinator_args`;
    `calibration`: the ``--calibration`` value that selects the cluster's calibration from
    any directory (None: the default)."""
    settings = replace(
        coordinator_config(config),
        listen=listen,
        worker_listen=worker_listen or "",
        redis_url=redis_url,
        # on a Redis Cluster the default prefix goes unsaid: the coordinator's cluster
        # default (with a hash tag) applies
        redis_prefix=config.redis_prefix,
        redis_cluster=config.redis_cluster,
        cluster=config.cluster,
        time_scale=config.time_scale,
        # the default goes unsaid, so that a default mesh's command lines are what they were
        calibration=None if calibration == DEFAULT_CALIBRATION else calibration,
        metrics_listen=metrics or "",
    )
    argv = [config.python, "-m", "hexgen_coordinator", *render_coordinator_argv(settings)]
    if worker_token_file is not None:
        argv += ["--worker-token-file", str(worker_token_file)]
    return argv + list(config.coordinator_args)


def tuner_argv(
    config: LocalClusterConfig,
    listen: str,
    coordinator: str,
    redis_url: str,
    calibration: str | None = None,
    metrics: str | None = None,
    auth: AuthDir | None = None,
) -> list[str]:
    """The tuner's command line, rendered through its settings
    (`hexgen_service.tuner_config`): its addresses, the Redis prefix and the period always,
    the calibration when not the default, `metrics`, where it serves Prometheus metrics,
    when given, and secured with `auth`'s credentials (`secure_settings`) when given (its
    Redis login is the caller's: `redis_login`)."""
    settings = TunerConfig(
        **(secure_settings(auth, "tuner") if auth is not None else {}),
        listen=listen,
        coordinator=coordinator,
        redis_url=redis_url,
        # on a Redis Cluster the default prefix is the services' cluster default (a hash tag)
        redis_prefix=cluster_prefix(
            None if config.redis_prefix == DEFAULT_REDIS_PREFIX else config.redis_prefix,
            config.redis_prefix,
            cluster=config.redis_cluster,
        ),
        redis_cluster=config.redis_cluster,
        period_s=config.tuner_period_s,
        metrics_listen=metrics or "",
        # the default goes unsaid, so that a default mesh's command lines are what they were
        calibration=None if calibration == DEFAULT_CALIBRATION else calibration,
    )
    said = ("listen", "coordinator", "redis_url", "redis_prefix", "period_s")
    return [config.python, "-m", "hexgen_tuner", *render_tuner_argv(settings, also=said)]


def gateway_argv(
    config: LocalClusterConfig, listen: str, coordinator: str, auth: AuthDir | None = None
) -> list[str]:
    """The OpenAI-compatible gateway's command line, rendered through its settings
    (`hexgen_service.gateway_config`): its address and the coordinator's, secured with
    `auth`'s credentials (`secure_settings`) when given."""
    secured = secure_settings(auth, "gateway") if auth is not None else {}
    settings = GatewayConfig(listen=listen, coordinator=coordinator, **secured)
    rendered = render_gateway_argv(settings, also=("listen", "coordinator"))
    return [config.python, "-m", "hexgen_gateway", *rendered]


def worker_argv(
    python: str,
    coordinator: str,
    slot: int,
    gpu: str,
    model: str,
    engine: str = "simulated",
    extra: Sequence[str] = (),
    calibration: str | None = None,
    gpus_file: str | None = None,
) -> list[str]:
    """The command line of the worker that takes `slot` (a `gpu` serving `model`) with
    `engine` (default simulated), latency from `calibration` (None: the default), `gpu`
    resolved with `gpus_file`'s GPU types (the cluster file, when it defines any) and `extra`
    options; its id is stable, so a restarted worker resumes its slot. Rendered through the
    worker's settings (`hexgen_service.worker_config`): the required options, the slot, and
    ``--model`` and ``--engine`` even when they are the defaults, as they always were."""
    settings = WorkerConfig(
        coordinator=coordinator,
        worker_id=f"local-worker-{slot}",
        slot=slot,
        gpu=gpu,
        model=model,
        engine=cast(EngineKind, engine),
        # the default goes unsaid, so that a default mesh's command lines are what they were
        calibration=None if calibration == DEFAULT_CALIBRATION else calibration,
        gpus_file=gpus_file,
    )
    rendered = render_worker_argv(settings, also=("slot", "model", "engine"))
    return [python, "-m", "hexgen_worker", *rendered, *extra]


def secure_argv(auth: AuthDir, service: str) -> list[str]:
    """What `service` (coordinator, tuner, gateway, worker) adds to its command line to run
    secured with the credentials of `auth` (`LocalClusterConfig.auth_dir`); "worker-metrics":
    what a worker that serves metrics adds besides (HTTPS with the server certificate, a
    scrape with an API key; the coordinator's and the tuner's metrics take their own TLS
    and keys files)."""
    if service == "worker-metrics":
        tls_metrics = ["--metrics-tls-cert", str(auth.server_cert)]
        tls_metrics += ["--metrics-tls-key", str(auth.server_key)]
        return [*tls_metrics, "--api-keys-file", str(auth.keys)]
    if service == "coordinator":
        return render_coordinator_argv(CoordinatorConfig(**secure_settings(auth, service)))
    if service == "tuner":
        return render_tuner_argv(TunerConfig(**secure_settings(auth, service)))
    if service == "gateway":
        return render_gateway_argv(GatewayConfig(**secure_settings(auth, service)))
    if service == "worker":
        tls_client = ["--tls-cert", str(auth.worker_cert), "--tls-key", str(auth.worker_key)]
        return ["--tls-ca", str(auth.ca), *tls_client]
    raise ValueError(f"no secure options for {service!r}")


def secure_settings(auth: AuthDir, service: str) -> dict[str, Any]:
    """The settings (field -> value) that run the coordinator, the tuner or the gateway
    (`service`) secured with the credentials of `auth`: the server certificate and the CA
    (TLS on its doors; the coordinator's workers' door requires client certificates signed
    by it, the others verify the coordinator with it), the coordinator's callers' keys file,
    and the tuner's keys (its callers' keys file, its own operator key for the
    coordinator). Rendered by `tuner_argv`, `gateway_argv`, `secure_argv` and the sharded
    mesh's coordinators (`hexgen_launch.sharded_mesh`)."""
    tls: dict[str, Any] = {"tls_cert": str(auth.server_cert), "tls_key": str(auth.server_key)}
    tls["tls_ca"] = str(auth.ca)
    if service == "coordinator":
        return {"api_keys_file": str(auth.keys), **tls}
    if service == "tuner":
        return {"api_keys_file": str(auth.keys), "api_key_file": str(auth.tuner_key), **tls}
    if service == "gateway":
        return tls
    raise ValueError(f"no secure settings for {service!r}")


def redis_login(url: str, auth: AuthDir, user: str) -> tuple[str, list[str]]:
    """The Redis URL of `user` of the private Redis's ACL, and the option that gives its
    password (a file: a command line is readable by every user of the machine)."""
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{user}@{rest}", ["--redis-password-file", str(auth.redis_password(user))]
