"""Latency models against the measured vLLM tables and the aiconfigurator estimates."""

from __future__ import annotations

import csv
import itertools
import math
from collections import defaultdict
from importlib import resources

import pytest

from hexgen_flow.errors import ConfigError, UnknownNameError
from hexgen_flow.estimate import REPRESENTATIVE_TOKENS, Estimator
from hexgen_flow.latency import known_gpus, known_models, monotone_slowdown, resolve_model
from hexgen_flow.latency import latency_model as _latency_model
from pinned_calibration import CALIBRATION, latency_model, parse_cluster

MODEL = "llama-3.1-70b"
MEASURED = ("A100", "A6000", "L40S")
ALL_GPUS = ("A100", "A6000", "L40S", "H100", "H200")
# GPU type -> its row name in the aiconfigurator table (A6000 is not there: L40S stands in).
AICONF_SYSTEM = {
    "A100": "a100_sxm",
    "L40S": "l40s",
    "H100": "h100_sxm",
    "H200": "h200_sxm",
    "A6000": "l40s",
}


def _profile_text(*parts: str) -> str:
    return resources.files("hexgen_flow").joinpath("data", "profiles", *parts).read_text()


def _single_rows(gpu: str) -> dict[tuple[int, int], list[float]]:
    """(input, output) -> measured latencies, read from the CSV without the library."""
    rows: dict[tuple[int, int], list[float]] = defaultdict(list)
    reader = csv.DictReader(_profile_text("vllm-llama3.1-70b", f"{gpu}-single.csv").splitlines())
    for row in reader:
        rows[(int(row["input_tokens"]), int(row["output_tokens"]))].append(float(row["latency_s"]))
    return rows


def _aiconf(model_name: str, stem: str) -> dict[tuple[str, int], tuple[float, float]]:
    """(system, batch) -> (TTFT s, TPOT s), from the SILICON rows of the TSV."""
    out: dict[tuple[str, int], tuple[float, float]] = {}
    text = _profile_text(f"aiconfigurator-{stem}.tsv")
    for row in csv.DictReader(text.splitlines(), delimiter="\t"):
        if row["model"] == model_name and row["mode"] == "SILICON" and row["TPOT_ms"]:
            out[(row["system"], int(row["bs"]))] = (
                float(row["TTFT_ms"]) / 1000,
                float(row["TPOT_ms"]) / 1000,
            )
    return out


LLAMA_AICONF = _aiconf("meta-llama/Meta-Llama-3.1-70B", "llama3.1-70b")


# --------------------------------------------------------------------------- measured tables


@pytest.mark.parametrize("gpu", MEASURED)
def test_single_latency_equals_every_measured_row(gpu: str) -> None:
    rows = _single_rows(gpu)
    assert len(rows) >= 480  # docs/algorithm.md §2: 484 measured pairs per GPU
    model = latency_model(MODEL, gpu)
    for (inp, out), values in rows.items():
        assert model.single_s(inp, out) == sum(values) / len(values), (gpu, inp, out)


@pytest.mark.parametrize("gpu", MEASURED)
def test_interpolation_stays_within_its_measured_neighbours(gpu: str) -> None:
    rows = {k: sum(v) / len(v) for k, v in _single_rows(gpu).items()}
    model = latency_model(MODEL, gpu)
    by_output: dict[int, list[int]] = defaultdict(list)
    for inp, out in sorted(rows):
        by_output[out].append(inp)
    checked = 0
    for out, inputs in by_output.items():
        for lo, hi in itertools.pairwise(inputs):
            mid = (lo + hi) // 2
            if mid in (lo, hi) or (mid, out) in rows:
                continue
            a, b = rows[(lo, out)], rows[(hi, out)]
            value = model.single_s(mid, out)
            assert 0.9 * min(a, b) <= value <= 1.1 * max(a, b), (gpu, lo, mid, hi, out)
            checked += 1
    assert checked > 100  # the tables have many pairs sharing an output length


@pytest.mark.parametrize("gpu", ALL_GPUS)
def test_latency_grows_with_tokens_off_the_grid(gpu: str) -> None:
    model = latency_model(MODEL, gpu)
    for inp in (1500, 4321, 9000, 15000):
        lats = [model.single_s(inp, out) for out in (10, 100, 400, 900)]
        assert all(math.isfinite(x) and x > 0 for x in lats)
        assert lats == sorted(lats), (gpu, inp, lats)
    # A longer prompt takes longer to prefill.
    prefills = [model.prefill_s(inp, 50) for inp in (500, 2000, 8000, 16000)]
    assert prefills == sorted(prefills) and prefills[-1] > prefills[0]


@pytest.mark.parametrize("gpu", ALL_GPUS)
def test_split_sums_to_the_single_latency(gpu: str) -> None:
    model = latency_model(MODEL, gpu)
    measured = list(_single_rows("A100"))[::40]
    for inp, out in [*measured, *REPRESENTATIVE_TOKENS.values(), (3333, 333), (20000, 7)]:
        prefill, decode = model.split(inp, out)
        assert prefill >= 0 and decode >= 0
        assert prefill + decode == pytest.approx(model.single_s(inp, out), rel=1e-12)
        assert model.prefill_s(inp, out) == prefill


def test_prefill_is_a_real_share_of_a_long_prompt() -> None:
    # A 11.7k-token prompt with 678 output tokens: prefill is well under the total but not 0.
    for gpu in ALL_GPUS:
        model = latency_model(MODEL, gpu)
        prefill, decode = model.split(11748, 678)
        assert 0.01 * (prefill + decode) < prefill < 0.5 * (prefill + decode), gpu


# --------------------------------------------------------------------------- batch slowdown


@pytest.mark.parametrize("gpu", ALL_GPUS)
def test_slowdown_is_one_alone_and_increases_with_batch(gpu: str) -> None:
    model = latency_model(MODEL, gpu)
    assert model.slowdown(1) == 1.0
    values = [model.slowdown(b) for b in range(1, 257)]
    assert all(b > a for a, b in itertools.pairwise(values))
    table = model.slowdown_table(64)
    assert table[0] == 1.0 and len(table) == 65
    assert all(table[b] == model.slowdown(b) for b in range(1, 65))


def test_monotone_slowdown_pools_the_points_that_fall() -> None:
    # Rising points stay; a fall is pooled with what it undercuts (their mean), batch 1 stays
    # at 1.0 and nothing is pulled below it.
    assert monotone_slowdown([1.0, 1.1, 1.3]) == [1.0, 1.1, 1.3]
    assert monotone_slowdown([1.0, 1.04, 1.02, 1.08]) == pytest.approx([1.0, 1.03, 1.03, 1.08])
    assert monotone_slowdown([1.0, 1.04, 1.01, 1.01, 1.2]) == pytest.approx(
        [1.0, 1.02, 1.02, 1.02, 1.2]
    )
    assert monotone_slowdown([1.0, 0.95, 1.1]) == [1.0, 1.0, 1.1]
    assert monotone_slowdown([1.0]) == [1.0]


@pytest.mark.parametrize("calibration", ["aiconfigurator", "chess-measured"])
@pytest.mark.parametrize("gpu", ALL_GPUS)
def test_no_calibration_has_a_batch_that_decodes_faster_than_a_smaller_one(
    calibration: str, gpu: str
) -> None:
    model = _latency_model(MODEL, gpu, calibration=calibration)
    table = model.slowdown_table(256)
    assert all(b >= a for a, b in itertools.pairwise(table))


@pytest.mark.parametrize("gpu", ALL_GPUS)
@pytest.mark.parametrize("batch", [8, 32])
def test_slowdown_matches_aiconfigurator_tpot_ratio(gpu: str, batch: int) -> None:
    system = AICONF_SYSTEM[gpu]
    expected = LLAMA_AICONF[(system, batch)][1] / LLAMA_AICONF[(system, 1)][1]
    assert latency_model(MODEL, gpu).slowdown(batch) == pytest.approx(expected, rel=1e-12)


def test_slower_card_slows_down_more_under_batching() -> None:
    # The PCIe-class 48 GiB cards lose more per token at batch 32 than the A100.
    assert latency_model(MODEL, "L40S").slowdown(32) > latency_model(MODEL, "A100").slowdown(32)


# --------------------------------------------------------------------------- GPU comparison


@pytest.mark.parametrize("fast", ["H100", "H200"])
def test_hopper_is_faster_than_a100_for_every_step(fast: str) -> None:
    a100, hopper = latency_model(MODEL, "A100"), latency_model(MODEL, fast)
    for step, (inp, out) in REPRESENTATIVE_TOKENS.items():
        assert hopper.single_s(inp, out) < a100.single_s(inp, out), step


@pytest.mark.parametrize("gpu", ["H100", "H200"])
def test_unmeasured_gpu_is_a100_scaled_by_aiconfigurator_batch1_ratios(gpu: str) -> None:
    a100, other = latency_model(MODEL, "A100"), latency_model(MODEL, gpu)
    ttft_a, tpot_a = LLAMA_AICONF[("a100_sxm", 1)]
    ttft_g, tpot_g = LLAMA_AICONF[(AICONF_SYSTEM[gpu], 1)]
    for inp, out in [(4000, 200), (11748, 678), (308, 5)]:
        pa, da = a100.split(inp, out)
        pg, dg = other.split(inp, out)
        assert pg == pytest.approx(pa * ttft_g / ttft_a, rel=1e-12)
        assert dg == pytest.approx(da * tpot_g / tpot_a, rel=1e-12)


def test_aiconfigurator_only_model_uses_its_batch1_ttft_and_tpot() -> None:
    qwen = _aiconf("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b")
    for gpu in ("A100", "H100", "H200", "L40S"):
        ttft, tpot = qwen[(AICONF_SYSTEM[gpu], 1)]
        model = latency_model("qwen3-30b-a3b", gpu)
        # At aiconfigurator's own point (4,000 in / 200 out) the model reproduces it: the
        # first token comes with the prefill, then a TPOT for each of the other 199.
        assert model.single_s(4000, 200) == pytest.approx(ttft + 199 * tpot, rel=1e-12)
        # A call of one output token is its prefill alone.
        assert model.single_s(4000, 1) == model.prefill_s(4000, 1) == pytest.approx(ttft)
        assert model.prefill_s(2000, 1) == pytest.approx(ttft / 2, rel=1e-12)


# --------------------------------------------------------------------------- KV capacity


def test_kv_capacity_is_positive_and_follows_memory() -> None:
    caps = {g: latency_model(MODEL, g).kv_capacity_tokens for g in ALL_GPUS}
    assert all(c > 0 for c in caps.values())
    assert caps["A100"] > caps["A6000"]
    assert caps["A6000"] == caps["L40S"]  # both 4 x 48 GiB
    assert caps["H100"] == caps["A100"]  # both 4 x 80 GiB
    # 4 x 80 GiB less 141 GB of bf16 weights at 320 KiB per token: hundreds of thousands.
    assert 300_000 < caps["A100"] < 800_000
    # Every instance holds at least one full-size CHESS request, with room to spare.
    assert min(caps.values()) > 10 * (11748 + 678)


def test_max_batch_is_vllms_default() -> None:
    assert latency_model(MODEL, "A100").max_batch == 256


# --------------------------------------------------------------------------- names


def test_unknown_gpu_lists_the_known_ones() -> None:
    with pytest.raises(UnknownNameError) as err:
        latency_model(MODEL, "V100")
    message = str(err.value)
    assert "V100" in message
    for gpu in ALL_GPUS:
        assert gpu in message
    assert isinstance(err.value, ConfigError)
    assert set(err.value.known) == set(known_gpus())


def test_unknown_model_lists_the_known_ones() -> None:
    with pytest.raises(UnknownNameError) as err:
        latency_model("gpt-5", "A100")
    message = str(err.value)
    assert "gpt-5" in message
    for name in known_models():
        assert name in message
    assert {"llama-3.1-70b", "qwen3-30b-a3b"} <= set(known_models())


def test_gpu_not_profiled_for_the_model_lists_the_ones_that_are() -> None:
    with pytest.raises(UnknownNameError) as err:
        latency_model("qwen3-30b-a3b", "A6000")
    assert "A6000" in str(err.value)
    assert set(err.value.known) == set(known_gpus("qwen3-30b-a3b", calibration=CALIBRATION))
    assert "A6000" not in err.value.known and "H100" in err.value.known


def test_names_resolve_case_insensitively_and_by_alias() -> None:
    assert resolve_model("meta-llama/Llama-3.1-70B-Instruct").name == MODEL
    assert resolve_model("  LLAMA-3.1-70B ").name == MODEL
    assert latency_model(MODEL, "a100").gpu == "A100"


# --------------------------------------------------------------------------- SLO_base


def test_slo_base_of_the_paper_cluster_is_58_9_seconds() -> None:
    estimator = Estimator(parse_cluster("A100,A100,A6000,L40S"))
    assert estimator.slo_base() == pytest.approx(58.9, abs=0.1)
