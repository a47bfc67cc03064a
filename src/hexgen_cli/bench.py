"""``bench``: the paper's benchmark matrix, sweeps and plots (`hexgen_flow.bench`)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from hexgen_cli.options import (
    add_belief_options,
    add_calibration_option,
    add_engine_options,
    positive_int,
)
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.sim.engines import prefix_caching_of

__all__ = ["register"]


def register(commands: Any) -> None:
    """Add ``bench`` to the command parser."""
    bench = commands.add_parser(
        "bench",
        help="run the benchmark matrix and write tables and plots",
        description="Run the paper's benchmark matrix, goodput search, SLO and load sweeps, "
        "multi-tenant run and simulator speed; write results.md, results.json and PNG "
        "plots.",
    )
    bench.add_argument(
        "--out",
        type=Path,
        default=Path("results"),
        metavar="DIR",
        help="output folder (default results/)",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="a much smaller benchmark (seconds) that still writes every output file",
    )
    bench.add_argument(
        "--workers",
        type=positive_int,
        default=2,
        metavar="N",
        help="worker processes (default 2; 1 runs everything in this process)",
    )
    bench.add_argument(
        "--stable",
        action="store_true",
        help="run only the stable-regime part: every policy at 50/70/90 %% of the best "
        "router's saturation rate, and goodput, under the clairvoyant and the realistic "
        "information models (writes stable.md and stable.json; its own information models, "
        "so no belief or calibration options)",
    )
    add_calibration_option(bench, file_default=False)
    add_belief_options(bench, max_tokens=False)  # max-tokens: its default cap
    add_engine_options(bench)  # the band runs prefix caching both on and off
    bench.set_defaults(handler=_cmd_bench)


def _cmd_stable(args: argparse.Namespace, out: Path) -> int:
    import json  # noqa: PLC0415 - only this part needs them
    import time  # noqa: PLC0415

    from hexgen_flow.bench.stable import (  # noqa: PLC0415
        QUICK_STABLE_PLAN,
        STABLE_PLAN,
        render_stable_markdown,
        run_stable,
    )
    from hexgen_flow.metrics import json_safe  # noqa: PLC0415

    given = [
        flag
        for flag, value in (
            ("--calibration", args.calibration),
            ("--planner-calibration", args.planner_calibration),
            ("--planner-error", args.planner_error),
            ("--learn-costs", args.learn_costs or None),
            ("--output-lengths", None if args.output_lengths.value == "known" else True),
        )
        if value is not None
    ]
    if given:
        raise ConfigError(
            f"--stable runs its own information models (hexgen_flow.bench.stable): drop {given[0]}"
        )
    started = time.perf_counter()
    doc = run_stable(QUICK_STABLE_PLAN if args.quick else STABLE_PLAN, workers=args.workers)
    doc["meta"]["wall_s"] = time.perf_counter() - started
    (out / "stable.json").write_text(json.dumps(json_safe(doc), indent=1, allow_nan=False) + "\n")
    (out / "stable.md").write_text(render_stable_markdown(doc))
    print(f"hexgen-flow bench: wrote stable.md, stable.json to {out}/")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from hexgen_flow.bench import FULL_PLAN, QUICK_PLAN, run_bench  # noqa: PLC0415 - matplotlib is heavy; only bench needs it

    if args.stable:
        return _cmd_stable(args, _out_dir(args.out))

    plan = QUICK_PLAN if args.quick else FULL_PLAN
    if args.calibration is not None:
        plan = dataclasses.replace(plan, calibration=args.calibration)
    plan = dataclasses.replace(
        plan,
        planner_calibration=args.planner_calibration,
        planner_error=tuple((g, p, d) for g, (p, d) in (args.planner_error or {}).items()),
        learn_costs=args.learn_costs,
        output_lengths=args.output_lengths.value,
    )
    caching = prefix_caching_of(args.engine, args.prefix_caching)
    plan = dataclasses.replace(plan, engine=args.engine, prefix_caching=caching)
    for _, spec in plan.clusters:  # a cluster the calibration cannot run fails here, once
        parse_cluster(spec, calibration=plan.calibration)
        if plan.planner_calibration is not None:
            try:
                parse_cluster(spec, calibration=plan.planner_calibration)
            except ConfigError as exc:
                raise ConfigError(f"--planner-calibration: {exc}") from None
    run_bench(plan, _out_dir(args.out), workers=args.workers)
    return 0


def _out_dir(out: Path) -> Path:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot create the folder ({exc.strerror})") from None
    return out
