"""``simulate`` and ``tune``: the simulator and the alpha tuner.

A thin adapter over the core: it parses arguments, builds the run's queries, cluster (with its
calibration), preset and `SimConfig`, calls `simulate` / `tune_alpha`, and prints.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from hexgen_cli.options import (
    DEFAULT_ARRIVAL_CV,
    DEFAULT_POLICY,
    DEFAULT_QPS,
    DEFAULT_SEED,
    DEFAULT_SLO_SCALE,
    DEFAULT_TRACE,
    PROG,
    add_belief_options,
    add_calibration_option,
    add_engine_options,
    alpha_or_auto,
    info,
    integer,
    positive_float,
    positive_int,
    print_json,
    print_rows,
)
from hexgen_flow import compiled_modules
from hexgen_flow.cluster import DEFAULT_CLUSTER, DEFAULT_MODEL, Cluster, parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.lengths import OutputLengths
from hexgen_flow.metrics import RunMetrics
from hexgen_flow.policies.presets import PRESETS, Preset, resolve_policy
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.traces import load_traces, take_queries
from hexgen_flow.tuning import AlphaPoint, TuningResult, auto_tune, tune_alpha
from hexgen_flow.workload import Query

__all__ = ["calibration_row", "engine_row", "latency_row", "register"]


def register(commands: Any) -> None:
    """Add ``simulate`` and ``tune`` to the command parser."""
    sim = commands.add_parser(
        "simulate",
        help="simulate one run and print its metrics",
        description="Simulate one run of a workload on a cluster under a policy.",
    )
    _add_run_options(
        sim,
        policy_help=f"preset name or DISPATCH+QUEUE[+BUDGET] (see `{PROG} policies`; "
        f"default {DEFAULT_POLICY})",
    )
    sim.add_argument(
        "--alpha",
        type=alpha_or_auto,
        default=None,
        metavar="FLOAT|auto",
        help="alpha of the workload-balanced dispatcher in [0, 1], or 'auto' to tune it on the "
        "run's queries with other arrivals (seed+1); ignored by policies without alpha "
        "(default auto)",
    )
    sim.set_defaults(handler=_cmd_simulate)

    tune = commands.add_parser(
        "tune",
        help="tune alpha by replaying the workload for each alpha",
        description="Replay the last --window queries for alpha in {0, 0.1, ..., 1} (plus two "
        "refining midpoints) and report the P95 latency curve and the best alpha.",
    )
    _add_run_options(tune, policy_help=f"preset with an alpha (default {DEFAULT_POLICY})")
    tune.add_argument(
        "--window",
        type=positive_int,
        default=None,
        metavar="N",
        help="replay only the last N queries (default: all)",
    )
    tune.set_defaults(handler=_cmd_tune)


def _add_run_options(parser: argparse.ArgumentParser, *, policy_help: str) -> None:
    parser.add_argument(
        "--trace",
        action="append",
        metavar="FILE",
        help=f"trace file (.json paper format or .jsonl) or built-in name (trace1, trace2, "
        f"trace3, financial, formula1); repeat to concatenate (default {DEFAULT_TRACE})",
    )
    parser.add_argument(
        "--cluster",
        default=DEFAULT_CLUSTER,
        metavar="GPUS|FILE.yaml",
        help=f"instances as GPU types, e.g. A100,A100,A6000,L40S or A100x2,L40S, or a YAML "
        f"file (default {DEFAULT_CLUSTER})",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="NAME",
        help=f"model every instance serves unless the cluster file says (default {DEFAULT_MODEL})",
    )
    add_calibration_option(parser)
    add_belief_options(parser)
    add_engine_options(parser)
    parser.add_argument("--policy", default=DEFAULT_POLICY, metavar="NAME", help=policy_help)
    parser.add_argument(
        "--qps",
        type=positive_float,
        default=DEFAULT_QPS,
        metavar="FLOAT",
        help=f"mean query arrival rate, queries/s (default {DEFAULT_QPS})",
    )
    parser.add_argument(
        "--num-queries",
        type=positive_int,
        default=None,
        metavar="N",
        help="queries to run, taken from the traces in order and cycled (default: each "
        "trace query once)",
    )
    parser.add_argument(
        "--slo-scale",
        type=positive_float,
        default=DEFAULT_SLO_SCALE,
        metavar="FLOAT",
        help=f"SLO = scale x SLO_base (default {DEFAULT_SLO_SCALE})",
    )
    parser.add_argument(
        "--seed",
        type=integer,
        default=DEFAULT_SEED,
        metavar="INT",
        help=f"seed of the arrival process and the policies (default {DEFAULT_SEED})",
    )
    parser.add_argument(
        "--arrival-cv",
        type=positive_float,
        default=DEFAULT_ARRIVAL_CV,
        metavar="FLOAT",
        help=f"coefficient of variation of inter-arrival gaps: 1 = Poisson, > 1 = bursty "
        f"(default {DEFAULT_ARRIVAL_CV})",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object on stdout instead of a table"
    )


# ------------------------------------------------------------------------------- run setup


@dataclass(frozen=True, slots=True)
class RunSetup:
    """What one ``simulate``/``tune`` invocation runs."""

    traces: tuple[str, ...]
    queries: list[Query]
    cluster: Cluster
    """The cluster the simulated engines run (``--calibration``)."""
    preset: Preset
    config: SimConfig
    planner: Cluster
    """The same instances as the scheduler believes them (``--planner-calibration``,
    ``--planner-error``): `cluster` itself unless those options say otherwise."""
    planner_errors: dict[str, tuple[float, float]] | None = None
    """``--planner-error``: GPU type -> (prefill, decode) factors of the planner's error."""

    @property
    def truth(self) -> Cluster | None:
        """What `Simulation` takes as ``truth``: None when the planner is exact."""
        return None if self.planner is self.cluster else self.cluster


def _setup(args: argparse.Namespace) -> RunSetup:
    preset = resolve_policy(args.policy)
    traces = tuple(args.trace or [DEFAULT_TRACE])
    queries = take_queries(load_traces(traces), args.num_queries)
    cluster = parse_cluster(args.cluster, args.model, args.calibration)
    planner = cluster
    if args.planner_calibration is not None:
        try:
            planner = parse_cluster(args.cluster, args.model, args.planner_calibration)
        except ConfigError as exc:
            raise ConfigError(f"--planner-calibration: {exc}") from None
        if planner.calibration.name == cluster.calibration.name:
            planner = cluster  # the same numbers: one cluster, the exact planner
    if args.planner_error:
        try:
            planner = planner.misjudged(args.planner_error)
        except ConfigError as exc:
            raise ConfigError(f"--planner-error: {exc}") from None
    config = SimConfig(
        qps=args.qps,
        slo_scale=args.slo_scale,
        seed=args.seed,
        arrival_cv=args.arrival_cv,
        engine=args.engine,
        prefix_caching=args.prefix_caching,
        learn_costs=args.learn_costs,
        output_lengths=args.output_lengths,
        max_tokens=args.max_tokens,
    )
    return RunSetup(traces, queries, cluster, preset, config, planner, args.planner_error)


def calibration_row(cluster: Cluster) -> tuple[str, str]:
    """The ``calibration`` row: every figure names where its latency numbers come from."""
    cached = sorted({i.gpu for i in cluster.instances if i.latency.source.prefix_cached})
    notes = [f"{', '.join(cached)} measured with prefix-cache hits"] if cached else []
    notes.append(f"`{PROG} calibrations` lists its sources and caveats")
    return ("calibration", f"{cluster.calibration.name} ({'; '.join(notes)})")


def planner_row(run: RunSetup) -> tuple[str, str]:
    """The ``planner`` row: what the scheduler plans with, beside what the engines run."""
    if run.truth is None:
        text = "the same numbers (exact)"
    else:
        text = f"{run.planner.calibration.name}"
        if run.planner_errors:
            text += " with " + ", ".join(
                f"{gpu} prefill x{p:g} decode x{d:g}" for gpu, (p, d) in run.planner_errors.items()
            )
        text += " (the engines run the calibration above)"
    if run.config.learn_costs:
        text += "; learns each instance's costs online"
    lengths = run.config.output_lengths
    if lengths is OutputLengths.LEARNED:
        text += "; predicts output lengths per step (learned)"
    elif lengths is OutputLengths.MAX_TOKENS:
        text += f"; believes every output {run.config.max_tokens} tokens (max-tokens)"
    return ("planner", text)


def latency_row(metrics: RunMetrics) -> tuple[str, str]:
    """The ``latency (s)`` row of a run's summary (simulate and replay print the same)."""
    lat = metrics.latency_summary()
    return (
        "latency (s)",
        f"mean {lat['mean']:.1f}   p50 {lat['p50']:.1f}   "
        f"p95 {lat['p95']:.1f}   p99 {lat['p99']:.1f}",
    )


# -------------------------------------------------------------------------------- commands


def _cmd_simulate(args: argparse.Namespace) -> int:
    run = _setup(args)
    preset = run.preset
    tuning: TuningResult | None = None
    if not preset.has_alpha:
        if args.alpha is not None:
            info(f"{PROG}: note: policy {preset.name!r} has no alpha; --alpha ignored")
    elif args.alpha is None:
        started = time.perf_counter()
        # The tuner replays what it believes: the planner's numbers, not the engines'.
        tuning = auto_tune(run.queries, run.planner, preset, run.config)
        info(
            f"{PROG}: tuned alpha over {len(tuning.curve)} values on {tuning.window} queries "
            f"(arrival seed {run.config.seed + 1}): {tuning.alpha:g} "
            f"({time.perf_counter() - started:.2f} s)"
        )
        preset = preset.with_alpha(tuning.alpha)
    else:
        preset = preset.with_alpha(args.alpha)

    started = time.perf_counter()
    sim = Simulation(run.queries, run.planner, preset, run.config, truth=run.truth)
    metrics = sim.run()
    wall_s = time.perf_counter() - started
    calls = sum(q.workflow.num_calls for q in run.queries)
    compiled = compiled_modules()
    how = f"{len(compiled)} modules compiled" if compiled else "as Python"
    speed = (
        f"{calls:,} LLM calls in {wall_s:.3f} s ({calls / max(wall_s, 1e-9):,.0f} calls/s, {how})"
    )

    if args.json:
        doc = metrics.to_json()
        doc["seed"] = run.config.seed
        doc["cluster"] = list(run.cluster.gpus)
        doc["traces"] = list(run.traces)
        doc["slo_scale"] = run.config.slo_scale
        doc["arrival_cv"] = run.config.arrival_cv
        doc["model"] = run.cluster.instances[0].model
        doc["calibration"] = run.cluster.calibration.name
        doc["planner_calibration"] = run.planner.calibration.name
        doc["planner_error"] = {
            gpu: {"prefill": p, "decode": d} for gpu, (p, d) in (run.planner_errors or {}).items()
        }
        doc["learn_costs"] = run.config.learn_costs
        doc["output_lengths"] = run.config.output_lengths.value
        learner = sim.scheduler.learner
        if learner is not None:
            doc["learned"] = [
                {
                    "instance": inst.name,
                    "prefill_factor": f.prefill,
                    "decode_factor": f.decode,
                    "calls": f.calls,
                    "dropped": f.dropped,
                }
                for inst, f in zip(run.cluster.instances, learner.factors(), strict=True)
            ]
        doc["engine"] = run.config.engine
        doc["prefix_caching"] = run.config.prefix_caching
        doc["preemptions"] = sim.preemptions
        if tuning is not None:
            doc["alpha_curve"] = [
                {"alpha": p.alpha, "p95_s": p.p95_s, "slo_attainment": p.slo_attainment}
                for p in tuning.curve
            ]
        print_json(doc)
        info(f"{PROG}: simulator speed: {speed}")
    else:
        _print_summary(run, metrics, tuning, speed, sim.preemptions, sys.stdout)
    return 0


def engine_row(config: SimConfig, preemptions: int | None = None) -> tuple[str, str]:
    """The ``engine`` row: the engine model every instance runs (and what it preempted)."""
    text = config.engine + (" with prefix caching" if config.prefix_caching else "")
    if preemptions is not None and config.engine == "vllm-v1":
        text += f" ({preemptions:,} preemptions)"
    return ("engine", text)


def _print_summary(
    run: RunSetup,
    metrics: RunMetrics,
    tuning: TuningResult | None,
    speed: str,
    preemptions: int,
    out: TextIO,
) -> None:
    if metrics.alpha is None:
        alpha = "none (policy has no alpha)"
    elif tuning is not None:
        alpha = f"{metrics.alpha:g} (auto-tuned over {len(tuning.curve)} values)"
    else:
        alpha = f"{metrics.alpha:g}"
    config = run.config
    rows = [
        ("policy", f"{metrics.policy}: {run.preset.description}"),
        ("alpha", alpha),
        (
            "cluster",
            f"{','.join(run.cluster.gpus)} ({len(run.cluster)} instances, "
            f"{run.cluster.instances[0].model})",
        ),
        calibration_row(run.cluster),
        planner_row(run),
        engine_row(config, preemptions),
        ("traces", f"{', '.join(run.traces)} ({metrics.num_queries} queries)"),
        ("arrivals", f"{config.qps:g} queries/s, cv {config.arrival_cv:g}, seed {config.seed}"),
        ("SLO", f"{config.slo_scale:g} x SLO_base = {metrics.slo_s:.1f} s"),
        ("completed", f"{metrics.completed} / {metrics.num_queries}"),
        ("SLO attainment", f"{100 * metrics.slo_attainment:.1f} %"),
        latency_row(metrics),
        ("throughput", f"{metrics.throughput_qps:.3f} queries/s over {metrics.makespan_s:.1f} s"),
        ("simulator speed", speed),
    ]
    print_rows(rows, out)


def _point_json(point: AlphaPoint) -> dict[str, Any]:
    return {
        "alpha": point.alpha,
        "p95_s": point.p95_s,
        "mean_s": point.mean_s,
        "slo_attainment": point.slo_attainment,
    }


def _cmd_tune(args: argparse.Namespace) -> int:
    run = _setup(args)
    if not run.preset.has_alpha:
        with_alpha = [name for name, p in PRESETS.items() if p.has_alpha]
        raise ConfigError(
            f"policy {run.preset.name!r} has no alpha to tune; policies with alpha: "
            f"{', '.join(with_alpha)}"
        )
    started = time.perf_counter()
    result = tune_alpha(
        run.queries, run.planner, run.preset, run.config, window=args.window, truth=run.truth
    )
    wall_s = time.perf_counter() - started
    info(
        f"{PROG}: replayed {result.window} queries for {len(result.curve)} alpha values "
        f"in {wall_s:.2f} s"
    )
    if args.json:
        print_json(
            {
                "policy": run.preset.name,
                "qps": run.config.qps,
                "seed": run.config.seed,
                "slo_scale": run.config.slo_scale,
                "arrival_cv": run.config.arrival_cv,
                "cluster": list(run.cluster.gpus),
                "calibration": run.cluster.calibration.name,
                "planner_calibration": run.planner.calibration.name,
                "engine": run.config.engine,
                "prefix_caching": run.config.prefix_caching,
                "traces": list(run.traces),
                "num_queries": len(run.queries),
                "window": result.window,
                "best_alpha": result.alpha,
                "best": _point_json(result.best),
                "curve": [_point_json(p) for p in result.curve],
            }
        )
        return 0
    print(
        f"alpha tuning: {run.preset.name} on {','.join(run.cluster.gpus)} "
        f"(calibration {run.cluster.calibration.name}, planner {run.planner.calibration.name}, "
        f"engine {engine_row(run.config)[1]}), "
        f"{run.config.qps:g} queries/s, {result.window} queries, seed {run.config.seed}"
    )
    print(f"{'alpha':>6}  {'P95 (s)':>9}  {'mean (s)':>9}  {'attainment':>10}")
    for p in result.curve:
        mark = "  <- best" if p.alpha == result.alpha else ""
        print(
            f"{p.alpha:>6.3g}  {p.p95_s:>9.1f}  {p.mean_s:>9.1f}  "
            f"{100 * p.slo_attainment:>9.1f}%{mark}"
        )
    print(f"best alpha: {result.alpha:g} (P95 {result.best.p95_s:.1f} s)")
    return 0
