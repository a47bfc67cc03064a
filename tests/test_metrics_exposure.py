"""The metrics doors under the mesh's exposure rule (docs/security.md, "The metrics doors"),
attacked with real processes:

- a metrics door beyond loopback without protection: `hexgen-flow up --metrics-listen
  0.0.0.0:P` exits 2 before starting anything, and so does each service started alone
  (coordinator, worker, tuner), one line naming ``--metrics-listen`` and what protects it;
  with ``--insecure`` the service starts and serves;
- `hexgen-flow up --secure` serves every metrics door (coordinator, tuner, workers; here
  on 0.0.0.0, which protection allows) over HTTPS only, answering 401 without a key or
  with a bad one, 403 to a tenant's key where an operator's is needed, the metrics to an
  operator's or admin's key, ``/health`` to anyone; and a real Prometheus with the shipped
  configuration (deploy/prometheus/prometheus.yml, compose's names and secrets made this
  machine's) scrapes every door, while a job without the key is refused (401);
- tenant labels are capped: 3,000 tenants give at most 101 tenant label values (the first
  100 seen, and "other").
"""

from __future__ import annotations

import asyncio
import collections
import shutil
import signal
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from cli_runner import one_error_line, run_cli
from hexgen_client.client import CoordinatorClient
from hexgen_client.errors import CoordinatorOverloadedError
from hexgen_flow.workload import LLMCall, Query, Workflow
from hexgen_launch.processes import free_port
from hexgen_service.auth_dir import AuthDir
from prometheus_here import (
    compose_config,
    doors,
    needs_prometheus,
    promtool_check,
    running_prometheus,
    write_config,
)
from redis_here import REDIS_URL, needs_redis
from up_runner import Up, listening, running_up

needs_redis_server = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server is not installed (apt install redis-server)",
)


def _single_error_line(proc: subprocess.CompletedProcess[str], prog: str) -> str:
    """The one line a refused service prints: exit 2, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    return lines[0]


def _serves_metrics(url: str, family: str, timeout_s: float = 30) -> bool:
    """Whether `url` answers 200 with `family` within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            answer = httpx.get(url, timeout=2)
            if answer.status_code == 200 and family in answer.text:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    return False


def _forget(prefix: str) -> None:
    """Delete the test Redis's keys under `prefix`."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=prefix + "*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


# ------------------------------------------------------------ 1. open doors are refused


@needs_redis_server
def test_up_refuses_open_metrics_beyond_loopback_before_starting_anything(
    tmp_path: Path,
) -> None:
    port = free_port()
    log_dir = tmp_path / "logs"
    proc = run_cli(
        "up", "--metrics-listen", f"0.0.0.0:{port}", "--listen", "127.0.0.1:0",
        "--tuner-listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0",
        "--log-dir", str(log_dir), timeout=30,
    )  # fmt: skip
    line = one_error_line(proc)
    assert f"--metrics-listen 0.0.0.0:{port}" in line and "--secure" in line, line
    assert not log_dir.exists(), "up started something before refusing"
    assert not listening(f"127.0.0.1:{port}")


def _coordinator(metrics: str, *extra: str) -> list[str]:
    prefix = f"hf-mexp-{uuid.uuid4().hex[:8]}:"
    return [
        sys.executable, "-m", "hexgen_coordinator", "--listen", f"127.0.0.1:{free_port()}",
        "--redis-url", REDIS_URL, "--redis-prefix", prefix, "--cluster", "A100",
        "--metrics-listen", metrics, *extra,
    ]  # fmt: skip


def _worker(metrics: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "hexgen_worker", "--coordinator", f"127.0.0.1:{free_port()}",
        "--worker-id", "exposed", "--gpu", "A100", "--metrics-listen", metrics, *extra,
    ]  # fmt: skip


def _tuner(metrics: str, *extra: str) -> list[str]:
    prefix = f"hf-mexp-{uuid.uuid4().hex[:8]}:"
    return [
        sys.executable, "-m", "hexgen_tuner", "--listen", f"127.0.0.1:{free_port()}",
        "--coordinator", f"127.0.0.1:{free_port()}", "--redis-url", REDIS_URL,
        "--redis-prefix", prefix, "--metrics-listen", metrics, *extra,
    ]  # fmt: skip


SERVICES = {
    # prog, its command line, what protects its door, a family its metrics always carry
    "coordinator": (
        "hexgen-coordinator",
        _coordinator,
        "--api-keys-file and --tls-cert/--tls-key",
        "hexgen_flow_queries_running",
    ),
    "worker": (
        "hexgen-worker",
        _worker,
        "--api-keys-file and --metrics-tls-cert/--metrics-tls-key",
        "hexgen_flow_worker_running_calls",
    ),
    "tuner": (
        "hexgen-tuner",
        _tuner,
        "--api-keys-file and --tls-cert/--tls-key",
        "hexgen_flow_tuner_run_seconds",
    ),
}


@needs_redis
@pytest.mark.parametrize("service", sorted(SERVICES))
def test_a_service_alone_refuses_open_metrics_beyond_loopback_unless_insecure(
    service: str, tmp_path: Path
) -> None:
    prog, argv, needs, family = SERVICES[service]
    port = free_port()
    refused = subprocess.run(
        argv(f"0.0.0.0:{port}"), capture_output=True, text=True, timeout=30, check=False
    )
    line = _single_error_line(refused, prog)
    assert f"--metrics-listen: refusing to listen on 0.0.0.0:{port} without {needs}" in line
    assert "--insecure" in line
    # --insecure: the operator owns it; the door opens, on every interface.
    insecure = argv(f"0.0.0.0:{port}", "--insecure")
    with (tmp_path / "insecure.log").open("w") as log:
        proc = subprocess.Popen(insecure, stdout=log, stderr=subprocess.STDOUT)
    try:
        assert _serves_metrics(f"http://127.0.0.1:{port}/metrics", family), (
            tmp_path / "insecure.log"
        ).read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if "--redis-prefix" in insecure:
            _forget(insecure[insecure.index("--redis-prefix") + 1])


# ------------------------------------------------ 2. a secured mesh's metrics doors


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Up, AuthDir]]:
    """`up --secure` with its metrics doors on every interface (protection allows it)."""
    folder = tmp_path_factory.mktemp("metrics-secure")
    auth = AuthDir(folder / "auth")
    options = ("--secure", "--auth-dir", str(auth.path), "--tenants", "a,health", "--cluster",
               "A100,A6000", "--no-gateway", "--time-scale", "20", "--tuner-period-s", "600",
               "--metrics-listen", "0.0.0.0:0")  # fmt: skip
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt install redis-server)")
    with running_up(folder, *options) as running:
        yield running, auth


def _get(address: str, auth: AuthDir, key: Path | str | None, path: str = "/metrics") -> Any:
    tls = ssl.create_default_context(cafile=str(auth.ca))
    headers = {}
    if key is not None:
        secret = key.read_text().strip() if isinstance(key, Path) else key
        headers["Authorization"] = f"Bearer {secret}"
    return httpx.get(f"https://{address}{path}", headers=headers, verify=tls, timeout=10)


FAMILIES = {
    "coordinator": "hexgen_flow_queries_running",
    "tuner": "hexgen_flow_tuner_run_seconds",
    "worker": "hexgen_flow_worker_running_calls",
}


def test_up_secure_serves_every_metrics_door_over_tls_to_api_keys_only(
    secured: tuple[Up, AuthDir],
) -> None:
    up, auth = secured
    found = doors(up)
    assert set(found) == {"coordinator", "tuner", "worker-0", "worker-1"}
    for name, address in found.items():
        kind = name.split("-")[0]
        # No key, a malformed one, a right id with a wrong secret: 401 with the challenge.
        bare = _get(address, auth, None)
        assert bare.status_code == 401, (name, bare.status_code, bare.text)
        assert bare.headers["www-authenticate"].startswith("Bearer"), name
        assert "no API key" in bare.text and "hexgen_flow" not in bare.text, name
        assert _get(address, auth, "not-a-key").status_code == 401, name
        admin = auth.admin_key.read_text().strip()
        forged = admin[:-5] + ("AAAAA" if not admin.endswith("AAAAA") else "BBBBB")
        wrong = _get(address, auth, forged)
        assert wrong.status_code == 401 and "unknown API key" in wrong.text, name
        # A tenant's key: the coordinator's and the tuner's metrics name every tenant.
        tenant = _get(address, auth, auth.tenant_key("a"))
        if kind == "worker":
            assert tenant.status_code == 200 and FAMILIES[kind] in tenant.text, name
        else:
            assert tenant.status_code == 403, (name, tenant.status_code)
            assert "the metrics need the operator role" in tenant.text, name
            assert "hexgen_flow" not in tenant.text, name
        # An operator's key (the tuner's) and the admin's: the metrics.
        for key in (auth.tuner_key, auth.admin_key):
            answer = _get(address, auth, key)
            assert answer.status_code == 200, (name, key.name, answer.text)
            assert FAMILIES[kind] in answer.text, name
        # Probes need no key and learn nothing else.
        health = _get(address, auth, None, "/health")
        assert health.status_code == 200 and health.text == "ok\n", name
        # Plaintext gets no answer at all: the door speaks TLS only.
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://{address}/metrics", timeout=5)
    # Each refusal left its audit line, as the gRPC doors' do.
    log = (up.log_dir / "coordinator.log").read_text()
    assert "denied metrics /metrics: unauthenticated: no API key" in log
    assert "denied metrics /metrics: permission denied: the metrics need the operator" in log


def _localized_prometheus_config(up: Up, auth: AuthDir, folder: Path) -> Path:
    """deploy/prometheus/prometheus.yml made this machine's (`compose_config`), plus a job
    without the key, to be refused."""
    config = compose_config(up, auth)
    coordinator = next(j for j in config["scrape_configs"] if j["job_name"] == "hexgen-coordinator")
    config["scrape_configs"].append(
        {
            "job_name": "no-key",
            "scheme": "https",
            "tls_config": dict(coordinator["tls_config"]),
            "static_configs": [{"targets": [doors(up)["coordinator"]]}],
        }
    )
    return write_config(config, folder / "prometheus.yml", scrape_interval_s=None)


@needs_prometheus
def test_the_shipped_prometheus_config_scrapes_the_secured_doors(
    secured: tuple[Up, AuthDir], tmp_path: Path
) -> None:
    up, auth = secured
    config = _localized_prometheus_config(up, auth, tmp_path)
    promtool_check(config)
    with running_prometheus(config, tmp_path / "prometheus") as prometheus:
        health = prometheus.wait_targets(5, timeout_s=90)
        refused = {k: v for k, v in health.items() if k.startswith("no-key ")}
        scraped = {k: v for k, v in health.items() if not k.startswith("no-key ")}
        assert len(scraped) == 4, health  # coordinator, tuner, worker-0, worker-1
        assert all(h == "up" for h, _ in scraped.values()), health
        ((state, error),) = refused.values()
        assert state == "down" and "401" in error, refused
        result = prometheus.query("hexgen_flow_instance_connected")
        assert len(result) == 2, result  # one series per instance


# ---------------------------------------------------------- 3. the tenant label cap


@needs_redis
def test_three_thousand_tenants_give_at_most_101_tenant_labels(tmp_path: Path) -> None:
    """150 tenants submit and cancel a query (queries_finished), then 3,000 more are refused
    (queries_rejected) while one query fills the coordinator: the first 100 tenants seen
    keep their label, everything else is counted under "other"."""
    address, port = f"127.0.0.1:{free_port()}", free_port()
    prefix = f"hf-mexp-{uuid.uuid4().hex[:8]}:"
    argv = [
        sys.executable, "-m", "hexgen_coordinator", "--listen", address,
        "--redis-url", REDIS_URL, "--redis-prefix", prefix, "--cluster", "A100",
        "--admission", "off", "--max-running-queries", "1",
        "--metrics-listen", f"127.0.0.1:{port}",
    ]  # fmt: skip
    with (tmp_path / "coordinator.log").open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    workflow = Workflow.chain([(LLMCall("step", 300, 8),)])

    async def flood() -> int:
        refused = 0
        async with CoordinatorClient(address) as client:
            await client.wait_ready(timeout_s=30)
            for i in range(150):
                await client.submit(Query(f"c-{i}", workflow, tenant=f"cancelling-{i}"))
                await client.cancel(f"c-{i}")
            await client.submit(Query("blocker", workflow, tenant="blocker"))
            limit = asyncio.Semaphore(16)

            async def refuse(i: int) -> None:
                nonlocal refused
                async with limit:
                    try:
                        await client.submit(Query(f"r-{i}", workflow, tenant=f"flood-{i}"))
                    except CoordinatorOverloadedError:
                        refused += 1

            await asyncio.gather(*(refuse(i) for i in range(3000)))
        return refused

    try:
        assert asyncio.run(flood()) == 3000
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        _forget(prefix)
    samples = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "tenant" in s.labels
    ]
    tenants = {s.labels["tenant"] for s in samples}
    assert len(tenants) == 101, len(tenants)  # the first 100 seen, and "other"
    assert tenants == {*(f"cancelling-{i}" for i in range(100)), "other"}

    def value(name: str, **labels: str) -> float:
        found = [s.value for s in samples if s.name == name and s.labels == labels]
        assert len(found) == 1, (name, labels)
        return found[0]

    finished = "hexgen_flow_queries_finished_total"
    assert value(finished, tenant="cancelling-0", outcome="cancelled") == 1
    assert value(finished, tenant="other", outcome="cancelled") == 50  # cancelling-100..149
    rejected = "hexgen_flow_queries_rejected_total"
    assert value(rejected, tenant="other", reason="running_limit") == 3000  # --max-running-queries
    # Each tenant value has the same few series (finished by outcome, slo_met, the latency
    # histogram's buckets, count and sum; "other" its rejections too): the scrape is bounded.
    per_value = collections.Counter(s.labels["tenant"] for s in samples)
    assert set(per_value.values()) == {per_value["cancelling-0"], per_value["other"]}
    assert len(samples) <= 101 * per_value["other"] <= 101 * 30
