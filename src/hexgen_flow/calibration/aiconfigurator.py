"""``aiconfigurator``: NVIDIA aiconfigurator's TTFT and TPOT alone (docs/hardware.md,
"Calibrations").

The rows are each model's ``aiconfigurator_table`` in the model catalogue (SILICON mode, read
by `hexgen_flow.profiles.aiconfigurator_points`). For one GPU system at one tp:

- prefill is a line through the origin in prompt tokens, through the batch-1 TTFTs (one
  prompt length, as shipped: through its TTFT; several: least squares);
- decode takes the batch-1 TPOT per output token, whatever the prompt;
- the batch slowdown f(B) is the TPOT at batch B over batch 1.

The fit takes whatever batch sizes and prompt lengths the table holds, so a denser sweep in
the same columns, named in models.yaml, changes the data and not this code.

A GPU aiconfigurator does not model (the A6000) is refused, not derived: its L40S rows, the
nearest card, prefill 4,000 tokens of Llama-3.1-70B in 5.0 s, 13 times the compute floor, so
something other than FLOP/s (the PCIe all-reduce of 4 cards) sets them, and a FLOP/s or
bandwidth ratio would be a guess dressed as a derivation.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from hexgen_flow.calibration.base import Calibration, Coverage
from hexgen_flow.hardware import GpuSpec, InstanceHardware, ModelSpec, profiled_tensor_parallel
from hexgen_flow.latency_parameters import LatencyParameters, LatencySource
from hexgen_flow.profiles import AiconfiguratorPoint, aiconfigurator_points

__all__ = ["AICONFIGURATOR", "Aiconfigurator"]


def _points(model: ModelSpec, gpu: GpuSpec) -> list[AiconfiguratorPoint]:
    if gpu.aiconfigurator_system is None:
        return []
    return [p for p in aiconfigurator_points(model.name) if p.system == gpu.aiconfigurator_system]


def _prefill_slope_s(points: list[AiconfiguratorPoint]) -> float:
    """Seconds per prompt token of a prefill line through the origin and the TTFTs."""
    if len({p.input_tokens for p in points}) == 1:
        return statistics.fmean(p.ttft_s for p in points) / points[0].input_tokens
    return sum(p.input_tokens * p.ttft_s for p in points) / sum(p.input_tokens**2 for p in points)


class Aiconfigurator(Calibration):
    name = "aiconfigurator"
    source = (
        "NVIDIA aiconfigurator's SILICON estimates, each model's aiconfigurator_table "
        "(shipped: data/profiles/aiconfigurator-*.tsv, TTFT and TPOT at batch 1, 8 and 32, "
        "4,000 tokens in, 200 out): prefill linear in prompt tokens through the batch-1 TTFT, "
        "decode at the batch-1 TPOT, the batch slowdown from the TPOT at each batch"
    )
    caveats = (
        "a model of the engine, not a measurement of this workload: one prompt length "
        "(4,000 tokens), so the decode time does not grow with the context",
        "GPU types aiconfigurator does not model (A6000) are refused, not derived",
        "aiconfigurator's L40S prefill (tp 4, PCIe) is 13x its compute floor: an L40S "
        "instance prefills far slower here than in chess-measured",
    )

    def coverage(self, model: ModelSpec, gpu: GpuSpec) -> Coverage | None:
        batches: dict[int, set[int]] = defaultdict(set)
        for p in _points(model, gpu):
            batches[p.tensor_parallel].add(p.batch)
        # Batch 1 (the call alone) and another batch size: the slowdown needs two points.
        degrees = {tp for tp, sizes in batches.items() if 1 in sizes and len(sizes) > 1}
        if not degrees:
            return None
        # The catalogue's tp where the table has it (every shipped row), else its smallest.
        preferred = profiled_tensor_parallel(model, gpu)
        return Coverage(preferred if preferred in degrees else min(degrees), "bf16")

    def uncovered_reason(self, model: ModelSpec, gpu: GpuSpec) -> str | None:
        if gpu.aiconfigurator_system is None:
            return f"NVIDIA aiconfigurator does not model the {gpu.name}"
        if not aiconfigurator_points(model.name):
            return f"no aiconfigurator rows for {model.name}"
        return None

    def parameters(self, hardware: InstanceHardware) -> LatencyParameters:
        points = [
            p
            for p in _points(hardware.model, hardware.gpu)
            if p.tensor_parallel == hardware.tensor_parallel
        ]
        alone = [p for p in points if p.batch == 1]
        tpot_by_batch: dict[int, list[float]] = defaultdict(list)
        for p in points:
            tpot_by_batch[p.batch].append(p.tpot_s)
        slowdown = {batch: statistics.fmean(t) for batch, t in sorted(tpot_by_batch.items())}
        system = hardware.gpu.aiconfigurator_system
        source = LatencySource(
            f"aiconfigurator: {system} x{hardware.tensor_parallel}, batches "
            f"{'/'.join(str(b) for b in slowdown)}",
            False,
        )
        return LatencyParameters(
            source,
            slowdown,
            (0.0, _prefill_slope_s(alone)),
            decode_per_token_s=slowdown[1],
        )


AICONFIGURATOR = Aiconfigurator()
