"""A real Redis Cluster of this machine, for the tests of a coordinator on one: three
masters (``redis-server --cluster-enabled yes`` on free ports of 127.0.0.1, each in its own
folder of one temporary folder, no persistence), joined by ``redis-cli --cluster create``
with no replicas; started and torn down by the test (the nodes die with the test process, as
`LocalCluster`'s children do). `needs_redis_cluster` skips when ``redis-server`` or
``redis-cli`` is not on PATH."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import pytest
import redis

from hexgen_launch.processes import ManagedProcess, stop_processes

__all__ = ["RedisClusterHere", "needs_redis_cluster"]

needs_redis_cluster = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
    reason="redis-server and redis-cli are needed to start a local Redis Cluster",
)

BUS_OFFSET = 10_000
"""A cluster node also listens on its port + 10000 (the cluster bus)."""


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(n: int) -> list[int]:
    """`n` ports free on 127.0.0.1 whose bus ports (+10000) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port + BUS_OFFSET < 65536 and port not in ports and _free(port + BUS_OFFSET):
            ports.append(port)
    return ports


class RedisClusterHere:
    """``with RedisClusterHere() as cluster:`` a 3-master cluster; `url` is its first
    node's (``redis://127.0.0.1:P1/0``), what a cluster client starts from."""

    def __init__(self, masters: int = 3, start_timeout_s: float = 30.0) -> None:
        self.masters = masters
        self.start_timeout_s = start_timeout_s
        self.ports: list[int] = []
        self.dir: Path | None = None
        self.processes: list[ManagedProcess] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def node_urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{port}/0" for port in self.ports]

    def client(self) -> redis.RedisCluster[bytes]:
        """A (sync) cluster client, for the tests' own reads."""
        return redis.RedisCluster.from_url(self.url)

    def start(self) -> RedisClusterHere:
        self.dir = Path(tempfile.mkdtemp(prefix="hexgen-redis-cluster-"))
        for _attempt in range(3):  # another process may take a free port before Redis does
            self.ports = _free_ports(self.masters)
            self.processes = [self._node(port) for port in self.ports]
            if all(self._ping(port) for port in self.ports):
                break
            self._stop_nodes()
        else:
            self.stop()
            raise RuntimeError("could not start the Redis Cluster's nodes (3 attempts)")
        argv = [
            "redis-cli", "--cluster", "create",
            *(f"127.0.0.1:{port}" for port in self.ports),
            "--cluster-replicas", "0", "--cluster-yes",
        ]  # fmt: skip
        create = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=self.start_timeout_s,
            check=False,
        )
        if create.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {create.stdout[-2000:]}")
        self._wait_ok()
        return self

    def _node(self, port: int) -> ManagedProcess:
        assert self.dir is not None
        folder = self.dir / str(port)
        folder.mkdir()
        argv = [
            "redis-server",
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(folder / "nodes.conf"),
            "--cluster-node-timeout", "5000",
            "--appendonly", "no",
            "--save", "",
            "--dir", str(folder),
            "--daemonize", "no",
        ]  # fmt: skip
        node = ManagedProcess(f"redis-cluster-{port}", argv, folder / "redis.log")
        node.start()
        return node

    def _ping(self, port: int) -> bool:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if not all(proc.running for proc in self.processes):
                return False
            try:
                with redis.Redis(port=port, socket_timeout=1) as node:
                    if node.ping():
                        return True
            except redis.RedisError:
                pass
            time.sleep(0.05)
        return False

    def _wait_ok(self) -> None:
        """Until every node's ``CLUSTER INFO`` says cluster_state:ok."""
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            states = []
            for port in self.ports:
                with redis.Redis(port=port, socket_timeout=1) as node:
                    states.append(node.execute_command("CLUSTER INFO"))
            if all(_info_ok(info) for info in states):
                return
            if time.monotonic() >= deadline:
                self.stop()
                raise RuntimeError(f"the Redis Cluster is not ok after {self.start_timeout_s} s")
            time.sleep(0.1)

    def _stop_nodes(self) -> None:
        stop_processes(self.processes, 5.0)
        self.processes = []

    def stop(self) -> None:
        self._stop_nodes()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> RedisClusterHere:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _info_ok(info: object) -> bool:
    """Whether a ``CLUSTER INFO`` answer (redis-py parses it into a dict) says ok."""
    if isinstance(info, dict):
        return str(info.get("cluster_state")) == "ok"
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text
