"""Shifting load: the phase schedule, the simulator's tick hook, the online tuner inside a
simulation (the same `retune` as the mesh's tuner), and the shifting-load bench on small
scenarios."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from hexgen_flow.bench.shifting import HighLoad, ShiftScenario, run_high_load, run_scenario
from hexgen_flow.bench.shifting_report import plot_shifting, render_markdown
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.metrics import json_safe
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.sim.arrivals import renewal_times
from hexgen_flow.sim.schedule import Phase, PhaseSchedule
from hexgen_flow.sim.simulator import SimConfig, Simulation, simulate
from hexgen_flow.traces import load_trace
from hexgen_flow.tuning import OnlineSettings, OnlineTuner, TuningWindow, retune, run_online

CLUSTER = parse_cluster("A100,A100,A6000,L40S")
FLOW = PRESETS["hexgen-flow"]
MIX = ("trace1", "trace2", "trace3")


# ------------------------------------------------------------------------------- schedule


def test_renewal_times_keep_their_rate_and_bounds() -> None:
    rng = random.Random(3)
    times = renewal_times(100.0, 0.5, 1.0, rng, until_s=4100.0)
    assert all(100.0 < t < 4100.0 for t in times)
    assert times == sorted(times)
    # Poisson: 2,000 expected, standard deviation about 45.
    assert abs(len(times) - 2000) < 200
    bursty = renewal_times(0.0, 0.5, 3.0, random.Random(3), count=2000)
    assert len(bursty) == 2000
    gaps = [b - a for a, b in zip([0.0, *bursty], bursty, strict=False)]
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert mean == pytest.approx(2.0, rel=0.25)
    assert cv == pytest.approx(3.0, rel=0.25)
    with pytest.raises(ConfigError, match="either"):
        renewal_times(0.0, 1.0, 1.0, rng)


def test_schedule_is_deterministic_and_each_phase_has_its_rate_and_traces() -> None:
    schedule = PhaseSchedule(
        (
            Phase(0.05, ("trace1",), duration_s=4000.0),
            Phase(0.5, MIX, duration_s=2000.0),
            Phase(0.2, ("financial",), num_queries=30),
        )
    )
    run = schedule.build(seed=7)
    assert run == schedule.build(seed=7)
    assert run != schedule.build(seed=8)
    first, second, third = (run.phase_queries(k) for k in range(3))
    assert run.bounds_s[:2] == ((0.0, 4000.0), (4000.0, 6000.0))
    assert run.bounds_s[2][0] == 6000.0 and run.bounds_s[2][1] == third[-1].arrival_s
    # Counts near rate x duration (Poisson: 200 +- 14, 1,000 +- 32), exactly 30 for the last.
    assert abs(len(first) - 200) < 60 and abs(len(second) - 1000) < 130 and len(third) == 30
    for k, queries in enumerate((first, second, third)):
        lo, hi = run.bounds_s[k]
        assert all(q.arrival_s is not None and lo < q.arrival_s <= hi for q in queries)
    arrivals = [q.arrival_s or 0.0 for q in run.queries]
    assert arrivals == sorted(arrivals)
    assert len({q.query_id for q in run.queries}) == len(run.queries)
    # trace1 continues where the first phase left it; the mix takes the traces in turn.
    trace1 = load_trace("trace1")
    assert [q.query_id for q in first[:2]] == ["trace1-0", "trace1-1"]
    n = len(first)  # > 90: the second phase's first query is in trace1's third round
    assert second[0].query_id == f"{trace1[n % len(trace1)].query_id}#{n // len(trace1)}"
    assert [q.query_id.split("-")[0] for q in second[:3]] == ["trace1", "trace2", "trace3"]
    assert all(q.query_id.startswith("financial-") for q in third)
    assert run.mean_qps == pytest.approx(len(run.queries) / run.bounds_s[-1][1])


def test_a_phase_needs_one_length_and_a_rate() -> None:
    with pytest.raises(ConfigError, match="either"):
        Phase(0.1, MIX)
    with pytest.raises(ConfigError, match="either"):
        Phase(0.1, MIX, duration_s=10.0, num_queries=5)
    with pytest.raises(ConfigError, match="qps"):
        Phase(0.0, MIX, duration_s=10.0)
    with pytest.raises(ConfigError, match="trace"):
        Phase(0.1, (), duration_s=10.0)
    with pytest.raises(ConfigError, match="no arrivals"):
        PhaseSchedule((Phase(1e-6, MIX, duration_s=1.0),)).build()


# ----------------------------------------------------------------------------- the hook


def test_the_hook_runs_every_period_before_later_events_and_costs_nothing_unused() -> None:
    run = PhaseSchedule((Phase(0.2, MIX, num_queries=25),)).build(seed=1)
    config = SimConfig(qps=0.2)
    plain = simulate(run.queries, CLUSTER, FLOW.with_alpha(0.5), config)
    seen: list[tuple[float, int]] = []
    sim = Simulation(run.queries, CLUSTER, FLOW.with_alpha(0.5), config)
    sim.every(30.0, lambda t, s: seen.append((t, len(s.finished))))
    hooked = sim.run()
    assert hooked.outcomes == plain.outcomes  # a hook that changes nothing changes nothing
    assert [t for t, _ in seen] == [30.0 * (k + 1) for k in range(len(seen))]
    last = max(o.finished_s for o in plain.outcomes)
    assert seen[-1][0] <= last < seen[-1][0] + 30.0  # ticks stop with the run
    # At each tick exactly the queries finished before it are visible.
    for t, finished in seen:
        assert finished == sum(o.finished_s < t for o in plain.outcomes)
    with pytest.raises(ConfigError, match="period"):
        sim.every(0.0, lambda t, s: None)


# ------------------------------------------------------------------------ online tuning

HIGH = PhaseSchedule((Phase(0.15, MIX, num_queries=120),))
SETTINGS = OnlineSettings(period_s=100.0, window=30, min_queries=10)


def test_online_tuner_moves_alpha_off_a_bad_start_under_high_load() -> None:
    run = HIGH.build(seed=1)
    # Without prefix caching, where α = 1 is the worst α at this load; with it, every α
    # meets the SLO here and there is nothing to move off.
    config = SimConfig(qps=0.15, prefix_caching=False)
    sim = Simulation(run.queries, CLUSTER, FLOW.with_alpha(1.0), config)
    tuner = OnlineTuner(SETTINGS)
    tuner.attach(sim)
    online = sim.run()
    steps = tuner.steps
    assert [s.time_s for s in steps] == [100.0 * (k + 1) for k in range(len(steps))]
    # Each run replays the queries admitted before it, finished or not.
    assert steps[0].window == sum((q.arrival_s or 0.0) < 100.0 for q in run.queries)
    assert any(s.changed for s in steps)
    assert sim.scheduler.alpha == steps[-1].alpha
    # α = 1 (every call to its fastest instance) is the worst α at this load
    # (docs/online-tuning.md): leaving it must show in P95 and attainment.
    static = simulate(run.queries, CLUSTER, FLOW.with_alpha(1.0), config)
    assert online.p95_s < static.p95_s
    assert online.slo_attainment > static.slo_attainment
    again, again_steps = run_online(run.queries, CLUSTER, FLOW.with_alpha(1.0), config, SETTINGS)
    assert again.outcomes == online.outcomes and list(again_steps) == steps


def test_every_online_step_is_the_cores_retune_of_the_window_the_mesh_would_read() -> None:
    run = HIGH.build(seed=3)
    config = SimConfig(qps=0.15)
    metrics, steps = run_online(run.queries, CLUSTER, FLOW.with_alpha(0.0), config, SETTINGS)
    by_id = {q.query_id: q for q in run.queries}
    arriving = sorted(metrics.outcomes, key=lambda o: o.arrival_s)
    current = 0.0
    for step in steps:
        # The window is the latest admitted queries, finished or not (the coordinator's
        # `admitted` stream): some of each window are still running at its tick.
        recent = [o for o in arriving if o.arrival_s < step.time_s][-SETTINGS.window :]
        assert any(o.finished_s > step.time_s for o in recent)
        window = TuningWindow.of((by_id[o.query_id], o.arrival_s, o.slo_s) for o in recent)
        again = retune(
            window,
            CLUSTER,
            FLOW,
            current,
            min_queries=SETTINGS.min_queries,
            tolerance=SETTINGS.tolerance,
        )
        assert (again.decision.alpha, again.decision.change) == (step.alpha, step.changed)
        assert again.decision.reason == step.reason
        current = step.alpha
    assert sum(s.changed for s in steps) >= 1


def test_a_run_with_too_few_admitted_queries_changes_nothing() -> None:
    run = HIGH.build(seed=1)
    sim = Simulation(run.queries, CLUSTER, FLOW.with_alpha(1.0), SimConfig(qps=0.15))
    tuner = OnlineTuner(OnlineSettings(period_s=20.0, window=30, min_queries=10))
    tuner.attach(sim)
    sim.run()
    first = tuner.steps[0]
    assert sum((q.arrival_s or 0.0) < 20.0 for q in run.queries) < 10
    assert (first.window, first.changed, first.alpha) == (0, False, 1.0)
    assert "too few queries in the window" in first.reason


def test_the_online_tuner_needs_an_alpha() -> None:
    run = HIGH.build(seed=0)
    sim = Simulation(run.queries, CLUSTER, PRESETS["vllm"], SimConfig(qps=0.15))
    with pytest.raises(ConfigError, match="alpha"):
        OnlineTuner().attach(sim)
    with pytest.raises(ConfigError, match="min-queries"):
        OnlineSettings(window=10, min_queries=20)
    with pytest.raises(ConfigError, match="tolerance"):
        OnlineSettings(tolerance=1.0)


# ------------------------------------------------------------------------------- bench

SMALL = ShiftScenario(
    "small",
    "small: low -> high",
    "A100,A100,A6000,L40S",
    (
        Phase(0.04, MIX, duration_s=400.0, label="low"),
        Phase(0.15, MIX, duration_s=300.0, label="high"),
    ),
    OnlineSettings(period_s=150.0, window=30, min_queries=8),
)


def test_a_small_scenario_reports_every_variant(tmp_path: Path) -> None:
    sc = run_scenario(SMALL, draws=2, prefix_caching=False)  # two draws that differ (below)
    for key in ("static", "online", "best_fixed"):
        rec = sc[key]
        assert rec["p95_s"] > 0 and 0 <= rec["slo_attainment"] <= 1
        assert len(rec["phases"]) == 2
    fixed = sc["fixed"]
    assert [r["alpha"] for r in fixed] == [i / 10 for i in range(11)]
    assert sc["best_fixed"]["p95_s"] == min(r["p95_s"] for r in fixed)
    draws = sc["draws"]
    assert [d["seed"] for d in draws] == [1, 2]
    # The two samples of the low phase tune to different α here, so the static runs and the
    # online runs started from them differ, and each online run keeps its own trajectory.
    assert draws[0]["alpha"] != draws[1]["alpha"]
    for d in draws:
        assert d["static"]["alpha"] == d["online"]["alpha"] == d["alpha"]
        on_grid = [r for r in fixed if r["alpha"] == d["alpha"]]
        assert not on_grid or on_grid[0]["p95_s"] == d["static"]["p95_s"]
        assert [t["time_s"] for t in d["trajectory"]][:4] == [150.0, 300.0, 450.0, 600.0]
        assert d["alpha_changes"] == sum(t["changed"] for t in d["trajectory"])
        assert sum(p["num_queries"] for p in sc["phases"]) == d["online"]["completed"]
        for a in d["alpha_by_phase"]:
            assert a["min"] <= a["mean"] <= a["max"]
    for key in ("static", "online"):  # the means over the draws, whole run and per phase
        assert sc[key]["p95_s"] == pytest.approx(sum(d[key]["p95_s"] for d in draws) / 2)
        assert sc[key]["phases"][1]["slo_attainment"] == pytest.approx(
            sum(d[key]["phases"][1]["slo_attainment"] for d in draws) / 2
        )
    checks = sc["checks"]
    assert checks["online_p95_over_best"] == sc["online"]["p95_s"] / sc["best_fixed"]["p95_s"]
    assert checks["online_p95_below_static"] == (sc["online"]["p95_s"] < sc["static"]["p95_s"])
    assert checks["worst_online_p95_over_best"] == pytest.approx(
        max(d["online"]["p95_s"] for d in draws) / sc["best_fixed"]["p95_s"]
    )

    hl = run_high_load(
        HighLoad(cluster="H100x2,A100x2", qps=1.0, num_queries=40, tune_grid=(0.0, 0.5, 1.0))
    )
    assert set(hl["results"]) == {"hexgen-flow", "vllm", "llf", "least-requests", "llm-d", "dynamo"}
    assert hl["results"]["vllm"]["speedup_vs_vllm"] == 1.0
    assert hl["results"]["hexgen-flow"]["alpha"] in {0.0, 0.25, 0.5, 0.75, 1.0}
    assert hl["instances"] == 4 and hl["gpus"] == 4

    doc = json_safe({"quick": True, "goal": "g", "wall_s": 1.0, "scenarios": [sc], "high_load": hl})
    json.dumps(doc, allow_nan=False)
    text = render_markdown(doc)
    assert "## Shifting load and online tuning" in text and "best fixed in hindsight" in text
    assert "Each sample: the static α, and the online tuner started from it" in text
    assert f"{sc['online']['p95_s']:.1f} s" in text
    assert plot_shifting(doc, tmp_path) == ("shifting_load.png",)
    assert (tmp_path / "shifting_load.png").stat().st_size > 10_000
