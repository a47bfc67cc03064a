"""`benchmarks/real_engine_hetero.py --load`: the replays' rate as a fraction of the two
servers' capacity, which the simulator finds from their profiles (the best load-aware
router's goodput), so that a run means the same load on a machine twice as fast. The
replays need vLLM (the real-engine tier); what is tested here is the capacity search on
real profiles, the rate it gives, and how a kept run is checked against it, through the
benchmark's own `--predict-from` path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.traces import load_trace, take_queries

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import real_engine_hetero as het
from real_engine_replay import predict
from real_engine_results import save_measured

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "examples" / "cpu-1core-cluster.yaml"
FAST = ROOT / "examples" / "profiles" / "smollm2-135m-vllm-cpu-1core.yaml"
WORKLOAD = ROOT / "benchmarks" / "workloads" / "smollm2-replay.jsonl"
FEW = 48
"""Workflows per simulated run of the search here (the benchmark runs 240): two rounds of
the workload, enough for a rate past capacity to show, and quick."""


def _work(tmp_path: Path, slowdown: float) -> Path:
    """A benchmark folder with the fast server's profile (the repository's) and a slow one
    `slowdown` x slower in both phases, as `_measure_all` leaves it after profiling."""
    work = tmp_path / f"x{slowdown:g}"
    work.mkdir()
    doc = yaml.safe_load(FAST.read_text())
    (work / "profile.server0.yaml").write_text(yaml.safe_dump(doc))
    for point in doc["prefill"]:
        point["ttft_s"] *= slowdown
    for point in doc["decode"]:
        point["decode_step_s"] *= slowdown
    (work / "profile.server1.yaml").write_text(yaml.safe_dump(doc))
    return work


def _setting(work: Path, n: int) -> het.Setting:
    args = het.build_parser().parse_args(["--num-queries", str(n)])
    return het.setting(args, take_queries(load_trace(str(WORKLOAD)), n), work)


def _attainment(chosen: het.Setting, router: str, qps: float) -> float:
    """The search's own run: `router` at `qps` over `FEW` workflows with their SLOs."""
    model = chosen.belief.instances[0].latency
    queries = het.with_slos(take_queries(load_trace(str(WORKLOAD)), FEW), model, 4.0)
    config = SimConfig(qps, seed=het.CAPACITY_SEED, prefix_caching=False)
    preset = resolve_policy(het.POLICIES[router].preset)
    run = Simulation(queries, chosen.belief, preset, config, truth=chosen.truth).run()
    return run.slo_attainment


def test_capacity_is_the_best_routers_goodput_and_falls_with_the_slow_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(het, "CAPACITY_WORKFLOWS", FEW)
    workload = load_trace(str(WORKLOAD))
    slow = _setting(_work(tmp_path, 2.5), 8)
    cap = het.capacity(slow, workload, 4.0)
    assert set(cap.goodput) == set(het.CAPACITY_ROUTERS)
    assert cap.qps == max(cap.goodput.values()) == cap.goodput[cap.router] > 0
    # the search's meaning: 95 % within SLO at the capacity, fewer a little past it
    assert _attainment(slow, cap.router, cap.qps) >= 0.95
    for router in het.CAPACITY_ROUTERS:
        assert _attainment(slow, router, 1.1 * cap.qps) < 0.95, router
    # the engines run each server's own profile: two fast servers serve more
    even = het.capacity(_setting(_work(tmp_path, 1.0), 8), workload, 4.0)
    assert even.qps > 1.3 * cap.qps, (even, cap)


def test_the_rate_is_qps_or_load_times_capacity() -> None:
    parser = het.build_parser()
    cap = het.Capacity(0.2, "least-requests", {"least-requests": 0.2, "llm-d-predicted": 0.15})
    assert het.arrival_rate(parser.parse_args([]), None) == het.DEFAULT_QPS
    assert het.arrival_rate(parser.parse_args(["--qps", "0.3"]), cap) == 0.3
    assert het.arrival_rate(parser.parse_args(["--load", "0.7"]), cap) == pytest.approx(0.14)
    with pytest.raises(ValueError, match="capacity"):
        het.arrival_rate(parser.parse_args(["--load", "0.7"]), None)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--load", "0"], "(0, 1]"),
        (["--load", "1.5"], "(0, 1]"),
        (["--load", "most"], "not a number"),
        (["--qps", "0.1", "--load", "0.7"], "not allowed with argument"),
    ],
)
def test_load_options_are_checked(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        het.build_parser().parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_kept_run_reports_its_load_and_is_checked_against_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder as a run at ``--load 0.7`` keeps it, its measurement stood in for by the
    simulator's run at that rate: `--predict-from` with the same load reports the load and
    the capacity; with another load it refuses, naming both rates."""
    monkeypatch.setattr(het, "CAPACITY_WORKFLOWS", FEW)
    work = _work(tmp_path, 2.5)
    chosen = _setting(work, 10)
    cap = het.capacity(chosen, load_trace(str(WORKLOAD)), 4.0)
    qps = het.arrival_rate(het.build_parser().parse_args(["--load", "0.7"]), cap)
    arrivals = {q.query_id: k / qps for k, q in enumerate(chosen.queries)}
    run = predict(
        chosen.queries, arrivals, chosen.belief, qps=qps, seed=0, policy="least-requests",
        engine=None, truth=chosen.truth,
    )  # fmt: skip
    save_measured(work / "measured-least-requests.json", 2, qps, run)

    argv = ["--predict-from", str(work), "--num-queries", "10", "--policies", "least-requests"]
    assert het.main([*argv, "--load", "0.7", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["qps"], doc["load"]) == (qps, 0.7)
    assert doc["capacity"] == {"qps": cap.qps, "router": cap.router, "goodput": cap.goodput}
    assert het.main([*argv, "--load", "0.7"]) == 0
    assert f"that is 0.7 of the servers' capacity, {cap.qps:g} q/s" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=f"measured at {qps:g} q/s, but --load 0.5"):
        het.main([*argv, "--load", "0.5"])
    # without --load the run is reported at its rate, with no capacity
    assert het.main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["qps"], doc["load"], doc["capacity"]) == (qps, None, None)
