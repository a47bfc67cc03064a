"""Local child processes for `LocalCluster`: `ManagedProcess`, `RedisServer`,
`Supervisor`, free ports.

A child runs in a session of its own with its output in a log file, so a Ctrl-C in the
terminal reaches only the parent, which then stops its children in order (SIGTERM, then
SIGKILL after a grace period). On Linux a child also dies with its parent: it is started
through a tiny launcher that sets the parent-death signal (``prctl(PR_SET_PDEATHSIG,
SIGKILL)``) and then execs the service, so a ``kill -9`` of the parent leaves no child and
no listening port behind. The kernel sends that signal when the *thread* that forked the
child ends, so every child is forked by one daemon thread that lives as long as the
process (`_SPAWNER`), whichever thread asked. `Supervisor` restarts children that die,
with exponential backoff. Importing this module starts nothing.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue
from types import TracebackType
from typing import IO

import redis

from hexgen_client.addresses import DEFAULT_COORDINATOR
from hexgen_flow.errors import ConfigError
from hexgen_launch.errors import ClusterError

__all__ = [
    "CAN_DIE_WITH_PARENT",
    "POLL_S",
    "ManagedProcess",
    "RedisServer",
    "RestartPolicy",
    "Supervisor",
    "find_redis_server",
    "free_port",
    "launcher_argv",
    "port_after",
    "resolve_address",
    "split_address",
    "stop_processes",
    "vllm_cpu_env",
]

POLL_S = 0.1
"""How often waits poll a process or a port (s)."""


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PICK = 10_000
"""Free ports are picked from here up to the ephemeral range: above the usual fixed service
ports (Redis 6379, PostgreSQL 5432, this project's 8000 and 9464-9469)."""
_PICKS = random.SystemRandom()


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux's default 32768)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, for a service started next to bind.

    Picked at random *below* the kernel's ephemeral range, not by binding port 0: the OS
    picks port 0 from the range that every outgoing connection takes its local port from,
    so between this pick and the service's own bind any process's connect (a Redis client,
    a gRPC channel) could take it, and the service then fails with EADDRINUSE (seen when
    CI starts three meshes at once). Below the range only another listener can take it.
    Falls back to the OS's pick when no such range is free."""
    low = _ephemeral_low()
    for _ in range(64 if low > _LOWEST_PICK + 1_000 else 0):
        port = _PICKS.randrange(_LOWEST_PICK, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        picked: int = sock.getsockname()[1]
        return picked


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"address {address!r}: expected HOST:PORT, e.g. {DEFAULT_COORDINATOR}")
    return host, int(port)


def port_after(listen: str, step: int) -> str:
    """HOST:PORT+step, for services that listen beside another; HOST:0 stays HOST:0 (each
    gets a free port of its own)."""
    host, _, port = listen.rpartition(":")
    return f"{host}:{int(port) + step if int(port) else 0}"


def resolve_address(address: str, *, reuse_addr: bool = False) -> str:
    """`address`, with port 0 replaced by a free port; a port in use is an error.
    `reuse_addr`: check as a server that sets SO_REUSEADDR binds (gRPC's listener, uvicorn
    and Prometheus' HTTP server all do), so that the TIME_WAIT connections a previous run
    left behind (a SIGKILLed coordinator's, for about a minute) do not count as in use,
    while a listening socket still does. Without it any socket on the port counts."""
    host, port = split_address(address)
    if port == 0:
        return f"{host}:{free_port(host)}"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if reuse_addr:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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

CAN_DIE_WITH_PARENT = sys.platform.startswith("linux") and bool(sys.executable)
"""Whether children can be made to die with their parent (Linux's parent-death signal)."""

_LAUNCHER = """\
import ctypes, os, sys
parent = int(sys.argv[1])
if ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG, SIGKILL
    sys.stderr.write("hexgen-flow launcher: prctl(PR_SET_PDEATHSIG) failed\\n")
    sys.exit(126)
if os.getppid() != parent:  # the parent died before the signal was armed
    sys.exit(1)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as exc:
    sys.stderr.write(f"hexgen-flow launcher: cannot run {sys.argv[2]}: {exc}\\n")
    sys.exit(127)
"""
"""Sets the parent-death signal, checks the parent is still there, and execs the service:
the signal survives exec, and the service keeps the launcher's pid."""


def launcher_argv(argv: list[str]) -> list[str]:
    """`argv` run through the launcher, so that it is SIGKILLed when this process dies."""
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), *argv]


class _Spawner:
    """Forks every child from one daemon thread that lives as long as this process: the
    parent-death signal fires when the thread that forked a child ends, so a child forked
    by a short-lived thread (``asyncio.to_thread``, a thread pool) would die with it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: SimpleQueue[
            tuple[Callable[[], subprocess.Popen[bytes]], Future[subprocess.Popen[bytes]]]
        ] = SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def popen(self, make: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        with self._lock:
            # A forked copy of this process has no spawner thread: start one of its own.
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._jobs = SimpleQueue()
                self._thread = threading.Thread(
                    target=self._run, args=(self._jobs,), name="hexgen-spawner", daemon=True
                )
                self._thread.start()
                self._pid = os.getpid()
            jobs = self._jobs
        future: Future[subprocess.Popen[bytes]] = Future()
        jobs.put((make, future))
        return future.result()

    @staticmethod
    def _run(
        jobs: SimpleQueue[
            tuple[Callable[[], subprocess.Popen[bytes]], Future[subprocess.Popen[bytes]]]
        ],
    ) -> None:
        while True:
            make, future = jobs.get()
            try:
                future.set_result(make())
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)


_SPAWNER = _Spawner()


class ManagedProcess:
    """One child process with its output in `log_path`, in a session of its own; with
    `die_with_parent` (on Linux) it is SIGKILLed by the kernel when this process dies."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        *,
        die_with_parent: bool = True,
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.die_with_parent = die_with_parent and CAN_DIE_WITH_PARENT
        self.popen: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        if self.running:
            raise ClusterError(f"{self.name} is already running (pid {self.pid})")
        self._close_log()
        argv = self.argv
        if self.die_with_parent:
            path = (self.env or os.environ).get("PATH", os.defpath)
            if shutil.which(argv[0], path=path) is None:
                raise ClusterError(
                    f"cannot start {self.name} ({argv[0]}): no such program"
                ) from None
            argv = launcher_argv(argv)
        try:
            log = self._log = self.log_path.open("ab")
        except OSError as exc:
            raise ClusterError(f"cannot open the log of {self.name}: {exc}") from None
        try:
            self.popen = _SPAWNER.popen(
                lambda: subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                )
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


# ---------------------------------------------------------------------------- supervision


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How `Supervisor` restarts a child that died: after `delay_s`, doubling with each
    restart up to `max_delay_s`; a child that stayed up `reset_after_s` starts over."""

    delay_s: float = 0.5
    max_delay_s: float = 10.0
    reset_after_s: float = 10.0

    def describe(self) -> str:
        return (
            f"restart a dead service after {self.delay_s:g} s, doubling to "
            f"{self.max_delay_s:g} s (back to {self.delay_s:g} s once up {self.reset_after_s:g} s)"
        )


@dataclass(slots=True)
class _Watched:
    key: str
    process: ManagedProcess
    restart: Callable[[], None]
    delay_s: float
    started: float
    """When it was last (re)started, on the supervisor's clock."""
    due: float | None = None
    """When it is to be restarted; None: it is not waiting for a restart."""


class Supervisor:
    """Restarts the children it watches when they die, with `RestartPolicy`'s backoff.

    `step` does the work and never blocks: call it every few tenths of a second. It
    returns one line per thing it did (a death noticed and the restart planned, or a
    restart that failed to start); `restarts` counts the restarts of each child by key.
    """

    def __init__(
        self, policy: RestartPolicy | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.policy = policy or RestartPolicy()
        self.clock = clock
        self.restarts: dict[str, int] = {}
        self._watched: dict[str, _Watched] = {}

    def watch(
        self, key: str, process: ManagedProcess, restart: Callable[[], None] | None = None
    ) -> None:
        """Watch `process` under `key`; `restart` starts it again (default its `start`)."""
        self._watched[key] = _Watched(
            key, process, restart or process.start, self.policy.delay_s, self.clock()
        )
        self.restarts.setdefault(key, 0)

    def step(self) -> list[str]:
        lines: list[str] = []
        now = self.clock()
        for watched in self._watched.values():
            proc = watched.process
            if watched.due is None:
                if proc.popen is None or proc.running:
                    continue
                if now - watched.started >= self.policy.reset_after_s:
                    watched.delay_s = self.policy.delay_s
                self.restarts[watched.key] += 1
                watched.due = now + watched.delay_s
                lines.append(
                    f"{proc.name} exited with code {proc.returncode}; restarting in "
                    f"{watched.delay_s:g} s (restart {self.restarts[watched.key]})"
                )
                watched.delay_s = min(watched.delay_s * 2, self.policy.max_delay_s)
            elif now >= watched.due:
                watched.due = None
                watched.started = now
                try:
                    watched.restart()
                except ClusterError as exc:  # noticed as dead again at the next step
                    lines.append(f"{proc.name} did not restart: {exc}")
        return lines


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
    """A private ``redis-server`` on a free port of 127.0.0.1 with a temporary folder; the
    folder goes with `stop`. No RDB snapshots (``--save ""``); with `appendfsync` (default
    ``always``) an append-only file in that folder, so that `restart` (same port, same
    folder) finds every acknowledged write again; None: no persistence at all."""

    def __init__(
        self,
        binary: str = "redis-server",
        *,
        host: str = "127.0.0.1",
        start_timeout_s: float = 10.0,
        grace_s: float = 5.0,
        appendfsync: str | None = "always",
        aclfile: Path | None = None,
        extra_args: Sequence[str] = (),
        maxmemory: str | None = None,
    ) -> None:
        if appendfsync not in (None, "always", "everysec", "no"):
            raise ConfigError(f"appendfsync {appendfsync!r}: expected always, everysec or no")
        self.binary = binary
        self.host = host
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        self.appendfsync = appendfsync
        self.aclfile = aclfile
        """Redis ACL users (``--aclfile``); None: the default user, no password."""
        self.extra_args = tuple(extra_args)
        """More ``redis-server`` options (``--replicaof HOST PORT`` for a replica)."""
        self.maxmemory = maxmemory
        """Redis's ``maxmemory`` (``1gb``, bytes, ...), with ``noeviction``: nothing of the
        mesh's state is ever evicted, and the coordinator refuses new work before Redis
        refuses writes; None: unbounded."""
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
                *self._persistence_args(),
                *(
                    ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
                    if self.maxmemory is not None
                    else []
                ),
                *(["--aclfile", str(self.aclfile)] if self.aclfile is not None else []),
                *self.extra_args,
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

    def _persistence_args(self) -> list[str]:
        if self.appendfsync is None:
            return ["--appendonly", "no"]
        return ["--appendonly", "yes", "--appendfsync", self.appendfsync]

    def restart(self, *, wait: bool = False) -> None:
        """Start the server again on its port and folder (after it died): with the
        append-only file it loads every write it acknowledged. `wait`: until it answers."""
        if self.process is None:
            raise ClusterError("the Redis server is not started")
        self.process.start()
        if wait and not self._wait_ready():
            raise self.process.failure(f"did not restart on port {self.port}")

    def _wait_ready(self) -> bool:
        assert self.process is not None and self.port is not None
        deadline = time.monotonic() + self.start_timeout_s
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=0.5)
        try:
            while time.monotonic() < deadline and self.process.running:
                try:
                    if client.ping():
                        return True
                except redis.AuthenticationError:
                    return True  # it answers, and wants a login (an ACL file)
                except redis.RedisError:
                    pass
                time.sleep(POLL_S / 2)
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


def vllm_cpu_env(python: str, core: int | None = None) -> dict[str, str]:
    """The environment a vLLM server on CPU wants (docs/real-engines.md): a local model and
    no network, a KV-cache size, Intel's OpenMP preloaded when `python`'s venv has it, and
    with `core` its OpenMP threads (the model's compute) bound to that core."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),  # GiB
        "PYTHONUNBUFFERED": "1",
    }
    if core is not None:
        # vLLM's CPU worker binds its OpenMP threads to this list (one thread per core).
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"  # <venv>/bin/python
    if iomp.is_file():
        preload = os.environ.get("LD_PRELOAD", "")
        env["LD_PRELOAD"] = f"{iomp}:{preload}" if preload else str(iomp)
    return env
