"""``estimate``: what the latency model believes about one call on one instance, beside the
physical floors of its hardware (docs/hardware.md).

An instance is given as ``--gpu NAME --tp N``, not in the ``--cluster`` syntax: there
``A100x2`` already means two instances.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hexgen_cli.options import add_calibration_option, positive_int, print_json, print_rows
from hexgen_flow.calibration import resolve_calibration
from hexgen_flow.cluster import DEFAULT_MODEL
from hexgen_flow.hardware import (
    PRECISIONS,
    InstanceHardware,
    default_tensor_parallel,
    gpu_catalogue,
    parse_precision,
    read_gpu_file,
    resolve_model,
)
from hexgen_flow.latency import has_latency_data, latency_model
from hexgen_flow.roofline import InstanceEstimate, estimate_instance

__all__ = ["estimate_json", "register"]


def register(commands: Any) -> None:
    """Add ``estimate`` to the command parser."""
    est = commands.add_parser(
        "estimate",
        help="one call's prefill, decode step and latency beside the physical floors",
        description="Print what the latency model gives for one call on one instance (GPU "
        "type x tensor-parallel degree x precision x model) and the floors its hardware "
        "allows: prefill >= 2 x active parameters per token at the dense peak, a decode "
        "step >= weights + KV cache read at the memory bandwidth.",
    )
    est.add_argument(
        "--gpu",
        required=True,
        metavar="NAME",
        help="GPU type, a catalogue name or alias (e.g. A100, A100-40GB-SXM, H100, L40S)",
    )
    est.add_argument(
        "--tp",
        type=positive_int,
        default=None,
        metavar="N",
        help="GPUs per instance (default: the tp the calibration's latency data was taken at "
        "on that GPU, else the smallest power of two that holds the weights and a KV cache)",
    )
    est.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="bf16",
        help="weight precision (default bf16; fp8 needs a GPU with fp8 tensor cores)",
    )
    est.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="NAME",
        help=f"model (default {DEFAULT_MODEL})",
    )
    est.add_argument("--input-tokens", type=positive_int, required=True, metavar="N")
    est.add_argument("--output-tokens", type=positive_int, required=True, metavar="M")
    est.add_argument(
        "--batch",
        type=positive_int,
        default=1,
        metavar="B",
        help="sequences decoding together in the decode step (default 1)",
    )
    est.add_argument(
        "--context",
        type=positive_int,
        default=None,
        metavar="C",
        help="context tokens per sequence in the decode step (default: --input-tokens)",
    )
    est.add_argument(
        "--gpus",
        type=Path,
        default=None,
        metavar="FILE.yaml",
        help="GPUs to add to the catalogue: a list of entries, or a cluster file's gpus:",
    )
    add_calibration_option(est, file_default=False)
    est.add_argument("--json", action="store_true", help="print one JSON object")
    est.set_defaults(handler=_cmd_estimate)


def estimate_json(estimate: InstanceEstimate, calibration: str) -> dict[str, Any]:
    """The command's JSON object (None where the instance has no latency data in
    `calibration`, named in it)."""
    hardware = estimate.hardware
    return {
        "calibration": calibration,
        "gpu": hardware.gpu.name,
        "model": hardware.model.name,
        "gpus_per_instance": hardware.tensor_parallel,
        "precision": hardware.precision,
        "prefill_s": estimate.prefill_s,
        "decode_step_s": estimate.decode_step_s,
        "latency_s": estimate.latency_s,
        "kv_capacity_tokens": hardware.kv_capacity_tokens,
        "floor_prefill_s": estimate.floor_prefill_s,
        "floor_decode_step_s": estimate.floor_decode_step_s,
        "below_floor": estimate.below_floor,
        "latency_source": None if estimate.source is None else estimate.source.description,
    }


def _seconds(value: float | None) -> str:
    return "no latency data" if value is None else f"{value:.4g} s"


def _cmd_estimate(args: argparse.Namespace) -> int:
    catalogue = gpu_catalogue() if args.gpus is None else read_gpu_file(args.gpus)
    model = resolve_model(args.model)
    gpu, label = catalogue.lookup(args.gpu)
    precision = parse_precision(args.precision, "--precision")
    calibration = resolve_calibration(args.calibration)
    covered = calibration.coverage(model, gpu)
    tp = args.tp or (
        covered.tensor_parallel if covered else default_tensor_parallel(model, gpu, precision)
    )
    hardware = InstanceHardware(model, gpu, tp, precision)
    latency = (
        latency_model(model.name, label, tp, precision, catalogue, args.calibration)
        if has_latency_data(hardware, args.calibration)
        else None
    )
    estimate = estimate_instance(
        hardware, latency, args.input_tokens, args.output_tokens, args.batch, args.context
    )
    doc = estimate_json(estimate, calibration.name)
    if args.json:
        print_json(doc)
        return 0
    below = doc["below_floor"]
    print_rows(
        [
            ("gpu", f"{doc['gpu']} ({gpu.memory_gib:g} GiB, {gpu.hbm_bandwidth_tb_s:g} TB/s)"),
            ("model", doc["model"]),
            ("gpus_per_instance", str(tp)),
            ("precision", precision),
            ("tokens", f"{args.input_tokens} in, {args.output_tokens} out"),
            ("prefill_s", _seconds(estimate.prefill_s)),
            ("floor_prefill_s", _seconds(estimate.floor_prefill_s)),
            (
                "decode_step_s",
                f"{_seconds(estimate.decode_step_s)} "
                f"(batch {estimate.batch}, context {estimate.context_tokens})",
            ),
            ("floor_decode_step_s", _seconds(estimate.floor_decode_step_s)),
            ("latency_s", _seconds(estimate.latency_s)),
            ("kv_capacity_tokens", f"{hardware.kv_capacity_tokens:,}"),
            ("below_floor", "no latency data" if below is None else str(below).lower()),
            ("calibration", calibration.name),
            ("latency_source", doc["latency_source"] or "none"),
        ]
    )
    return 0
