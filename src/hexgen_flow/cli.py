"""The ``hexgen-flow`` command line: ``simulate``, ``tune``, ``policies`` and ``bench``.

A thin adapter over the library: it parses arguments, builds the run's queries, cluster,
preset and `SimConfig`, calls `simulate` / `tune_alpha` / `run_bench`, and prints.

Output contract:

- ``--json`` prints exactly one JSON object on stdout (one line); progress and information
  go to stderr. Non-finite numbers are written as ``null``.
- Bad input (missing or malformed trace, unknown policy/GPU/model, bad option value) exits
  with code 2 and one line on stderr, ``hexgen-flow: error: ...``; never a traceback.
- Ctrl-C exits with code 130 without a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TextIO

from hexgen_flow import __version__
from hexgen_flow.cluster import DEFAULT_CLUSTER, DEFAULT_MODEL, Cluster, parse_cluster
from hexgen_flow.errors import ConfigError, HexgenFlowError
from hexgen_flow.metrics import RunMetrics
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
        "GPU clusters: simulator, alpha tuner and benchmark.",
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
    return parser


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


def _finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _print_json(doc: dict[str, Any]) -> None:
    print(json.dumps(_finite(doc), allow_nan=False))


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


# ------------------------------------------------------------------------------------ main


def _one_line(message: str) -> str:
    return " ".join(message.split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            raise UsageError(
                f"choose a command: simulate, tune, policies, bench (see {PROG} --help)"
            )
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
