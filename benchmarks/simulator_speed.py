"""Simulator speed per engine model: simulated LLM calls per second of wall time.

For each engine model (``vllm-v1`` with prefix caching, the default; ``vllm-v1`` without;
``prefill-first``) it simulates the same run, `hexgen-flow` at α 0.5 (the preset's own,
no tuning) on the first 10,000 trace1 queries cycled (`take_queries`) at 0.5 queries/s on
the paper's cluster A100,A100,A6000,L40S, and prints the LLM calls of the run divided by
the wall time of the simulation alone: building the `Simulation` and running it, what
``hexgen-flow simulate`` reports as its speed. Process start, imports, trace loading and
building the cluster are outside the timing. Each engine runs `--repeats` times (in turn,
so a neighbour's load spreads over all of them) and the best run counts; the CPU seconds
of that run and the median of the runs are printed beside it. The machine (CPU model,
cores) heads the table.

    .venv/bin/python benchmarks/simulator_speed.py [--queries 10000] [--repeats 3]
        [--trace trace1] [--cluster A100,A100,A6000,L40S] [--qps 0.5]
        [--policy hexgen-flow] [--alpha 0.5] [--calibration NAME] [--seed 0]
        [--engines vllm-v1 vllm-v1-no-cache prefill-first] [--json]

The figures and what they led to: docs/design.md, "Simulated engine" (*Speed*).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from hexgen_flow import compiled_modules
from hexgen_flow.cluster import Cluster, parse_cluster
from hexgen_flow.policies.presets import Preset, resolve_policy
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.traces import load_traces, take_queries
from hexgen_flow.workload import Query

PAPER_CLUSTER = "A100,A100,A6000,L40S"

ENGINES: dict[str, tuple[str, bool]] = {
    "vllm-v1": ("vllm-v1", True),
    "vllm-v1-no-cache": ("vllm-v1", False),
    "prefill-first": ("prefill-first", False),
}
"""Benchmark rows: name -> (engine model, prefix caching)."""


@dataclass(frozen=True, slots=True)
class Row:
    engine: str
    """The row's name (`ENGINES`)."""
    engine_model: str
    prefix_caching: bool
    calls: int
    """LLM calls the run simulates."""
    best_wall_s: float
    median_wall_s: float
    best_cpu_s: float
    """CPU seconds of the fastest run."""
    calls_per_s: float
    """calls / best_wall_s."""
    preemptions: int
    p95_s: float
    """The run's P95 query latency: the same in every repeat (a run is deterministic)."""


def machine() -> dict[str, Any]:
    """The CPU model (from /proc/cpuinfo where there is one), the cores this process may
    use, and the Python that ran the benchmark."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 0
    return {
        "cpu": model,
        "cores": cores,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        # modules that run compiled (scripts/compile_core.py: `make compile`), none by default
        "compiled": compiled_modules(),
    }


def time_run(
    queries: list[Query], cluster: Cluster, preset: Preset, config: SimConfig
) -> tuple[float, float, Simulation, float]:
    """(wall seconds, CPU seconds, the finished simulation, its P95) of one run."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    sim = Simulation(queries, cluster, preset, config)
    metrics = sim.run()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return wall, cpu, sim, metrics.latency_summary()["p95"]


def measure(
    queries: list[Query],
    cluster: Cluster,
    preset: Preset,
    args: argparse.Namespace,
) -> list[Row]:
    calls = sum(q.workflow.num_calls for q in queries)
    configs = {
        name: SimConfig(
            qps=args.qps,
            seed=args.seed,
            engine=ENGINES[name][0],
            prefix_caching=ENGINES[name][1],
        )
        for name in args.engines
    }
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in args.engines}
    facts: dict[str, tuple[int, float]] = {}
    for _ in range(args.repeats):
        for name, config in configs.items():
            wall, cpu, sim, p95 = time_run(queries, cluster, preset, config)
            runs[name].append((wall, cpu))
            facts[name] = (sim.preemptions, p95)
            del sim
    rows = []
    for name in args.engines:
        best_wall, best_cpu = min(runs[name])
        preemptions, p95 = facts[name]
        rows.append(
            Row(
                engine=name,
                engine_model=ENGINES[name][0],
                prefix_caching=ENGINES[name][1],
                calls=calls,
                best_wall_s=best_wall,
                median_wall_s=statistics.median(w for w, _ in runs[name]),
                best_cpu_s=best_cpu,
                calls_per_s=calls / best_wall,
                preemptions=preemptions,
                p95_s=p95,
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=10_000, help="queries (default 10000)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per engine, the best counts (default 3)"
    )
    parser.add_argument(
        "--trace", action="append", default=None, help="trace name or file (default trace1)"
    )
    parser.add_argument("--cluster", default=PAPER_CLUSTER, help=f"default {PAPER_CLUSTER}")
    parser.add_argument("--calibration", default=None, help="default: the default calibration")
    parser.add_argument("--qps", type=float, default=0.5, help="queries/s (default 0.5)")
    parser.add_argument("--policy", default="hexgen-flow", help="default hexgen-flow")
    parser.add_argument(
        "--alpha", type=float, default=None, help="default: the preset's own (no tuning)"
    )
    parser.add_argument("--seed", type=int, default=0, help="default 0")
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=list(ENGINES),
        default=list(ENGINES),
        help="rows to run (default all)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.queries < 1 or args.repeats < 1:
        parser.error("--queries and --repeats must be >= 1")

    traces = args.trace or ["trace1"]
    queries = take_queries(load_traces(traces), args.queries)
    cluster = parse_cluster(args.cluster, calibration=args.calibration)
    preset = resolve_policy(args.policy)
    if args.alpha is not None:
        preset = preset.with_alpha(args.alpha)
    rows = measure(queries, cluster, preset, args)
    host = machine()
    setting = {
        "traces": traces,
        "queries": args.queries,
        "cluster": args.cluster,
        "calibration": cluster.calibration.name,
        "qps": args.qps,
        "policy": preset.name,
        "alpha": preset.alpha,
        "seed": args.seed,
        "repeats": args.repeats,
    }
    if args.json:
        doc = {"machine": host, "setting": setting, "rows": [asdict(r) for r in rows]}
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    alpha = "" if preset.alpha is None else f" (alpha {preset.alpha:g})"
    print(f"machine: {host['cpu']}, {host['cores']} cores, Python {host['python']}")
    compiled = f"{len(host['compiled'])} modules (mypyc)" if host["compiled"] else "none"
    print(f"compiled: {compiled}")
    print(
        f"run: {preset.name}{alpha} on {', '.join(traces)} x {args.queries:,} queries "
        f"({rows[0].calls:,} LLM calls) at {args.qps:g} queries/s, {args.cluster} "
        f"({cluster.calibration.name}), seed {args.seed}; best of {args.repeats}"
    )
    head = (
        f"{'engine':<18} {'calls/s':>9} {'best (s)':>9} {'median (s)':>10} "
        f"{'CPU (s)':>8} {'preemptions':>11} {'P95 (s)':>9}"
    )
    print(head)
    for r in rows:
        print(
            f"{r.engine:<18} {r.calls_per_s:>9,.0f} {r.best_wall_s:>9.3f} "
            f"{r.median_wall_s:>10.3f} {r.best_cpu_s:>8.3f} {r.preemptions:>11,} "
            f"{r.p95_s:>9.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
