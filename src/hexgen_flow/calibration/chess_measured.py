"""``chess-measured``: the paper authors' measured vLLM tables, and aiconfigurator where they
have none (docs/algorithm.md §2 and §10, docs/hardware.md "Calibrations").

Three sources, in order of trust (profiles/ in the package data):

1. ``vllm-llama3.1-70b/<GPU>-single.csv``: measured end-to-end latency of a single request
   for 484 (input, output) pairs on A100, A6000 and L40S. `SingleRequestTable` returns these
   values exactly at measured pairs and interpolates between them.
2. ``vllm-llama3.1-70b/<GPU>-ttft-tpot.csv``: time to first token per input length, used only
   to split a single-request latency into prefill and decode for the batching engine.
3. ``aiconfigurator-*.tsv``: NVIDIA aiconfigurator TTFT/TPOT at batch 1, 8 and 32. They give
   the decode slowdown with batch size, and the GPUs without a measured table (H100, H200,
   and every GPU for Qwen3-30B-A3B).

Which GPUs a model has data for, at which tp, is the model catalogue's ``tensor_parallel``.
"""

from __future__ import annotations

import functools

from hexgen_flow.calibration.base import Calibration, Coverage
from hexgen_flow.hardware import (
    GpuSpec,
    InstanceHardware,
    ModelSpec,
    Precision,
    gpu_catalogue,
    profiled_tensor_parallel,
)
from hexgen_flow.latency_parameters import (
    LatencyParameters,
    LatencySource,
    SingleRequestTable,
    robust_line,
)
from hexgen_flow.profiles import aiconfigurator_rows, measured_profile, read_table

__all__ = ["ANCHOR_GPU", "CHESS_MEASURED", "PROFILED_PRECISION"]

# Every table of this calibration was taken with bf16 weights.
PROFILED_PRECISION: Precision = "bf16"
# The GPU whose measured table anchors the GPUs that only aiconfigurator knows.
ANCHOR_GPU = "A100"


@functools.cache
def _measured(folder: str, stem: str) -> tuple[SingleRequestTable, tuple[float, float]]:
    single = read_table(folder, f"{stem}-single.csv")
    ttft = read_table(folder, f"{stem}-ttft-tpot.csv")
    table = SingleRequestTable(single[:, 0], single[:, 1], single[:, 2])
    intercept, slope = robust_line(ttft[:, 0], ttft[:, 3])
    return table, (max(intercept, 0.0), max(slope, 0.0))


class ChessMeasured(Calibration):
    name = "chess-measured"
    source = (
        "the paper authors' measured vLLM tables of Llama-3.1-70B on A100, A6000 and L40S "
        "(Sim4Txt2SQL, CHESS on BIRD); H100 and H200 scale the A100 table by NVIDIA "
        "aiconfigurator's batch-1 TTFT and TPOT ratios; models without tables "
        "(Qwen3-30B-A3B) come from aiconfigurator alone; the batch slowdown is "
        "aiconfigurator's everywhere (A6000 borrows the L40S curve)"
    )
    caveats = (
        "the measured prompts repeat one word and vLLM caches prefixes: the A100 prefill "
        "sits below the physical floor (prefix-cache hits) and H100/H200 inherit it through "
        "the scaling; loading reports this instead of refusing it",
        "the A6000 and L40S decode at 12,000 tokens of context is below the bf16 bandwidth "
        "floor, which prefix caching does not explain",
        "the A100 table looks like a 40 GB or PCIe part, not the 80 GB SXM part the "
        "catalogue's A100 is (docs/algorithm.md §10)",
    )

    def coverage(self, model: ModelSpec, gpu: GpuSpec) -> Coverage | None:
        tp = profiled_tensor_parallel(model, gpu)
        return None if tp is None else Coverage(tp, PROFILED_PRECISION)

    def covered_gpus(self, model: ModelSpec) -> list[str]:
        return sorted(name for name, _ in model.tensor_parallel)

    def parameters(self, hardware: InstanceHardware) -> LatencyParameters:
        spec, gpu = hardware.model, hardware.gpu
        catalogue = gpu_catalogue()
        ai = aiconfigurator_rows(spec.name)
        # A GPU aiconfigurator does not model (A6000) borrows its catalogued stand-in's
        # slowdown (the L40S: the other 48 GiB PCIe card).
        stand_in = catalogue.resolve(gpu.aiconfigurator_stand_in or gpu.name)
        system = stand_in.aiconfigurator_system
        slowdown = {bs: tpot for (sys_, bs), (_, tpot) in ai.items() if sys_ == system}

        if spec.measured_profile:
            profile = measured_profile(spec.measured_profile)
            stem = profile.file_stem(gpu)
            if stem is not None:
                table, line = _measured(profile.folder, stem)
                source = LatencySource(
                    f"measured: {profile.folder}/{stem} ({profile.description})",
                    profile.prefix_caching,
                )
                return LatencyParameters(source, slowdown, line, table=table)
            # No measured table: scale the anchor GPU's table by aiconfigurator's batch-1
            # ratios, so a GPU type only ever differs from a measured one by what NVIDIA's
            # data says.
            anchor = catalogue.resolve(ANCHOR_GPU)
            anchor_stem = profile.file_stem(anchor) or ANCHOR_GPU
            table, line = _measured(profile.folder, anchor_stem)
            anchor_ttft, anchor_tpot = ai[(anchor.aiconfigurator_system or "", 1)]
            ttft, tpot = ai[(gpu.aiconfigurator_system or "", 1)]
            source = LatencySource(
                f"scaled: {profile.folder}/{anchor_stem} x aiconfigurator batch-1 ratios "
                f"{gpu.aiconfigurator_system}/{anchor.aiconfigurator_system}",
                # The scaled table keeps the measured one's prefix-cache hits.
                profile.prefix_caching,
            )
            return LatencyParameters(
                source,
                slowdown,
                line,
                table=table,
                prefill_scale=ttft / anchor_ttft,
                decode_scale=tpot / anchor_tpot,
            )
        # Model known only to aiconfigurator: prefill linear in input tokens through its TTFT
        # at 4,000 tokens, decode at its batch-1 TPOT.
        ttft, tpot = ai[(gpu.aiconfigurator_system or "", 1)]
        source = LatencySource(f"aiconfigurator: {gpu.aiconfigurator_system} batch 1", False)
        return LatencyParameters(source, slowdown, (0.0, ttft / 4000), decode_per_token_s=tpot)


CHESS_MEASURED = ChessMeasured()
