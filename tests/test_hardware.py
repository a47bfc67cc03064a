"""The GPU and model catalogues, user GPUs in cluster files, and instances' tp and precision."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError, UnknownNameError
from hexgen_flow.hardware import (
    InstanceHardware,
    default_tensor_parallel,
    gpu_catalogue,
    model_catalogue,
    read_gpu_file,
    resolve_model,
)
from hexgen_flow.latency import known_gpus, latency_model

MODEL = "llama-3.1-70b"
B200 = """
  - name: B200
    memory_gib: 180
    hbm_bandwidth_tb_s: 8
    dense_bf16_tflop_s: 2250
    dense_fp8_tflop_s: 4500
    interconnect: nvlink
    interconnect_gb_s: 1800
    form_factor: sxm
"""


def _cluster_file(tmp_path: Path, gpus: str, instances: str = "  - gpu: A100\n") -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"gpus:\n{gpus}\ninstances:\n{instances}")
    return str(path)


# --------------------------------------------------------------------------- the catalogues


def test_gpu_catalogue_loads_every_shipped_part() -> None:
    names = {gpu.name for gpu in gpu_catalogue().gpus}
    assert names == {
        "A100-40GB-SXM",
        "A100-80GB-SXM",
        "A100-40GB-PCIe",
        "A100-80GB-PCIe",
        "A6000",
        "L40S",
        "H100-SXM",
        "H200",
    }
    for gpu in gpu_catalogue().gpus:
        assert gpu.memory_gib > 0 and gpu.hbm_bandwidth_tb_s > 0 and gpu.dense_bf16_tflop_s > 0
        assert gpu.interconnect in ("nvlink", "pcie") and gpu.form_factor in ("sxm", "pcie")


def test_the_four_a100s_are_distinct_parts() -> None:
    catalogue = gpu_catalogue()
    parts = {
        name: catalogue.resolve(name)
        for name in ("A100-40GB-SXM", "A100-80GB-SXM", "A100-40GB-PCIe", "A100-80GB-PCIe")
    }
    assert {n: g.hbm_bandwidth_tb_s for n, g in parts.items()} == {
        "A100-40GB-SXM": 1.555,
        "A100-80GB-SXM": 2.039,
        "A100-40GB-PCIe": 1.555,
        "A100-80GB-PCIe": 1.935,
    }
    assert {g.dense_bf16_tflop_s for g in parts.values()} == {312}
    assert {g.dense_fp8_tflop_s for g in parts.values()} == {None}
    assert parts["A100-40GB-SXM"].memory_gib == 40 and parts["A100-80GB-PCIe"].memory_gib == 80
    assert parts["A100-40GB-PCIe"].interconnect == "pcie"
    assert len(set(parts.values())) == 4


@pytest.mark.parametrize(
    ("alias", "name", "spelling"),
    [
        ("A100", "A100-80GB-SXM", "A100"),
        (" a100 ", "A100-80GB-SXM", "A100"),
        ("H100", "H100-SXM", "H100"),
        ("h100-sxm", "H100-SXM", "H100-SXM"),
        ("L40S", "L40S", "L40S"),
    ],
)
def test_aliases_resolve(alias: str, name: str, spelling: str) -> None:
    gpu, spelled = gpu_catalogue().lookup(alias)
    assert (gpu.name, spelled) == (name, spelling)


def test_plain_names_keep_the_figures_the_code_always_used() -> None:
    # memory (GiB, as the KV formula reads it) and aiconfigurator rows of the plain names
    expected = {
        "A100": (80, "a100_sxm"),
        "A6000": (48, None),
        "L40S": (48, "l40s"),
        "H100": (80, "h100_sxm"),
        "H200": (141, "h200_sxm"),
    }
    for name, (memory, system) in expected.items():
        gpu = gpu_catalogue().resolve(name)
        assert (gpu.memory_gib, gpu.aiconfigurator_system) == (memory, system)


def test_unknown_gpu_lists_names_and_aliases() -> None:
    with pytest.raises(UnknownNameError) as err:
        gpu_catalogue().resolve("V100")
    assert {"A100", "A100-80GB-SXM", "H100", "H100-SXM"} <= set(err.value.known)


def test_model_catalogue() -> None:
    assert {m.name for m in model_catalogue()} == {
        "llama-3.1-70b",
        "qwen3-30b-a3b",
        "llama-3.1-8b",
        "smollm2-135m",
    }
    llama = resolve_model(MODEL)
    assert llama.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert llama.weight_bytes("bf16") == 70.6e9 * 2
    assert llama.weight_bytes("fp8") == 70.6e9
    qwen = resolve_model("Qwen/Qwen3-30B-A3B")
    assert qwen.active_parameters < qwen.parameters
    assert resolve_model("HuggingFaceTB/SmolLM2-135M").kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    # What a prompt token is multiplied through: less the input embedding (a lookup) and the
    # output head (the last prompt token only); one matrix when they are tied.
    assert not llama.tied_embeddings and llama.embedding_parameters == 128_256 * 8_192
    assert llama.prompt_token_parameters == 70.6e9 - 2 * 128_256 * 8_192
    assert llama.decode_read_bytes("bf16") == (70.6e9 - 128_256 * 8_192) * 2
    smollm = resolve_model("smollm2-135m")
    assert smollm.tied_embeddings
    assert smollm.prompt_token_parameters == 134_515_008 - 49_152 * 576
    assert smollm.decode_read_bytes("bf16") == 134_515_008 * 2  # the head reads it all
    assert qwen.prompt_token_parameters == 3.3e9 - 2 * 151_936 * 2_048


# --------------------------------------------------------------------------- instances


def test_instance_kv_capacity_is_the_latency_models() -> None:
    for gpu in known_gpus(MODEL):
        lat = latency_model(MODEL, gpu)
        assert lat.hardware.kv_capacity_tokens == lat.kv_capacity_tokens > 0
    assert latency_model(MODEL, "A100").kv_capacity_tokens == 512_810


def test_precision_fp8_needs_fp8_tensor_cores_and_frees_kv_memory() -> None:
    llama = resolve_model(MODEL)
    catalogue = gpu_catalogue()
    with pytest.raises(ConfigError, match="no fp8"):
        InstanceHardware(llama, catalogue.resolve("A100"), 4, "fp8")
    bf16 = InstanceHardware(llama, catalogue.resolve("L40S"), 4, "bf16")
    fp8 = InstanceHardware(llama, catalogue.resolve("L40S"), 4, "fp8")
    assert fp8.weight_bytes * 2 == bf16.weight_bytes
    assert fp8.kv_capacity_tokens > bf16.kv_capacity_tokens


def test_default_tp_is_the_profiled_one_else_the_least_that_fits() -> None:
    catalogue = gpu_catalogue()
    llama = resolve_model(MODEL)
    assert default_tensor_parallel(llama, catalogue.resolve("H200"), "bf16") == 2
    # 2 x 40 GiB cannot hold 141 GB of weights; 4 x 40 GiB leaves about 41k KV tokens.
    a100_40 = catalogue.resolve("A100-40GB-SXM")
    assert default_tensor_parallel(llama, a100_40, "bf16") == 4
    assert InstanceHardware(llama, a100_40, 4, "bf16").kv_capacity_tokens == 40_950
    assert default_tensor_parallel(resolve_model("llama-3.1-8b"), a100_40, "bf16") == 1


# --------------------------------------------------------------------------- latency data


def test_catalogue_name_and_alias_share_the_latency_data() -> None:
    plain, full = latency_model(MODEL, "A100"), latency_model(MODEL, "A100-80GB-SXM")
    assert (plain.gpu, full.gpu) == ("A100", "A100-80GB-SXM")
    assert plain.single_s(4000, 200) == full.single_s(4000, 200)
    assert plain.hardware == full.hardware


def test_a_catalogued_gpu_without_latency_data_lists_the_ones_with() -> None:
    with pytest.raises(UnknownNameError) as err:
        latency_model(MODEL, "A100-80GB-PCIe")
    assert set(err.value.known) == set(known_gpus(MODEL))


def test_a_model_without_latency_data_lists_the_ones_with() -> None:
    with pytest.raises(UnknownNameError) as err:
        latency_model("llama-3.1-8b", "A100", calibration="chess-measured")
    assert set(err.value.known) == {"llama-3.1-70b", "qwen3-30b-a3b"}


# --------------------------------------------------------------------------- cluster files


def test_cluster_file_tp_and_precision_at_the_profiled_values(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("instances:\n  - gpu: A100\n    tp: 4\n    precision: bf16\n  - gpu: H200\n")
    cluster = parse_cluster(str(path))
    assert cluster.instances[0].latency is latency_model(MODEL, "A100")
    assert cluster.instances[1].latency.hardware.tensor_parallel == 2


@pytest.mark.parametrize(
    ("instance", "message"),
    [
        ("gpu: A100\n    tp: 2", "no latency data for llama-3.1-70b on A100 at tp 2"),
        ("gpu: L40S\n    precision: fp8", "no latency data .* fp8"),
        ("gpu: A100\n    precision: fp8", "A100-80GB-SXM has no fp8"),
        ("gpu: A100\n    precision: int4", "precision must be one of bf16, fp8"),
        ("gpu: A100\n    tp: four", "tp must be an integer"),
    ],
)
def test_cluster_file_tp_and_precision_without_data(
    tmp_path: Path, instance: str, message: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"instances:\n  - {instance}\n")
    with pytest.raises(ConfigError, match=message):
        parse_cluster(str(path))


def test_cluster_file_adds_a_gpu(tmp_path: Path) -> None:
    path = _cluster_file(tmp_path, B200)
    assert parse_cluster(path).gpus == ("A100",)  # the added GPU does not disturb the rest
    b200 = read_gpu_file(Path(path)).resolve("b200")
    assert (b200.memory_gib, b200.dense_fp8_tflop_s, b200.aiconfigurator_system) == (
        180,
        4500,
        None,
    )
    # An added GPU has no latency data yet: the simulator refuses it by name.
    with pytest.raises(UnknownNameError, match=re.escape("llama-3.1-70b on B200 (NVIDIA")):
        parse_cluster(_cluster_file(tmp_path, B200, "  - gpu: B200\n"))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (("hbm_bandwidth_tb_s: 8", "hbm_bandwidth_tb_s: fast"), "hbm_bandwidth_tb_s"),
        (("memory_gib: 180", "memory_gib: -1"), "memory_gib"),
        (("interconnect: nvlink", "interconnect: infiniband"), "interconnect"),
        (("form_factor: sxm", "form_factor_x: sxm"), "form_factor_x"),
        (("    dense_bf16_tflop_s: 2250\n", ""), "field dense_bf16_tflop_s is required"),
        (("name: B200", "name: A100"), "'A100' is already GPU A100-80GB-SXM"),
    ],
)
def test_a_bad_gpu_entry_names_the_field(
    tmp_path: Path, change: tuple[str, str], field: str
) -> None:
    path = _cluster_file(tmp_path, B200.replace(*change))
    with pytest.raises(ConfigError) as err:
        parse_cluster(path)
    message = str(err.value)
    assert field in message and "gpus[0]" in message and "\n" not in message
