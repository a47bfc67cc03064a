"""A whole mesh on this machine, as real processes: `LocalCluster` (and `RedisServer`).

`LocalCluster` starts, in order, a private ``redis-server`` (unless it is given a Redis
URL), the coordinator, the tuner (optional), the OpenAI-compatible gateway (optional, off
by default; ``hexgen-flow up`` turns it on) and one worker per instance of the cluster
(simulated engines; worker i takes slot i), each as ``sys.executable -m PACKAGE ...`` with
its output in a log file, and waits until the coordinator reports every instance connected.
`stop` ends them in reverse order (workers, tuner and gateway, then the coordinator, then the
private Redis): SIGTERM, then SIGKILL after a grace period. A worker may be given another
engine, interpreter, options and environment (`WorkerLaunch`, e.g. a vLLM engine under the
Python of a vLLM venv). ``hexgen-flow up`` and
``hexgen-flow demo`` run on it; tests and benchmarks use it to kill and restart pieces::

    with LocalCluster(LocalClusterConfig(listen="127.0.0.1:0", time_scale=20)) as cluster:
        ...  # CoordinatorClient(cluster.coordinator_address)
        cluster.kill_worker(2)
        cluster.restart_coordinator()

Children run in their own session, so a Ctrl-C in the terminal reaches only the parent,
which then stops them in order; on Linux they also die with it (a ``kill -9`` of the parent
SIGKILLs every child: see `hexgen_launch.processes`). `supervise`, called every few tenths
of a second (``hexgen-flow up`` does), restarts a service that died, private Redis
included, with exponential backoff, and counts the restarts in `restarts`. The private
Redis keeps an append-only file (``appendfsync always``), so a restarted Redis has the
mesh's state, and a restarted coordinator rebuilds its running queries from it. Importing
this module starts nothing.
"""

from __future__ import annotations

import os
import shutil
import ssl
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

import grpc

from hexgen_api.v1 import coordinator_pb2, coordinator_pb2_grpc
from hexgen_flow.cluster import cluster_file_catalogue, parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.hardware import gpu_catalogue
from hexgen_flow.policies.presets import resolve_policy
from hexgen_launch.cluster_config import (
    DEFAULT_GATEWAY,
    LocalClusterConfig,
    WorkerLaunch,
    coordinator_argv,
    coordinator_config,
    gateway_argv,
    redis_login,
    secure_argv,
    tuner_argv,
    worker_argv,
)
from hexgen_launch.errors import ClusterError
from hexgen_launch.processes import (
    CAN_DIE_WITH_PARENT,
    POLL_S,
    ManagedProcess,
    RedisServer,
    RestartPolicy,
    Supervisor,
    find_redis_server,
    port_after,
    resolve_address,
    stop_processes,
)
from hexgen_service.auth import AUTH_METADATA, read_secret
from hexgen_service.auth_dir import AuthDir
from hexgen_service.healthcheck import check
from hexgen_service.worker_token import write_token

__all__ = [
    "DEFAULT_GATEWAY",
    "LocalCluster",
    "LocalClusterConfig",
    "WorkerLaunch",
    "coordinator_argv",
    "gateway_argv",
    "tuner_argv",
    "worker_argv",
]


class LocalCluster:
    """Redis (private unless given), coordinator, tuner and one simulated worker per
    instance, as processes of this machine. Constructing it starts nothing; `start` does
    (or ``with``), `stop` undoes it, in order, and may be called more than once."""

    def __init__(self, config: LocalClusterConfig | None = None) -> None:
        self.config = config or LocalClusterConfig()
        if not self.config.time_scale > 0:
            raise ConfigError(f"time scale must be > 0, got {self.config.time_scale}")
        cluster = parse_cluster(self.config.cluster, calibration=self.config.calibration)
        self.instances = cluster.instances
        self.calibration = cluster.calibration
        """The cluster's calibration, which every service is started with."""
        self.gpus = tuple(inst.gpu for inst in self.instances)
        file = Path(self.config.cluster)
        self.gpus_file = (
            str(file.resolve())
            if cluster.description == self.config.cluster
            and file.is_file()
            and len(cluster_file_catalogue(str(file)).gpus) > len(gpu_catalogue().gpus)
            else None
        )
        """The cluster file, when it defines GPU types of its own: the workers resolve
        their ``--gpu`` with it (``--gpus-file``)."""
        if len(self.config.workers) > len(self.instances):
            raise ConfigError(
                f"{len(self.config.workers)} worker launches for a cluster of "
                f"{len(self.instances)} instances"
            )
        # Bad settings fail here, before any process starts.
        resolve_policy(self.config.policy)
        _check_config(self.config)
        if self.config.redis_url is None:
            find_redis_server(self.config.redis_binary)
        self.coordinator_address = self.config.listen
        self.worker_address = self.config.worker_listen
        """The coordinator's door for workers (its WorkerService)."""
        self.auth = AuthDir(self.config.auth_dir) if self.config.auth_dir is not None else None
        """The credentials of a secured cluster (`LocalClusterConfig.auth_dir`); None: open."""
        self.tuner_address: str | None = None
        self.gateway_address: str | None = None
        """The gateway's HOST:PORT (its API: ``http://ADDRESS/v1``); None when not run."""
        self.metrics_address: str | None = None
        """Where the coordinator serves Prometheus metrics (``http://ADDRESS/metrics``)."""
        self.tuner_metrics_address: str | None = None
        """Where the tuner serves Prometheus metrics; None when not served."""
        self.worker_token_file: Path | None = None
        """The workers' token (`LocalClusterConfig.worker_token`), once started."""
        self.worker_metrics_addresses: list[str] = []
        """Where each slot's worker serves Prometheus metrics; empty when not served."""
        self.redis_url = self.config.redis_url
        self.log_dir: Path | None = None
        self.redis: RedisServer | None = None
        self.coordinator: ManagedProcess | None = None
        self.tuner: ManagedProcess | None = None
        self.gateway: ManagedProcess | None = None
        self.workers: list[ManagedProcess] = []
        self._own_log_dir = False
        self._env: dict[str, str] = {}
        self._supervisor: Supervisor | None = None
        self._restarts: dict[str, int] = {}

    # ------------------------------------------------------------------------ lifecycle

    def start(self) -> LocalCluster:
        config = self.config
        try:
            # Every service binds with SO_REUSEADDR (gRPC, uvicorn, Prometheus): the
            # TIME_WAIT connections of a run just killed must not stop `up` from starting
            # again at once on the same ports, while a live listener still does.
            self.coordinator_address = resolve_address(config.listen, reuse_addr=True)
            self.worker_address = resolve_address(config.worker_listen, reuse_addr=True)
            if self.auth is not None:
                self.auth.init(config.tenants, redis_prefix=config.redis_prefix)
            if config.tuner:
                self.tuner_address = resolve_address(config.tuner_listen, reuse_addr=True)
            if config.metrics_listen is not None:
                self.metrics_address = resolve_address(config.metrics_listen, reuse_addr=True)
            if config.worker_metrics_listen is not None:
                self.worker_metrics_addresses = [
                    resolve_address(port_after(config.worker_metrics_listen, i), reuse_addr=True)
                    for i in range(len(self.instances))
                ]
            if config.tuner and config.tuner_metrics_listen is not None:
                self.tuner_metrics_address = resolve_address(
                    config.tuner_metrics_listen, reuse_addr=True
                )
            if config.gateway:
                # uvicorn binds with SO_REUSEADDR: the TIME_WAIT connections of the last
                # run (HTTP servers close first) must not stop a quick restart of `up`.
                self.gateway_address = resolve_address(config.gateway_listen, reuse_addr=True)
            if config.log_dir is not None:
                config.log_dir.mkdir(parents=True, exist_ok=True)
                self.log_dir = config.log_dir
            else:
                self.log_dir = Path(tempfile.mkdtemp(prefix="hexgen-flow-logs-"))
                self._own_log_dir = True
            if config.worker_token and self.auth is not None:
                self.worker_token_file = self.auth.worker_token
            elif config.worker_token:
                self.worker_token_file = self.log_dir / "worker-token"
                write_token(self.worker_token_file)
            self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **config.env}
            if self.redis_url is None:
                self.redis = RedisServer(
                    config.redis_binary,
                    grace_s=config.stop_grace_s,
                    appendfsync=config.redis_appendfsync,
                    aclfile=self.auth.redis_acl if self.auth is not None else None,
                    maxmemory=config.redis_maxmemory,
                )
                self.redis_url = self.redis.start()
            self._start_coordinator()
            if self.tuner_address is not None:
                redis_url, login = self._redis_login("tuner")
                argv = tuner_argv(
                    config,
                    self.tuner_address,
                    self.coordinator_address,
                    redis_url,
                    self.calibration.argument,
                    self.tuner_metrics_address,
                    self.auth,
                )
                argv += login
                self.tuner = self._process("tuner", "tuner.log", argv)
                self.tuner.start()
                self._wait_healthy(self.tuner, self.tuner_address)
            if self.gateway_address is not None:
                argv = gateway_argv(
                    config, self.gateway_address, self.coordinator_address, self.auth
                )
                self.gateway = self._process("gateway", "gateway.log", argv)
                self.gateway.start()
                self._wait_healthy(self.gateway, self.gateway_address, http=True)
            self.workers = [
                self._process(
                    f"worker {i} ({gpu})",
                    f"worker-{i}.log",
                    self._worker_argv(i),
                    self.worker_launch(i).env,
                )
                for i, gpu in enumerate(self.gpus)
            ]
            for worker in self.workers:
                worker.start()
            self.wait_connected()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Workers, tuner and gateway, then the coordinator, then the private Redis:
        SIGTERM, then SIGKILL after the grace period."""
        if self._supervisor is not None:
            self._restarts = dict(self._supervisor.restarts)
            self._supervisor = None  # nothing restarts what is being stopped
        grace = self.config.stop_grace_s
        others = [p for p in (self.tuner, self.gateway) if p is not None]
        stop_processes([*self.workers, *others], grace)
        if self.coordinator is not None:
            stop_processes([self.coordinator], grace)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
            self.redis_url = self.config.redis_url
        if (
            self._own_log_dir
            and self.log_dir is not None
            and (not self.config.keep_logs or not any(self.log_dir.iterdir()))
        ):
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self.log_dir = None
            self._own_log_dir = False

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---------------------------------------------------------------- pieces, for tests

    def kill_worker(self, slot: int) -> None:
        """SIGKILL the worker of `slot` (its calls are lost with it)."""
        self.workers[slot].kill()

    def start_worker(self, slot: int) -> None:
        """Start the worker of `slot` again (it reconnects under the same worker id)."""
        self.workers[slot].start()

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator (its state is in Redis; the workers keep theirs)."""
        if self.coordinator is not None:
            self.coordinator.kill()

    def restart_coordinator(self) -> None:
        """Stop the coordinator if it runs (SIGKILL), start it again on the same address and
        Redis, and wait until it serves and every worker has reconnected."""
        self.kill_coordinator()
        self._start_coordinator()
        self.wait_connected()

    def exited(self) -> list[ManagedProcess]:
        """The services that have exited since they were started."""
        procs = [self.coordinator, self.tuner, self.gateway, *self.workers]
        return [p for p in procs if p is not None and p.popen is not None and not p.running]

    # -------------------------------------------------------------------- supervision

    @property
    def dies_with_parent(self) -> bool:
        """Whether the services are SIGKILLed by the kernel when this process dies."""
        return CAN_DIE_WITH_PARENT

    @property
    def restart_policy(self) -> RestartPolicy:
        """How `supervise` restarts a service that died."""
        config = self.config
        return RestartPolicy(
            config.restart_delay_s, config.restart_max_delay_s, config.restart_reset_s
        )

    def supervise(self) -> list[str]:
        """Restart every service that died (coordinator, tuner, gateway, workers, private
        Redis)
        with `restart_policy`'s backoff; returns a line for each death noticed (with the
        planned restart) and each restart that failed. Never blocks: call it every few
        tenths of a second after `start`. The first call starts watching; a service that
        died before it is restarted too."""
        if self._supervisor is None:
            if self.coordinator is None:
                raise ClusterError("the cluster is not started")
            supervisor = Supervisor(self.restart_policy)
            if self.redis is not None and self.redis.process is not None:
                supervisor.watch("redis", self.redis.process, self.redis.restart)
            supervisor.watch("coordinator", self.coordinator)
            if self.tuner is not None:
                supervisor.watch("tuner", self.tuner)
            if self.gateway is not None:
                supervisor.watch("gateway", self.gateway)
            for slot, worker in enumerate(self.workers):
                supervisor.watch(f"worker-{slot}", worker)
            for key, count in self._restarts.items():
                supervisor.restarts[key] = count
            self._supervisor = supervisor
        return self._supervisor.step()

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts by `supervise` of each service ("redis", "coordinator", "tuner",
        "gateway", "worker-0", ...), counted when the death is noticed; empty before `supervise`."""
        if self._supervisor is not None:
            return dict(self._supervisor.restarts)
        return dict(self._restarts)

    # ------------------------------------------------------------------------- status

    def status(self, timeout_s: float = 2.0) -> coordinator_pb2.ClusterStatusResponse:
        """The coordinator's ClusterStatus (a blocking call; secured: with the admin key)."""
        if self.auth is None:
            channel = grpc.insecure_channel(self.coordinator_address)
            metadata = None
        else:
            channel = grpc.secure_channel(
                self.coordinator_address,
                grpc.ssl_channel_credentials(self.auth.ca.read_bytes()),
            )
            key = read_secret(self.auth.admin_key, "admin key")
            metadata = ((AUTH_METADATA, f"Bearer {key}"),)
        with channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            return stub.ClusterStatus(
                coordinator_pb2.ClusterStatusRequest(), timeout=timeout_s, metadata=metadata
            )

    def wait_connected(
        self, timeout_s: float | None = None
    ) -> coordinator_pb2.ClusterStatusResponse:
        """Wait until the coordinator reports a worker connected on every instance."""
        timeout_s = timeout_s or self.config.start_timeout_s
        deadline = time.monotonic() + timeout_s
        last = "no answer from the coordinator"
        while True:
            for proc in self.exited():
                raise proc.failure(f"exited with code {proc.returncode} while starting")
            try:
                status = self.status()
            except grpc.RpcError as exc:
                code = exc.code().name if isinstance(exc, grpc.Call) else str(exc)
                last = f"ClusterStatus failed: {code}"
            else:
                connected = sum(inst.connected for inst in status.instances)
                if status.instances and connected == len(status.instances):
                    return status
                last = f"{connected} of {len(status.instances)} instances connected"
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"the cluster did not come up within {timeout_s:g} s "
                    f"({last}); logs in {self.log_dir}"
                )
            time.sleep(POLL_S)

    # ---------------------------------------------------------------------- internals

    def worker_launch(self, slot: int) -> WorkerLaunch:
        """How the worker of `slot` is started."""
        workers = self.config.workers
        return workers[slot] if slot < len(workers) else WorkerLaunch()

    def _process(
        self, name: str, log_name: str, argv: list[str], env: Mapping[str, str] | None = None
    ) -> ManagedProcess:
        assert self.log_dir is not None
        return ManagedProcess(name, argv, self.log_dir / log_name, {**self._env, **(env or {})})

    def _worker_argv(self, slot: int) -> list[str]:
        inst, launch = self.instances[slot], self.worker_launch(slot)
        python = launch.python or self.config.python
        extra = (
            [
                "--metrics-listen",
                self.worker_metrics_addresses[slot],
                *self._secure("worker-metrics"),
            ]
            if self.worker_metrics_addresses
            else []
        )
        if self.worker_token_file is not None:
            extra += ["--worker-token-file", str(self.worker_token_file)]
        extra += self._secure("worker")
        return worker_argv(
            python,
            self.worker_address,
            slot,
            inst.gpu,
            inst.model,
            launch.engine,
            [*launch.args, *extra],
            self.calibration.argument,
            self.gpus_file,
        )

    def _secure(self, service: str) -> list[str]:
        return secure_argv(self.auth, service) if self.auth is not None else []

    def _redis_login(self, user: str) -> tuple[str, list[str]]:
        """The Redis URL `user` (coordinator, tuner) logs in with, and its password option:
        an ACL user of the private Redis of a secured cluster, else the plain URL."""
        assert self.redis_url is not None
        if self.auth is None or self.redis is None:
            return self.redis_url, []
        return redis_login(self.redis_url, self.auth, user)

    def _start_coordinator(self) -> None:
        if self.coordinator is None:
            redis_url, login = self._redis_login("coordinator")
            argv = coordinator_argv(
                self.config,
                self.coordinator_address,
                redis_url,
                self.calibration.argument,
                self.metrics_address,
                self.worker_token_file,
                self.worker_address,
            )
            argv += [*login, *self._secure("coordinator")]
            self.coordinator = self._process("coordinator", "coordinator.log", argv)
        self.coordinator.start()
        self._wait_healthy(self.coordinator, self.coordinator_address)

    def _wait_healthy(self, proc: ManagedProcess, address: str, *, http: bool = False) -> None:
        """Until `proc` answers the gRPC health check at `address` (`http`: its HTTP
        ``/health`` answers 200)."""
        deadline = time.monotonic() + self.config.start_timeout_s
        problem: str | None = "not started"
        while True:
            if not proc.running:
                raise proc.failure(f"exited with code {proc.returncode} while starting")
            ca = self.auth.ca if self.auth is not None else None
            problem = (
                _http_health(address, ca=ca) if http else check(address, timeout_s=1.0, tls_ca=ca)
            )
            if problem is None:
                return
            if time.monotonic() >= deadline:
                raise proc.failure(
                    f"did not report SERVING within {self.config.start_timeout_s:g} s ({problem})"
                )
            time.sleep(POLL_S)


def _http_health(address: str, timeout_s: float = 1.0, ca: Path | None = None) -> str | None:
    """None when ``http://address/health`` answers 200 (``https://`` verified against `ca`
    when given), else what went wrong."""
    scheme = "https" if ca is not None else "http"
    context = ssl.create_default_context(cafile=str(ca)) if ca is not None else None
    try:
        with urllib.request.urlopen(
            f"{scheme}://{address}/health", timeout=timeout_s, context=context
        ) as answer:
            return None if answer.status == 200 else f"HTTP {answer.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except OSError as exc:  # URLError is one
        return str(getattr(exc, "reason", exc))


def _check_config(config: LocalClusterConfig) -> None:
    """The coordinator options and the restart policy, checked before anything starts."""
    if config.redis_cluster and config.redis_url is None:
        raise ConfigError("redis_cluster: give the redis_url of a node of the Redis Cluster")
    coordinator_config(config)  # the coordinator's own checks (--admission, --retention-s, ...)
    if not 0 < config.restart_delay_s <= config.restart_max_delay_s:
        raise ConfigError(
            f"restart delays: need 0 < {config.restart_delay_s} <= {config.restart_max_delay_s}"
        )
    if config.restart_reset_s < 0:
        raise ConfigError(f"restart reset must be >= 0 s, got {config.restart_reset_s}")
