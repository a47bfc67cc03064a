"""The coordinator's Prometheus metrics, scraped from a real coordinator process with a real
worker: queries that succeed and one that fails are counted by outcome, calls by instance,
latency and overhead land in histograms, and the present load is reported per instance."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from hexgen_client.client import CoordinatorClient
from hexgen_flow.cluster import DEFAULT_MODEL
from hexgen_flow.workload import LLMCall, Query, Workflow
from hexgen_launch.cluster_config import worker_argv
from hexgen_launch.processes import free_port
from redis_here import REDIS_URL, needs_redis

pytestmark = needs_redis


class _Mesh:
    def __init__(self, folder: Path) -> None:
        self.prefix = f"hf-metrics-{uuid.uuid4().hex[:8]}:"
        self.address = f"127.0.0.1:{free_port()}"
        self.metrics = f"http://127.0.0.1:{free_port()}/metrics"
        port = self.metrics.split(":")[2].split("/")[0]
        log = (folder / "coordinator.log").open("w")
        argv = [
            sys.executable, "-m", "hexgen_coordinator", "--listen", self.address,
            "--redis-url", REDIS_URL, "--redis-prefix", self.prefix, "--cluster", "A100",
            "--time-scale", "50", "--admission", "off", "--max-call-attempts", "2",
            "--metrics-listen", f"127.0.0.1:{port}",
        ]  # fmt: skip
        self.procs = [subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)]
        # A worker that declares a small KV cache: a 5,000-token call fails on every attempt.
        self.worker_metrics = f"http://127.0.0.1:{free_port()}/metrics"
        worker_port = self.worker_metrics.split(":")[2].split("/")[0]
        argv = worker_argv(
            sys.executable, self.address, 0, "A100", DEFAULT_MODEL,
            extra=("--kv-cache-tokens", "2000", "--metrics-listen", f"127.0.0.1:{worker_port}"),
        )  # fmt: skip
        self.procs.append(
            subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=30)
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=self.prefix + "*"))
        if keys:
            client.delete(*keys)
        client.close()


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[_Mesh]:
    m = _Mesh(tmp_path)
    yield m
    m.stop()


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url, timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_queries_calls_latency_and_report_the_present(mesh: _Mesh) -> None:
    async def run() -> None:
        async with CoordinatorClient(mesh.address) as client:
            status = await client.wait_ready(timeout_s=30)
            deadline = time.monotonic() + 30
            while not status.instances[0].connected:
                assert time.monotonic() < deadline, "the worker did not connect"
                await asyncio.sleep(0.05)
                status = await client.status()
            chain = [(LLMCall("evaluate", 300, 8),), (LLMCall("revise", 400, 8),)]
            for n in range(3):
                await client.submit(Query(f"ok-{n}", Workflow.chain(chain), tenant="acme"))
            await client.submit(Query("doomed", Workflow.chain([(LLMCall("revise", 5000, 8),)])))
            for query_id in ("ok-0", "ok-1", "ok-2", "doomed"):
                async for _event in client.watch(query_id):
                    pass

    asyncio.run(run())
    m = _scrape(mesh.metrics)
    finished = "hexgen_flow_queries_finished_total"
    assert m[(finished, (("outcome", "succeeded"), ("tenant", "acme")))] == 3
    assert m[(finished, (("outcome", "failed"), ("tenant", "default")))] == 1
    # by tenant: the doomed query (tenant "default") failed, so only acme's are timed;
    # default's series is there from its admission, at 0 (Prometheus's rate() sees it start)
    assert m[("hexgen_flow_query_latency_seconds_count", (("tenant", "acme"),))] == 3
    assert m[("hexgen_flow_query_latency_seconds_sum", (("tenant", "acme"),))] > 0
    assert m[("hexgen_flow_query_latency_seconds_count", (("tenant", "default"),))] == 0
    assert m[(finished, (("outcome", "cancelled"), ("tenant", "acme")))] == 0
    # by stage (step type): each of the three chains finished its evaluate and revise stage
    stage = "hexgen_flow_stage_latency_seconds_count"
    assert m[(stage, (("stage", "evaluate"),))] == 3
    assert m[(stage, (("stage", "revise"),))] == 3
    assert m[("hexgen_flow_slo_met_total", (("tenant", "acme"),))] == 3
    # 6 calls of the three queries, and the doomed call twice (its attempt limit)
    # The instance is gpu_instance: `instance` is Prometheus's target label.
    assert m[("hexgen_flow_calls_dispatched_total", (("gpu_instance", "A100#0"),))] == 8
    assert m[("hexgen_flow_calls_failed_total", (("gpu_instance", "A100#0"),))] == 2
    assert not any(dict(labels).keys() & {"instance", "job"} for _, labels in m)
    assert m[("hexgen_flow_completion_to_dispatch_seconds_count", ())] == 3  # stage 1 releases
    assert m[("hexgen_flow_submit_to_dispatch_seconds_count", ())] == 4
    assert m[("hexgen_flow_queries_running", ())] == 0
    assert m[("hexgen_flow_alpha", ())] == pytest.approx(0.5)
    assert m[("hexgen_flow_instance_connected", (("gpu_instance", "A100#0"),))] == 1
    assert m[("hexgen_flow_instance_kv_capacity_tokens", (("gpu_instance", "A100#0"),))] > 0
    assert m[("hexgen_flow_instance_in_flight_calls", (("gpu_instance", "A100#0"),))] == 0


DASHBOARD = Path(__file__).resolve().parents[1] / "deploy/grafana/dashboards/hexgen-flow.json"


def test_every_dashboard_panel_queries_metrics_the_coordinator_serves(mesh: _Mesh) -> None:
    import json
    import re

    async def ready() -> None:
        async with CoordinatorClient(mesh.address) as client:
            await client.wait_ready(timeout_s=30)

    asyncio.run(ready())
    served: set[str] = set()
    for url in (mesh.metrics, mesh.worker_metrics):  # the coordinator's and a worker's
        for family in text_string_to_metric_families(_get_when_up(url)):
            # A family's samples: counters end in _total, histograms in _bucket/_count/_sum.
            suffixes = ("_total", "_bucket", "_count", "_sum")
            served |= {family.name, *(f"{family.name}{s}" for s in suffixes)}
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"], "the dashboard has no panels"
    for panel in dashboard["panels"]:
        exprs = [t["expr"] for t in panel["targets"]]
        assert exprs, panel["title"]
        for expr in exprs:
            names = set(re.findall(r"\bhexgen_flow_[a-z_]+\b", expr))
            assert names, (panel["title"], expr)
            assert names <= served, (panel["title"], sorted(names - served))


def _get_when_up(url: str, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return httpx.get(url, timeout=5).text
        except httpx.TransportError:
            assert time.monotonic() < deadline, f"nothing serves {url}"
            time.sleep(0.1)
