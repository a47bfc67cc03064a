"""The shipped Grafana dashboard, through a real Prometheus with each shipped scrape
configuration, against a real mesh started as users start it (`hexgen-flow up --secure`,
four GPUs).

A Prometheus scrape gives every series its target's ``job`` and ``instance`` labels; a
metric's own label of either name is renamed ``exported_*`` (``honor_labels: false``, the
default, which no shipped config changes). So the metrics must not use those names: a
per-GPU label called ``instance`` came out of a scrape as ``exported_instance``, and the
dashboard's ``sum by (instance)`` added the four GPUs up into one line per target.

Here two Prometheus servers scrape the same mesh every second, one with
deploy/prometheus/prometheus.yml (compose's), one with deploy/k8s/base/prometheus-scrape.yml
(its pod discovery replaced by static targets carrying the labels Kubernetes would give
the manifests' pods, so that the config's own relabelling picks and names them; see
tests/prometheus_here.py); `promtool check config` passes on each, and on the Kubernetes one
with its discovery kept. Tenants ``a`` and ``b`` run workflows of three stages, and one
query is refused (its SLO cannot be met). Then every query of every panel of
deploy/grafana/dashboards/hexgen-flow.json is evaluated through each Prometheus's HTTP API:
each returns series, none carries an ``exported_*`` label, each legend's labels are on every
series and the legends are distinct (Grafana's lines can be told apart), and a per-GPU
panel has one series for each of the four GPU instances, a per-worker one for each worker.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from compose_file import ROOT
from hexgen_client.client import CoordinatorClient
from hexgen_client.errors import CoordinatorError
from hexgen_flow.workload import LLMCall, Query, Workflow
from hexgen_service.auth_dir import AuthDir
from prometheus_here import (
    Prometheus,
    compose_config,
    k8s_config,
    k8s_static_config,
    needs_prometheus,
    promtool_check,
    running_prometheus,
    write_config,
)
from up_runner import Up, running_up

pytestmark = needs_prometheus

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "hexgen-flow.json"
GPUS = ["A100", "A100", "A100", "A100"]  # equal: the load reaches every one
INSTANCES = {f"{gpu}#{i}" for i, gpu in enumerate(GPUS)}
TENANTS = ("a", "b")
QUERIES_PER_TENANT = 6
STAGES = ("information_retriever", "generate_candidate", "unit_tester")


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Up, AuthDir]]:
    """`up --secure` on four GPUs: every metrics door over HTTPS to API keys, as the
    shipped scrape configs expect."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    folder = tmp_path_factory.mktemp("dashboard")
    auth = AuthDir(folder / "auth")
    options = ("--secure", "--auth-dir", str(auth.path), "--tenants", "a,b,health",
               "--cluster", ",".join(GPUS), "--no-gateway", "--time-scale", "5",
               "--tuner-period-s", "600")  # fmt: skip
    with running_up(folder, *options) as up:
        yield up, auth


def _workflow() -> Workflow:
    return Workflow.chain(
        [
            tuple(LLMCall(STAGES[0], 600, 40) for _ in range(4)),
            tuple(LLMCall(STAGES[1], 900, 80) for _ in range(2)),
            (LLMCall(STAGES[2], 300, 10),),
        ]
    )


async def _run_load(up: Up, auth: AuthDir) -> tuple[int, int]:
    """Tenants a and b each run `QUERIES_PER_TENANT` workflows at once, after one query
    that is refused (an SLO of a second); returns (queries ended, queries refused)."""
    clients = {
        tenant: CoordinatorClient(
            up.coordinator, api_key=auth.tenant_key(tenant).read_text().strip(), tls_ca=auth.ca
        )
        for tenant in TENANTS
    }
    refused = 0
    try:
        await clients["a"].wait_ready(timeout_s=30)
        try:
            await clients["a"].submit(Query("hopeless", _workflow(), tenant="a", slo_s=1.0))
        except CoordinatorError:
            refused += 1
        submitted: list[tuple[str, str]] = []
        for n in range(QUERIES_PER_TENANT):
            for tenant in TENANTS:
                query_id = f"{tenant}-{n}"
                try:
                    await clients[tenant].submit(
                        Query(query_id, _workflow(), tenant=tenant, slo_s=900.0)
                    )
                    submitted.append((tenant, query_id))
                except CoordinatorError:  # overloaded: counted, and the panels show it
                    refused += 1

        async def watch(tenant: str, query_id: str) -> None:
            async for _event in clients[tenant].watch(query_id):
                pass

        await asyncio.wait_for(asyncio.gather(*(watch(t, q) for t, q in submitted)), 120)
        return len(submitted), refused
    finally:
        for client in clients.values():
            await client.close()


def _scalar(prometheus: Prometheus, expr: str) -> float:
    result = prometheus.query(expr)
    return float(result[0]["value"][1]) if result else math.nan


def _wait_scraped(prometheus: Prometheus, ended: int, timeout_s: float = 30) -> None:
    """Until `prometheus` has scraped the mesh's final state: `ended` queries finished,
    none running, and a second more."""
    deadline = time.monotonic() + timeout_s
    while True:
        finished = _scalar(prometheus, "sum(hexgen_flow_queries_finished_total)")
        running = _scalar(prometheus, "sum(hexgen_flow_queries_running)")
        if finished == ended and running == 0:
            break
        assert time.monotonic() < deadline, (prometheus.url, finished, running)
        time.sleep(0.25)
    time.sleep(1.5)


LEGEND_LABEL = r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}"
"""A label in a legend: ``{{gpu_instance}}``."""


def _legend_labels(legend: str) -> list[str]:
    return re.findall(LEGEND_LABEL, legend)


def _render(legend: str, labels: dict[str, str]) -> str:
    """A legend as Grafana writes it for a series of `labels`."""

    def value(found: re.Match[str]) -> str:
        return labels.get(found[1], "")

    return re.sub(LEGEND_LABEL, value, legend)


def _check_panel(title: str, target: dict[str, Any], series: list[dict[str, Any]]) -> None:
    """What a panel's query must give for Grafana to draw what its title says."""
    expr, legend = target["expr"], target.get("legendFormat", "")
    where = f"panel {title!r}, {expr}: {json.dumps(series)[:2000]}"
    assert series, f"no series: {where}"
    for one in series:
        exported = [name for name in one["metric"] if name.startswith("exported_")]
        assert not exported, f"a metric's label collides with a target label: {where}"
    labels = _legend_labels(legend)
    for name in labels:
        assert all(one["metric"].get(name) for one in series), f"series without {name}: {where}"
    rendered = [_render(legend, one["metric"]) for one in series]
    assert len(set(rendered)) == len(rendered), f"lines that look the same {rendered}: {where}"
    if "per GPU instance" in title:  # each target: a line for each GPU, named by it
        assert "gpu_instance" in labels, f"a per-GPU legend without the GPU: {where}"
    if "gpu_instance" in labels:
        gpus = [one["metric"]["gpu_instance"] for one in series]
        assert sorted(gpus) == sorted(INSTANCES), f"not one series per GPU: {where}"
    if "per worker" in title:
        assert "worker" in labels, f"a per-worker legend without the worker: {where}"
    if "worker" in labels:
        workers = {one["metric"]["worker"] for one in series}
        assert len(workers) == len(series) == len(GPUS), f"not one series per worker: {where}"
    values = [float(one["value"][1]) for one in series]
    assert any(math.isfinite(v) for v in values), f"nothing to draw: {where}"


def test_every_dashboard_panel_through_prometheus_with_each_shipped_scrape_config(
    secured: tuple[Up, AuthDir], tmp_path: Path
) -> None:
    up, auth = secured
    configs = {
        "compose": write_config(
            compose_config(up, auth), tmp_path / "compose.yml", scrape_interval_s=1
        ),
        "k8s": write_config(
            k8s_static_config(up, auth, GPUS), tmp_path / "k8s.yml", scrape_interval_s=1
        ),
    }
    discovery = write_config(k8s_config(auth), tmp_path / "k8s-sd.yml", scrape_interval_s=None)
    for path in (*configs.values(), discovery):
        promtool_check(path)
    dashboard = json.loads(DASHBOARD.read_text())
    with (
        running_prometheus(configs["compose"], tmp_path / "prom-compose") as compose,
        running_prometheus(configs["k8s"], tmp_path / "prom-k8s") as k8s,
    ):
        servers = {"compose": compose, "k8s": k8s}
        for name, prometheus in servers.items():
            # the coordinator, the tuner and four workers (the gateway's pod has no
            # scrape annotation: the Kubernetes config drops it)
            health = prometheus.wait_targets(6)
            assert len(health) == 6 and all(h == "up" for h, _ in health.values()), (
                name,
                health,
            )
        ended, refused = asyncio.run(_run_load(up, auth))
        assert refused >= 1 and ended >= 1, (ended, refused)
        for name, prometheus in servers.items():
            _wait_scraped(prometheus, ended)
            for panel in dashboard["panels"]:
                assert panel["targets"], panel["title"]
                for target in panel["targets"]:
                    _check_panel(
                        f"{name}: {panel['title']}", target, prometheus.query(target["expr"])
                    )
            # the load reached every GPU: each has dispatched calls
            dispatched = {
                one["metric"].get("gpu_instance"): float(one["value"][1])
                for one in prometheus.query(
                    "sum by (gpu_instance) (hexgen_flow_calls_dispatched_total)"
                )
            }
            assert set(dispatched) == INSTANCES and all(dispatched.values()), (name, dispatched)
            # the labels the issue asked for, as Prometheus stores them
            reasons = {
                one["metric"]["reason"]
                for one in prometheus.query("hexgen_flow_queries_rejected_total")
            }
            assert "infeasible" in reasons, (name, reasons)
            tenants = {
                one["metric"]["tenant"]
                for one in prometheus.query("hexgen_flow_query_latency_seconds_count")
            }
            assert tenants == set(TENANTS), (name, tenants)
            stages = {
                one["metric"]["stage"]
                for one in prometheus.query("hexgen_flow_stage_latency_seconds_count")
            }
            assert stages == set(STAGES), (name, stages)
