"""``hexgen-flow estimate``, run for real as a subprocess: the JSON contract, the floors, the
table, and one-line errors with exit code 2."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from cli_runner import run_cli, run_json

FIELDS = {
    "calibration",
    "gpu",
    "model",
    "gpus_per_instance",
    "precision",
    "prefill_s",
    "decode_step_s",
    "latency_s",
    "kv_capacity_tokens",
    "floor_prefill_s",
    "floor_decode_step_s",
    "below_floor",
    "latency_source",
}
CALL = ("--input-tokens", "12000", "--output-tokens", "200")


def run_estimate(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("estimate", *args)


def estimate_json(*args: str) -> dict[str, Any]:
    doc = run_json("estimate", *args)
    assert set(doc) == FIELDS
    return doc


def test_shipped_a100_table_is_below_the_prefill_floor() -> None:
    doc = estimate_json("--gpu", "A100", *CALL, "--calibration", "chess-measured")
    assert doc["gpu"] == "A100-80GB-SXM"
    assert (doc["model"], doc["gpus_per_instance"], doc["precision"]) == (
        "llama-3.1-70b",
        4,
        "bf16",
    )
    assert doc["floor_prefill_s"] > 0 and doc["floor_decode_step_s"] > 0
    assert doc["prefill_s"] < doc["floor_prefill_s"]
    assert doc["below_floor"] is True
    assert doc["latency_s"] > doc["prefill_s"] > 0
    assert doc["kv_capacity_tokens"] == 512_810
    assert doc["latency_source"].startswith("measured: vllm-llama3.1-70b/A100")


def test_batch_and_context_set_the_decode_step() -> None:
    one = estimate_json("--gpu", "H100", *CALL)
    many = estimate_json("--gpu", "H100", *CALL, "--batch", "32", "--context", "2000")
    assert many["decode_step_s"] > one["decode_step_s"]
    assert many["floor_decode_step_s"] > one["floor_decode_step_s"]
    assert many["prefill_s"] == one["prefill_s"]


def test_an_instance_without_latency_data_shows_its_floors(tmp_path: Path) -> None:
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(
        "gpus:\n  - {name: B200, memory_gib: 180, hbm_bandwidth_tb_s: 8, "
        "dense_bf16_tflop_s: 2250, dense_fp8_tflop_s: 4500, interconnect: nvlink, "
        "interconnect_gb_s: 1800, form_factor: sxm}\n"
    )
    doc = estimate_json("--gpu", "B200", "--gpus", str(gpus), "--precision", "fp8", *CALL)
    assert (doc["gpu"], doc["gpus_per_instance"], doc["precision"]) == ("B200", 1, "fp8")
    assert doc["prefill_s"] is None and doc["below_floor"] is None
    assert doc["latency_source"] is None
    # the parameters a prompt token is multiplied through: less two untied 128,256 x 8,192 tables
    assert doc["floor_prefill_s"] == 12000 * 2 * (70.6e9 - 2 * 128_256 * 8_192) / 4500e12
    assert doc["kv_capacity_tokens"] > 0


def test_table_output() -> None:
    proc = run_estimate("--gpu", "A100-80GB-PCIe", *CALL)
    assert proc.returncode == 0, proc.stderr
    rows = dict(line.split(None, 1) for line in proc.stdout.splitlines())
    assert set(rows) >= FIELDS
    assert rows["prefill_s"] == "no latency data"
    assert rows["floor_prefill_s"].endswith(" s")


def test_a_bad_gpu_exits_2_with_one_line_naming_the_known_ones() -> None:
    proc = run_estimate("--gpu", "V100", *CALL)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1
    assert "V100" in lines[0]
    for known in ("A100", "A100-40GB-SXM", "A6000", "L40S", "H100", "H200"):
        assert known in lines[0]


def test_fp8_on_a_gpu_without_it_exits_2() -> None:
    proc = run_estimate("--gpu", "A100", "--precision", "fp8", *CALL)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "no fp8" in proc.stderr
