"""``--calibration`` on the command line, run for real as a subprocess: the default changes no
figure, every run names its calibration, and bad calibrations fail on one line (exit 2)."""

from __future__ import annotations

from pathlib import Path

import yaml

from cli_runner import one_error_line, run_cli, run_json

SMALL_RUN = ("--num-queries", "30", "--alpha", "0.5")


def _profile(path: Path, per_token_s: float, prefix_cached: bool) -> str:
    path.write_text(
        yaml.safe_dump(
            {
                "model": "llama-3.1-70b",
                "gpu": "A100",
                "tp": 4,
                "precision": "bf16",
                "prefix_cached": prefix_cached,
                "prefill": [
                    {"input_tokens": n, "ttft_s": per_token_s * n} for n in (1000, 4000, 12000)
                ],
                "decode": [
                    {"batch": 1, "context_tokens": 2000, "decode_step_s": 0.03},
                    {"batch": 16, "context_tokens": 2000, "decode_step_s": 0.04},
                ],
            }
        )
    )
    return f"measured:{path}"


def test_the_default_is_aiconfigurator_and_gives_the_same_figures() -> None:
    plain = run_json("simulate", *SMALL_RUN)
    named = run_json("simulate", *SMALL_RUN, "--calibration", "aiconfigurator")
    assert plain["calibration"] == "aiconfigurator"
    assert plain == named
    chess = run_json("simulate", *SMALL_RUN, "--calibration", "chess-measured")
    assert chess["latency_s"] != plain["latency_s"]


def test_simulate_names_its_calibration_in_the_table() -> None:
    proc = run_cli("simulate", *SMALL_RUN, "--calibration", "aiconfigurator", "--cluster", "H100")
    assert proc.returncode == 0, proc.stderr
    rows = dict(line.split(None, 1) for line in proc.stdout.splitlines() if line.strip())
    assert rows["calibration"].startswith("aiconfigurator (")
    chess = run_cli("simulate", *SMALL_RUN, "--calibration", "chess-measured")
    assert "chess-measured (A100, A6000, L40S measured with prefix-cache hits" in chess.stdout


def test_aiconfigurator_runs_a_hopper_mix_and_refuses_a_gpu_without_rows() -> None:
    doc = run_json(
        "simulate",
        *SMALL_RUN,
        "--calibration",
        "aiconfigurator",
        "--cluster",
        "H100,H200,A100,L40S",
    )
    assert doc["calibration"] == "aiconfigurator"
    assert doc["completed"] == 30
    line = one_error_line(run_cli("simulate", *SMALL_RUN, "--cluster", "A100,A100-80GB-PCIe"))
    assert (
        "calibration 'aiconfigurator' has no latency data for llama-3.1-70b on A100-80GB-PCIe"
        in line
    )
    assert line.endswith("it covers: A100, A100-40GB-SXM, A6000, H100, H200, L40S")


def test_a_measured_profile_drives_simulate(tmp_path: Path) -> None:
    name = _profile(tmp_path / "a100.yaml", 170e-6, prefix_cached=False)
    doc = run_json("simulate", *SMALL_RUN, "--calibration", name, "--cluster", "A100x2")
    assert doc["calibration"] == name
    assert doc["completed"] == 30


def test_a_sub_physical_profile_exits_2_unless_prefix_cached(tmp_path: Path) -> None:
    # 50 µs per prompt token on 4 x A100; the floor is about 113 µs.
    name = _profile(tmp_path / "fast.yaml", 50e-6, prefix_cached=False)
    line = one_error_line(
        run_cli("simulate", *SMALL_RUN, "--calibration", name, "--cluster", "A100")
    )
    assert "on A100 (A100-80GB-SXM x4, bf16)" in line
    assert "prefill of 1000 tokens: 0.05 s in the latency model, floor 0.1098 s" in line
    cached = _profile(tmp_path / "cached.yaml", 50e-6, prefix_cached=True)
    doc = run_json("simulate", *SMALL_RUN, "--calibration", cached, "--cluster", "A100")
    assert doc["completed"] == 30


def test_an_unknown_calibration_exits_2_listing_the_known_ones() -> None:
    line = one_error_line(run_cli("simulate", "--calibration", "roofline"))
    assert "unknown calibration 'roofline'" in line
    assert "known: aiconfigurator, chess-measured, measured:FILE" in line


def test_the_help_states_the_default() -> None:
    for command in ("simulate", "tune", "bench", "estimate", "demo", "up"):
        proc = run_cli(command, "--help")
        assert proc.returncode == 0, proc.stderr
        assert "--calibration" in proc.stdout and "aiconfigurator)" in " ".join(proc.stdout.split())


def test_calibrations_lists_names_sources_and_caveats() -> None:
    proc = run_cli("calibrations")
    assert proc.returncode == 0, proc.stderr
    for name in ("aiconfigurator  [default]", "chess-measured", "measured:FILE"):
        assert name in proc.stdout
    assert "source:" in proc.stdout and "prefix" in proc.stdout
    doc = run_json("calibrations")
    assert doc["default"] == "aiconfigurator"
    assert set(doc["calibrations"]) == {"chess-measured", "aiconfigurator", "measured:FILE"}
    assert doc["calibrations"]["aiconfigurator"]["covers"]["llama-3.1-70b"] == [
        "A100",
        "A100-40GB-SXM",
        "A6000",
        "H100",
        "H200",
        "L40S",
    ]


def test_estimate_and_tune_name_their_calibration() -> None:
    call = ("--input-tokens", "12000", "--output-tokens", "200")
    doc = run_json("estimate", "--gpu", "A100", *call, "--calibration", "aiconfigurator")
    assert doc["calibration"] == "aiconfigurator"
    assert doc["below_floor"] is False
    assert doc["prefill_s"] >= doc["floor_prefill_s"]
    assert doc["latency_source"].startswith("aiconfigurator: a100_sxm x4")
    a6000 = run_json("estimate", "--gpu", "A6000", *call, "--calibration", "aiconfigurator")
    assert a6000["latency_source"].startswith("aiconfigurator: A6000 derived from l40s x4")
    assert a6000["prefill_s"] >= a6000["floor_prefill_s"]
    pcie = run_json("estimate", "--gpu", "A100-80GB-PCIe", *call)
    assert pcie["prefill_s"] is None  # no data: the floors stand alone
    tune = run_json(
        "tune", "--num-queries", "20", "--calibration", "aiconfigurator", "--cluster", "H100,L40S"
    )
    assert tune["calibration"] == "aiconfigurator"


def test_bench_refuses_a_calibration_its_clusters_cannot_run(tmp_path: Path) -> None:
    name = _profile(tmp_path / "a100.yaml", 170e-6, prefix_cached=False)  # the A100 alone
    line = one_error_line(
        run_cli("bench", "--quick", "--calibration", name, "--out", str(tmp_path / "out"))
    )
    assert "A6000" in line and "a100.yaml" in line
