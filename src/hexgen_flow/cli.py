"""The ``hexgen-flow`` command line: ``simulate``, ``tune``, ``policies`` and ``bench`` on the
library, and ``up``, ``replay``, ``ask``, ``status`` and ``demo`` on the service mesh.

A thin adapter over the library: it parses arguments, builds the run's queries, cluster,
preset and `SimConfig`, calls `simulate` / `tune_alpha` / `run_bench`, and prints. The mesh
commands drive the Python client (``hexgen_client``), imported inside each command so that
the library commands never load grpc.

Output contract:

- ``--json`` prints exactly one JSON object on stdout (one line); progress and information
  go to stderr. Non-finite numbers are written as ``null``.
- Bad input (missing or malformed trace, unknown policy/GPU/model, bad option value) exits
  with code 2 and one line on stderr, ``hexgen-flow: error: ...``; never a traceback.
- Ctrl-C exits with code 130 without a traceback (``up`` and ``demo`` stop their processes
  first; ``up`` then exits with 0).
- A coordinator that does not answer: ``hexgen-flow: error: cannot reach the coordinator at
  ADDR: is `hexgen-flow up` running?``, exit code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TextIO

from hexgen_client.addresses import (  # constants only: no grpc at import time
    DEFAULT_COORDINATOR,
    DEFAULT_REDIS_PREFIX,
    DEFAULT_TUNER,
)
from hexgen_flow import __version__
from hexgen_flow.cluster import DEFAULT_CLUSTER, DEFAULT_MODEL, Cluster, parse_cluster
from hexgen_flow.errors import ConfigError, HexgenFlowError
from hexgen_flow.metrics import RunMetrics, json_safe
from hexgen_flow.policies.presets import PRESETS, Preset, resolve_policy
from hexgen_flow.policies.registration import BUDGETS, DISPATCHERS, QUEUES
from hexgen_flow.policies.registry import Registry
from hexgen_flow.sim.simulator import SimConfig, simulate
from hexgen_flow.traces import load_traces, take_queries
from hexgen_flow.tuning import AlphaPoint, TuningResult, auto_tune, tune_alpha
from hexgen_flow.workload import Query

__all__ = ["build_parser", "main"]

PROG = "hexgen-flow"
DEFAULT_TRACE = "trace1"
DEFAULT_POLICY = "hexgen-flow"
DEFAULT_QPS = 0.5
DEFAULT_SLO_SCALE = 3.0
DEFAULT_SEED = 0
DEFAULT_ARRIVAL_CV = 1.0
DEFAULT_DEMO_TRACE = "trace3"
DEFAULT_DEMO_QUERIES = 100
DEFAULT_DEMO_TIME_SCALE = 20.0
COMMANDS = ("simulate", "tune", "policies", "bench", "up", "replay", "ask", "status", "demo")
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A command-line error found by argparse (unknown option, bad value)."""


class _Parser(argparse.ArgumentParser):
    """argparse, except that errors raise `UsageError` (printed by `main` as one line)
    instead of printing the usage block and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


# ------------------------------------------------------------------------ option value types


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _alpha(text: str) -> float | None:
    """A float in [0, 1], or None for ``auto``."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number in [0, 1] or 'auto', got {text!r}"
        ) from None
    if not 0.0 <= value <= 1.0:  # False for NaN too
        raise argparse.ArgumentTypeError(f"must be in [0, 1] or 'auto', got {text}")
    return value


# ---------------------------------------------------------------------------------- parser


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
    parser.add_argument("--policy", default=DEFAULT_POLICY, metavar="NAME", help=policy_help)
    parser.add_argument(
        "--qps",
        type=_positive_float,
        default=DEFAULT_QPS,
        metavar="FLOAT",
        help=f"mean query arrival rate, queries/s (default {DEFAULT_QPS})",
    )
    parser.add_argument(
        "--num-queries",
        type=_positive_int,
        default=None,
        metavar="N",
        help="queries to run, taken from the traces in order and cycled (default: each "
        "trace query once)",
    )
    parser.add_argument(
        "--slo-scale",
        type=_positive_float,
        default=DEFAULT_SLO_SCALE,
        metavar="FLOAT",
        help=f"SLO = scale x SLO_base (default {DEFAULT_SLO_SCALE})",
    )
    parser.add_argument(
        "--seed",
        type=_int,
        default=DEFAULT_SEED,
        metavar="INT",
        help=f"seed of the arrival process and the policies (default {DEFAULT_SEED})",
    )
    parser.add_argument(
        "--arrival-cv",
        type=_positive_float,
        default=DEFAULT_ARRIVAL_CV,
        metavar="FLOAT",
        help=f"coefficient of variation of inter-arrival gaps: 1 = Poisson, > 1 = bursty "
        f"(default {DEFAULT_ARRIVAL_CV})",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object on stdout instead of a table"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Deadline-aware scheduling of agentic LLM workflows on heterogeneous "
        "GPU clusters: simulator, alpha tuner and benchmark, and the service mesh (up, "
        "replay, ask, status, demo).",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

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
        type=_alpha,
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
        type=_positive_int,
        default=None,
        metavar="N",
        help="replay only the last N queries (default: all)",
    )
    tune.set_defaults(handler=_cmd_tune)

    pol = commands.add_parser(
        "policies",
        help="list presets and registered policies",
        description="List the policy presets and the registered dispatch, queue and "
        "stage-budget policies with their parameters.",
    )
    pol.add_argument("--json", action="store_true", help="print one JSON object")
    pol.set_defaults(handler=_cmd_policies)

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
        type=_positive_int,
        default=2,
        metavar="N",
        help="worker processes (default 2; 1 runs everything in this process)",
    )
    bench.set_defaults(handler=_cmd_bench)
    _add_mesh_commands(commands)
    return parser


def _address(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT, e.g. {DEFAULT_COORDINATOR}; got {text!r}"
        )
    return text


def _unit_interval(text: str) -> float:
    value = _alpha(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def _add_coordinator_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--coordinator",
        type=_address,
        default=DEFAULT_COORDINATOR,
        metavar="HOST:PORT",
        help=f"the coordinator's address (default {DEFAULT_COORDINATOR})",
    )


def _add_cluster_options(parser: argparse.ArgumentParser, *, time_scale: float) -> None:
    """The options `up` and `demo` share: what the local cluster runs."""
    parser.add_argument(
        "--cluster",
        default=DEFAULT_CLUSTER,
        metavar="GPUS|FILE.yaml",
        help=f"instances, one simulated worker each (default {DEFAULT_CLUSTER})",
    )
    parser.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        metavar="NAME",
        help=f"the coordinator's policy (default {DEFAULT_POLICY})",
    )
    parser.add_argument(
        "--alpha",
        type=_unit_interval,
        default=None,
        metavar="FLOAT",
        help="the coordinator's initial alpha (default: the coordinator's)",
    )
    parser.add_argument(
        "--slo-scale",
        type=_positive_float,
        default=DEFAULT_SLO_SCALE,
        metavar="FLOAT",
        help=f"the coordinator's default SLO scale (default {DEFAULT_SLO_SCALE})",
    )
    parser.add_argument(
        "--time-scale",
        type=_positive_float,
        default=time_scale,
        metavar="FLOAT",
        help=f"cluster seconds per wall second: simulated engines run this much faster "
        f"(default {time_scale:g})",
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        metavar="URL",
        help="a running Redis to use (default: start a private redis-server on a free port)",
    )


def _add_mesh_commands(commands: Any) -> None:
    up = commands.add_parser(
        "up",
        help="run a local mesh: Redis, coordinator, tuner, one simulated worker per instance",
        description="Start the coordinator, the alpha tuner and one worker per instance "
        "(simulated engines) as local processes, with a private redis-server unless "
        "--redis-url is given; wait until every worker has connected, print the addresses, "
        "and run until Ctrl-C or SIGTERM, which stops everything.",
    )
    _add_cluster_options(up, time_scale=1.0)
    up.add_argument(
        "--listen",
        type=_address,
        default=DEFAULT_COORDINATOR,
        metavar="HOST:PORT",
        help=f"the coordinator's address; port 0 picks a free one (default {DEFAULT_COORDINATOR})",
    )
    up.add_argument(
        "--redis-prefix",
        default=DEFAULT_REDIS_PREFIX,
        metavar="PREFIX",
        help=f"prefix of the mesh's Redis keys (default {DEFAULT_REDIS_PREFIX})",
    )
    up.add_argument(
        "--tuner",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the alpha tuner (default: yes)",
    )
    up.add_argument(
        "--tuner-listen",
        type=_address,
        default=DEFAULT_TUNER,
        metavar="HOST:PORT",
        help=f"the tuner's address (default {DEFAULT_TUNER})",
    )
    up.add_argument(
        "--tuner-period-s",
        type=_positive_float,
        default=30.0,
        metavar="FLOAT",
        help="wall seconds between tuning runs (default 30)",
    )
    up.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the services write their logs (default: a temporary folder, kept)",
    )
    up.set_defaults(handler=_cmd_up)

    rep = commands.add_parser(
        "replay",
        help="drive a running mesh with a trace and print the same metrics as simulate",
        description="Submit the trace's queries to a running coordinator at the simulator's "
        "arrival times for the same seed (scaled by the coordinator's time scale), wait for "
        "all of them, and print the metrics simulate prints, from the coordinator's times.",
    )
    rep.add_argument(
        "--trace",
        action="append",
        metavar="FILE",
        help=f"trace file or built-in name; repeat to concatenate (default {DEFAULT_TRACE})",
    )
    rep.add_argument(
        "--qps",
        type=_positive_float,
        required=True,
        metavar="FLOAT",
        help="mean query arrival rate, queries per cluster second",
    )
    rep.add_argument(
        "--num-queries",
        type=_positive_int,
        default=None,
        metavar="N",
        help="queries to run, taken from the traces in order and cycled (default: each once)",
    )
    rep.add_argument(
        "--seed", type=_int, default=DEFAULT_SEED, metavar="INT", help="arrival seed (default 0)"
    )
    rep.add_argument(
        "--arrival-cv",
        type=_positive_float,
        default=DEFAULT_ARRIVAL_CV,
        metavar="FLOAT",
        help=f"coefficient of variation of inter-arrival gaps (default {DEFAULT_ARRIVAL_CV})",
    )
    rep.add_argument(
        "--slo-scale",
        type=_positive_float,
        default=None,
        metavar="FLOAT",
        help="SLO = scale x SLO_base for queries without their own (default: the "
        "coordinator's scale)",
    )
    _add_coordinator_option(rep)
    rep.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress bar on stderr (default: when stderr is a terminal)",
    )
    rep.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    rep.set_defaults(handler=_cmd_replay)

    ask = commands.add_parser(
        "ask",
        help="run one query on a running mesh and print its events as they stream",
        description="Run one query (RunQuery) and print its events as the coordinator "
        "streams them.",
    )
    _add_coordinator_option(ask)
    source = ask.add_mutually_exclusive_group()
    source.add_argument(
        "--trace",
        default=None,
        metavar="NAME|FILE",
        help=f"take the query from a trace (default {DEFAULT_TRACE})",
    )
    source.add_argument(
        "--file", default=None, metavar="FILE.jsonl", help="take the query from a workflow file"
    )
    ask.add_argument(
        "--index",
        type=_int,
        default=0,
        metavar="N",
        help="which query of the trace or file, from 0 (default 0)",
    )
    ask.add_argument(
        "--query-id",
        default=None,
        metavar="ID",
        help="the id to submit under (default: the query's id plus a unique suffix, so each "
        "ask runs anew; an id already known shows that query's events)",
    )
    ask.add_argument(
        "--slo-scale",
        type=_positive_float,
        default=None,
        metavar="FLOAT",
        help="SLO = scale x SLO_base if the query has none (default: the coordinator's)",
    )
    ask.set_defaults(handler=_cmd_ask)

    st = commands.add_parser(
        "status",
        help="show a running mesh: instances, load, policy and alpha",
        description="Print the coordinator's ClusterStatus as a table.",
    )
    _add_coordinator_option(st)
    st.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    st.set_defaults(handler=_cmd_status)

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
        type=_positive_int,
        default=DEFAULT_DEMO_QUERIES,
        metavar="N",
        help=f"queries (default {DEFAULT_DEMO_QUERIES})",
    )
    demo.add_argument(
        "--qps",
        type=_positive_float,
        default=DEFAULT_QPS,
        metavar="FLOAT",
        help=f"arrival rate, queries per cluster second (default {DEFAULT_QPS})",
    )
    demo.add_argument(
        "--seed", type=_int, default=DEFAULT_SEED, metavar="INT", help="arrival seed (default 0)"
    )
    _add_cluster_options(demo, time_scale=DEFAULT_DEMO_TIME_SCALE)
    demo.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    demo.set_defaults(handler=_cmd_demo)


# ------------------------------------------------------------------------------- run setup


@dataclass(frozen=True, slots=True)
class RunSetup:
    """What one ``simulate``/``tune`` invocation runs."""

    traces: tuple[str, ...]
    queries: list[Query]
    cluster: Cluster
    preset: Preset
    config: SimConfig


def _setup(args: argparse.Namespace) -> RunSetup:
    preset = resolve_policy(args.policy)
    traces = tuple(args.trace or [DEFAULT_TRACE])
    queries = take_queries(load_traces(traces), args.num_queries)
    cluster = parse_cluster(args.cluster, args.model)
    config = SimConfig(
        qps=args.qps, slo_scale=args.slo_scale, seed=args.seed, arrival_cv=args.arrival_cv
    )
    return RunSetup(traces, queries, cluster, preset, config)


def _print_json(doc: dict[str, Any]) -> None:
    print(json.dumps(json_safe(doc), allow_nan=False))


def _info(message: str) -> None:
    print(message, file=sys.stderr)


def _point_json(point: AlphaPoint) -> dict[str, Any]:
    return {
        "alpha": point.alpha,
        "p95_s": point.p95_s,
        "mean_s": point.mean_s,
        "slo_attainment": point.slo_attainment,
    }


# -------------------------------------------------------------------------------- commands


def _cmd_simulate(args: argparse.Namespace) -> int:
    run = _setup(args)
    preset = run.preset
    tuning: TuningResult | None = None
    if not preset.has_alpha:
        if args.alpha is not None:
            _info(f"{PROG}: note: policy {preset.name!r} has no alpha; --alpha ignored")
    elif args.alpha is None:
        started = time.perf_counter()
        tuning = auto_tune(run.queries, run.cluster, preset, run.config)
        _info(
            f"{PROG}: tuned alpha over {len(tuning.curve)} values on {tuning.window} queries "
            f"(arrival seed {run.config.seed + 1}): {tuning.alpha:g} "
            f"({time.perf_counter() - started:.2f} s)"
        )
        preset = preset.with_alpha(tuning.alpha)
    else:
        preset = preset.with_alpha(args.alpha)

    started = time.perf_counter()
    metrics = simulate(run.queries, run.cluster, preset, run.config)
    wall_s = time.perf_counter() - started
    calls = sum(q.workflow.num_calls for q in run.queries)
    speed = f"{calls:,} LLM calls in {wall_s:.3f} s ({calls / max(wall_s, 1e-9):,.0f} calls/s)"

    if args.json:
        doc = metrics.to_json()
        doc["seed"] = run.config.seed
        doc["cluster"] = list(run.cluster.gpus)
        doc["traces"] = list(run.traces)
        doc["slo_scale"] = run.config.slo_scale
        doc["arrival_cv"] = run.config.arrival_cv
        doc["model"] = run.cluster.instances[0].model
        if tuning is not None:
            doc["alpha_curve"] = [
                {"alpha": p.alpha, "p95_s": p.p95_s, "slo_attainment": p.slo_attainment}
                for p in tuning.curve
            ]
        _print_json(doc)
        _info(f"{PROG}: simulator speed: {speed}")
    else:
        _print_summary(run, metrics, tuning, speed, sys.stdout)
    return 0


def _print_summary(
    run: RunSetup, metrics: RunMetrics, tuning: TuningResult | None, speed: str, out: TextIO
) -> None:
    lat = metrics.latency_summary()
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
        ("traces", f"{', '.join(run.traces)} ({metrics.num_queries} queries)"),
        ("arrivals", f"{config.qps:g} queries/s, cv {config.arrival_cv:g}, seed {config.seed}"),
        ("SLO", f"{config.slo_scale:g} x SLO_base = {metrics.slo_s:.1f} s"),
        ("completed", f"{metrics.completed} / {metrics.num_queries}"),
        ("SLO attainment", f"{100 * metrics.slo_attainment:.1f} %"),
        (
            "latency (s)",
            f"mean {lat['mean']:.1f}   p50 {lat['p50']:.1f}   "
            f"p95 {lat['p95']:.1f}   p99 {lat['p99']:.1f}",
        ),
        ("throughput", f"{metrics.throughput_qps:.3f} queries/s over {metrics.makespan_s:.1f} s"),
        ("simulator speed", speed),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}", file=out)


def _cmd_tune(args: argparse.Namespace) -> int:
    run = _setup(args)
    if not run.preset.has_alpha:
        with_alpha = [name for name, p in PRESETS.items() if p.has_alpha]
        raise ConfigError(
            f"policy {run.preset.name!r} has no alpha to tune; policies with alpha: "
            f"{', '.join(with_alpha)}"
        )
    started = time.perf_counter()
    result = tune_alpha(run.queries, run.cluster, run.preset, run.config, window=args.window)
    wall_s = time.perf_counter() - started
    _info(
        f"{PROG}: replayed {result.window} queries for {len(result.curve)} alpha values "
        f"in {wall_s:.2f} s"
    )
    if args.json:
        _print_json(
            {
                "policy": run.preset.name,
                "qps": run.config.qps,
                "seed": run.config.seed,
                "slo_scale": run.config.slo_scale,
                "arrival_cv": run.config.arrival_cv,
                "cluster": list(run.cluster.gpus),
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
        f"alpha tuning: {run.preset.name} on {','.join(run.cluster.gpus)}, "
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


def _registry_json(registry: Registry[Any]) -> dict[str, Any]:
    return {
        name: {
            "description": _first_line(registry.factory(name).__doc__),
            "parameters": {k: _jsonable(v) for k, v in registry.parameters(name).items()},
        }
        for name in registry.names()
    }


def _first_line(doc: str | None) -> str:
    lines = (doc or "").strip().splitlines()
    return lines[0].rstrip(":") if lines else ""


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def _cmd_policies(args: argparse.Namespace) -> int:
    families = (("dispatch", DISPATCHERS), ("queue", QUEUES), ("budget", BUDGETS))
    if args.json:
        _print_json(
            {
                "presets": {
                    p.name: {
                        "description": p.description,
                        "dispatch": {"name": p.dispatch.name, "params": dict(p.dispatch.params)},
                        "queue": {"name": p.queue.name, "params": dict(p.queue.params)},
                        "budget": {"name": p.budget.name, "params": dict(p.budget.params)},
                        "has_alpha": p.has_alpha,
                    }
                    for p in PRESETS.values()
                },
                **{family: _registry_json(reg) for family, reg in families},
            }
        )
        return 0
    print("Presets (--policy NAME):")
    width = max(len(name) for name in PRESETS)
    for p in PRESETS.values():
        parts = [
            _ref(p.dispatch.name, p.dispatch.params),
            _ref(p.queue.name, p.queue.params),
            _ref(p.budget.name, p.budget.params),
        ]
        print(f"  {p.name:<{width}}  {p.description}")
        print(f"  {'':<{width}}  = {' + '.join(parts)}{'  [alpha]' if p.has_alpha else ''}")
    print()
    print("Or combine registered policies with their defaults: --policy DISPATCH+QUEUE[+BUDGET]")
    for family, registry in families:
        print()
        print(f"{family} policies:")
        names = registry.names()
        nwidth = max(len(n) for n in names)
        for name in names:
            params = registry.parameters(name)
            shown = ", ".join(f"{k}={v!r}" for k, v in params.items()) or "no parameters"
            print(f"  {name:<{nwidth}}  {_first_line(registry.factory(name).__doc__)}")
            print(f"  {'':<{nwidth}}  ({shown})")
    return 0


def _ref(name: str, params: Any) -> str:
    if not params:
        return name
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in params.items())})"


def _cmd_bench(args: argparse.Namespace) -> int:
    from hexgen_flow.bench import FULL_PLAN, QUICK_PLAN, run_bench  # noqa: PLC0415 - matplotlib is heavy; only bench needs it

    plan = QUICK_PLAN if args.quick else FULL_PLAN
    out: Path = args.out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot create the folder ({exc.strerror})") from None
    run_bench(plan, out, workers=args.workers)
    return 0


# ------------------------------------------------------------------------- the service mesh
# The mesh commands import hexgen_client (grpc, redis) inside the function, so that the
# library commands never load them.


def _cmd_up(args: argparse.Namespace) -> int:

    from hexgen_client.cluster import LocalCluster, LocalClusterConfig  # noqa: PLC0415 - loads grpc

    cluster = LocalCluster(  # checks the cluster and the policy before starting anything
        LocalClusterConfig(
            cluster=args.cluster,
            policy=args.policy,
            alpha=args.alpha,
            slo_scale=args.slo_scale,
            time_scale=args.time_scale,
            listen=args.listen,
            redis_url=args.redis_url,
            redis_prefix=args.redis_prefix,
            tuner=args.tuner,
            tuner_listen=args.tuner_listen,
            tuner_period_s=args.tuner_period_s,
            log_dir=args.log_dir,
            keep_logs=True,
        )
    )

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        _info(f"{PROG}: starting {len(cluster.gpus)} simulated workers ({args.cluster}) ...")
        cluster.start()
        _print_up(cluster, args)
        while True:
            time.sleep(0.5)
            for proc in cluster.exited():
                raise proc.failure(f"exited with code {proc.returncode}")
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _info(f"{PROG}: stopping ...")
        cluster.stop()
        _info(f"{PROG}: stopped")
        return 0
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, previous)


def _print_up(cluster: Any, args: argparse.Namespace) -> None:
    redis_note = "given" if args.redis_url else "private, removed on exit"
    rows = [
        ("coordinator", cluster.coordinator_address),
        (
            "tuner",
            f"{cluster.tuner_address} (every {args.tuner_period_s:g} s)"
            if cluster.tuner_address
            else "off",
        ),
        ("redis", f"{cluster.redis_url} ({redis_note}, keys {args.redis_prefix}*)"),
        ("instances", f"{','.join(cluster.gpus)}: simulated engines"),
        ("policy", args.policy + (f", alpha {args.alpha:g}" if args.alpha is not None else "")),
        ("time scale", f"{args.time_scale:g} cluster seconds per wall second"),
        ("logs", str(cluster.log_dir)),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"{PROG} up: the mesh is running")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    print("Ctrl-C stops it.", flush=True)


def _cmd_replay(args: argparse.Namespace) -> int:

    from hexgen_client.client import CoordinatorClient  # noqa: PLC0415 - loads grpc
    from hexgen_client.replay import replay  # noqa: PLC0415 - loads grpc

    traces = tuple(args.trace or [DEFAULT_TRACE])
    queries = take_queries(load_traces(traces), args.num_queries)
    progress = sys.stderr.isatty() if args.progress is None else args.progress

    async def run() -> tuple[RunMetrics, Any]:
        async with CoordinatorClient(args.coordinator) as client:
            status = await client.status()
            _info(
                f"{PROG}: replaying {len(queries)} queries at {args.qps:g} q/s into "
                f"{args.coordinator} ({status.policy}, time scale {status.time_scale:g}x)"
            )
            metrics = await replay(
                client,
                queries,
                args.qps,
                seed=args.seed,
                arrival_cv=args.arrival_cv,
                slo_scale=args.slo_scale,
                progress=progress,
            )
            return metrics, await client.status()

    metrics, status = asyncio.run(run())
    _note_resubmitted(metrics)
    gpus = [i.gpu for i in sorted(status.instances, key=lambda i: i.index)]
    slo_scale = args.slo_scale if args.slo_scale is not None else metrics.slo_s / status.slo_base_s
    if args.json:
        doc = metrics.to_json()
        doc["seed"] = args.seed
        doc["cluster"] = gpus
        doc["traces"] = list(traces)
        doc["slo_scale"] = slo_scale
        doc["arrival_cv"] = args.arrival_cv
        doc["model"] = status.instances[0].model if status.instances else None
        doc["coordinator"] = args.coordinator
        doc["time_scale"] = status.time_scale
        _print_json(doc)
        return 0
    lat = metrics.latency_summary()
    alpha = "none (policy has no alpha)" if metrics.alpha is None else f"{metrics.alpha:g}"
    rows = [
        ("coordinator", f"{args.coordinator} (time scale {status.time_scale:g}x)"),
        ("policy", metrics.policy),
        ("alpha", alpha),
        ("cluster", f"{','.join(gpus)} ({len(gpus)} instances)"),
        ("traces", f"{', '.join(traces)} ({metrics.num_queries} queries)"),
        ("arrivals", f"{args.qps:g} queries/s, cv {args.arrival_cv:g}, seed {args.seed}"),
        ("SLO", f"{slo_scale:g} x SLO_base = {metrics.slo_s:.1f} s"),
        ("completed", f"{metrics.completed} / {metrics.num_queries}"),
        ("SLO attainment", f"{100 * metrics.slo_attainment:.1f} %"),
        (
            "latency (s)",
            f"mean {lat['mean']:.1f}   p50 {lat['p50']:.1f}   "
            f"p95 {lat['p95']:.1f}   p99 {lat['p99']:.1f}",
        ),
        ("throughput", f"{metrics.throughput_qps:.3f} queries/s over {metrics.makespan_s:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _note_resubmitted(metrics: RunMetrics) -> None:
    resubmitted = metrics.extra.get("resubmitted", 0)
    if resubmitted:
        _info(
            f"{PROG}: note: {resubmitted} of the query ids were already known to the "
            "coordinator; their earlier results are reported (replay is idempotent on ids)"
        )
    if "alpha_at_start" in metrics.extra:
        _info(
            f"{PROG}: note: alpha changed during the run ({metrics.extra['alpha_at_start']:g} "
            f"-> {metrics.alpha:g}); the final one is reported"
        )


def _ask_query(args: argparse.Namespace) -> Query:
    name = args.file or args.trace or DEFAULT_TRACE
    queries = load_traces([name])
    index: int = args.index
    if not 0 <= index < len(queries):
        raise ConfigError(f"--index {index}: {name} has queries 0 to {len(queries) - 1}")
    return queries[index]


def _cmd_ask(args: argparse.Namespace) -> int:

    from hexgen_client.client import CoordinatorClient  # noqa: PLC0415 - loads grpc
    from hexgen_client.report import event_line, state_name  # noqa: PLC0415 - loads grpc

    query = _ask_query(args)
    query_id = args.query_id or f"{query.query_id}@{uuid.uuid4().hex[:8]}"
    query = dataclasses.replace(query, query_id=query_id, arrival_s=None)

    async def run() -> Any:
        async with CoordinatorClient(args.coordinator) as client:
            header = (
                f"query {query_id}: {query.workflow.num_calls} calls in "
                f"{len(query.workflow.stages)} stages (times in cluster seconds)"
            )
            async for event in client.run(query, slo_scale=args.slo_scale):
                if header:  # once the coordinator has answered
                    print(header)
                    header = ""
                print(event_line(event), flush=True)
            return (await client.get(query_id)).query

    info = asyncio.run(run())
    latency = info.finished_s - info.arrival_s
    verdict = "met" if latency <= info.slo_s else "missed"
    print(
        f"{state_name(info.state).lower()}: {latency:.1f} s end to end, SLO {info.slo_s:.1f} s "
        f"({verdict}), {info.calls_done}/{info.calls_total} calls"
    )
    return 0


def _cmd_status(args: argparse.Namespace) -> int:

    from hexgen_client.client import CoordinatorClient  # noqa: PLC0415 - loads grpc
    from hexgen_client.report import status_json, status_lines  # noqa: PLC0415 - loads grpc

    async def run() -> Any:
        async with CoordinatorClient(args.coordinator) as client:
            return await client.status()

    status = asyncio.run(run())
    if args.json:
        doc = status_json(status)
        doc["coordinator"] = args.coordinator
        _print_json(doc)
    else:
        print("\n".join(status_lines(status, args.coordinator)))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:

    from hexgen_client.client import CoordinatorClient  # noqa: PLC0415 - loads grpc
    from hexgen_client.cluster import LocalCluster, LocalClusterConfig  # noqa: PLC0415 - loads grpc
    from hexgen_client.replay import replay  # noqa: PLC0415 - loads grpc

    queries = take_queries(load_traces([args.trace]), args.num_queries)
    cluster_spec = parse_cluster(args.cluster)
    preset = resolve_policy(args.policy)
    config = SimConfig(qps=args.qps, slo_scale=args.slo_scale, seed=args.seed)
    mesh = LocalCluster(
        LocalClusterConfig(
            cluster=args.cluster,
            policy=args.policy,
            alpha=args.alpha,
            slo_scale=args.slo_scale,
            time_scale=args.time_scale,
            listen="127.0.0.1:0",
            redis_url=args.redis_url,
            # a Redis of one's own may hold an earlier demo's queries under the same ids
            redis_prefix=f"hf-demo-{uuid.uuid4().hex[:8]}:" if args.redis_url else "hf:",
            tuner=False,  # alpha stays put, so the simulator can be given the very same one
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

    _info(
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
        _print_json(
            {
                "engines": "simulated",
                "trace": args.trace,
                "num_queries": len(queries),
                "qps": args.qps,
                "seed": args.seed,
                "cluster": list(cluster_spec.gpus),
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
        f"{','.join(cluster_spec.gpus)}, {measured.policy} ({alpha}), "
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


# ------------------------------------------------------------------------------------ main


def _one_line(message: str) -> str:
    return " ".join(message.split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            raise UsageError(f"choose a command: {', '.join(COMMANDS)} (see {PROG} --help)")
        status: int = args.handler(args)
        sys.stdout.flush()
    except UsageError as exc:
        print(f"{PROG}: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except HexgenFlowError as exc:
        print(f"{PROG}: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`hexgen-flow policies | head`): not an error of ours. Point
        # stdout at devnull so that the interpreter's final flush does not complain again.
        _silence_stdout()
        return 1
    return status


def _silence_stdout() -> None:
    import os  # noqa: PLC0415 - only needed on this rare path

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
