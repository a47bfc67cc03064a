"""``demo``: a local mesh with simulated engines, a trace replayed through it, and the
simulator's prediction for the same queries side by side."""

from __future__ import annotations

import argparse
import asyncio
import math
import time
import uuid
from typing import Any

from hexgen_cli.mesh import add_cluster_options, require_mesh
from hexgen_cli.options import (
    DEFAULT_QPS,
    DEFAULT_SEED,
    PROG,
    info,
    integer,
    positive_float,
    positive_int,
    print_json,
)
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.metrics import RunMetrics
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.sim.simulator import SimConfig, simulate
from hexgen_flow.traces import load_traces, take_queries

__all__ = ["comparison_lines", "register"]

DEFAULT_DEMO_TRACE = "trace3"
DEFAULT_DEMO_QUERIES = 100
DEFAULT_DEMO_TIME_SCALE = 20.0


def register(commands: Any) -> None:
    """Add ``demo`` to the command parser."""
    demo = commands.add_parser(
        "demo",
        help="run a local mesh (simulated engines), replay a trace, compare with the simulator",
        description="Start a local mesh with simulated engines and a private Redis, replay a "
        "trace through it with a progress bar, stop it, and print the measured metrics side "
        "by side with the simulator's prediction for the same queries, seed, cluster, "
        "policy and alpha.",
    )
    demo.add_argument(
        "--trace",
        default=DEFAULT_DEMO_TRACE,
        metavar="NAME|FILE",
        help=f"trace (default {DEFAULT_DEMO_TRACE})",
    )
    demo.add_argument(
        "--num-queries",
        type=positive_int,
        default=DEFAULT_DEMO_QUERIES,
        metavar="N",
        help=f"queries (default {DEFAULT_DEMO_QUERIES})",
    )
    demo.add_argument(
        "--qps",
        type=positive_float,
        default=DEFAULT_QPS,
        metavar="FLOAT",
        help=f"arrival rate, queries per cluster second (default {DEFAULT_QPS})",
    )
    demo.add_argument(
        "--seed", type=integer, default=DEFAULT_SEED, metavar="INT", help="arrival seed (default 0)"
    )
    add_cluster_options(demo, time_scale=DEFAULT_DEMO_TIME_SCALE)
    demo.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    demo.set_defaults(handler=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    require_mesh("demo")
    from hexgen_client.client import CoordinatorClient  # noqa: PLC0415 - loads grpc
    from hexgen_launch.cluster import LocalCluster, LocalClusterConfig  # noqa: PLC0415 - loads grpc
    from hexgen_launch.replay import replay  # noqa: PLC0415 - loads grpc

    queries = take_queries(load_traces([args.trace]), args.num_queries)
    cluster_spec = parse_cluster(args.cluster, calibration=args.calibration)
    preset = resolve_policy(args.policy)
    config = SimConfig(qps=args.qps, slo_scale=args.slo_scale, seed=args.seed)
    mesh = LocalCluster(
        LocalClusterConfig(
            cluster=args.cluster,
            calibration=args.calibration,
            policy=args.policy,
            alpha=args.alpha,
            slo_scale=args.slo_scale,
            time_scale=args.time_scale,
            listen="127.0.0.1:0",
            redis_url=args.redis_url,
            # a Redis of one's own may hold an earlier demo's queries under the same ids
            redis_prefix=f"hf-demo-{uuid.uuid4().hex[:8]}:" if args.redis_url else "hf:",
            tuner=False,  # alpha stays put, so the simulator can be given the very same one
            admission="off",  # the simulator admits every query: so does the mesh here
        )
    )

    async def run(address: str) -> RunMetrics:
        async with CoordinatorClient(address) as client:
            return await replay(
                client,
                queries,
                args.qps,
                seed=args.seed,
                slo_scale=args.slo_scale,
                progress=not args.json,
            )

    info(
        f"{PROG} demo: starting a local mesh with SIMULATED ENGINES "
        f"({args.cluster}, {args.policy}, time scale {args.time_scale:g}x) ..."
    )
    with mesh:
        started = time.perf_counter()
        measured = asyncio.run(run(mesh.coordinator_address))
        wall_s = time.perf_counter() - started
    if measured.alpha is not None and preset.has_alpha:
        preset = preset.with_alpha(measured.alpha)
    predicted = simulate(queries, cluster_spec, preset, config)
    if args.json:
        print_json(
            {
                "engines": "simulated",
                "trace": args.trace,
                "num_queries": len(queries),
                "qps": args.qps,
                "seed": args.seed,
                "cluster": list(cluster_spec.gpus),
                "calibration": cluster_spec.calibration.name,
                "policy": measured.policy,
                "alpha": measured.alpha,
                "slo_scale": args.slo_scale,
                "time_scale": args.time_scale,
                "wall_s": wall_s,
                "measured": measured.to_json(per_query=False),
                "simulated": predicted.to_json(per_query=False),
            }
        )
        return 0
    alpha = "no alpha" if measured.alpha is None else f"alpha {measured.alpha:g}"
    print(
        f"{args.trace}: {len(queries)} queries at {args.qps:g} q/s (seed {args.seed}) on "
        f"{','.join(cluster_spec.gpus)} (calibration {cluster_spec.calibration.name}), "
        f"{measured.policy} ({alpha}), "
        f"SLO {args.slo_scale:g} x SLO_base = {measured.slo_s:.1f} s"
    )
    print(
        f"measured: the service mesh with SIMULATED ENGINES at time scale "
        f"{args.time_scale:g}x ({wall_s:.1f} s wall); simulated: hexgen-flow simulate"
    )
    print()
    for line in comparison_lines(measured, predicted):
        print(line)
    return 0


def comparison_lines(measured: RunMetrics, predicted: RunMetrics) -> list[str]:
    """A table of the metrics of two runs of the same workload and their relative
    difference (measured / predicted - 1)."""
    m, p = measured.latency_summary(), predicted.latency_summary()
    rows: list[tuple[str, float, float, str]] = [
        ("latency P50 (s)", m["p50"], p["p50"], "{:.1f}"),
        ("latency P95 (s)", m["p95"], p["p95"], "{:.1f}"),
        ("latency P99 (s)", m["p99"], p["p99"], "{:.1f}"),
        ("latency mean (s)", m["mean"], p["mean"], "{:.1f}"),
        ("SLO attainment (%)", 100 * measured.slo_attainment, 100 * predicted.slo_attainment,
         "{:.1f}"),
        ("throughput (q/s)", measured.throughput_qps, predicted.throughput_qps, "{:.3f}"),
        ("completed", float(measured.completed), float(predicted.completed), "{:.0f}"),
    ]  # fmt: skip
    header = ("metric", "measured", "simulated", "difference")
    cells = [header]
    for name, a, b, fmt in rows:
        diff = a / b - 1 if b and math.isfinite(a) and math.isfinite(b) else math.nan
        cells.append(
            (
                name,
                fmt.format(a) if math.isfinite(a) else "-",
                fmt.format(b) if math.isfinite(b) else "-",
                f"{100 * diff:+.1f} %" if math.isfinite(diff) else "-",
            )
        )
    widths = [max(len(row[c]) for row in cells) for c in range(4)]
    return [
        "  ".join(
            [row[0].ljust(widths[0]), *(row[c].rjust(widths[c]) for c in range(1, 4))]
        ).rstrip()
        for row in cells
    ]
