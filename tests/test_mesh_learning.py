"""The coordinator learns what its workers really cost (``--learn-costs``), in real processes.

The coordinator plans with ``aiconfigurator`` while its two L40S workers' simulated engines
(the documented stand-in for a GPU) run ``chess-measured``, whose L40S prefill is about 90x
faster, below the physical floor (which the learner will not cross). After a few dozen
calls each, the learned factors the coordinator exports to Prometheus have moved the right
way and agree with what the simulator learns from the same calls; a coordinator without
the option exports none.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hexgen_client.client import CoordinatorClient
from hexgen_coordinator.coordinator import LEARNED_SAVE_S
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.learning import CostLearner, read_cost_journal
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.workload import LLMCall, Query, Workflow
from hexgen_launch.processes import free_port
from process_mesh import ProcessMesh
from redis_here import needs_redis

pytestmark = needs_redis

GPUS = ("A100", "L40S")
STATUS = (sys.executable, "-m", "hexgen_cli", "status")
LEARNED_METRICS = "hexgen_flow_instance_learned"
LEARNING_GPUS = ("L40S", "L40S")
"""Two alike instances share the calls evenly, so each sees dozens."""
JOURNAL = "costs.jsonl"
"""The learning coordinator's ``--cost-journal``, in the mesh's folder."""


class _Mesh(ProcessMesh):
    """The coordinator plans with aiconfigurator, the workers' engines run chess-measured."""

    def __init__(
        self,
        folder: Path,
        *,
        learn: bool,
        gpus: tuple[str, ...] = GPUS,
        journal: Path | None = None,
    ) -> None:
        port = free_port()
        self.metrics = f"http://127.0.0.1:{port}/metrics"
        self.journal = journal or folder / JOURNAL
        coordinator_args = [
            "--calibration", "aiconfigurator", "--admission", "off",
            "--metrics-listen", f"127.0.0.1:{port}",
            *(["--learn-costs", "--cost-journal", str(self.journal)] if learn else []),
        ]  # fmt: skip
        super().__init__(
            folder,
            coordinator_args,
            time_scale=200.0,
            cluster=",".join(gpus),
            worker_calibration="chess-measured",
        )

    def kill_and_restart_coordinator(self) -> None:
        self.kill_coordinator()
        self.start_coordinator()


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url, timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _queries(n: int) -> list[Query]:
    rng = random.Random(5)
    out = []
    for q in range(n):
        stages = [
            tuple(
                LLMCall("generate_candidate", rng.randint(1000, 12000), rng.randint(20, 400))
                for _ in range(rng.randint(1, 2))
            )
            for _ in range(3)
        ]
        out.append(Query(f"learn-{q}", Workflow.chain(stages)))
    return out


def _run(mesh: _Mesh, queries: list[Query]) -> None:
    async def run() -> None:
        async with CoordinatorClient(mesh.address) as client:
            for query in queries:
                await client.submit(query)
            for query in queries:
                async for _event in client.watch(query.query_id):
                    pass

    asyncio.run(run())


@pytest.fixture
def learning_mesh(tmp_path: Path) -> Iterator[_Mesh]:
    mesh = _Mesh(tmp_path, learn=True, gpus=LEARNING_GPUS)
    yield mesh
    mesh.stop()


@pytest.fixture
def plain_mesh(tmp_path: Path) -> Iterator[_Mesh]:
    mesh = _Mesh(tmp_path, learn=False)
    yield mesh
    mesh.stop()


def test_the_coordinator_learns_what_its_workers_cost(learning_mesh: _Mesh) -> None:
    queries = _queries(24)
    _run(learning_mesh, queries)
    m = _scrape(learning_mesh.metrics)

    def factor(instance: str, part: str) -> float:
        key = (("gpu_instance", instance), ("part", part))
        return m[("hexgen_flow_instance_learned_cost_factor", key)]

    instances = ("L40S#0", "L40S#1")
    for instance in instances:
        assert m[("hexgen_flow_instance_learned_calls", (("gpu_instance", instance),))] >= 30
    planner = parse_cluster(",".join(LEARNING_GPUS), calibration="aiconfigurator")
    floor = CostLearner(planner).instances[0].floor_prefill
    # The engines' L40S prefill is ~90x faster than planned, below the physical floor: the
    # learner goes most of the way down, and never below the floor.
    for instance in instances:
        assert floor <= factor(instance, "prefill") < 0.5
    # `hexgen-flow status` shows the same, beside each instance.
    shown = subprocess.run(
        [*STATUS, "--coordinator", learning_mesh.address],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "learned cost" in shown
    doc = json.loads(
        subprocess.run(
            [*STATUS, "--json", "--coordinator", learning_mesh.address],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    )
    for row in doc["instances"]:
        assert row["learned_prefill_factor"] == factor(row["name"], "prefill")
        assert row["learned_decode_factor"] == factor(row["name"], "decode")
        assert f"prefill x{row['learned_prefill_factor']:.2f}" in shown
    # The cost journal holds exactly what the learner took in: replayed through a fresh
    # learner, it gives the very factors the coordinator exports.
    costs = read_cost_journal(learning_mesh.journal.read_text().splitlines())
    replayed = CostLearner(planner)
    for cost in costs:
        replayed.observe(cost)
    for instance, learned in zip(instances, replayed.factors(), strict=True):
        calls = m[("hexgen_flow_instance_learned_calls", (("gpu_instance", instance),))]
        assert learned.calls == calls
        assert (learned.prefill, learned.decode) == (
            factor(instance, "prefill"),
            factor(instance, "decode"),
        )
    # One implementation in both drivers: the simulator, given the same calls, the same
    # beliefs and engines, learns factors close to the coordinator's (arrivals and the
    # wall clock's jitter differ a little).
    truth = parse_cluster(",".join(LEARNING_GPUS), calibration="chess-measured")
    config = SimConfig(qps=100.0, learn_costs=True)
    sim = Simulation(queries, planner, PRESETS["hexgen-flow"], config, truth=truth)
    sim.run()
    assert sim.scheduler.learner is not None
    for instance, learned in zip(instances, sim.scheduler.learner.factors(), strict=True):
        assert factor(instance, "prefill") == pytest.approx(learned.prefill, rel=0.3)
        assert factor(instance, "decode") == pytest.approx(learned.decode, rel=0.3)


def test_a_cost_journal_that_cannot_be_written_costs_no_call(tmp_path: Path) -> None:
    """A full disk (/dev/full) under the journal: the coordinator gives the journal up with
    a warning and every query still finishes, learning as before."""
    mesh = _Mesh(tmp_path, learn=True, gpus=LEARNING_GPUS, journal=Path("/dev/full"))
    try:
        _run(mesh, _queries(4))
        m = _scrape(mesh.metrics)
        for instance in ("L40S#0", "L40S#1"):
            assert m[("hexgen_flow_instance_learned_calls", (("gpu_instance", instance),))] > 0
        assert "cost journal given up" in mesh.log("coordinator")
    finally:
        mesh.stop()


def test_a_coordinator_killed_carries_on_from_what_it_learned(learning_mesh: _Mesh) -> None:
    _run(learning_mesh, _queries(8))
    time.sleep(LEARNED_SAVE_S + 1.5)  # the learner's state is written every LEARNED_SAVE_S
    before = _scrape(learning_mesh.metrics)
    learned = {key: v for key, v in before.items() if key[0].startswith(LEARNED_METRICS)}
    assert learned and all(v > 0 for v in learned.values())
    learning_mesh.kill_and_restart_coordinator()  # SIGKILL: no goodbye write
    deadline = time.monotonic() + 30
    after: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    while not all(key in after for key in learned):
        assert time.monotonic() < deadline, "the coordinator did not come back learning"
        time.sleep(0.1)
        with contextlib.suppress(httpx.HTTPError):
            after = _scrape(learning_mesh.metrics)
    assert {key: after[key] for key in learned} == learned


def test_without_the_option_nothing_is_learned(plain_mesh: _Mesh) -> None:
    _run(plain_mesh, _queries(2))
    m = _scrape(plain_mesh.metrics)
    shown = subprocess.run(
        [*STATUS, "--coordinator", plain_mesh.address],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "learned cost" not in shown and "L40S#1" in shown
    assert not any(name.startswith("hexgen_flow_instance_learned") for name, _ in m)
    assert m[("hexgen_flow_instance_connected", (("gpu_instance", "L40S#1"),))] == 1
