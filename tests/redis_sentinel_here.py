"""Redis behind Sentinel on this machine, for the tests of a mesh on one: a master and a
replica of it (`hexgen_launch.processes.RedisServer`, no persistence) and one Sentinel that
monitors them (quorum 1), on free ports of 127.0.0.1; started and torn down by the test.
`url` is what the services take (``redis+sentinel://127.0.0.1:S/SERVICE``).
`needs_redis_sentinel` skips when ``redis-server`` is not on PATH."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from types import TracebackType

import pytest
import redis

from hexgen_launch.processes import ManagedProcess, RedisServer, free_port, stop_processes

__all__ = ["RedisSentinelHere", "needs_redis_sentinel"]

needs_redis_sentinel = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server is needed to start a Redis with a replica behind Sentinel",
)

SERVICE = "hexgen"


class RedisSentinelHere:
    """``with RedisSentinelHere() as here:`` a master, a replica and a Sentinel."""

    def __init__(self, start_timeout_s: float = 30.0) -> None:
        self.start_timeout_s = start_timeout_s
        self.master = RedisServer(appendfsync=None)
        self.replica: RedisServer | None = None
        self.sentinel_port = 0
        self.dir: Path | None = None
        self.sentinel_process: ManagedProcess | None = None

    @property
    def master_port(self) -> int:
        assert self.master.port is not None
        return self.master.port

    @property
    def replica_port(self) -> int:
        assert self.replica is not None and self.replica.port is not None
        return self.replica.port

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{SERVICE}"

    def sentinel(self) -> redis.Redis[str]:
        """A client of the Sentinel itself (SENTINEL commands)."""
        return redis.Redis(port=self.sentinel_port, decode_responses=True, socket_timeout=5)

    def master_address(self) -> tuple[str, int]:
        """Where the Sentinel says the master is now."""
        with self.sentinel() as sentinel:
            host, port = sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return str(host), int(port)

    def start(self) -> RedisSentinelHere:
        self.master.start()
        self.replica = RedisServer(
            appendfsync=None, extra_args=("--replicaof", "127.0.0.1", str(self.master_port))
        )
        self.replica.start()
        self._wait(self._replica_in_sync)
        self.dir = Path(tempfile.mkdtemp(prefix="hexgen-redis-sentinel-"))
        self.sentinel_port = free_port()
        self.sentinel_process = self._sentinel()
        self._wait(self._sentinel_sees_the_replica)
        return self

    def _sentinel(self) -> ManagedProcess:
        assert self.dir is not None
        folder = self.dir / f"sentinel-{self.sentinel_port}"
        folder.mkdir()
        conf = folder / "sentinel.conf"  # Sentinel rewrites its file: one of its own
        conf.write_text(
            f"port {self.sentinel_port}\n"
            "bind 127.0.0.1\n"
            f"dir {folder}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.master_port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        argv = ["redis-server", str(conf), "--sentinel"]
        sentinel = ManagedProcess(f"sentinel-{self.sentinel_port}", argv, folder / "sentinel.log")
        sentinel.start()
        return sentinel

    def _replica_in_sync(self) -> bool:
        with redis.Redis(port=self.replica_port, socket_timeout=1) as replica:
            info = replica.info("replication")
        return bool(info.get("master_link_status") == "up")

    def _sentinel_sees_the_replica(self) -> bool:
        with self.sentinel() as sentinel:
            return bool(sentinel.execute_command("SENTINEL", "REPLICAS", SERVICE))

    def failover(self) -> tuple[str, int]:
        """A planned failover, as an upgrade runs one: the master's writes paused until the
        replica has every one of them, then ``SENTINEL FAILOVER`` (which promotes at once,
        and on its own would drop what the replica had not yet received); returns the new
        master's address once the Sentinel names it. The clients' writes held by the pause
        then meet a replica, and go to the new master."""
        host, port = self.master_address()
        with redis.Redis(host=host, port=port, socket_timeout=5) as master:
            master.execute_command("CLIENT", "PAUSE", "30000", "WRITE")
            try:
                self._wait(lambda: self._caught_up(master))
                with self.sentinel() as sentinel:
                    sentinel.execute_command("SENTINEL", "FAILOVER", SERVICE)
                self._wait(lambda: self.master_address() != (host, port))
                # Until Sentinel has made the old master a replica, a held write let go
                # would land there, and be dropped when it resyncs from the new master.
                self._wait(lambda: master.info("replication")["role"] == "slave")
            finally:
                master.execute_command("CLIENT", "UNPAUSE")
        return self.master_address()

    def _caught_up(self, master: redis.Redis[bytes]) -> bool:
        """Whether every replica has acknowledged the master's whole replication stream."""
        info = master.info("replication")
        offset = int(info["master_repl_offset"])
        replicas = [v for k, v in info.items() if str(k).startswith("slave")]
        return bool(replicas) and all(
            isinstance(r, dict) and int(r["offset"]) >= offset for r in replicas
        )

    def _wait(self, ready: object) -> None:
        assert callable(ready)
        deadline = time.monotonic() + self.start_timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                if ready():
                    return
            except (redis.RedisError, OSError) as exc:
                last = exc
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"Redis behind Sentinel not ready in {self.start_timeout_s} s: {last}")

    def stop(self) -> None:
        if self.sentinel_process is not None:
            stop_processes([self.sentinel_process], 5.0)
            self.sentinel_process = None
        for server in (self.replica, self.master):
            if server is not None:
                server.stop()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> RedisSentinelHere:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
