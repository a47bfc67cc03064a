"""``hexgen-flow get``: a finished three-stage workflow's stages with their deadlines and
its calls, read from a real `hexgen-flow up` (and an unknown id refused in one line)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cli_runner import run_cli
from hexgen_client.client import CoordinatorClient
from hexgen_flow.workload import LLMCall, Query, Workflow
from hexgen_launch.errors import ClusterError
from hexgen_launch.processes import find_redis_server
from up_runner import Up, replay, running_up

try:
    find_redis_server()
    HAVE_REDIS_SERVER = True
except ClusterError:
    HAVE_REDIS_SERVER = False

pytestmark = pytest.mark.skipif(not HAVE_REDIS_SERVER, reason="redis-server is not installed")

WORKFLOW = Workflow.chain(
    [
        (LLMCall("information_retriever", 3000, 40),),
        (LLMCall("generate_candidate", 6000, 300), LLMCall("generate_candidate", 6000, 300)),
        (LLMCall("evaluate", 900, 20),),
    ]
)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    folder: Path = tmp_path_factory.mktemp("up")
    with running_up(folder, "--time-scale", "50", "--admission", "off") as running:
        yield running


def _get(up: Up, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hexgen_cli", "get", *args, "--coordinator", up.coordinator],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_get_shows_the_stages_with_their_deadlines_and_the_calls(up: Up) -> None:
    async def run() -> None:
        async with CoordinatorClient(up.coordinator) as client:
            await client.submit(Query("three-stages", WORKFLOW))
            async for _event in client.watch("three-stages"):
                pass

    asyncio.run(run())
    done = _get(up, "three-stages", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["state"] == "SUCCEEDED" and doc["latency_s"] > 0
    stages = doc["stages"]
    assert [s["step"] for s in stages] == [
        "information_retriever",
        "generate_candidate",
        "evaluate",
    ]
    assert [s["calls_done"] for s in stages] == [1, 2, 1]
    for before, after in itertools.pairwise(stages):
        # each stage is released when the one before it finishes, with a deadline of its own
        assert after["released_s"] == pytest.approx(before["finished_s"])
        assert before["released_s"] < before["deadline_s"] <= doc["deadline_s"]
    assert stages[-1]["deadline_s"] <= doc["deadline_s"] + 1e-6
    assert {c["call_id"] for c in doc["calls"]} == {
        "three-stages/0.0", "three-stages/1.0", "three-stages/1.1", "three-stages/2.0"
    }  # fmt: skip
    assert all(c["instance"] and c["finished_s"] for c in doc["calls"])

    text = _get(up, "three-stages")
    assert text.returncode == 0, text.stderr
    assert "SUCCEEDED" in text.stdout and "deadline s" in text.stdout
    assert "generate_candidate" in text.stdout and "calls (4):" in text.stdout


def test_get_of_an_unknown_id_is_one_line_and_exit_2(up: Up) -> None:
    done = _get(up, "no-such-query")
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert "no query 'no-such-query'" in line


def test_up_serves_the_coordinators_metrics_where_its_banner_says(up: Up) -> None:
    url = up.banner["metrics"].split()[0]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    text = httpx.get(url, timeout=10).text
    assert "# TYPE hexgen_flow_queries_finished_total counter" in text
    assert 'hexgen_flow_instance_connected{gpu_instance="A100#0"} 1.0' in text
    # The tuner serves its own, on the address the same banner line gives.
    tuner = up.banner["metrics"].split("; ")[1].split()[0]
    assert tuner.startswith("http://127.0.0.1:") and tuner != url
    text = httpx.get(tuner, timeout=10).text
    assert "# TYPE hexgen_flow_tuner_runs_total counter" in text
    assert "# TYPE hexgen_flow_tuner_run_seconds histogram" in text
    # And each worker its engine's: the calls it ran (the earlier tests' queries), its load.
    workers = up.banner["metrics"].split("; ")[2].removesuffix(" (workers)").split(", ")
    assert len(workers) == 4
    finished = 0.0
    for worker in workers:
        families = text_string_to_metric_families(httpx.get(worker, timeout=10).text)
        samples = {
            (x.name, x.labels.get("outcome", "")): x.value for f in families for x in f.samples
        }
        finished += samples.get(("hexgen_flow_worker_calls_total", "finished"), 0.0)
        assert samples[("hexgen_flow_worker_kv_capacity_tokens", "")] > 0
    assert finished >= 4  # the three-stage workflow's calls at least


def test_a_replay_of_ten_queries_is_counted_in_the_metrics(tmp_path: Path) -> None:
    # A mesh of its own: its counters start at zero.
    with running_up(tmp_path, "--time-scale", "50", "--admission", "off", "--no-tuner") as fresh:
        done = replay(fresh, "--trace", "trace3", "--qps", "2", "--num-queries", "10")
        out, err = done.communicate(timeout=240)
        assert done.returncode == 0, err
        assert json.loads(out)["completed"] == 10
        url = fresh.banner["metrics"].split()[0]
        samples = [
            s for f in text_string_to_metric_families(httpx.get(url, timeout=10).text)
            for s in f.samples
        ]  # fmt: skip
    finished = [s.value for s in samples if s.name == "hexgen_flow_queries_finished_total"]
    assert sum(finished) == 10
    counts = [s.value for s in samples if s.name == "hexgen_flow_query_latency_seconds_count"]
    assert sum(counts) == 10  # by tenant


def test_top_shows_recent_attainment_and_each_instance(up: Up) -> None:
    async def run() -> None:
        async with CoordinatorClient(up.coordinator) as client:
            for n in range(2):
                async for _event in client.run(Query(f"top-{n}", WORKFLOW, slo_s=10_000)):
                    pass

    asyncio.run(run())
    argv = [sys.executable, "-m", "hexgen_cli", "top", "--coordinator", up.coordinator]
    done = subprocess.run(
        [*argv, "--count", "2", "--interval-s", "0.2"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    screens = done.stdout.split("hexgen-flow top ")
    assert len(screens) == 3, done.stdout  # two refreshes (not a terminal: one after another)
    last = screens[-1]
    assert "last 5 min" in last and "100.0 % within their SLO" in last
    assert "A100#0" in last and "L40S#3" in last and "policy       hexgen-flow" in last
    once = [*argv, "--count", "1", "--json"]
    shown = subprocess.run(once, capture_output=True, text=True, timeout=60, check=True)
    doc = json.loads(shown.stdout)
    assert doc["recent"]["succeeded"] >= 2 and doc["recent"]["attainment"] == 1.0
    assert len(doc["instances"]) == 4
    bad = subprocess.run(
        [*argv, "--interval-s", "0"], capture_output=True, text=True, timeout=60, check=False
    )
    assert bad.returncode == 2 and "interval-s" in bad.stderr


def test_top_follows_the_clock_and_names_what_each_column_reads(up: Up) -> None:
    # The mesh runs at 50x: a replay is over in a few wall seconds, so without
    # --interval-s a refresh comes every 20 cluster seconds (0.4 s), not every 2 s.
    env = {**os.environ, "HEXGEN_COORDINATOR": up.coordinator}  # the variable, not a flag
    done = subprocess.run(
        [sys.executable, "-m", "hexgen_cli", "top", "--count", "3"],
        capture_output=True, text=True, timeout=60, check=True, env=env,
    )  # fmt: skip
    screens = done.stdout.split("hexgen-flow top ")[1:]
    assert len(screens) == 3, done.stdout
    for screen in screens:
        assert "(every 0.4 s = 20 cluster s)" in screen.splitlines()[0]
        assert f"coordinator  {up.coordinator}" in screen
        # in-flight is the coordinator's count now, running and queued the worker's last
        # heartbeat: two readings, which the screen names.
        assert (
            "in-flight: calls the coordinator dispatched there and has not seen finish (now); "
            "running, queued: the worker's engine at its last heartbeat"
        ) in screen
    help_text = " ".join(run_cli("top", "--help").stdout.split())
    assert "0.4 s at time scale 50" in help_text and "$HEXGEN_COORDINATOR" in help_text
