"""What online cost learning buys when the planner's latency table is wrong.

For each information setting (what the planner believes against what the simulated engines
run) it simulates every router and `hexgen-flow` with and without `--learn-costs` on the
same queries and arrivals, and prints the P95 workflow latency of each (mean over seeds),
the best router (the lowest P95 among them, each router planning with the same wrong
table), and two ratios: the best router's P95 over `hexgen-flow`'s (the lead), and
`hexgen-flow` with learning against `hexgen-flow` whose planner had the engines' own
table (the exact planner; 1.00 = learning recovered everything).

The load regime is printed with the figures: the fraction of the best router's queries
within SLO, and its makespan against the arrivals' span (a makespan much longer than the
span means the run is overloaded and its ratios grow with the trace's length: read such a
row as such).

    .venv/bin/python benchmarks/cost_learning.py [--queries 300] [--qps 0.25]
        [--seeds 0 1 2] [--trace trace1] [--cluster A100,A100,A6000,L40S] [--json]

α is fixed at 0.5 (the preset's), so that tuning does not hide what the table changes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from hexgen_flow.bench.plan import BASELINE, LOAD_AWARE
from hexgen_flow.cluster import Cluster, parse_cluster
from hexgen_flow.lengths import OutputLengths
from hexgen_flow.metrics import RunMetrics
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.traces import load_traces, take_queries
from hexgen_flow.workload import Query

ROUTERS = (BASELINE, *LOAD_AWARE)
"""Every router preset: the best router of a row is the lowest P95 among them."""


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    engines: str
    """The calibration the simulated engines run."""
    planner: str
    """The calibration the planner believes."""
    errors: dict[str, tuple[float, float]]
    """The planner's extra error by GPU type: (prefill, decode) factors."""


SETTINGS = (
    Setting("exact", "aiconfigurator", "aiconfigurator", {}),
    Setting("planner chess-measured", "aiconfigurator", "chess-measured", {}),
    Setting("engines chess-measured", "chess-measured", "aiconfigurator", {}),
    Setting(
        "slow GPUs' prefill believed 3x slower",
        "aiconfigurator",
        "aiconfigurator",
        {"L40S": (3.0, 1.0), "A6000": (3.0, 1.0)},
    ),
    Setting(
        "slow GPUs' prefill believed 3x faster",
        "aiconfigurator",
        "aiconfigurator",
        {"L40S": (1 / 3, 1.0), "A6000": (1 / 3, 1.0)},
    ),
)


def run(
    queries: list[Query],
    belief: Cluster,
    truth: Cluster,
    policy: str,
    qps: float,
    seed: int,
    learn: bool,
    lengths: OutputLengths,
) -> RunMetrics:
    preset = PRESETS[policy]
    if preset.has_alpha:
        preset = preset.with_alpha(0.5)
    config = SimConfig(qps=qps, seed=seed, learn_costs=learn, output_lengths=lengths)
    exact = belief is truth
    return Simulation(queries, belief, preset, config, truth=None if exact else truth).run()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--qps", type=float, default=0.25)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--trace", default="trace1")
    parser.add_argument("--cluster", default="A100,A100,A6000,L40S")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--output-lengths",
        choices=[m.value for m in OutputLengths],
        default="known",
        help="what every scheduler knows of output lengths (default known)",
    )
    args = parser.parse_args()
    lengths = OutputLengths(args.output_lengths)
    queries = take_queries(load_traces([args.trace]), args.queries)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for k, setting in enumerate(SETTINGS, 1):
        truth = parse_cluster(args.cluster, calibration=setting.engines)
        belief = parse_cluster(args.cluster, calibration=setting.planner)
        errors = {gpu: f for gpu, f in setting.errors.items() if gpu in truth.gpus}
        if setting.errors and not errors:
            # It names only GPU types the cluster lacks (a homogeneous H100 one, say): it
            # would be the exact setting again.
            print(f"[{k}/{len(SETTINGS)}] {setting.name}: skipped, no such GPU", file=sys.stderr)
            continue
        if errors:
            belief = belief.misjudged(errors)
        elif setting.planner == setting.engines:
            belief = truth
        p95: dict[str, list[float]] = {}
        within: dict[str, list[float]] = {}
        spans: dict[str, list[float]] = {}
        runs = [(p, False) for p in ROUTERS] + [("hexgen-flow", False), ("hexgen-flow", True)]
        for seed in args.seeds:
            for policy, learn in runs:
                name = policy + (" +learn" if learn else "")
                m = run(queries, belief, truth, policy, args.qps, seed, learn, lengths)
                p95.setdefault(name, []).append(m.latency_summary()["p95"])
                within.setdefault(name, []).append(m.slo_attainment)
                last_arrival = max(o.arrival_s for o in m.outcomes)
                spans.setdefault(name, []).append(m.makespan_s / max(last_arrival, 1e-9))
            exact = run(queries, truth, truth, "hexgen-flow", args.qps, seed, False, lengths)
            p95.setdefault("hexgen-flow exact", []).append(exact.latency_summary()["p95"])
        mean = {name: statistics.fmean(v) for name, v in p95.items()}
        best = min(ROUTERS, key=lambda r: mean[r])
        row: dict[str, Any] = {
            "setting": setting.name,
            "p95_s": mean,
            "best_router": best,
            "best_router_within_slo": statistics.fmean(within[best]),
            "best_router_makespan_over_span": statistics.fmean(spans[best]),
            "hexgen_within_slo": statistics.fmean(within["hexgen-flow"]),
            "lead": mean[best] / mean["hexgen-flow"],
            "lead_learning": mean[best] / mean["hexgen-flow +learn"],
            "learning_over_exact": mean["hexgen-flow +learn"] / mean["hexgen-flow exact"],
            "no_learning_over_exact": mean["hexgen-flow"] / mean["hexgen-flow exact"],
        }
        rows.append(row)
        print(
            f"[{k}/{len(SETTINGS)}] {setting.name}: {time.perf_counter() - started:.0f} s",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps({"args": vars(args), "rows": rows}))
        return 0
    print(
        f"{args.trace} x {args.queries} queries at {args.qps:g} queries/s on {args.cluster}, "
        f"seeds {' '.join(map(str, args.seeds))}; P95 (s), mean over seeds; alpha 0.5; "
        f"output lengths {args.output_lengths}"
    )
    header = (
        f"{'setting':<40} {'best router':>16} {'hexgen':>8} {'+learn':>8} {'exact':>8} "
        f"{'lead':>6} {'lead+L':>6} {'L/exact':>7} {'noL/ex':>7} {'router in SLO':>13} "
        f"{'span x':>6}"
    )
    print(header)
    for shown in rows:
        row, p95s = shown, shown["p95_s"]
        best = row["best_router"]
        print(
            f"{row['setting']:<40} {best + ' ' + format(p95s[best], '.0f'):>16} "
            f"{p95s['hexgen-flow']:>8.1f} {p95s['hexgen-flow +learn']:>8.1f} "
            f"{p95s['hexgen-flow exact']:>8.1f} {row['lead']:>6.2f} "
            f"{row['lead_learning']:>6.2f} "
            f"{row['learning_over_exact']:>7.3f} {row['no_learning_over_exact']:>7.3f} "
            f"{100 * row['best_router_within_slo']:>12.1f}% "
            f"{row['best_router_makespan_over_span']:>6.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
