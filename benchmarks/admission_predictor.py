"""Admission control measured in the simulator: what it refuses, and what that costs.

A predictor that refuses too little lets admitted queries miss their SLO; one that refuses
too much turns away queries the cluster would have served in time. For each setting
(cluster, trace, rate) it runs the same queries twice with `hexgen-flow`: once admitting
everything (`Simulation`), once with the coordinator's rule at each arrival
(`hexgen_flow.sim.admitting.AdmittingSimulation`, `--admission reject`), and prints per
setting: queries admitted and refused, how many admitted met their SLO (and the share),
and how many met it without admission control. The totals say how many queries met their
SLO in all, with and without it; the worst share says how well the admitted are
protected.

    .venv/bin/python benchmarks/admission_predictor.py [--set paper|holdout|all]
        [--seeds 0] [--queries 200] [--workers 2] [--json]

`paper`: the paper's cluster A100,A100,A6000,L40S (trace1-3 at 0.1-3 q/s), H100 x 4
(0.25-2 q/s) and A100 x 2 (trace3 at 0.3, 1 and 20 q/s); `holdout`: clusters and rates
the predictor was not adjusted on (the paper's cluster twice, H100 x 2, H200 x 6). Figures
and what they led to: docs/admission.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

from tqdm import tqdm

from hexgen_flow.cluster import parse_cluster
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.sim.admitting import AdmittingSimulation
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.traces import load_trace, take_queries

PAPER = "A100,A100,A6000,L40S"
TRACES = ("trace1", "trace2", "trace3")

SETS: dict[str, list[tuple[str, str, float]]] = {
    "paper": [(PAPER, t, q) for t in TRACES for q in (0.1, 0.2, 0.5, 1.0, 3.0)]
    + [("H100,H100,H100,H100", t, q) for t in TRACES for q in (0.25, 0.5, 1.0, 2.0)]
    + [("A100,A100", "trace3", q) for q in (0.3, 1.0, 20.0)],
    "holdout": [(f"{PAPER},{PAPER}", t, q) for t in TRACES for q in (0.3, 0.75, 2.0)]
    + [("H100,H100", t, q) for t in ("trace1", "trace3") for q in (0.15, 0.4, 1.0)]
    + [(PAPER, t, q) for t in ("trace1", "trace3") for q in (0.15, 0.75)]
    + [(",".join(["H200"] * 6), "trace2", q) for q in (0.5, 1.5, 4.0)],
}
SETS["all"] = SETS["paper"] + SETS["holdout"]


@dataclass(frozen=True, slots=True)
class Row:
    cluster: str
    trace: str
    qps: float
    seed: int
    admitted: int
    rejected: int
    met_admitted: int
    met_without_admission: int

    @property
    def share(self) -> float:
        return self.met_admitted / self.admitted if self.admitted else 1.0


def run_setting(args: tuple[str, str, float, int, int]) -> Row:
    cluster_spec, trace, qps, seed, n = args
    queries = take_queries(load_trace(trace), n)
    cluster = parse_cluster(cluster_spec)
    preset = resolve_policy("hexgen-flow")
    config = SimConfig(qps, 3.0, seed)
    unguarded = Simulation(queries, cluster, preset, config).run()
    sim = AdmittingSimulation(queries, cluster, preset, config)
    guarded = sim.run()
    return Row(
        cluster_spec,
        trace,
        qps,
        seed,
        guarded.completed,
        sim.rejected,
        sum(o.met_slo for o in guarded.outcomes),
        sum(o.met_slo for o in unguarded.outcomes),
    )


def _label(cluster: str) -> str:
    gpus = cluster.split(",")
    if len(set(gpus)) == 1:
        return f"{gpus[0]} x {len(gpus)}"
    return cluster if cluster == PAPER else f"{PAPER} x {len(gpus) // 4}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", choices=sorted(SETS), default="paper")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    jobs = [(c, t, q, s, args.queries) for s in args.seeds for c, t, q in SETS[args.set]]
    rows: list[Row] = []
    with ProcessPoolExecutor(args.workers) as pool:
        bar = tqdm(total=len(jobs), desc="admission", unit="setting", file=sys.stderr)
        for row in pool.map(run_setting, jobs):
            rows.append(row)
            bar.update()
        bar.close()
    met = sum(r.met_admitted for r in rows)
    met_without = sum(r.met_without_admission for r in rows)
    worst = min(rows, key=lambda r: r.share)
    if args.json:
        print(
            json.dumps(
                {
                    "rows": [asdict(r) for r in rows],
                    "met": met,
                    "met_without_admission": met_without,
                    "worst_admitted_share": worst.share,
                }
            )
        )
        return 0
    print(
        f"{'cluster':<24} {'trace':<7} {'q/s':>5} {'seed':>4} {'admitted':>8} {'refused':>7} "
        f"{'met (of admitted)':>18} {'met without':>11}"
    )
    for r in rows:
        print(
            f"{_label(r.cluster):<24} {r.trace:<7} {r.qps:>5g} {r.seed:>4} {r.admitted:>8} "
            f"{r.rejected:>7} {r.met_admitted:>9} ({r.share:5.1%}) {r.met_without_admission:>11}"
        )
    print(
        f"\nmet their SLO: {met} with admission control, {met_without} without "
        f"({len(rows)} settings x {args.queries} queries)"
    )
    print(
        f"worst share of admitted queries within their SLO: {worst.share:.1%} "
        f"({_label(worst.cluster)}, {worst.trace}, {worst.qps:g} q/s, seed {worst.seed})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
