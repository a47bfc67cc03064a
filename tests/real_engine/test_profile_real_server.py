"""`hexgen-flow profile` against a real vLLM server (conftest's `vllm_server`: SmolLM2-135M,
max context 2048, at most 8 sequences), and the profile it writes used as a calibration by
`estimate` and `simulate` on the CPU entry of examples/cpu-2core-cluster.yaml.

A short plan (two prompt lengths, batches 1 and 4, one context, one repeat): this checks
that the command works against the real thing, not the figures, which
examples/profiles/smollm2-135m-vllm-cpu.yaml holds from a longer run. Skipped unless the
tier is configured (conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hexgen_cli.main import main
from hexgen_flow.calibration.profile_file import read_profile_file

pytestmark = pytest.mark.real_engine

ROOT = Path(__file__).resolve().parents[2]
CPU_CLUSTER = ROOT / "examples" / "cpu-2core-cluster.yaml"
CPU = "CPU-2core"


def show(capsys: pytest.CaptureFixture[str], what: str, doc: object) -> None:
    """Put the figures in the test's output (outside capsys, which the CLI's output uses)."""
    with capsys.disabled():
        print(f"\n{what}: {json.dumps(doc)}")


def test_profile_a_vllm_server_and_use_it_as_a_calibration(
    vllm_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profile.yaml"
    argv = ["profile", "--openai-url", vllm_server, "--model", "smollm2-135m"]
    argv += ["--gpu", CPU, "--out", str(out), "--input-tokens", "64,512"]
    argv += ["--batches", "1,4", "--contexts", "256", "--output-tokens", "16"]
    argv += ["--repeats", "1", "--json"]
    assert main(argv) == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out)
    show(capsys, "profile", result)
    # vLLM says its max context, and its KV cache in /metrics (VLLM_CPU_KVCACHE_SPACE GiB).
    assert result["max_context_tokens"] == 2048
    assert result["kv_capacity_tokens"] and result["kv_capacity_tokens"] > 10_000
    assert result["server"].startswith("vllm")

    doc = yaml.safe_load(out.read_text())
    assert doc["prefix_cached"] is False and doc["gpu"] == CPU
    prefill = {row["input_tokens"]: row["ttft_s"] for row in doc["prefill"]}
    short, long = sorted(prefill)
    assert abs(short - 64) < 16 and abs(long - 512) < 32, prefill  # the server's own counts
    assert prefill[long] > prefill[short] > 0
    steps = {row["batch"]: row["decode_step_s"] for row in doc["decode"]}
    assert set(steps) == {1, 4}
    # A batch of 4 costs more per step than one sequence, and less than four of them.
    assert steps[1] < steps[4] < 4 * steps[1], steps
    read_profile_file(out, str(out))

    calibration = f"measured:{out}"
    argv = ["estimate", "--calibration", calibration, "--gpus", str(CPU_CLUSTER), "--gpu", CPU]
    argv += ["--model", "smollm2-135m", "--input-tokens", "300", "--output-tokens", "20"]
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    estimate = json.loads(capsys.readouterr().out)
    show(capsys, "estimate", estimate)
    assert estimate["below_floor"] is False
    assert estimate["latency_s"] > 0

    argv = ["simulate", "--cluster", str(CPU_CLUSTER), "--calibration", calibration]
    argv += ["--num-queries", "5", "--json"]
    assert main(argv) == 0, capsys.readouterr().err
    simulated = json.loads(capsys.readouterr().out)
    show(capsys, "simulate", {k: simulated.get(k) for k in ("completed", "latency_s")})
    assert simulated["completed"] == 5


def test_a_model_the_server_does_not_serve_lists_the_served_ones(
    vllm_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["profile", "--openai-url", vllm_server, "--model", "smollm2", "--gpu", CPU]
    argv += ["--profile-model", "smollm2-135m", "--out", str(tmp_path / "p.yaml")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hexgen-flow: error: ") and err.count("\n") == 1, err
    assert "does not serve 'smollm2'; it serves: smollm2-135m" in err


def test_prompts_beyond_the_max_context_are_refused(
    vllm_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["profile", "--openai-url", vllm_server, "--model", "smollm2-135m", "--gpu", CPU]
    argv += ["--input-tokens", "4096", "--out", str(tmp_path / "p.yaml")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hexgen-flow: error: ") and err.count("\n") == 1, err
    assert "exceeds the server's max context of 2048" in err
