"""Physical floors, computed by hand, and the check of latency models against them."""

from __future__ import annotations

import pytest

from hexgen_flow.errors import ConfigError
from hexgen_flow.hardware import InstanceHardware, Precision, gpu_catalogue, resolve_model
from hexgen_flow.latency import LatencyModel, LatencySource, known_gpus, latency_model
from hexgen_flow.roofline import (
    check_floors,
    compare_with_floors,
    decode_step_floor_s,
    estimate_instance,
    prefill_floor_s,
)

MODEL = "llama-3.1-70b"


def _hardware(
    gpu: str, tp: int, model: str = MODEL, precision: Precision = "bf16"
) -> InstanceHardware:
    return InstanceHardware(resolve_model(model), gpu_catalogue().resolve(gpu), tp, precision)


def _sub_physical(prefix_cached: bool) -> LatencyModel:
    """Llama-3.1-70B on 4 x A100 prefilling at 1 µs per token (the floor is ~113 µs)."""
    return LatencyModel(
        _hardware("A100", 4),
        None,
        (0.0, 1e-6),
        0.05,
        1.0,
        1.0,
        {1: 0.02, 8: 0.03},
        LatencySource("test: a tiny prefill slope", prefix_cached),
    )


# --------------------------------------------------------------------------- floors by hand


# Llama-3.1-70B: 70.6e9 parameters, of which two untied tables of 128,256 x 8,192 (the input
# embedding, a lookup, and the output head, run for a prompt's last token only)
LLAMA_PROMPT_PARAMS = 70.6e9 - 2 * 128_256 * 8_192  # 68.499e9
LLAMA_DECODE_READ = 70.6e9 - 128_256 * 8_192  # a step reads the input table's rows only


def test_prefill_floor_by_hand() -> None:
    # 12,000 tokens x 2 x 68.499e9 FLOP / (4 x 312e12 FLOP/s) = 1.3173 s
    assert prefill_floor_s(_hardware("A100", 4), 12_000) == pytest.approx(
        12_000 * 2 * LLAMA_PROMPT_PARAMS / (4 * 312e12), rel=1e-12
    )
    assert prefill_floor_s(_hardware("A100", 4), 12_000) == pytest.approx(1.3173, abs=1e-4)
    # fp8 on L40S: 733 instead of 362 TFLOP/s
    assert prefill_floor_s(_hardware("L40S", 4, precision="fp8"), 1000) == pytest.approx(
        1000 * 2 * LLAMA_PROMPT_PARAMS / (4 * 733e12), rel=1e-12
    )
    # tied embeddings are one matrix: SmolLM2-135M drops one table of 49,152 x 576
    smollm = _hardware("A100", 1, model="smollm2-135m")
    assert prefill_floor_s(smollm, 1000) == pytest.approx(
        1000 * 2 * (134_515_008 - 49_152 * 576) / 312e12, rel=1e-12
    )


def test_decode_step_floor_by_hand() -> None:
    # (137.0e9 weight bytes + 8 x 4,000 x 327,680 KV bytes) / (4 x 2.039e12 B/s)
    expected = (LLAMA_DECODE_READ * 2 + 8 * 4000 * 2 * 80 * 8 * 128 * 2) / (4 * 2.039e12)
    assert decode_step_floor_s(_hardware("A100", 4), 8, 4000) == pytest.approx(expected, rel=1e-12)
    # fp8 weights are half the bytes; the KV cache stays bf16
    fp8 = (LLAMA_DECODE_READ + 8 * 4000 * 327_680) / (4 * 0.864e12)
    assert decode_step_floor_s(_hardware("L40S", 4, precision="fp8"), 8, 4000) == pytest.approx(
        fp8, rel=1e-12
    )


def test_a_mixture_of_experts_reads_its_active_weights() -> None:
    qwen = _hardware("A100", 1, model="qwen3-30b-a3b")
    table = 151_936 * 2_048  # untied: input embedding and output head
    expected = ((3.3e9 - table) * 2 + 1000 * 2 * 48 * 4 * 128 * 2) / 2.039e12
    assert decode_step_floor_s(qwen, 1, 1000) == pytest.approx(expected, rel=1e-12)
    assert prefill_floor_s(qwen, 1000) == pytest.approx(
        1000 * 2 * (3.3e9 - 2 * table) / 312e12, rel=1e-12
    )


# --------------------------------------------------------------------------- the check


def test_a_sub_physical_model_is_refused_with_both_numbers() -> None:
    with pytest.raises(ConfigError) as err:
        check_floors(_sub_physical(prefix_cached=False), input_tokens=(12_000,))
    message = str(err.value)
    assert "\n" not in message
    for part in ("llama-3.1-70b", "A100", "prefill of 12000 tokens", "0.012 s", "1.317 s"):
        assert part in message, (part, message)


def test_a_sub_physical_model_marked_prefix_cached_is_reported_not_refused() -> None:
    comparisons = check_floors(_sub_physical(prefix_cached=True), input_tokens=(12_000,))
    prefill = next(c for c in comparisons if c.phase == "prefill")
    assert prefill.below and prefill.tokens == 12_000
    assert prefill.model_s == pytest.approx(0.012)
    assert prefill.floor_s == pytest.approx(1.3173, abs=1e-4)


def test_the_decode_step_is_checked_too() -> None:
    fast_decode = LatencyModel(
        _hardware("A100", 4),
        None,
        (0.0, 2e-4),
        0.001,  # 1 ms per token: the weights alone need 17 ms to read
        1.0,
        1.0,
        {1: 0.02, 8: 0.03},
        LatencySource("test: a tiny decode time", False),
    )
    with pytest.raises(ConfigError, match="decode step at batch 1, context 1000 tokens"):
        check_floors(fast_decode, input_tokens=(1000,))


CHESS = "chess-measured"


@pytest.mark.parametrize(
    ("model", "gpu"), [(m, g) for m in (MODEL,) for g in known_gpus(m, calibration=CHESS)]
)
def test_shipped_measured_tables_pass_only_as_prefix_cached(model: str, gpu: str) -> None:
    lat = latency_model(model, gpu, calibration=CHESS)
    assert lat.source.prefix_cached
    check_floors(lat)  # reported, not refused
    below = {(c.phase, c.tokens) for c in compare_with_floors(lat) if c.below}
    if gpu in ("A100", "H100", "H200"):
        # The A100 table's prefill (~70 µs/token) and the Hopper models scaled from it.
        assert {("prefill", n) for n in (1000, 4000, 12_000)} <= below
    else:
        # A6000 and L40S prefill above their floors; their decode at 12k context does not.
        assert not any(phase == "prefill" for phase, _ in below)


@pytest.mark.parametrize("gpu", known_gpus("qwen3-30b-a3b"))
def test_aiconfigurator_models_are_above_every_floor(gpu: str) -> None:
    lat = latency_model("qwen3-30b-a3b", gpu)
    assert not lat.source.prefix_cached
    assert not any(c.below for c in check_floors(lat))


# --------------------------------------------------------------------------- estimates


def test_estimate_without_latency_data_has_floors_only() -> None:
    estimate = estimate_instance(_hardware("A100-40GB-SXM", 4), None, 12_000, 200)
    assert estimate.prefill_s is None and estimate.below_floor is None
    assert estimate.floor_prefill_s == pytest.approx(1.3173, abs=1e-4)
    assert estimate.context_tokens == 12_000


def test_estimate_decode_step_is_per_step_decode_times_slowdown() -> None:
    lat = latency_model(MODEL, "A100")
    estimate = estimate_instance(lat.hardware, lat, 4000, 200, batch=8, context_tokens=2000)
    per_step = lat.split(2000, 200)[1] / 199  # 200 output tokens: the prefill samples one
    assert estimate.decode_step_s == pytest.approx(per_step * lat.slowdown(8), rel=1e-12)
    # One output token takes no decode step: the estimate shows the model's reference step.
    alone = estimate_instance(lat.hardware, lat, 4000, 1, batch=8, context_tokens=2000)
    assert alone.decode_step_s == pytest.approx(lat.decode_step_s(8, 2000), rel=1e-12)
    assert alone.latency_s == lat.prefill_s(4000, 1)
    assert estimate.latency_s == lat.single_s(4000, 200)
    assert estimate.floor_decode_step_s == decode_step_floor_s(lat.hardware, 8, 2000)
