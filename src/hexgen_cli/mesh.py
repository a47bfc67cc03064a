"""``up``, ``replay``, ``ask`` and ``status``: the service mesh, through the Python client.

The client (grpc, redis) is imported inside each command, once `require_mesh` has checked
that the mesh's packages are installed: the simulator commands never load them, and a core
install (``pip install hexgen-flow``) gets one clear line instead of a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import signal
import sys
import time
import uuid
from pathlib import Path
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
    address,
    info,
    integer,
    positive_float,
    positive_int,
    print_json,
    print_rows,
    unit_interval,
)
from hexgen_cli.simulation import latency_row
from hexgen_client.addresses import (  # constants only: no grpc at import time  # constants only
    DEFAULT_COORDINATOR,
    DEFAULT_GATEWAY,
    DEFAULT_METRICS,
    DEFAULT_REDIS_PREFIX,
    DEFAULT_TUNER,
)
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
    """Add ``up``, ``replay``, ``ask`` and ``status`` to the command parser."""
    up = commands.add_parser(
        "up",
        help="run a local mesh: Redis, coordinator, tuner, OpenAI-compatible gateway, one "
        "simulated worker per instance",
        description="Start the coordinator, the alpha tuner, the OpenAI-compatible gateway "
        "and one worker per instance "
        "(simulated engines) as local processes, with a private redis-server unless "
        "--redis-url is given; wait until every worker has connected, print the addresses, "
        "and run until Ctrl-C or SIGTERM, which stops everything. A service that dies is "
        "restarted (after 0.5 s, doubling to 10 s; back to 0.5 s once it stayed up 10 s), "
        "the private Redis keeps an append-only file so that a restart loses no state, and "
        "on Linux every service dies with `up` itself, even on kill -9.",
    )
    add_cluster_options(up, time_scale=1.0)
    up.add_argument(
        "--listen",
        type=address,
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
        type=address,
        default=DEFAULT_TUNER,
        metavar="HOST:PORT",
        help=f"the tuner's address (default {DEFAULT_TUNER})",
    )
    up.add_argument(
        "--gateway",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the OpenAI-compatible gateway (default: yes; docs/mesh.md)",
    )
    up.add_argument(
        "--gateway-listen",
        type=address,
        default=DEFAULT_GATEWAY,
        metavar="HOST:PORT",
        help=f"the gateway's HTTP address; port 0 picks a free one (default {DEFAULT_GATEWAY})",
    )
    up.add_argument(
        "--metrics-listen",
        type=address,
        default=DEFAULT_METRICS,
        metavar="HOST:PORT",
        help="where the coordinator serves Prometheus metrics, at /metrics; port 0 picks a "
        f"free one (default {DEFAULT_METRICS}); the tuner serves its own on the next port "
        "(a free one with port 0)",
    )
    up.add_argument(
        "--tuner-period-s",
        type=positive_float,
        default=30.0,
        metavar="FLOAT",
        help="wall seconds between tuning runs (default 30)",
    )
    up.add_argument(
        "--admission",
        choices=("reject", "best-effort", "off"),
        default=None,
        help="the coordinator's admission control for queries predicted to miss their SLO: "
        "reject them, admit them best-effort, or admit everything (default: the "
        "coordinator's, reject)",
    )
    up.add_argument(
        "--retention-s",
        type=positive_float,
        default=None,
        metavar="FLOAT",
        help="wall seconds a finished query stays in Redis (default: the coordinator's, 3600)",
    )
    up.add_argument(
        "--max-call-attempts",
        type=positive_int,
        default=None,
        metavar="N",
        help="dispatches a call gets when its engine fails it before its query fails "
        "(default: the coordinator's, 3)",
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
        help="a running Redis to use (default: start a private redis-server on a free port)",
    )


# -------------------------------------------------------------------------------- commands


def _cmd_up(args: argparse.Namespace) -> int:
    require_mesh("up")
    from hexgen_client.cluster import LocalCluster, LocalClusterConfig  # noqa: PLC0415 - loads grpc

    cluster = LocalCluster(  # checks the cluster and the policy before starting anything
        LocalClusterConfig(
            cluster=args.cluster,
            calibration=args.calibration,
            policy=args.policy,
            alpha=args.alpha,
            slo_scale=args.slo_scale,
            admission=args.admission,
            retention_s=args.retention_s,
            max_call_attempts=args.max_call_attempts,
            time_scale=args.time_scale,
            listen=args.listen,
            redis_url=args.redis_url,
            redis_prefix=args.redis_prefix,
            tuner=args.tuner,
            tuner_listen=args.tuner_listen,
            tuner_period_s=args.tuner_period_s,
            gateway=args.gateway,
            gateway_listen=args.gateway_listen,
            metrics_listen=args.metrics_listen,
            tuner_metrics_listen=_next_port(args.metrics_listen),
            log_dir=args.log_dir,
            keep_logs=True,
        )
    )

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        info(f"{PROG}: starting {len(cluster.gpus)} simulated workers ({args.cluster}) ...")
        cluster.start()
        _print_up(cluster, args)
        while True:  # supervision: a service that dies is restarted, with backoff
            for line in cluster.supervise():
                info(f"{PROG}: {line}")
            time.sleep(SUPERVISE_PERIOD_S)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        info(f"{PROG}: stopping ...")
        cluster.stop()
        info(f"{PROG}: stopped ({_restart_summary(cluster.restarts)})")
        return 0
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, previous)


SUPERVISE_PERIOD_S = 0.2
"""How often `up` looks for services that died (wall seconds)."""


def _restart_summary(restarts: dict[str, int]) -> str:
    done = [f"{key} {count}" for key, count in restarts.items() if count]
    return "restarts: " + (", ".join(done) if done else "none")


def _print_up(cluster: Any, args: argparse.Namespace) -> None:
    redis_note = (
        "given" if args.redis_url else "private, append-only file fsynced always, removed on exit"
    )
    coordinator_options = [
        f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
        for flag, value in (
            ("admission", args.admission),
            ("retention", args.retention_s),
            ("max call attempts", args.max_call_attempts),
        )
        if value is not None
    ]
    rows = [
        ("coordinator", cluster.coordinator_address),
        (
            "tuner",
            f"{cluster.tuner_address} (every {args.tuner_period_s:g} s)"
            if cluster.tuner_address
            else "off",
        ),
        (
            "gateway",
            f"http://{cluster.gateway_address}/v1 (OpenAI-compatible)"
            if cluster.gateway_address
            else "off",
        ),
        (
            "metrics",
            f"http://{cluster.metrics_address}/metrics (Prometheus, coordinator)"
            + (
                f"; http://{cluster.tuner_metrics_address}/metrics (tuner)"
                if cluster.tuner_metrics_address
                else ""
            ),
        ),
        ("redis", f"{cluster.redis_url} ({redis_note}, keys {args.redis_prefix}*)"),
        ("instances", f"{','.join(cluster.gpus)}: simulated engines"),
        ("calibration", cluster.calibration.name),
        (
            "policy",
            ", ".join(
                [
                    args.policy,
                    *([f"alpha {args.alpha:g}"] if args.alpha is not None else []),
                    *coordinator_options,
                ]
            ),
        ),
        ("time scale", f"{args.time_scale:g} cluster seconds per wall second"),
        ("supervision", cluster.restart_policy.describe()),
        (
            "on exit",
            "every service stops with up"
            + (", even on kill -9" if cluster.dies_with_parent else " (Ctrl-C, SIGTERM)"),
        ),
        ("logs", str(cluster.log_dir)),
    ]
    print(f"{PROG} up: the mesh is running")
    print_rows(rows, indent="  ")
    print("Ctrl-C stops it.", flush=True)


def _cmd_replay(args: argparse.Namespace) -> int:
    require_mesh("replay")
    from hexgen_client.client import CoordinatorClient  # noqa: PLC0415 - loads grpc
    from hexgen_client.replay import replay  # noqa: PLC0415 - loads grpc

    traces = tuple(args.trace or [DEFAULT_TRACE])
    queries = take_queries(load_traces(traces), args.num_queries)
    progress = sys.stderr.isatty() if args.progress is None else args.progress

    async def run() -> tuple[RunMetrics, Any]:
        async with CoordinatorClient(args.coordinator) as client:
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
    from hexgen_client.client import CoordinatorClient  # noqa: PLC0415 - loads grpc
    from hexgen_client.report import status_json, status_lines  # noqa: PLC0415 - loads grpc

    async def run() -> Any:
        async with CoordinatorClient(args.coordinator) as client:
            return await client.status()

    status = asyncio.run(run())
    if args.json:
        doc = status_json(status)
        doc["coordinator"] = args.coordinator
        print_json(doc)
    else:
        print("\n".join(status_lines(status, args.coordinator)))
    return 0


def _next_port(listen: str) -> str:
    """HOST:PORT+1 (HOST:0 stays: a free port of its own)."""
    host, _, port = listen.rpartition(":")
    return f"{host}:{int(port) + 1 if int(port) else 0}"
