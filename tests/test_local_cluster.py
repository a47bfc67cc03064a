"""`LocalCluster`'s process supervision, with real processes: the private redis-server
starts (with an append-only file), answers and goes away with its folder; a service that
dies while starting stops everything already started; SIGTERM escalates to SIGKILL after
the grace period; nothing starts before `start`. Restarts of services that die are in
tests/test_supervision.py."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import redis
import yaml

from hexgen_client.client import CoordinatorClient
from hexgen_flow.errors import ConfigError
from hexgen_flow.traces import load_trace, take_queries
from hexgen_launch.cluster import (
    DEFAULT_GATEWAY,
    LocalCluster,
    LocalClusterConfig,
    WorkerLaunch,
    coordinator_argv,
    gateway_argv,
    worker_argv,
)
from hexgen_launch.errors import ClusterError
from hexgen_launch.processes import ManagedProcess, RedisServer, resolve_address, stop_processes
from hexgen_launch.replay import replay

needs_redis_server = pytest.mark.skipif(
    subprocess.run(["which", "redis-server"], capture_output=True, check=False).returncode != 0,
    reason="redis-server is not installed (apt install redis-server)",
)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@needs_redis_server
def test_private_redis_starts_with_an_append_only_file_and_goes_away() -> None:
    server = RedisServer()
    url = server.start()
    assert server.process is not None and server.dir is not None
    pid, folder = server.process.pid, server.dir
    assert pid is not None and folder.is_dir()
    client = redis.Redis.from_url(url)
    try:
        assert client.ping()
        assert client.config_get("save") == {"save": ""}  # no RDB snapshots
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
        assert client.config_get("dir")["dir"] == str(folder.resolve())
        assert client.config_get("bind")["bind"] == "127.0.0.1"
    finally:
        client.close()
    server.stop()
    assert _gone(pid)
    assert not folder.exists()
    server.stop()  # twice is fine


@needs_redis_server
def test_private_redis_without_persistence() -> None:
    with RedisServer(appendfsync=None) as server:
        client = redis.Redis.from_url(server.url)
        try:
            assert client.config_get("appendonly") == {"appendonly": "no"}
        finally:
            client.close()
    with pytest.raises(ConfigError, match="appendfsync 'sometimes'"):
        RedisServer(appendfsync="sometimes")


def test_a_missing_redis_binary_says_how_to_install_it() -> None:
    with pytest.raises(ClusterError) as err:
        RedisServer("no-such-redis-server").start()
    assert "apt install redis-server" in str(err.value)
    assert "--redis-url" in str(err.value)


def test_constructing_a_cluster_starts_nothing_and_checks_its_config() -> None:
    # A fresh interpreter: importing and constructing leave it without children.
    code = (
        "import os, hexgen_launch.cluster as c\n"
        "cluster = c.LocalCluster()\n"
        "path = f'/proc/{os.getpid()}/task/{os.getpid()}/children'\n"
        "print(open(path).read().strip() if os.path.exists(path) else '')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    assert proc.stdout.strip() == ""
    with pytest.raises(ConfigError, match="cannot read"):
        LocalCluster(LocalClusterConfig(cluster="A100,??"))
    with pytest.raises(ConfigError, match="unknown policy"):
        LocalCluster(LocalClusterConfig(policy="no-such-policy"))
    with pytest.raises(ConfigError, match="time scale"):
        LocalCluster(LocalClusterConfig(time_scale=0))
    with pytest.raises(ConfigError, match="admission 'maybe'"):
        LocalCluster(LocalClusterConfig(admission="maybe"))
    with pytest.raises(ConfigError, match="retention"):
        LocalCluster(LocalClusterConfig(retention_s=0))
    with pytest.raises(ConfigError, match="--max-call-attempts must be >= 1"):
        LocalCluster(LocalClusterConfig(max_call_attempts=0))
    with pytest.raises(ConfigError, match="restart delays"):
        LocalCluster(LocalClusterConfig(restart_delay_s=5, restart_max_delay_s=1))
    cluster = LocalCluster()
    assert cluster.restarts == {}
    with pytest.raises(ClusterError, match="not started"):
        cluster.supervise()


def test_the_coordinator_gets_the_admission_retention_and_attempt_options() -> None:
    plain = coordinator_argv(LocalClusterConfig(), "127.0.0.1:1", "redis://r/0")
    assert not {"--admission", "--retention-s", "--max-call-attempts"} & set(plain)
    config = LocalClusterConfig(admission="best-effort", retention_s=60.0, max_call_attempts=2)
    argv = coordinator_argv(config, "127.0.0.1:1", "redis://r/0")
    added = [a for a in argv if a not in plain]
    assert sorted(zip(added[::2], added[1::2], strict=True)) == [
        ("--admission", "best-effort"), ("--max-call-attempts", "2"), ("--retention-s", "60.0"),
    ]  # fmt: skip


def test_the_gateway_is_off_unless_asked_for_and_gets_its_addresses() -> None:
    config = LocalClusterConfig()
    assert config.gateway is False and config.gateway_listen == DEFAULT_GATEWAY
    assert gateway_argv(config, "127.0.0.1:8001", "127.0.0.1:50051") == [
        sys.executable, "-m", "hexgen_gateway",
        "--listen", "127.0.0.1:8001", "--coordinator", "127.0.0.1:50051",
    ]  # fmt: skip


@needs_redis_server
def test_a_gateway_on_port_0_gets_a_free_port_serves_and_is_supervised(tmp_path: Path) -> None:
    config = LocalClusterConfig(
        cluster="A100",
        listen="127.0.0.1:0",
        tuner=False,
        gateway=True,
        gateway_listen="127.0.0.1:0",
        log_dir=tmp_path,
    )
    with LocalCluster(config) as cluster:
        assert cluster.gateway is not None and cluster.gateway_address is not None
        assert not cluster.gateway_address.endswith(":0")
        url = f"http://{cluster.gateway_address}/health"
        with urllib.request.urlopen(url, timeout=10) as answer:
            assert answer.status == 200
        assert cluster.supervise() == []
        assert "gateway" in cluster.restarts
        cluster.gateway.kill()
        assert cluster.supervise()[0].startswith("gateway exited with code -9")
        address = cluster.gateway_address
    assert not cluster.gateway.running
    # The HTTP server closed those connections first, so they linger in TIME_WAIT on its
    # port: a cluster started again at once still gets that address.
    again = dataclasses.replace(config, gateway_listen=address)
    with LocalCluster(again) as cluster:
        assert cluster.gateway_address == address


def test_a_gateway_address_being_listened_on_is_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ClusterError, match=f"cannot listen on 127.0.0.1:{port}"):
            resolve_address(f"127.0.0.1:{port}", reuse_addr=True)


@needs_redis_server
def test_a_worker_launch_sets_its_engine_interpreter_options_and_environment() -> None:
    vllm = WorkerLaunch("vllm", ("--vllm-model", "/m"), python="/venv/python", env={"K": "1"})
    cluster = LocalCluster(LocalClusterConfig(cluster="A100,L40S", workers=(vllm,)))
    assert cluster.worker_launch(0) is vllm
    assert cluster.worker_launch(1) == WorkerLaunch()  # the rest: simulated, as before
    assert cluster._worker_argv(0) == [
        "/venv/python", "-m", "hexgen_worker", "--coordinator", cluster.worker_address,
        "--worker-id", "local-worker-0", "--slot", "0", "--gpu", "A100",
        "--model", cluster.instances[0].model, "--engine", "vllm", "--vllm-model", "/m",
    ]  # fmt: skip
    assert cluster._worker_argv(1) == worker_argv(
        sys.executable, cluster.worker_address, 1, "L40S", cluster.instances[1].model
    )
    assert cluster._worker_argv(1)[-2:] == ["--engine", "simulated"]
    with pytest.raises(ConfigError, match="2 worker launches for a cluster of 1"):
        LocalCluster(LocalClusterConfig(cluster="A100", workers=(vllm, vllm)))


@needs_redis_server
def test_a_service_that_dies_while_starting_stops_what_was_started(tmp_path: Path) -> None:
    # The "interpreter" exits at once with code 1, so the coordinator dies while starting.
    config = LocalClusterConfig(
        listen="127.0.0.1:0", python="/bin/false", log_dir=tmp_path, start_timeout_s=10
    )
    cluster = LocalCluster(config)
    with pytest.raises(ClusterError) as err:
        cluster.start()
    message = str(err.value)
    assert message.startswith("coordinator exited with code 1 while starting")
    assert str(tmp_path / "coordinator.log") in message
    assert "\n" not in message  # one line, as the CLI prints it
    assert cluster.redis is None  # the private Redis was stopped
    assert cluster.exited() == [cluster.coordinator]


def test_an_address_in_use_is_reported_before_anything_starts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cluster = LocalCluster(LocalClusterConfig(listen=f"127.0.0.1:{port}"))
        with pytest.raises(ClusterError, match=f"cannot listen on 127.0.0.1:{port}"):
            cluster.start()
        assert cluster.redis is None and cluster.coordinator is None


def test_sigterm_escalates_to_sigkill_after_the_grace_period(tmp_path: Path) -> None:
    stubborn = ManagedProcess(
        "stubborn",
        [
            sys.executable,
            "-c",
            "import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n",
        ],
        tmp_path / "stubborn.log",
    )
    polite = ManagedProcess(
        "polite", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "polite.log"
    )
    stubborn.start()
    polite.start()
    for _ in range(100):  # until the SIGTERM handler is in place
        if "ready" in stubborn.log_tail():
            break
        subprocess.run(["sleep", "0.05"], check=True)
    stop_processes([stubborn, polite], grace_s=0.5)
    assert polite.returncode == -signal.SIGTERM
    assert stubborn.returncode == -signal.SIGKILL
    assert not stubborn.running and not polite.running


@needs_redis_server
def test_a_cluster_file_of_its_own_gpu_types_runs_a_mesh(tmp_path: Path) -> None:
    """A cluster file that defines a GPU type the catalogue lacks (a CPU core serving
    SmolLM2, as the real-engine benchmarks run) starts a mesh whose workers resolve that
    type through the file (--gpus-file) and serve queries; the welcome names the slots
    inline, and the workers read those names with the file's types too."""
    root = Path(__file__).resolve().parents[1]
    doc = yaml.safe_load((root / "examples/cpu-1core-cluster.yaml").read_text())
    doc["instances"] = [{**doc["instances"][0], "count": 2}]
    doc["calibration"] = f"measured:{root}/examples/profiles/smollm2-135m-vllm-cpu-1core.yaml"
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(doc))
    config = LocalClusterConfig(
        cluster=str(cluster_file),
        policy="hexgen-flow",
        listen="127.0.0.1:0",
        tuner=False,
        time_scale=20.0,
        log_dir=tmp_path / "logs",
    )
    mesh = LocalCluster(config)
    assert mesh.gpus == ("CPU-1core", "CPU-1core")
    assert mesh.gpus_file == str(cluster_file.resolve())
    assert "--gpus-file" in mesh._worker_argv(1)
    assert LocalCluster(LocalClusterConfig(cluster="A100,L40S")).gpus_file is None
    queries = take_queries(load_trace(str(root / "benchmarks/workloads/smollm2-replay.jsonl")), 2)

    async def run(address: str) -> int:
        async with CoordinatorClient(address) as client:
            return (await replay(client, queries, 1.0, seed=0)).completed

    with mesh:
        assert asyncio.run(run(mesh.coordinator_address)) == 2
