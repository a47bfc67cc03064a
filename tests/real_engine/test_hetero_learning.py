"""Two real engines of different speed: `benchmarks/real_engine_hetero.py` at a small size.

The benchmark (docs/real-engines.md, "Two engines of different speed") starts two vLLM
servers for SmolLM2-135M, each on a CPU core of its own and the second held to 0.4 of its
core by a cgroup CPU quota, profiles both, and replays workflows through a real mesh that
plans both instances with the fast server's profile, under ``hexgen-flow`` with online
cost learning and under round-robin. This test runs 8 workflows and checks what must hold
on any machine, not how fast it is (the figures are the benchmark's to print):

- every workflow of both policies finished, and the simulator predicted both runs, with
  the servers' profiles and with what the learning mesh had learned of them;
- the slow server really is slower than the fast one (its own profile says so);
- the learning mesh learned that: its belief about the slow server moved from the fast
  server's profile toward the slow one's, so its model error shrank;
- its coordinator kept every call it learned from (``--cost-journal``), with the engines'
  first tokens, and those calls replayed give the factors it ended with; the benchmark's
  check of the learner on those calls (each predicted from the calls before it) puts it
  within 1.5x of what the engines took.

Skipped unless the tier is configured (conftest.py) and this process may make a cgroup
(root); it takes several minutes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from hexgen_flow.cluster import parse_cluster
from hexgen_flow.learning import CostLearner, read_cost_journal

if TYPE_CHECKING:  # conftest is pytest's to import, not a module of a package
    from real_engine.conftest import RealEngines

pytestmark = pytest.mark.real_engine

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = ROOT / "benchmarks" / "real_engine_hetero.py"
WORKFLOWS = 8
TIMEOUT_S = 1800.0
"""Two vLLM start-ups, their profiles and two replays on a 2-core machine, with room."""


def test_the_mesh_learns_which_real_engine_is_slow(
    real_engines: RealEngines, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if os.geteuid() != 0:
        pytest.skip("the slow server's cgroup CPU quota needs root")
    argv = [
        sys.executable, str(BENCHMARK),
        "--vllm-python", real_engines.python,
        "--model-dir", str(real_engines.model_dir),
        "--num-queries", str(WORKFLOWS),
        "--policies", "hexgen-flow+learn,round-robin",
        "--out-dir", str(tmp_path),
        "--json",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    with capsys.disabled():
        for run in doc["runs"]:
            print(
                f"\n{run['policy']}: P95 measured {run['measured_p95_s']:.1f} s, predicted "
                f"{run['predicted_p95_s']:.1f} s"
            )
        print(f"learning: {doc['learning']}")

    assert [r["policy"] for r in doc["runs"]] == ["hexgen-flow+learn", "round-robin"]
    assert doc["workflows"] == WORKFLOWS
    for run in doc["runs"]:
        assert run["measured_p95_s"] > 0 and run["predicted_p95_s"] > 0
        # predicted a second time, with the engines as the learning mesh had measured them
        assert run["learned_predicted_p95_s"] > 0
    assert doc["true_slowdown"] > 1.5  # the quota made server 1 slower
    curve = doc["learning"]["hexgen-flow+learn"]
    assert curve[0]["calls"] == 0 and curve[0]["error"] < -0.3  # it starts believing server 0
    assert len(curve) > 1, "the learner never took in a call of the slow server"
    assert abs(curve[-1]["error"]) < abs(curve[0]["error"])
    # The coordinator kept every call its learner took in (--cost-journal): the engine's
    # first tokens came with them, and replayed they give the factors it ended with.
    costs = read_cost_journal((tmp_path / "costs-hexgen-flow+learn.jsonl").read_text().splitlines())
    assert costs and any(c.first_token_s > 0 for c in costs)
    replayed = CostLearner(parse_cluster(str(tmp_path / "cluster.yaml")))
    for cost in costs:
        replayed.observe(cost)
    last = json.loads((tmp_path / "learning-hexgen-flow+learn.json").read_text())[-1]
    for learned, shown in zip(replayed.factors(), last["factors"], strict=True):
        assert [learned.prefill, learned.decode] == pytest.approx(shown, rel=1e-6)
    # The benchmark judged the learner on the calls the engines served, each predicted from
    # the calls before it: every server's calls past its first few, and on those it is off
    # by less than 1.5x either way in the median (it was within 6 % at 30 workflows).
    check = doc["journal_check"]["hexgen-flow+learn"]
    served = Counter(c.instance for c in costs if c.service_s > 0)
    assert [s["instance"] for s in check["servers"]] == [0, 1]
    for server in check["servers"]:
        assert server["calls"] == max(0, served[server["instance"]] - check["after_calls"])
        if server["calls"]:
            assert abs(server["bias"]) < math.log(1.5), server
    # And on the server that served most calls, the median error of its last 20 calls fell
    # within 20 % at some point (after 20-24 of its calls in the 30-workflow runs).
    fast = check["servers"][0]
    assert served[0] >= 20, served
    assert fast["within_after"] is not None, fast
