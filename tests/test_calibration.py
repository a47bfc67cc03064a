"""Calibrations: the default, aiconfigurator, sits above the floors, derives the GPUs it does
not model from a stand-in and refuses those without one; a measured profile file loads,
drives the simulator and is refused below a floor unless marked as prefix-cached."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from hexgen_flow.calibration import (
    CALIBRATIONS,
    DEFAULT_CALIBRATION,
    CalibrationCoverageError,
    calibration_names,
    resolve_calibration,
)
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError, UnknownNameError
from hexgen_flow.latency import has_latency_data, known_gpus, latency_model
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.profiles import aiconfigurator_rows
from hexgen_flow.roofline import (
    compare_with_floors,
    decode_step_floor_s,
    decode_step_s,
    prefill_floor_s,
)
from hexgen_flow.sim.simulator import SimConfig, simulate
from hexgen_flow.traces import load_trace
from hexgen_launch.cluster import LocalCluster, LocalClusterConfig, coordinator_argv, tuner_argv

MODEL = "llama-3.1-70b"
HOPPER_MIX = "H100,H200,A100,L40S"


def _latencies(cluster_text: str, calibration: str | None, num_queries: int = 20) -> list[float]:
    queries = load_trace("trace1")[:num_queries]
    cluster = parse_cluster(cluster_text, calibration=calibration)
    metrics = simulate(queries, cluster, PRESETS["hexgen-flow"].with_alpha(0.5), SimConfig(qps=0.5))
    return [o.latency_s for o in metrics.outcomes]


# --------------------------------------------------------------------------- the registry


def test_the_default_is_aiconfigurator_and_above_every_floor() -> None:
    assert DEFAULT_CALIBRATION == "aiconfigurator"
    assert resolve_calibration(None) is resolve_calibration("aiconfigurator")
    assert parse_cluster("A100,A6000").calibration.name == "aiconfigurator"
    default = _latencies("A100,A100,A6000,L40S", None)
    assert default == _latencies("A100,A100,A6000,L40S", "aiconfigurator")
    assert default != _latencies("A100,A100,A6000,L40S", "chess-measured")
    # Every GPU the default covers sits at or above both floors at 1,000-12,000 tokens.
    covered = known_gpus(MODEL)
    assert {"A100", "A6000", "H100", "H200", "L40S"} <= set(covered)
    for gpu in covered:
        model = latency_model(MODEL, gpu)
        assert not any(c.below for c in compare_with_floors(model)), gpu


def test_every_calibration_names_its_source_and_caveats() -> None:
    assert calibration_names() == ["aiconfigurator", "chess-measured", "measured:FILE"]
    for calibration in CALIBRATIONS.values():
        assert calibration.source and calibration.caveats


def test_an_unknown_calibration_lists_the_known_ones() -> None:
    with pytest.raises(UnknownNameError) as err:
        resolve_calibration("roofline")
    message = str(err.value)
    assert "'roofline'" in message and "\n" not in message
    for name in ("aiconfigurator", "chess-measured", "measured:FILE"):
        assert name in message


# --------------------------------------------------------------------------- aiconfigurator


def test_aiconfigurator_runs_a_hopper_mix_above_the_floors() -> None:
    cluster = parse_cluster(HOPPER_MIX, calibration="aiconfigurator")
    assert cluster.calibration.name == "aiconfigurator"
    for inst in cluster.instances:
        assert inst.latency.source.description.startswith("aiconfigurator:")
        assert not inst.latency.source.prefix_cached
        assert not any(c.below for c in compare_with_floors(inst.latency))
    a100 = latency_model(MODEL, "A100", calibration="aiconfigurator")
    assert a100.prefill_s(12_000, 200) >= prefill_floor_s(a100.hardware, 12_000)
    # The dense sweep's a100_sxm tp 4 row at 12,288 tokens; between rows the curve is
    # piecewise linear (tests/test_calibration_aiconfigurator.py checks every row).
    assert a100.prefill_s(12_288, 200) == pytest.approx(2.1327384, rel=1e-9)
    assert len(_latencies(HOPPER_MIX, "aiconfigurator")) == 20


def test_aiconfigurator_decode_and_slowdown_are_its_steps() -> None:
    h200 = latency_model(MODEL, "H200", calibration="aiconfigurator")
    assert h200.hardware.tensor_parallel == 2
    # Batch-1 steps of the sweep's h200_sxm tp 2 rows: 21.34 ms at 2,048 tokens of context,
    # 21.84 at 16,384; the batch slowdown at 2,048 tokens: 23.87 ms at batch 32.
    assert h200.split(2048, 200)[1] == pytest.approx(200 * 0.0213412, rel=0.01)
    assert h200.split(16384, 200)[1] == pytest.approx(200 * 0.0218416, rel=0.01)
    assert h200.slowdown(32) == pytest.approx(23.8672 / 21.3412, rel=1e-9)


def test_aiconfigurator_derives_the_a6000_from_the_l40s_by_the_roofline_difference() -> None:
    a6000 = latency_model(MODEL, "A6000", calibration="aiconfigurator")
    l40s = latency_model(MODEL, "L40S", calibration="aiconfigurator")
    assert "A6000 derived from l40s" in a6000.source.description
    assert a6000.kv_capacity_tokens == l40s.kv_capacity_tokens  # both 48 GiB x 4
    for tokens in (1024, 4096, 16384):  # rows of the sweep: the curves pass through them
        extra = prefill_floor_s(a6000.hardware, tokens) - prefill_floor_s(l40s.hardware, tokens)
        assert extra > 0  # the A6000's tensor cores are slower
        assert a6000.prefill_s(tokens, 1) == pytest.approx(l40s.prefill_s(tokens, 1) + extra)
    # A decode step reads the same bytes over slower memory: longer, by the floor difference.
    for context in (2048, 16384):
        mine = decode_step_s(a6000, context, 200, 1)
        theirs = decode_step_s(l40s, context, 200, 1)
        floors = decode_step_floor_s(a6000.hardware, 1, context) - decode_step_floor_s(
            l40s.hardware, 1, context
        )
        assert mine - theirs == pytest.approx(floors, rel=0.05)
    assert not any(c.below for c in compare_with_floors(a6000))


def test_the_40gb_a100_is_derived_with_its_own_memory() -> None:
    small = latency_model(MODEL, "A100-40GB-SXM", calibration="aiconfigurator")
    big = latency_model(MODEL, "A100", calibration="aiconfigurator")
    assert small.prefill_s(4096, 1) == pytest.approx(big.prefill_s(4096, 1))  # same chip
    assert decode_step_s(small, 4096, 200, 1) > decode_step_s(big, 4096, 200, 1)
    assert small.kv_capacity_tokens < big.kv_capacity_tokens / 10


def test_aiconfigurator_refuses_a_gpu_without_rows_or_stand_in() -> None:
    with pytest.raises(CalibrationCoverageError) as err:
        latency_model(MODEL, "A100-80GB-PCIe", calibration="aiconfigurator")
    message = str(err.value)
    assert "\n" not in message
    assert "'aiconfigurator'" in message and "A100-80GB-PCIe" in message
    assert "does not model" in message and "no stand-in" in message
    assert message.endswith("it covers: A100, A100-40GB-SXM, A6000, H100, H200, L40S")
    assert isinstance(err.value, ConfigError)
    with pytest.raises(CalibrationCoverageError):
        parse_cluster("A100,A100-80GB-PCIe")


def test_qwen_under_chess_measured_keeps_the_4000_token_sample() -> None:
    # chess-measured still reads the small aiconfigurator-*.tsv sample (its published
    # figures must not move); the aiconfigurator calibration reads the dense sweep, which
    # agrees with the sample at 4,000 tokens to within a few per cent.
    for gpu in known_gpus("qwen3-30b-a3b", calibration="chess-measured"):
        ours = latency_model("qwen3-30b-a3b", gpu, calibration="chess-measured")
        system = ours.hardware.gpu.aiconfigurator_system or ""
        ttft, tpot = aiconfigurator_rows("qwen3-30b-a3b")[(system, 1)]
        assert ours.split(4000, 200) == pytest.approx((ttft, 199 * tpot), rel=1e-12)
        theirs = latency_model("qwen3-30b-a3b", gpu, calibration="aiconfigurator")
        assert theirs.prefill_s(4000, 200) == pytest.approx(ttft, rel=0.05)


# --------------------------------------------------------------------------- measured:FILE


def _profile(
    ttft_per_token_s: float, prefix_cached: bool | None, gpu: str = "A100"
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "model": MODEL,
        "gpu": gpu,
        "tp": 4,
        "precision": "bf16",
        "source": "test numbers",
        "prefill": [
            {"input_tokens": n, "ttft_s": 0.02 + ttft_per_token_s * n} for n in (1000, 4000, 12000)
        ],
        "decode": [
            {"batch": 1, "context_tokens": 1000, "decode_step_s": 0.028},
            {"batch": 1, "context_tokens": 12000, "decode_step_s": 0.032},
            {"batch": 8, "context_tokens": 1000, "decode_step_s": 0.031},
            {"batch": 32, "context_tokens": 1000, "tpot_s": 0.040},
        ],
    }
    if prefix_cached is not None:
        doc["prefix_cached"] = prefix_cached
    return doc


def _write(path: Path, doc: object) -> str:
    path.write_text(yaml.safe_dump(doc))
    return f"measured:{path}"


def test_a_measured_profile_loads_and_drives_the_simulator(tmp_path: Path) -> None:
    name = _write(tmp_path / "a100.yaml", _profile(170e-6, prefix_cached=False))
    lat = latency_model(MODEL, "A100", calibration=name)
    assert lat.source.description == "measured: a100.yaml (test numbers)"
    assert lat.prefill_s(4000, 200) == pytest.approx(0.02 + 170e-6 * 4000, rel=1e-9)
    # A decode step grows with the prompt: 28 ms at 1,000 tokens, 32 ms at 12,000; a call of
    # 100 output tokens takes 99 of them (the prefill's step samples the first), and a call
    # of one output token its time to first token alone.
    assert lat.split(1000, 100)[1] == pytest.approx(99 * 0.028, rel=1e-9)
    assert lat.split(12000, 100)[1] == pytest.approx(99 * 0.032, rel=1e-9)
    assert lat.single_s(1000, 1) == lat.prefill_s(1000, 1) == pytest.approx(0.02 + 0.17)
    assert lat.slowdown(8) == pytest.approx(0.031 / 0.028, rel=1e-9)
    assert has_latency_data(lat.hardware, name)
    assert known_gpus(MODEL, name) == ["A100"]
    assert len(_latencies("A100,A100", name)) == 20
    with pytest.raises(CalibrationCoverageError, match="it covers: A100"):
        parse_cluster("A100,L40S", calibration=name)


def test_a_sub_physical_profile_is_refused_unless_prefix_cached(tmp_path: Path) -> None:
    # 50 µs per prompt token on 4 x A100: the floor is about 113 µs.
    name = _write(tmp_path / "fast.yaml", _profile(50e-6, prefix_cached=False))
    with pytest.raises(ConfigError) as err:
        parse_cluster("A100", calibration=name)
    message = str(err.value)
    assert "\n" not in message
    assert "A100" in message and "prefill of 1000 tokens" in message
    floor = prefill_floor_s(latency_model(MODEL, "A100").hardware, 1000)
    assert f"{0.02 + 50e-6 * 1000:.4g} s in the latency model" in message
    assert f"floor {floor:.4g} s" in message
    cached = _write(tmp_path / "cached.yaml", _profile(50e-6, prefix_cached=True))
    lat = parse_cluster("A100", calibration=cached).instances[0].latency
    assert lat.source.prefix_cached
    assert any(c.below for c in compare_with_floors(lat))


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"prefix_cached": None}, "prefix_cached must be true or false"),
        ({"decode": [{"batch": 1, "context_tokens": 1000, "decode_step_s": 0.03}]}, "batch 1"),
        ({"tp": 0}, "tp must be an integer >= 1"),
        ({"precision": "int4"}, "precision must be one of bf16, fp8"),
        ({"prefill": []}, "prefill must be a non-empty list"),
        ({"gpus": 4}, "unknown field 'gpus'"),
    ],
)
def test_a_bad_profile_fails_on_one_line(
    tmp_path: Path, change: dict[str, Any], expected: str
) -> None:
    doc = {**_profile(170e-6, prefix_cached=False), **change}
    doc = {k: v for k, v in doc.items() if v is not None}
    with pytest.raises(ConfigError, match=expected) as err:
        resolve_calibration(_write(tmp_path / "bad.yaml", doc))
    assert "\n" not in str(err.value)


def test_a_missing_profile_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        resolve_calibration(f"measured:{tmp_path / 'nope.yaml'}")


def test_one_file_may_profile_several_gpus(tmp_path: Path) -> None:
    l40s = _profile(600e-6, prefix_cached=False, gpu="L40S")
    l40s["decode"] = [{**row, "decode_step_s": 0.06} for row in l40s["decode"]]
    for row in l40s["decode"]:
        row.pop("tpot_s", None)
    doc = {"profiles": [_profile(170e-6, prefix_cached=False), l40s]}
    name = _write(tmp_path / "two.yaml", doc)
    cluster = parse_cluster("A100,L40S", calibration=name)
    assert [i.latency.hardware.gpu.name for i in cluster.instances] == ["A100-80GB-SXM", "L40S"]
    twice = {"profiles": [_profile(170e-6, False), _profile(170e-6, False, gpu="A100-80GB-SXM")]}
    with pytest.raises(ConfigError, match=r"two profiles of llama-3\.1-70b"):
        resolve_calibration(_write(tmp_path / "twice.yaml", twice))


# --------------------------------------------------------------------------- cluster files


def test_a_cluster_file_names_its_calibration_and_the_flag_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("calibration: aiconfigurator\ninstances:\n  - gpu: H100\n  - gpu: L40S\n")
    assert parse_cluster(str(path)).calibration.name == "aiconfigurator"
    assert parse_cluster(str(path), calibration="chess-measured").calibration.name == (
        "chess-measured"
    )
    # A profile named in the file is found beside it, wherever the run starts.
    (tmp_path / "prof.yaml").write_text(yaml.safe_dump(_profile(170e-6, prefix_cached=False)))
    path.write_text("calibration: measured:prof.yaml\ninstances:\n  - gpu: A100\n")
    assert (
        parse_cluster(str(path))
        .instances[0]
        .latency.source.description.startswith("measured: prof.yaml")
    )


# --------------------------------------------------------------------------- the mesh


def test_a_local_mesh_hands_its_calibration_to_every_service(tmp_path: Path) -> None:
    def argv(calibration: str | None) -> tuple[list[str], list[str], list[str]]:
        mesh = LocalCluster(
            LocalClusterConfig(cluster="H100,L40S", calibration=calibration, redis_url="redis://x")
        )
        arg = mesh.calibration.argument
        return (
            coordinator_argv(mesh.config, "127.0.0.1:1", "redis://x", arg),
            tuner_argv(mesh.config, "127.0.0.1:2", "127.0.0.1:1", "redis://x", arg),
            mesh._worker_argv(1),
        )

    for line in argv("chess-measured"):
        assert line[line.index("--calibration") + 1] == "chess-measured"
    for line in argv(None):
        assert "--calibration" not in line
    profile = tmp_path / "a100.yaml"
    profile.write_text(yaml.safe_dump(_profile(170e-6, prefix_cached=False)))
    mesh = LocalCluster(
        LocalClusterConfig(cluster="A100", calibration=f"measured:{profile}", redis_url="x")
    )
    worker = mesh._worker_argv(0)
    # The services may start elsewhere: the profile goes by its absolute path.
    assert worker[worker.index("--calibration") + 1] == f"measured:{profile.resolve()}"
