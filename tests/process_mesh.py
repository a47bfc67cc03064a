"""A coordinator and its simulated workers as real processes (``python -m
hexgen_coordinator``, ``python -m hexgen_worker``) on a Redis of the test's choosing, under a
fresh key prefix: for tests that give the coordinator options `hexgen-flow up` does not pass
on, or that kill and restart single workers."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import redis

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import coordinator_pb2_grpc as cpb_grpc
from hexgen_launch.cluster_config import worker_argv
from hexgen_launch.processes import free_port
from hexgen_service import redis_schema as rs
from hexgen_service.healthcheck import check
from redis_here import REDIS_URL

__all__ = ["MODEL", "MeshFactory", "ProcessMesh", "meshes"]

MODEL = "llama-3.1-70b"


class ProcessMesh:
    """A coordinator with `coordinator_args` and `workers` simulated workers (slots 0 to
    workers - 1 of `cluster`), each a process logging into `logs`; `stop` ends them and
    drops the keys."""

    def __init__(
        self,
        logs: Path,
        coordinator_args: list[str],
        workers: int | None = None,
        time_scale: float = 10.0,
        *,
        cluster: str = "A100,A100",
        redis_url: str = REDIS_URL,
        worker_calibration: str | None = None,
    ) -> None:
        self.logs = logs
        self.worker_calibration = worker_calibration
        """What the workers' simulated engines run (None: their default)."""
        self.gpus = cluster.split(",")
        self.redis_url = redis_url
        self.prefix = f"test-mesh-{uuid.uuid4().hex[:8]}:"
        self.address = f"127.0.0.1:{free_port()}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.coordinator_argv = [
            sys.executable, "-m", "hexgen_coordinator",
            "--listen", self.address,
            "--redis-url", redis_url,
            "--redis-prefix", self.prefix,
            "--cluster", cluster,
            "--time-scale", repr(time_scale),
            "--log-level", "WARNING",
            *coordinator_args,
        ]  # fmt: skip
        workers = len(self.gpus) if workers is None else workers
        try:
            self.start_coordinator()
            for slot in range(workers):
                self.start_worker(slot)
            if workers:
                self.wait_connected(workers)
        except BaseException:
            self.stop()
            raise

    def start_coordinator(self) -> None:
        """Start the coordinator (again, after `kill_coordinator`: on the same address and
        state) and wait until it answers."""
        self._start("coordinator", self.coordinator_argv)
        deadline = time.monotonic() + 30
        while check(self.address, timeout_s=1.0) is not None:
            self._alive("coordinator")
            assert time.monotonic() < deadline, "the coordinator did not start"
            time.sleep(0.05)

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator (its state stays in Redis)."""
        proc = self.procs["coordinator"]
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def _start(self, name: str, argv: list[str]) -> None:
        with (self.logs / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def _alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            tail = (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]
            raise AssertionError(f"{name} exited with {proc.returncode}:\n{tail}")

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def start_worker(self, slot: int) -> None:
        argv = worker_argv(
            sys.executable,
            self.address,
            slot,
            self.gpus[slot],
            MODEL,
            calibration=self.worker_calibration,
        )
        self._start(f"worker-{slot}", argv)

    def kill_worker(self, slot: int) -> None:
        proc = self.procs[f"worker-{slot}"]
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def status(self) -> cpb.ClusterStatusResponse:
        with grpc.insecure_channel(self.address) as channel:
            stub = cpb_grpc.CoordinatorServiceStub(channel)
            return stub.ClusterStatus(cpb.ClusterStatusRequest(), timeout=5)

    def epoch_unix_s(self) -> float:
        """The cluster clock's epoch, as the coordinator keeps it in Redis: cluster time t is
        Unix time ``epoch + t / time_scale``."""
        client = redis.Redis.from_url(self.redis_url)
        try:
            value = client.hget(rs.key(self.prefix, rs.META), rs.M.EPOCH_UNIX_S)
        finally:
            client.close()
        assert value is not None, "the coordinator wrote no clock"
        return float(value)

    def wait_connected(self, n: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while sum(i.connected for i in self.status().instances) < n:
            for name in self.procs:
                self._alive(name)
            assert time.monotonic() < deadline, "the workers did not connect"
            time.sleep(0.1)

    def stop(self) -> None:
        for proc in reversed(self.procs.values()):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        client = redis.Redis.from_url(self.redis_url)
        try:
            keys = list(client.scan_iter(match=f"{self.prefix}*", count=1000))
            if keys:
                client.delete(*keys)
        except redis.RedisError:
            pass  # a private Redis the test stopped first
        finally:
            client.close()


MeshFactory = Callable[..., ProcessMesh]


def meshes(logs: Path) -> Iterator[MeshFactory]:
    """For a test module's ``mesh_factory`` fixture (``yield from meshes(tmp_path)``): a
    function ``start(coordinator_args, workers=None, time_scale=10, cluster=...,
    redis_url=...)`` that starts a `ProcessMesh` logging into `logs`; every mesh started is
    stopped at the end."""
    started: list[ProcessMesh] = []

    def start(coordinator_args: list[str], *args: object, **kwargs: object) -> ProcessMesh:
        mesh = ProcessMesh(logs, coordinator_args, *args, **kwargs)  # type: ignore[arg-type]
        started.append(mesh)
        return mesh

    try:
        yield start
    finally:
        for mesh in started:
            mesh.stop()
