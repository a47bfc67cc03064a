"""A whole mesh on this machine, as real processes: `LocalCluster` (and `RedisServer`).

`LocalCluster` starts, in order, a private ``redis-server`` (unless it is given a Redis
URL), the coordinator, the tuner (optional) and one worker per instance of the cluster
(simulated engines; worker i takes slot i), each as ``sys.executable -m PACKAGE ...`` with
its output in a log file, and waits until the coordinator reports every instance connected.
`stop` ends them in reverse order (workers and tuner, then the coordinator, then the
private Redis): SIGTERM, then SIGKILL after a grace period. A worker may be given another
engine, interpreter, options and environment (`WorkerLaunch`, e.g. a vLLM engine under the
Python of a vLLM venv). ``hexgen-flow up`` and
``hexgen-flow demo`` run on it; tests and benchmarks use it to kill and restart pieces::

    with LocalCluster(LocalClusterConfig(listen="127.0.0.1:0", time_scale=20)) as cluster:
        ...  # CoordinatorClient(cluster.coordinator_address)
        cluster.kill_worker(2)
        cluster.restart_coordinator()

Children run in their own session, so a Ctrl-C in the terminal reaches only the parent,
which then stops them in order. Importing this module starts nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

import grpc
import redis

from hexgen_api.v1 import coordinator_pb2, coordinator_pb2_grpc
from hexgen_client.addresses import DEFAULT_COORDINATOR, DEFAULT_REDIS_PREFIX, DEFAULT_TUNER
from hexgen_client.errors import ClusterError
from hexgen_flow.cluster import DEFAULT_CLUSTER, parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.policies.presets import resolve_policy
from hexgen_service.healthcheck import check

__all__ = [
    "LocalCluster",
    "LocalClusterConfig",
    "ManagedProcess",
    "RedisServer",
    "WorkerLaunch",
    "coordinator_argv",
    "find_redis_server",
    "free_port",
    "stop_processes",
    "tuner_argv",
    "worker_argv",
]

_POLL_S = 0.1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"address {address!r}: expected HOST:PORT, e.g. {DEFAULT_COORDINATOR}")
    return host, int(port)


def _resolve_address(address: str) -> str:
    """`address`, with port 0 replaced by a free port; a port in use is an error."""
    host, port = _split_address(address)
    if port == 0:
        return f"{host}:{free_port(host)}"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ClusterError(
                f"cannot listen on {address} ({exc.strerror}): is another `hexgen-flow up` "
                "running? Stop it, or choose another address"
            ) from None
    return address


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


# ----------------------------------------------------------------------------- processes


class ManagedProcess:
    """One child process with its output in `log_path`, in a session of its own."""

    def __init__(
        self, name: str, argv: list[str], log_path: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.popen: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        if self.running:
            raise ClusterError(f"{self.name} is already running (pid {self.pid})")
        self._close_log()
        self._log = self.log_path.open("ab")
        try:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        except OSError as exc:
            self._close_log()
            raise ClusterError(f"cannot start {self.name} ({self.argv[0]}): {exc}") from None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen is not None else None

    def send(self, sig: signal.Signals) -> None:
        if self.running:
            assert self.popen is not None
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the process and everything it started (its own session, e.g. vLLM's
        engine core), and wait until it is gone."""
        if self.popen is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)  # its session leader is itself
            self.popen.wait()
        self._close_log()

    def log_tail(self, lines: int = 15) -> str:
        return _tail(self.log_path, lines)

    def failure(self, what: str) -> ClusterError:
        """An error saying that this process `what` (e.g. "exited with code 1"), with the
        last line of its log and where the log is (one line, as the CLI prints errors)."""
        lines = [line for line in self.log_tail(20).splitlines() if line.strip()]
        last = f": {lines[-1].strip()}" if lines else ""
        return ClusterError(f"{self.name} {what}{last} (log: {self.log_path})")

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        self._close_log()


def stop_processes(processes: Iterable[ManagedProcess], grace_s: float) -> None:
    """SIGTERM every running process, SIGKILL those still running after `grace_s`."""
    procs = [p for p in processes if p.running]
    for proc in procs:
        proc.send(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        assert proc.popen is not None
        try:
            proc.popen.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            proc.kill()
        proc.close()


# --------------------------------------------------------------------------------- Redis


def find_redis_server(binary: str = "redis-server") -> str:
    """The path of the Redis server program; `ClusterError` saying how to install it."""
    path = shutil.which(binary)
    if path is None:
        raise ClusterError(
            f"{binary} not found: install Redis (e.g. `apt install redis-server`, "
            "`brew install redis`) or point --redis-url at a running Redis"
        )
    return path


class RedisServer:
    """A private ``redis-server`` on a free port of 127.0.0.1 with a temporary folder and no
    persistence (``--save "" --appendonly no``); the folder goes with `stop`."""

    def __init__(
        self,
        binary: str = "redis-server",
        *,
        host: str = "127.0.0.1",
        start_timeout_s: float = 10.0,
        grace_s: float = 5.0,
    ) -> None:
        self.binary = binary
        self.host = host
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        self.port: int | None = None
        self.dir: Path | None = None
        self.process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise ClusterError("the Redis server is not started")
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> str:
        """Start the server; returns its URL."""
        path = find_redis_server(self.binary)
        for _attempt in range(3):  # another process may take the free port before Redis does
            self.port = free_port(self.host)
            self.dir = Path(tempfile.mkdtemp(prefix="hexgen-redis-"))
            argv = [
                path,
                "--port", str(self.port),
                "--bind", self.host,
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.dir),
                "--daemonize", "no",
            ]  # fmt: skip
            self.process = ManagedProcess("redis-server", argv, self.dir / "redis.log")
            self.process.start()
            if self._wait_ready():
                return self.url
            in_use = "Address already in use" in self.process.log_tail(50)
            error = self.process.failure(f"did not start on port {self.port}")
            self.stop()
            if not in_use:
                raise error
        raise ClusterError("redis-server could not find a free port (3 attempts)")

    def _wait_ready(self) -> bool:
        assert self.process is not None and self.port is not None
        deadline = time.monotonic() + self.start_timeout_s
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=0.5)
        try:
            while time.monotonic() < deadline and self.process.running:
                with contextlib.suppress(redis.RedisError):
                    if client.ping():
                        return True
                time.sleep(_POLL_S / 2)
        finally:
            client.close()
        return False

    def stop(self) -> None:
        if self.process is not None:
            stop_processes([self.process], self.grace_s)
            self.process = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


# ------------------------------------------------------------------------------ the mesh


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
    policy: str = "hexgen-flow"
    """The coordinator's policy: a preset or ``DISPATCH+QUEUE[+BUDGET]``."""
    alpha: float | None = None
    """The coordinator's initial α; None: its default."""
    slo_scale: float = 3.0
    """The coordinator's default SLO scale (SLO = scale x SLO_base)."""
    time_scale: float = 1.0
    """Cluster seconds per wall second (simulated engines run this much faster)."""
    listen: str = DEFAULT_COORDINATOR
    """The coordinator's address; port 0 picks a free port."""
    redis_url: str | None = None
    """A running Redis to use; None starts a private ``redis-server``."""
    redis_prefix: str = DEFAULT_REDIS_PREFIX
    """Prefix of the mesh's Redis keys."""
    redis_binary: str = "redis-server"
    """The Redis server program for the private Redis (looked up on PATH)."""
    tuner: bool = True
    """Whether to run the α tuner."""
    tuner_listen: str = DEFAULT_TUNER
    """The tuner's address; port 0 picks a free port."""
    tuner_period_s: float = 30.0
    """Wall seconds between the tuner's runs."""
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
    workers: tuple[WorkerLaunch, ...] = ()
    """How to start the worker of each slot, in slot order; slots past the end get
    ``WorkerLaunch()`` (a simulated engine)."""


def coordinator_argv(config: LocalClusterConfig, listen: str, redis_url: str) -> list[str]:
    argv = [
        config.python, "-m", "hexgen_coordinator",
        "--listen", listen,
        "--redis-url", redis_url,
        "--redis-prefix", config.redis_prefix,
        "--cluster", config.cluster,
        "--policy", config.policy,
        "--time-scale", repr(config.time_scale),
        "--slo-scale", repr(config.slo_scale),
    ]  # fmt: skip
    if config.alpha is not None:
        argv += ["--alpha", repr(config.alpha)]
    return argv


def tuner_argv(
    config: LocalClusterConfig, listen: str, coordinator: str, redis_url: str
) -> list[str]:
    return [
        config.python, "-m", "hexgen_tuner",
        "--listen", listen,
        "--coordinator", coordinator,
        "--redis-url", redis_url,
        "--redis-prefix", config.redis_prefix,
        "--period-s", repr(config.tuner_period_s),
    ]  # fmt: skip


def worker_argv(
    python: str,
    coordinator: str,
    slot: int,
    gpu: str,
    model: str,
    engine: str = "simulated",
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line of the worker that takes `slot` (a `gpu` serving `model`) with
    `engine` (default simulated) and `extra` options; its id is stable, so a restarted
    worker resumes its slot."""
    return [
        python, "-m", "hexgen_worker",
        "--coordinator", coordinator,
        "--worker-id", f"local-worker-{slot}",
        "--slot", str(slot),
        "--gpu", gpu,
        "--model", model,
        "--engine", engine,
        *extra,
    ]  # fmt: skip


class LocalCluster:
    """Redis (private unless given), coordinator, tuner and one simulated worker per
    instance, as processes of this machine. Constructing it starts nothing; `start` does
    (or ``with``), `stop` undoes it, in order, and may be called more than once."""

    def __init__(self, config: LocalClusterConfig | None = None) -> None:
        self.config = config or LocalClusterConfig()
        if not self.config.time_scale > 0:
            raise ConfigError(f"time scale must be > 0, got {self.config.time_scale}")
        self.instances = parse_cluster(self.config.cluster).instances
        self.gpus = tuple(inst.gpu for inst in self.instances)
        if len(self.config.workers) > len(self.instances):
            raise ConfigError(
                f"{len(self.config.workers)} worker launches for a cluster of "
                f"{len(self.instances)} instances"
            )
        # Bad settings fail here, before any process starts.
        resolve_policy(self.config.policy)
        if self.config.redis_url is None:
            find_redis_server(self.config.redis_binary)
        self.coordinator_address = self.config.listen
        self.tuner_address: str | None = None
        self.redis_url = self.config.redis_url
        self.log_dir: Path | None = None
        self.redis: RedisServer | None = None
        self.coordinator: ManagedProcess | None = None
        self.tuner: ManagedProcess | None = None
        self.workers: list[ManagedProcess] = []
        self._own_log_dir = False
        self._env: dict[str, str] = {}

    # ------------------------------------------------------------------------ lifecycle

    def start(self) -> LocalCluster:
        config = self.config
        try:
            self.coordinator_address = _resolve_address(config.listen)
            if config.tuner:
                self.tuner_address = _resolve_address(config.tuner_listen)
            if config.log_dir is not None:
                config.log_dir.mkdir(parents=True, exist_ok=True)
                self.log_dir = config.log_dir
            else:
                self.log_dir = Path(tempfile.mkdtemp(prefix="hexgen-flow-logs-"))
                self._own_log_dir = True
            self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **config.env}
            if self.redis_url is None:
                self.redis = RedisServer(config.redis_binary, grace_s=config.stop_grace_s)
                self.redis_url = self.redis.start()
            self._start_coordinator()
            if self.tuner_address is not None:
                argv = tuner_argv(
                    config, self.tuner_address, self.coordinator_address, self.redis_url
                )
                self.tuner = self._process("tuner", "tuner.log", argv)
                self.tuner.start()
                self._wait_healthy(self.tuner, self.tuner_address)
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
        """Workers and tuner, then the coordinator, then the private Redis: SIGTERM, then
        SIGKILL after the grace period."""
        grace = self.config.stop_grace_s
        stop_processes([*self.workers, *([self.tuner] if self.tuner else [])], grace)
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
        procs = [self.coordinator, self.tuner, *self.workers]
        return [p for p in procs if p is not None and p.popen is not None and not p.running]

    # ------------------------------------------------------------------------- status

    def status(self, timeout_s: float = 2.0) -> coordinator_pb2.ClusterStatusResponse:
        """The coordinator's ClusterStatus (a blocking call)."""
        with grpc.insecure_channel(self.coordinator_address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            return stub.ClusterStatus(coordinator_pb2.ClusterStatusRequest(), timeout=timeout_s)

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
            time.sleep(_POLL_S)

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
        return worker_argv(
            python, self.coordinator_address, slot, inst.gpu, inst.model, launch.engine, launch.args
        )

    def _start_coordinator(self) -> None:
        assert self.redis_url is not None
        if self.coordinator is None:
            argv = coordinator_argv(self.config, self.coordinator_address, self.redis_url)
            self.coordinator = self._process("coordinator", "coordinator.log", argv)
        self.coordinator.start()
        self._wait_healthy(self.coordinator, self.coordinator_address)

    def _wait_healthy(self, proc: ManagedProcess, address: str) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        problem: str | None = "not started"
        while True:
            if not proc.running:
                raise proc.failure(f"exited with code {proc.returncode} while starting")
            problem = check(address, timeout_s=1.0)
            if problem is None:
                return
            if time.monotonic() >= deadline:
                raise proc.failure(
                    f"did not report SERVING within {self.config.start_timeout_s:g} s ({problem})"
                )
            time.sleep(_POLL_S)
