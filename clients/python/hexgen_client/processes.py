"""Local child processes for `LocalCluster`: `ManagedProcess`, `RedisServer`, free ports.

A child runs in a session of its own with its output in a log file, so a Ctrl-C in the
terminal reaches only the parent, which then stops its children in order (SIGTERM, then
SIGKILL after a grace period). Importing this module starts nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO

import redis

from hexgen_client.addresses import DEFAULT_COORDINATOR
from hexgen_client.errors import ClusterError
from hexgen_flow.errors import ConfigError

__all__ = [
    "POLL_S",
    "ManagedProcess",
    "RedisServer",
    "find_redis_server",
    "free_port",
    "resolve_address",
    "split_address",
    "stop_processes",
    "vllm_cpu_env",
]

POLL_S = 0.1
"""How often waits poll a process or a port (s)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"address {address!r}: expected HOST:PORT, e.g. {DEFAULT_COORDINATOR}")
    return host, int(port)


def resolve_address(address: str) -> str:
    """`address`, with port 0 replaced by a free port; a port in use is an error."""
    host, port = split_address(address)
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
