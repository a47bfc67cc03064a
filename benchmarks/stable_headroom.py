"""How much lead a stable-regime row leaves to take: each row's floor.

`hexgen-flow bench --stable` compares `hexgen-flow` with the best router at 50, 70 and 90 %
of a row's saturation rate. Any lead there is bounded: no scheduler finishes a workflow
sooner than it takes with the cluster to itself. This benchmark measures that floor for each
engine calibration and trace of a stable results file: the lowest P95 that any preset of the
file reaches (α tuned, as the bench tunes it) when workflows arrive so rarely (default 0.005
q/s) that they almost never meet, planning with the engines' own table and the recorded
output lengths. Then, per row and load, it prints

- the bound: the best router's P95 over the floor (no scheduler can lead it by more);
- `hexgen-flow`'s lead: the best router's P95 over `hexgen-flow`'s;
- the share of the router's excess over the floor that `hexgen-flow` removes,
  (router − hexgen-flow) / (router − floor),

and flags the rows whose bound is below `--target`: there, a lead of `--target` is out of
reach of any scheduler, not only of this one.

    .venv/bin/python benchmarks/stable_headroom.py [--results benchmarks/stable-results.json]
        [--floor-qps 0.005] [--target 1.3] [--loads 0.7] [--workers 2] [--json]

It reads the rows' figures from the results file and simulates only the floors
(calibrations × traces × presets runs; about 3 minutes for the README's file on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from hexgen_flow.bench.plan import FLAGSHIP, Task
from hexgen_flow.bench.run import run_tasks
from hexgen_flow.bench.stable import STABLE_PLAN

DEFAULT_RESULTS = Path(__file__).with_name("stable-results.json")


def floor_tasks(doc: dict[str, Any], floor_qps: float) -> list[Task]:
    """One run per (engine calibration, trace, preset) of the results document `doc`, at
    `floor_qps`, the planner knowing the engines' table and every output length."""
    meta = doc["meta"]
    cluster = ",".join(meta["cluster"]["x1"])
    pairs = sorted(
        {(meta["information"][r["information"]]["calibration"], r["trace"]) for r in doc["rows"]}
    )
    return [
        Task(
            "run",
            (calibration, trace, preset),
            trace,
            cluster,
            preset,
            floor_qps,
            meta["num_queries"],
            seed=meta["seed"],
            slo_scale=meta["slo_scale"],
            arrival_cv=meta.get("arrival_cv", STABLE_PLAN.arrival_cv),
            calibration=calibration,
            engine=meta["engine"],
            prefix_caching=meta["prefix_caching"],
        )
        for calibration, trace in pairs
        for preset in meta["presets"]
    ]


def floors(
    results: dict[tuple[Any, ...], dict[str, Any]],
) -> dict[tuple[str, str], tuple[float, str]]:
    """Per (engine calibration, trace): the lowest P95 among the floor runs `results`, and
    the preset that reached it."""
    best: dict[tuple[str, str], tuple[float, str]] = {}
    for (calibration, trace, preset), record in results.items():
        p95 = float(record["p95_s"])
        key = (calibration, trace)
        if key not in best or p95 < best[key][0]:
            best[key] = (p95, preset)
    return best


def headroom(
    doc: dict[str, Any],
    floor_of: dict[tuple[str, str], tuple[float, str]],
    loads: list[float] | None = None,
) -> list[dict[str, Any]]:
    """Per row of `doc` and load (`loads`; None: every load of the row): the floor, the
    best router's and `hexgen-flow`'s P95, the lead, the bound and the share removed."""
    info = doc["meta"]["information"]
    out = []
    for row in doc["rows"]:
        floor, floor_preset = floor_of[(info[row["information"]]["calibration"], row["trace"])]
        for cell in row["loads"]:
            if loads is not None and not any(abs(cell["load"] - f) < 1e-9 for f in loads):
                continue
            router = cell["best_router"]
            router_p95 = float(cell["p95_s"][router])
            ours = float(cell["p95_s"][FLAGSHIP])
            excess = router_p95 - floor
            out.append({
                "information": row["information"],
                "realistic": bool(row["realistic"]),
                "trace": row["trace"],
                "load": cell["load"],
                "qps": cell["qps"],
                "floor_s": floor,
                "floor_preset": floor_preset,
                "best_router": router,
                "router_p95_s": router_p95,
                "hexgen_flow_p95_s": ours,
                "lead": router_p95 / ours,
                "bound": router_p95 / floor,
                "share_removed": (router_p95 - ours) / excess if excess > 0 else None,
            })  # fmt: skip
    return out


def render(cells: list[dict[str, Any]], target: float) -> str:
    lines = [
        "| information | trace | load | floor (s) | best router P95 (s) | hexgen-flow P95 (s) "
        "| lead | bound | share removed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        share = "" if c["share_removed"] is None else f"{100 * c['share_removed']:.0f} %"
        flag = " (below target)" if c["bound"] < target else ""
        lines.append(
            f"| {c['information']} | {c['trace']} | {c['load']:.0%} | {c['floor_s']:.1f} "
            f"| {c['router_p95_s']:.1f} (`{c['best_router']}`) | {c['hexgen_flow_p95_s']:.1f} "
            f"| {c['lead']:.2f}× | {c['bound']:.2f}×{flag} | {share} |"
        )
    short = [c for c in cells if c["bound"] < target]
    missed = [c for c in cells if c["lead"] < target]
    lines.append("")
    lines.append(
        f"{len(short)} of {len(cells)} cells have a bound below {target:.2f}× (no scheduler "
        f"leads the best router there by {target:.2f}×); hexgen-flow's lead is below it in "
        f"{len(missed)}."
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--floor-qps", type=float, default=0.005)
    parser.add_argument("--target", type=float, default=1.3)
    parser.add_argument(
        "--loads", type=float, nargs="+", default=None, help="default: every load of a row"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--num-queries", type=int, default=None, help="default: the file's")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.floor_qps <= 0:
        parser.error(f"--floor-qps must be > 0, got {args.floor_qps}")
    doc = json.loads(args.results.read_text())
    if doc.get("meta", {}).get("plan", "").split("-")[0] != "stable":
        parser.error(f"{args.results}: not a `hexgen-flow bench --stable` results file")
    if args.num_queries is not None:
        doc["meta"]["num_queries"] = args.num_queries
    tasks = floor_tasks(doc, args.floor_qps)
    print(
        f"stable_headroom: {len(tasks)} floor runs at {args.floor_qps} q/s "
        f"({doc['meta']['num_queries']} workflows each)",
        file=sys.stderr,
    )
    started = time.perf_counter()
    floor_of = floors(run_tasks(tasks, args.workers))
    cells = headroom(doc, floor_of, args.loads)
    if args.json:
        print(json.dumps({"floor_qps": args.floor_qps, "target": args.target, "cells": cells}))
    else:
        print(render(cells, args.target))
        print(f"\n{time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
