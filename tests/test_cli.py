"""The ``hexgen-flow`` command line, run for real as a subprocess: output contract,
determinism, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_runner import interruptible, run_cli, run_json
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.policies.registration import BUDGETS, DISPATCHERS, QUEUES

CONTRACT_FIELDS = {
    "policy",
    "alpha",
    "qps",
    "num_queries",
    "completed",
    "slo_s",
    "slo_attainment",
    "throughput_qps",
    "makespan_s",
    "latency_s",
    "queries",
    "seed",
    "cluster",
    "traces",
    "slo_scale",
}


# ------------------------------------------------------------------------------- simulate


def test_bare_simulate_json_has_every_contract_field() -> None:
    doc = run_json("simulate")
    assert set(doc) >= CONTRACT_FIELDS
    assert doc["policy"] == "hexgen-flow"
    assert doc["qps"] == 0.5
    assert doc["seed"] == 0
    assert doc["slo_scale"] == 3.0
    assert doc["traces"] == ["trace1"]
    assert doc["cluster"] == ["A100", "A100", "A6000", "L40S"]
    assert doc["num_queries"] == 90  # trace1, each query once
    assert doc["completed"] == doc["num_queries"]
    assert len(doc["queries"]) == doc["num_queries"]
    assert 0.0 <= doc["slo_attainment"] <= 1.0
    lat = doc["latency_s"]
    assert set(lat) == {"mean", "p50", "p95", "p99"}
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"]
    assert doc["slo_s"] > 0 and doc["makespan_s"] > 0 and doc["throughput_qps"] > 0
    latencies = [q["latency_s"] for q in doc["queries"]]
    assert all(x > 0 for x in latencies)
    assert max(latencies) == pytest.approx(lat["p99"], rel=0.5)
    # auto-tuned alpha: in range, and the curve is reported.
    assert 0.0 <= doc["alpha"] <= 1.0
    curve = doc["alpha_curve"]
    assert len(curve) >= 11
    assert {tuple(sorted(p)) for p in curve} == {("alpha", "p95_s", "slo_attainment")}
    assert doc["alpha"] in [p["alpha"] for p in curve]


def test_simulate_reports_speed_on_stderr_and_in_summary() -> None:
    proc = run_cli("simulate", "--policy", "vllm", "--num-queries", "20")
    assert proc.returncode == 0, proc.stderr
    assert "p95" in proc.stdout and "SLO attainment" in proc.stdout
    assert re.search(r"simulator speed .*calls/s", proc.stdout)
    proc = run_cli("simulate", "--policy", "vllm", "--num-queries", "20", "--json")
    assert re.search(r"simulator speed: .*calls/s", proc.stderr)
    # Whether the hot modules ran compiled: under `make test-compiled`, the installed wheel's.
    how = r"\d+ modules compiled" if os.environ.get("HEXGEN_EXPECT_COMPILED") else "as Python"
    assert re.search(rf"calls/s, {how}\)", proc.stderr), proc.stderr


def test_same_seed_gives_identical_json() -> None:
    args = ("simulate", "--num-queries", "30", "--seed", "7", "--qps", "0.8")
    assert run_json(*args) == run_json(*args)
    first = run_cli(*args, "--json").stdout
    assert first == run_cli(*args, "--json").stdout  # byte for byte, auto-tuning included


def test_different_seed_gives_different_arrivals() -> None:
    common = ("simulate", "--policy", "vllm", "--num-queries", "30")
    a = run_json(*common, "--seed", "1")
    b = run_json(*common, "--seed", "2")
    assert a["seed"] == 1 and b["seed"] == 2
    arrivals_a = [q["arrival_s"] for q in a["queries"]]
    arrivals_b = [q["arrival_s"] for q in b["queries"]]
    assert sorted(arrivals_a) != sorted(arrivals_b)


def test_num_queries_cycles_through_the_trace() -> None:
    doc = run_json("simulate", "--policy", "vllm", "--trace", "formula1", "--num-queries", "70")
    assert doc["num_queries"] == doc["completed"] == 70
    ids = {q["query_id"] for q in doc["queries"]}
    assert len(ids) == 70  # formula1 has 29 queries: rounds 0, 1 and 2
    assert {"formula1-0", "formula1-0#1", "formula1-0#2", "formula1-11#2"} <= ids
    assert "formula1-12#2" not in ids


def test_several_traces_are_concatenated() -> None:
    doc = run_json("simulate", "--policy", "vllm", "--trace", "formula1", "--trace", "trace1")
    assert doc["traces"] == ["formula1", "trace1"]
    assert doc["num_queries"] == 29 + 90


def test_explicit_alpha_is_echoed_and_not_tuned() -> None:
    doc = run_json("simulate", "--num-queries", "20", "--alpha", "0.3")
    assert doc["alpha"] == 0.3
    assert "alpha_curve" not in doc


def test_policy_without_alpha_reports_null() -> None:
    proc = run_cli("simulate", "--policy", "llf", "--num-queries", "20", "--alpha", "0.7", "--json")
    assert proc.returncode == 0
    doc = json.loads(proc.stdout)
    assert doc["policy"] == "llf"
    assert doc["alpha"] is None
    assert "alpha_curve" not in doc
    assert "ignored" in proc.stderr


def test_policy_combination_and_cluster_options() -> None:
    doc = run_json(
        "simulate",
        "--policy",
        "least-work+urgency+dag",
        "--cluster",
        "A100x2,L40S",
        "--num-queries",
        "20",
        "--slo-scale",
        "2",
        "--arrival-cv",
        "2",
    )
    assert doc["policy"] == "least-work+urgency+dag"
    assert doc["cluster"] == ["A100", "A100", "L40S"]
    assert doc["slo_scale"] == 2.0


def test_jsonl_trace_and_yaml_cluster(tmp_path: Path) -> None:
    examples = Path(__file__).resolve().parents[1] / "examples" / "workflows.jsonl"
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("instances:\n  - gpu: A100\n    count: 2\n  - gpu: L40S\n")
    doc = run_json(
        "simulate", "--trace", str(examples), "--cluster", str(cluster), "--policy", "vllm"
    )
    assert doc["cluster"] == ["A100", "A100", "L40S"]
    assert doc["completed"] == doc["num_queries"] >= 1


# ----------------------------------------------------------------------------------- errors


def _bad_files(tmp_path: Path) -> dict[str, str]:
    good = {"stages": [{"step": "revise", "calls": [{"input_tokens": 10, "output_tokens": 2}]}]}
    bad_json = tmp_path / "bad_json.jsonl"
    bad_json.write_text(json.dumps(good) + "\n{not json\n")
    no_stages = tmp_path / "no_stages.jsonl"
    no_stages.write_text(json.dumps({"query_id": "q1"}) + "\n")
    no_tokens = tmp_path / "no_tokens.json"
    no_tokens.write_text(
        json.dumps([{"Text2SQLRequest": [{"step": "revise", "input_length": 100}]}])
    )
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("instances: [gpu: A100\n  - : :\n")
    return {
        "bad_json": str(bad_json),
        "no_stages": str(no_stages),
        "no_tokens": str(no_tokens),
        "bad_yaml": str(bad_yaml),
        "missing": str(tmp_path / "missing.jsonl"),
    }


ERROR_CASES: list[tuple[list[str], str]] = [
    (["simulate", "--trace", "{missing}"], "missing.jsonl does not exist"),
    (["simulate", "--trace", "{bad_json}"], "bad_json.jsonl:2: not valid JSON"),
    (["simulate", "--trace", "{no_stages}"], "no_stages.jsonl:1: field 'stages'"),
    (["simulate", "--trace", "{no_tokens}"], "'output_length'"),
    (["simulate", "--policy", "nope"], "unknown policy 'nope'"),
    (["simulate", "--policy", "round-robin+nope"], "unknown queue policy 'nope'"),
    (["simulate", "--cluster", "A100,H900"], "unknown GPU type 'H900'"),
    (["simulate", "--cluster", "A100,,L40S"], "--cluster"),
    (["simulate", "--cluster", "{bad_yaml}"], "not valid YAML"),
    (["simulate", "--cluster", "nowhere.yaml"], "does not exist"),
    (["simulate", "--model", "gpt-9"], "unknown model 'gpt-9'"),
    (["simulate", "--qps", "0"], "--qps"),
    (["simulate", "--qps", "-1"], "--qps"),
    (["simulate", "--qps", "fast"], "--qps"),
    (["simulate", "--alpha", "1.5"], "--alpha"),
    (["simulate", "--alpha", "high"], "--alpha"),
    (["simulate", "--alpha", "nan"], "--alpha"),
    (["simulate", "--num-queries", "0"], "--num-queries"),
    (["simulate", "--slo-scale", "0"], "--slo-scale"),
    (["simulate", "--arrival-cv", "0"], "--arrival-cv"),
    (["simulate", "--seed", "x"], "--seed"),
    (["simulate", "--bogus"], "unrecognized arguments"),
    (["frobnicate"], "invalid choice"),
    ([], "choose a command"),
    (["tune", "--policy", "vllm"], "has no alpha"),
    (["tune", "--window", "0"], "--window"),
]


@pytest.mark.parametrize(
    ("args", "expected"), ERROR_CASES, ids=[" ".join(a) or "no-command" for a, _ in ERROR_CASES]
)
def test_bad_input_exits_2_with_one_line(tmp_path: Path, args: list[str], expected: str) -> None:
    files = _bad_files(tmp_path)
    proc = run_cli(*(a.format(**files) for a in args))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hexgen-flow: error: ")
    assert expected in lines[0]


def test_unknown_names_list_the_known_ones() -> None:
    proc = run_cli("simulate", "--policy", "nope")
    assert all(name in proc.stderr for name in PRESETS)
    proc = run_cli("simulate", "--cluster", "H900")
    assert "A100" in proc.stderr and "L40S" in proc.stderr


# ------------------------------------------------------------------------------------- tune


def test_tune_prints_curve_and_best_alpha() -> None:
    proc = run_cli("tune", "--num-queries", "40", "--window", "30")
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(
        r"^\s*([01](?:\.\d+)?)\s+(\d+\.\d)\s+(\d+\.\d)\s+(\d+\.\d)%(.*)$", proc.stdout, re.MULTILINE
    )
    assert len(rows) >= 11
    marked = [r for r in rows if "best" in r[4]]
    assert len(marked) == 1
    best = re.search(r"^best alpha: (\S+)", proc.stdout, re.MULTILINE)
    assert best is not None
    assert float(best.group(1)) == float(marked[0][0])
    assert float(marked[0][1]) == min(float(r[1]) for r in rows)


def test_tune_json() -> None:
    doc = run_json("tune", "--num-queries", "40", "--window", "30", "--policy", "hexgen-flow-paper")
    assert doc["policy"] == "hexgen-flow-paper"
    assert doc["window"] == 30
    alphas = [p["alpha"] for p in doc["curve"]]
    assert alphas == sorted(alphas) and len(alphas) >= 11
    assert {0.0, 0.5, 1.0} <= set(alphas)
    assert doc["best_alpha"] in alphas
    assert doc["best"]["p95_s"] == pytest.approx(min(p["p95_s"] for p in doc["curve"]))
    assert all(0 <= p["slo_attainment"] <= 1 and math.isfinite(p["mean_s"]) for p in doc["curve"])


# --------------------------------------------------------------------------------- policies


def test_policies_lists_every_preset_and_registered_policy() -> None:
    proc = run_cli("policies")
    assert proc.returncode == 0
    for preset in PRESETS.values():
        assert preset.name in proc.stdout
        assert preset.description in proc.stdout
    for registry in (DISPATCHERS, QUEUES, BUDGETS):
        for name in registry.names():
            assert name in proc.stdout
    assert "alpha=0.5" in proc.stdout  # a parameter with its default


def test_policies_json() -> None:
    doc = run_json("policies")
    assert list(doc["presets"]) == list(PRESETS)
    assert set(doc["dispatch"]) == set(DISPATCHERS.names())
    assert set(doc["queue"]) == set(QUEUES.names())
    assert set(doc["budget"]) == set(BUDGETS.names())
    assert doc["presets"]["hexgen-flow"]["has_alpha"] is True
    assert doc["presets"]["vllm"]["has_alpha"] is False


# ---------------------------------------------------------------------------------- Ctrl-C


@pytest.mark.skipif(os.name != "posix", reason="sends SIGINT")
def test_ctrl_c_exits_130_quietly(tmp_path: Path) -> None:
    # The full benchmark runs for minutes: it is certainly still running when interrupted,
    # inside the worker pool.
    proc = subprocess.Popen(
        interruptible([sys.executable, "-m", "hexgen_cli", "bench", "--out", str(tmp_path)]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(2.0)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 130
    assert "Traceback" not in stderr
    assert "KeyboardInterrupt" not in stderr
