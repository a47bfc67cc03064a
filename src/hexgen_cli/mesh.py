"""``replay``, ``ask`` and ``status``: the service mesh, through the Python client (``up`` is
`hexgen_cli.up`).

The client (grpc, redis) is imported inside each command, once `require_mesh` has checked
that the mesh's packages are installed: the simulator commands never load them, and a core
install (``pip install hexgen-flow``) gets one clear line instead of a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import sys
import uuid
from typing import Any

from hexgen_cli.options import (
    DEFAULT_ARRIVAL_CV,
    DEFAULT_POLICY,
    DEFAULT_SEED,
    DEFAULT_SLO_SCALE,
    DEFAULT_TRACE,
    PROG,
    add_calibration_option,
    add_coordinator_option,
    coordinator_client,
    info,
    integer,
    positive_float,
    positive_int,
    print_json,
    print_rows,
    unit_interval,
)
from hexgen_cli.simulation import latency_row
from hexgen_flow.cluster import DEFAULT_CLUSTER
from hexgen_flow.errors import ConfigError
from hexgen_flow.metrics import RunMetrics
from hexgen_flow.traces import load_traces, take_queries
from hexgen_flow.workload import Query

__all__ = ["add_cluster_options", "register", "require_mesh"]

MESH_PACKAGES = ("grpc", "redis", "google.protobuf", "opentelemetry.sdk")
"""What the mesh commands need beyond the core: the ``mesh`` extra."""


def require_mesh(command: str) -> None:
    """Raise ConfigError (one line, exit 2) when the mesh extra is not installed."""
    missing = [name for name in MESH_PACKAGES if not _installed(name)]
    if missing:
        raise ConfigError(
            f"`{PROG} {command}` needs the service mesh's packages ({', '.join(missing)} "
            f"not installed): pip install 'hexgen-flow[mesh]'"
        )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


def register(commands: Any) -> None:
    """Add ``replay``, ``ask`` and ``status`` to the command parser (``up``: `hexgen_cli.up`)."""
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
        type=positive_float,
        required=True,
        metavar="FLOAT",
        help="mean query arrival rate, queries per cluster second",
    )
    rep.add_argument(
        "--num-queries",
        type=positive_int,
        default=None,
        metavar="N",
        help="queries to run, taken from the traces in order and cycled (default: each once)",
    )
    rep.add_argument(
        "--seed", type=integer, default=DEFAULT_SEED, metavar="INT", help="arrival seed (default 0)"
    )
    rep.add_argument(
        "--retry-rejected",
        action="store_true",
        help="submit a query that admission control refused again after the coordinator's "
        "retry-after hint (default: count it as rejected)",
    )
    rep.add_argument(
        "--arrival-cv",
        type=positive_float,
        default=DEFAULT_ARRIVAL_CV,
        metavar="FLOAT",
        help=f"coefficient of variation of inter-arrival gaps (default {DEFAULT_ARRIVAL_CV})",
    )
    rep.add_argument(
        "--slo-scale",
        type=positive_float,
        default=None,
        metavar="FLOAT",
        help="SLO = scale x SLO_base for queries without their own (default: the "
        "coordinator's scale)",
    )
    add_coordinator_option(rep)
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
    add_coordinator_option(ask)
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
        type=integer,
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
        type=positive_float,
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
    add_coordinator_option(st)
    st.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    st.set_defaults(handler=_cmd_status)


def add_cluster_options(parser: argparse.ArgumentParser, *, time_scale: float) -> None:
    """The options `up` and `demo` share: what the local cluster runs."""
    parser.add_argument(
        "--cluster",
        default=DEFAULT_CLUSTER,
        metavar="GPUS|FILE.yaml",
        help=f"instances, one simulated worker each (default {DEFAULT_CLUSTER})",
    )
    add_calibration_option(parser)  # the coordinator's, the workers' and the tuner's alike
    parser.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        metavar="NAME",
        help=f"the coordinator's policy (default {DEFAULT_POLICY})",
    )
    parser.add_argument(
        "--alpha",
        type=unit_interval,
        default=None,
        metavar="FLOAT",
        help="the coordinator's initial alpha (default: the coordinator's)",
    )
    parser.add_argument(
        "--slo-scale",
        type=positive_float,
        default=DEFAULT_SLO_SCALE,
        metavar="FLOAT",
        help=f"the coordinator's default SLO scale (default {DEFAULT_SLO_SCALE})",
    )
    parser.add_argument(
        "--time-scale",
        type=positive_float,
        default=time_scale,
        metavar="FLOAT",
        help=f"cluster seconds per wall second: simulated engines run this much faster "
        f"(default {time_scale:g})",
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        metavar="URL",
        help="a running Redis to use: redis://HOST:PORT/DB, or behind Sentinel "
        "redis+sentinel://HOST:PORT[,...]/SERVICE (default: start a private redis-server "
        "on a free port)",
    )


# -------------------------------------------------------------------------------- commands


def _cmd_replay(args: argparse.Namespace) -> int:
    require_mesh("replay")
    from hexgen_launch.replay import replay  # noqa: PLC0415 - loads grpc

    traces = tuple(args.trace or [DEFAULT_TRACE])
    queries = take_queries(load_traces(traces), args.num_queries)
    progress = sys.stderr.isatty() if args.progress is None else args.progress

    async def run() -> tuple[RunMetrics, Any]:
        async with coordinator_client(args) as client:
            status = await client.status()
            info(
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
                retry_rejected=args.retry_rejected,
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
        print_json(doc)
        return 0
    alpha = "none (policy has no alpha)" if metrics.alpha is None else f"{metrics.alpha:g}"
    rows = [
        ("coordinator", f"{args.coordinator} (time scale {status.time_scale:g}x)"),
        ("policy", metrics.policy),
        ("alpha", alpha),
        ("cluster", f"{','.join(gpus)} ({len(gpus)} instances)"),
        ("traces", f"{', '.join(traces)} ({len(queries)} queries)"),
        ("arrivals", f"{args.qps:g} queries/s, cv {args.arrival_cv:g}, seed {args.seed}"),
        ("SLO", f"{slo_scale:g} x SLO_base = {metrics.slo_s:.1f} s"),
        (
            "admitted",
            f"{metrics.extra.get('admitted', metrics.num_queries)} of "
            f"{metrics.extra.get('submitted', metrics.num_queries)} submitted "
            f"({metrics.extra.get('rejected', 0)} rejected by admission control, "
            f"{metrics.extra.get('best_effort', 0)} best-effort)",
        ),
        (
            "completed",
            f"{metrics.completed} / {metrics.num_queries} admitted "
            f"({metrics.extra.get('failed', 0)} failed)",
        ),
        ("SLO attainment", f"{100 * metrics.slo_attainment:.1f} % of the admitted"),
        latency_row(metrics),
        ("throughput", f"{metrics.throughput_qps:.3f} queries/s over {metrics.makespan_s:.1f} s"),
    ]
    print_rows(rows)
    return 0


def _note_resubmitted(metrics: RunMetrics) -> None:
    resubmitted = metrics.extra.get("resubmitted", 0)
    if resubmitted:
        info(
            f"{PROG}: note: {resubmitted} of the query ids were already known to the "
            "coordinator; their earlier results are reported (replay is idempotent on ids)"
        )
    if "alpha_at_start" in metrics.extra:
        info(
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
    require_mesh("ask")
    from hexgen_client.report import event_line, state_name  # noqa: PLC0415 - loads grpc

    query = _ask_query(args)
    query_id = args.query_id or f"{query.query_id}@{uuid.uuid4().hex[:8]}"
    query = dataclasses.replace(query, query_id=query_id, arrival_s=None)

    async def run() -> Any:
        async with coordinator_client(args) as client:
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

    query_info = asyncio.run(run())
    latency = query_info.finished_s - query_info.arrival_s
    verdict = "met" if latency <= query_info.slo_s else "missed"
    print(
        f"{state_name(query_info.state).lower()}: {latency:.1f} s end to end, SLO "
        f"{query_info.slo_s:.1f} s ({verdict}), "
        f"{query_info.calls_done}/{query_info.calls_total} calls"
    )
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    require_mesh("status")
    from hexgen_client.report import status_json, status_lines  # noqa: PLC0415 - loads grpc

    async def run() -> Any:
        async with coordinator_client(args) as client:
            return await client.status()

    status = asyncio.run(run())
    if args.json:
        doc = status_json(status)
        doc["coordinator"] = args.coordinator
        print_json(doc)
    else:
        print("\n".join(status_lines(status, args.coordinator)))
    return 0
