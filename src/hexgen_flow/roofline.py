"""Physical floors of prefill and decode, and a latency model's numbers beside them.

No engine beats its hardware's peaks (docs/hardware.md, docs/algorithm.md §10):

- prefill of N prompt tokens >= N x 2 x the parameters a prompt token is multiplied through
  (the active ones less the embedding tables: `ModelSpec.prompt_token_parameters`) /
  (tp x dense FLOP/s);
- one decode step of B sequences at context C >= (the weight bytes it reads whole, active
  less the input embedding table + B x C x KV bytes per token) / (tp x memory bandwidth).

Both ignore attention's own FLOPs and every overhead, so a real engine sits above them. A
latency model below a floor is not physics: `check_floors` refuses it, unless its source is
marked as measured with prefix caching (the shipped vLLM tables), which it reports instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from hexgen_flow.errors import ConfigError
from hexgen_flow.hardware import InstanceHardware
from hexgen_flow.latency_parameters import LatencySource, decode_steps

if TYPE_CHECKING:  # latency.py runs the check on every model it builds, so imports this one
    from hexgen_flow.latency import LatencyModel

__all__ = [
    "CHECK_INPUT_TOKENS",
    "CHECK_OUTPUT_TOKENS",
    "FloorComparison",
    "InstanceEstimate",
    "check_floors",
    "compare_with_floors",
    "decode_step_floor_s",
    "decode_step_s",
    "estimate_instance",
    "prefill_floor_s",
]

# Prompt lengths the check looks at: the profiled first-token range (928-3,318 tokens) and a
# CHESS candidate-generation prompt (about 12,000).
CHECK_INPUT_TOKENS = (1_000, 4_000, 12_000)
CHECK_OUTPUT_TOKENS = 200


def prefill_floor_s(hardware: InstanceHardware, input_tokens: int) -> float:
    """Least time to prefill `input_tokens`: 2 FLOPs per parameter a prompt token is
    multiplied through, per token, at the group's dense peak."""
    flop = input_tokens * 2 * hardware.model.prompt_token_parameters
    return flop / (hardware.tensor_parallel * hardware.gpu.flop_s(hardware.precision))


def decode_step_floor_s(hardware: InstanceHardware, batch: int, context_tokens: int) -> float:
    """Least time of one decode step of `batch` sequences of `context_tokens` each: the
    weights and every sequence's KV cache read once at the group's peak bandwidth.

    The weights counted are the active ones less the input embedding table, of which a step
    reads its sequences' rows only: a mixture of experts reads only the routed experts at
    batch 1, and no batch reads fewer, so this stays a floor for any batch.
    """
    kv_bytes = batch * context_tokens * hardware.model.kv_bytes_per_token
    read = hardware.model.decode_read_bytes(hardware.precision) + kv_bytes
    return read / (hardware.tensor_parallel * hardware.gpu.memory_bytes_per_s)


def decode_step_s(
    latency: LatencyModel, context_tokens: int, output_tokens: int, batch: int
) -> float:
    """The latency model's decode step at `batch`: its batch-1 decode time per step of a call
    of `output_tokens` with `context_tokens` prompt tokens, stretched by `slowdown(batch)`
    (a call of one output token takes no step: then the model's reference step)."""
    steps = decode_steps(output_tokens)
    if steps == 0:
        return latency.decode_step_s(batch, context_tokens)
    decode_s = latency.split(context_tokens, output_tokens)[1]
    return decode_s / steps * latency.slowdown(batch)


@dataclass(frozen=True, slots=True)
class FloorComparison:
    """One figure of a latency model beside its physical floor."""

    phase: Literal["prefill", "decode step"]
    tokens: int
    """Prompt tokens (prefill) or context tokens per sequence (decode step)."""
    batch: int
    model_s: float
    floor_s: float

    @property
    def below(self) -> bool:
        return self.model_s < self.floor_s

    def describe(self) -> str:
        what = (
            f"prefill of {self.tokens} tokens"
            if self.phase == "prefill"
            else f"decode step at batch {self.batch}, context {self.tokens} tokens"
        )
        return f"{what}: {self.model_s:.4g} s in the latency model, floor {self.floor_s:.4g} s"


def compare_with_floors(
    latency: LatencyModel,
    input_tokens: tuple[int, ...] = CHECK_INPUT_TOKENS,
    output_tokens: int = CHECK_OUTPUT_TOKENS,
    batch: int = 1,
) -> tuple[FloorComparison, ...]:
    """The model's prefill and decode step at each prompt length, beside their floors."""
    hardware = latency.hardware
    comparisons: list[FloorComparison] = []
    for tokens in input_tokens:
        comparisons.append(
            FloorComparison(
                "prefill",
                tokens,
                1,
                latency.prefill_s(tokens, output_tokens),
                prefill_floor_s(hardware, tokens),
            )
        )
        comparisons.append(
            FloorComparison(
                "decode step",
                tokens,
                batch,
                decode_step_s(latency, tokens, output_tokens, batch),
                decode_step_floor_s(hardware, batch, tokens),
            )
        )
    return tuple(comparisons)


def check_floors(
    latency: LatencyModel,
    input_tokens: tuple[int, ...] = CHECK_INPUT_TOKENS,
    output_tokens: int = CHECK_OUTPUT_TOKENS,
    batch: int = 1,
) -> tuple[FloorComparison, ...]:
    """`compare_with_floors`, refusing a model below a floor (ConfigError naming the GPU, the
    model, the tokens and both numbers) unless its source was measured with prefix caching;
    then the comparisons returned say where it sits below."""
    comparisons = compare_with_floors(latency, input_tokens, output_tokens, batch)
    below = [c for c in comparisons if c.below]
    if below and not latency.source.prefix_cached:
        hw = latency.hardware
        raise ConfigError(
            f"{latency.model} on {latency.gpu} ({hw.gpu.name} x{hw.tensor_parallel}, "
            f"{hw.precision}): {below[0].describe()}; below the physical floor, the latency "
            f"source ({latency.source.description}) is not physics unless it was measured "
            "with prefix caching"
        )
    return comparisons


@dataclass(frozen=True, slots=True)
class InstanceEstimate:
    """What the latency model and the floors say about one call on one instance."""

    hardware: InstanceHardware
    input_tokens: int
    output_tokens: int
    batch: int
    context_tokens: int
    prefill_s: float | None
    """The latency model's prefill; None without latency data for this instance."""
    decode_step_s: float | None
    latency_s: float | None
    """The call's single-request latency."""
    floor_prefill_s: float
    floor_decode_step_s: float
    source: LatencySource | None

    @property
    def below_floor(self) -> bool | None:
        """Whether the model's prefill or decode step is below its floor (None: no model)."""
        if self.prefill_s is None or self.decode_step_s is None:
            return None
        return (
            self.prefill_s < self.floor_prefill_s or self.decode_step_s < self.floor_decode_step_s
        )


def estimate_instance(
    hardware: InstanceHardware,
    latency: LatencyModel | None,
    input_tokens: int,
    output_tokens: int,
    batch: int = 1,
    context_tokens: int | None = None,
) -> InstanceEstimate:
    """The model's figures for one call (None without a latency model) beside the floors;
    the decode step is at `batch` sequences of `context_tokens` (default: the prompt)."""
    if min(input_tokens, output_tokens, batch) < 1:
        raise ConfigError("input tokens, output tokens and batch must be >= 1")
    context = input_tokens if context_tokens is None else context_tokens
    if context < 1:
        raise ConfigError(f"context must be >= 1 token, got {context}")
    prefill = step = single = None
    if latency is not None:
        prefill = latency.prefill_s(input_tokens, output_tokens)
        step = decode_step_s(latency, context, output_tokens, batch)
        single = latency.single_s(input_tokens, output_tokens)
    return InstanceEstimate(
        hardware=hardware,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        batch=batch,
        context_tokens=context,
        prefill_s=prefill,
        decode_step_s=step,
        latency_s=single,
        floor_prefill_s=prefill_floor_s(hardware, input_tokens),
        floor_decode_step_s=decode_step_floor_s(hardware, batch, context),
        source=None if latency is None else latency.source,
    )
