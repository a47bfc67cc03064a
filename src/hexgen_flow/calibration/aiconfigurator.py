"""``aiconfigurator``: NVIDIA aiconfigurator's dense SILICON sweep alone (docs/hardware.md,
"Calibrations").

The rows are ``data/profiles/aiconfigurator/<model>.tsv`` (aiconfigurator 0.12.0, vLLM
backend; read by `hexgen_flow.profiles.aiconfigurator_sweep`). For one GPU system at one tp:

- prefill is the piecewise-linear curve through the batch-1 TTFTs at 128-16,384 prompt
  tokens (each row reproduced exactly; beyond the last row the last segment continues);
- a decode step at batch 1 (one per output token after the first) is a line in the context
  (`decode_per_context_token_s`), least squares in relative terms through the batch-1 steps
  at 512-16,384 tokens of context;
- the batch slowdown f(B) is the step at batch B over batch 1, both at `REFERENCE_CONTEXT`
  tokens of context (the only context the sweep has at every batch up to 128 on nearly every
  instance); beyond its last batch the last segment continues, as for every calibration.

The step of B sequences at context C is then decode(C) x f(B); the tests bound how far that
and the prefill curve sit from the rows. Every tp the sweep has is selectable (`tp:` in a cluster),
the catalogue's where the sweep has it being the default.

A GPU aiconfigurator does not model is derived from the catalogued GPU its entry names as
`aiconfigurator_stand_in` (the A6000 from the L40S, the A100-40GB-SXM from the 80 GB part),
at the same tp: every row is the stand-in's time plus the difference of the two parts'
roofline times for that row (prefill: compute; a decode step: the larger of compute and
memory traffic). Not a ratio: the L40S prefills 4,096 tokens of Llama-3.1-70B at tp 4 in
5.1 s, 13 times its compute floor, so the PCIe all-reduce of 4 cards sets most of that time,
and the A6000 shares that link; scaling the whole row by a FLOP/s ratio would charge the
all-reduce to the slower tensor cores. The difference is added, so a derived row sits above
the derived GPU's floor by as much as the stand-in's row sits above its own. A GPU without
rows or stand-in is refused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from hexgen_flow.calibration.base import Calibration, Coverage
from hexgen_flow.hardware import (
    GpuSpec,
    InstanceHardware,
    ModelSpec,
    gpu_catalogue,
    profiled_tensor_parallel,
)
from hexgen_flow.latency_parameters import LatencyParameters, LatencySource
from hexgen_flow.profiles import SweepRow, aiconfigurator_sweep
from hexgen_flow.roofline import decode_step_floor_s, prefill_floor_s

__all__ = [
    "AICONFIGURATOR",
    "REFERENCE_CONTEXT",
    "Aiconfigurator",
    "SweepInstance",
    "stand_in",
    "sweep_instances",
]

REFERENCE_CONTEXT = 2_048
"""Context tokens of the decode rows the batch slowdown is taken at: within the profiled
first-token range (928-3,318 tokens), and the sweep's only context whose batches reach 128
on all but three instances (the rest of the grid runs out of memory sooner)."""


@dataclass(frozen=True, slots=True)
class SweepInstance:
    """The sweep's rows of one (model, system, tp)."""

    prefill: tuple[tuple[int, float], ...]
    """(prompt tokens, TTFT s) at batch 1, ascending."""
    decode: tuple[SweepRow, ...]

    def step(self, batch: int, context: int) -> float | None:
        for row in self.decode:
            if (row.batch, row.tokens) == (batch, context):
                return row.seconds
        return None

    @property
    def alone(self) -> tuple[tuple[int, float], ...]:
        """(context tokens, step s) at batch 1, ascending."""
        return tuple(sorted((r.tokens, r.seconds) for r in self.decode if r.batch == 1))

    @property
    def slowdown_points(self) -> dict[int, float]:
        return {
            r.batch: r.seconds
            for r in sorted(self.decode, key=lambda r: r.batch)
            if r.tokens == REFERENCE_CONTEXT
        }

    @property
    def usable(self) -> bool:
        # Two prefill rows for a curve, two contexts for the decode line, batch 1 and another
        # batch at the reference context for the slowdown.
        slowdown = self.slowdown_points
        return (
            len(self.prefill) >= 2 and len(self.alone) >= 2 and 1 in slowdown and len(slowdown) >= 2
        )


def stand_in(gpu: GpuSpec) -> GpuSpec | None:
    """The catalogued GPU whose rows `gpu` is derived from; None when `gpu` has rows of its
    own or no stand-in (a stand-in without rows of its own does not count: no chains)."""
    if gpu.aiconfigurator_system is not None or gpu.aiconfigurator_stand_in is None:
        return None
    proxy = gpu_catalogue().resolve(gpu.aiconfigurator_stand_in)
    return proxy if proxy.aiconfigurator_system is not None else None


def _roofline_s(hardware: InstanceHardware, row: SweepRow) -> float:
    if row.phase == "prefill":
        return prefill_floor_s(hardware, row.tokens)
    # A decode step of B sequences is B tokens of compute or the weights and KV read,
    # whichever takes longer.
    return max(
        prefill_floor_s(hardware, row.batch),
        decode_step_floor_s(hardware, row.batch, row.tokens),
    )


def _derived(
    instance: SweepInstance, mine: InstanceHardware, theirs: InstanceHardware
) -> SweepInstance:
    def shift(row: SweepRow) -> float:
        return row.seconds + _roofline_s(mine, row) - _roofline_s(theirs, row)

    prefill = tuple(
        (n, s + prefill_floor_s(mine, n) - prefill_floor_s(theirs, n)) for n, s in instance.prefill
    )
    decode = tuple(replace(r, seconds=shift(r)) for r in instance.decode)
    return SweepInstance(prefill, decode)


@functools.cache
def sweep_instances(model: ModelSpec, gpu: GpuSpec) -> dict[int, SweepInstance]:
    """tp -> the sweep's usable rows of `model` on `gpu` (those the calibration fits);
    derived from the stand-in's rows for a GPU aiconfigurator does not model."""
    proxy = stand_in(gpu)
    if proxy is not None:
        out: dict[int, SweepInstance] = {}
        for tp, instance in sweep_instances(model, proxy).items():
            derived = InstanceHardware(model, gpu, tp, "bf16")
            if derived.kv_capacity_tokens > 0:  # the weights fit in the derived part's memory
                out[tp] = _derived(instance, derived, InstanceHardware(model, proxy, tp, "bf16"))
        return out
    if gpu.aiconfigurator_system is None:
        return {}
    rows = [r for r in aiconfigurator_sweep(model.name) if r.system == gpu.aiconfigurator_system]
    out = {}
    for tp in sorted({r.tensor_parallel for r in rows}):
        mine = [r for r in rows if r.tensor_parallel == tp]
        prefill = sorted(
            (r.tokens, r.seconds) for r in mine if r.phase == "prefill" and r.batch == 1
        )
        instance = SweepInstance(tuple(prefill), tuple(r for r in mine if r.phase == "decode"))
        if instance.usable:
            out[tp] = instance
    return out


def _decode_line(alone: tuple[tuple[int, float], ...]) -> tuple[float, float]:
    """(s per output token at no context, s per context token): least squares in relative
    terms, so the 512-token step counts as much as the 16k one."""
    context = np.array([c for c, _ in alone], dtype=float)
    step = np.array([s for _, s in alone])
    design = np.column_stack([np.ones_like(context), context])
    coef, *_ = np.linalg.lstsq(design / step[:, None], np.ones_like(step), rcond=None)
    return float(coef[0]), float(coef[1])


class Aiconfigurator(Calibration):
    name = "aiconfigurator"
    source = (
        "NVIDIA aiconfigurator 0.12.0's SILICON estimates (vLLM backend), the dense sweep "
        "data/profiles/aiconfigurator/<model>.tsv: prefill piecewise linear through the "
        "batch-1 TTFTs at 128-16,384 prompt tokens, decode per token a line in the context "
        "through the batch-1 steps at 512-16,384 tokens, the batch slowdown from the steps "
        f"at batch 1-128 and {REFERENCE_CONTEXT:,} tokens of context; every tp of the sweep"
    )
    caveats = (
        "a model of the engine, not a measurement of this workload: static estimates, no "
        "in-flight batching, chunked prefill, prefix cache or scheduler overhead",
        "the batch slowdown is taken at one context (2,048 tokens): at long contexts a big "
        "batch decodes slower than that",
        "GPUs aiconfigurator does not model are derived from a stand-in (A6000 from L40S, "
        "A100-40GB-SXM from A100-80GB-SXM): the stand-in's time plus the roofline "
        "difference, which assumes both spend the same time off the roofline",
        "its L40S at tp 4 and 8 is bound by the PCIe all-reduce (Llama-3.1-70B prefill 13x "
        "and 51x the compute floor): an upper bound, far slower than chess-measured's L40S",
        "Qwen3-30B-A3B's decode step is not linear in the batch (a mixture of experts reads "
        "more experts as the batch grows); a100_sxm's kernels are an older vLLM (0.14.0) "
        "collection than the other systems' (0.24.0)",
    )

    def coverage(self, model: ModelSpec, gpu: GpuSpec) -> Coverage | None:
        degrees = self.tensor_parallel_degrees(model, gpu)
        if not degrees:
            return None
        # The catalogue's tp where the sweep has it (what a cluster without `tp:` has always
        # meant), else the sweep's smallest.
        preferred = profiled_tensor_parallel(model, gpu)
        return Coverage(preferred if preferred in degrees else degrees[0], "bf16")

    def tensor_parallel_degrees(self, model: ModelSpec, gpu: GpuSpec) -> tuple[int, ...]:
        return tuple(sweep_instances(model, gpu))

    def uncovered_reason(self, model: ModelSpec, gpu: GpuSpec) -> str | None:
        if gpu.aiconfigurator_system is None and stand_in(gpu) is None:
            return f"NVIDIA aiconfigurator does not model the {gpu.name} and it has no stand-in"
        if not aiconfigurator_sweep(model.name):
            return f"no aiconfigurator rows for {model.name}"
        return None

    def parameters(self, hardware: InstanceHardware) -> LatencyParameters:
        instance = sweep_instances(hardware.model, hardware.gpu)[hardware.tensor_parallel]
        intercept, per_context = _decode_line(instance.alone)
        slowdown = instance.slowdown_points
        proxy = stand_in(hardware.gpu)
        system = (
            hardware.gpu.aiconfigurator_system
            if proxy is None
            else f"{hardware.gpu.name} derived from {proxy.aiconfigurator_system}"
        )
        source = LatencySource(
            f"aiconfigurator: {system} x{hardware.tensor_parallel}, "
            f"dense sweep (prefill {instance.prefill[0][0]}-{instance.prefill[-1][0]} tokens, "
            f"batches {min(slowdown)}-{max(slowdown)} at {REFERENCE_CONTEXT} context)",
            False,
        )
        first_tokens, first_s = instance.prefill[0]
        return LatencyParameters(
            source,
            slowdown,
            # Unused while prefill_points are given; the line through the origin and the first
            # row keeps the field meaningful for anything that reads it.
            (0.0, first_s / first_tokens),
            prefill_points=instance.prefill,
            decode_per_token_s=intercept,
            decode_per_context_token_s=per_context,
        )


AICONFIGURATOR = Aiconfigurator()
