"""``calibrations``: where the latency numbers can come from, and what to keep in mind."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from hexgen_cli.options import PROG, print_json
from hexgen_flow.calibration import CALIBRATIONS, DEFAULT_CALIBRATION, MEASURED_FILE
from hexgen_flow.calibration.profile_file import ProfileFile
from hexgen_flow.hardware import resolve_model

__all__ = ["register"]

_MEASURED_SOURCE = (
    "a latency profile the user measured: YAML with model, gpu, tp, precision, "
    "prefix_cached, prefill rows (input_tokens, ttft_s) and decode rows (batch, "
    "context_tokens, decode_step_s); docs/hardware.md, Calibrations"
)


def register(commands: Any) -> None:
    """Add ``calibrations`` to the command parser."""
    cal = commands.add_parser(
        "calibrations",
        help="list the latency calibrations: names, sources and caveats",
        description="List what --calibration takes: each calibration's source and caveats, "
        "and the models and GPU types it covers.",
    )
    cal.add_argument("--json", action="store_true", help="print one JSON object")
    cal.set_defaults(handler=_cmd_calibrations)


def _entries() -> dict[str, dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {}
    for name, calibration in CALIBRATIONS.items():
        entries[name] = {
            "default": name == DEFAULT_CALIBRATION,
            "source": calibration.source,
            "caveats": list(calibration.caveats),
            "covers": {
                model: calibration.covered_gpus(resolve_model(model))
                for model in calibration.covered_models()
            },
        }
    entries[MEASURED_FILE] = {
        "default": False,
        "source": _MEASURED_SOURCE,
        "caveats": list(ProfileFile.caveats),
        "covers": "the (model, GPU type) pairs of the file",
    }
    return entries


def _cmd_calibrations(args: argparse.Namespace) -> int:
    entries = _entries()
    if args.json:
        print_json({"default": DEFAULT_CALIBRATION, "calibrations": entries})
        return 0
    print(f"Calibrations (--calibration NAME; default {DEFAULT_CALIBRATION}):")
    for name, entry in entries.items():
        print()
        print(f"  {name}{'  [default]' if entry['default'] else ''}")
        for line in textwrap.wrap(f"source: {entry['source']}", 88):
            print(f"    {line}")
        covers = entry["covers"]
        if isinstance(covers, dict):
            covers = "; ".join(f"{m} on {', '.join(g)}" for m, g in covers.items())
        for line in textwrap.wrap(f"covers: {covers}", 88):
            print(f"    {line}")
        for caveat in entry["caveats"]:
            for n, line in enumerate(textwrap.wrap(caveat, 86)):
                print(f"    {'- ' if n == 0 else '  '}{line}")
    print()
    print(f"A simulated figure is only as good as its calibration: quote it with the name ({PROG}")
    print("simulate prints it in its calibration row, bench in results.md).")
    return 0
