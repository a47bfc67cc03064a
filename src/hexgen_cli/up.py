"""``up``: run the service mesh locally (Redis, coordinator, tuner, gateway, simulated
workers) until Ctrl-C, supervised; print where everything listens."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from hexgen_cli.auth import name_list, usage_rows
from hexgen_cli.foreground import run_in_foreground
from hexgen_cli.mesh import add_cluster_options, require_mesh
from hexgen_cli.options import (
    PROG,
    address,
    info,
    positive_float,
    positive_int,
    print_rows,
)
from hexgen_cli.up_settings import coordinator_fields
from hexgen_cli.up_shards import cmd_up_sharded
from hexgen_client.addresses import (  # constants only: no grpc at import time
    DEFAULT_COORDINATOR,
    DEFAULT_GATEWAY,
    DEFAULT_METRICS,
    DEFAULT_REDIS_PREFIX,
    DEFAULT_TUNER,
)
from hexgen_flow.errors import ConfigError
from hexgen_flow.lengths import SERVED_OUTPUT_LENGTHS

__all__ = ["register"]


def register(commands: Any) -> None:
    """Add ``up`` to the command parser."""
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
        "--redis-maxmemory",
        default="1gb",
        metavar="SIZE",
        help="the private Redis's maxmemory, with maxmemory-policy noeviction: the "
        "coordinator refuses new work above 90 %% of it, before Redis would refuse writes "
        "(default %(default)s; e.g. 512mb, 4gb)",
    )
    up.add_argument(
        "--redis-cluster",
        action="store_true",
        help="--redis-url is a node of a Redis Cluster: every key of the mesh carries one "
        "hash tag (prefix hf:{0}: unless --redis-prefix gives one with a tag)",
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
        "and the workers on the ports after (free ones with port 0); with --secure over "
        "HTTPS to API keys (beyond loopback only with --secure)",
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
        "--learn-costs",
        action="store_true",
        help="the coordinator learns each instance's prefill and decode costs online from the "
        "calls it served, with the calibration as the prior (default: off)",
    )
    up.add_argument(
        "--output-lengths",
        choices=SERVED_OUTPUT_LENGTHS,
        default=None,
        help="what the coordinator plans each call's output length with: the declared tokens "
        "(known), or a per-step prediction learned from finished calls, capped by the "
        "declared tokens (learned) (default: the coordinator's, known)",
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
        "--secure",
        action="store_true",
        help="run secured: API keys (tenants, operators, admin), TLS on every link, workers "
        "with client certificates, a Redis with one ACL user per service; the credentials "
        "are made in (or read from) --auth-dir",
    )
    up.add_argument(
        "--auth-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="with --secure: where the credentials are (made if missing; default: LOG_DIR/auth)",
    )
    up.add_argument(
        "--tenants",
        type=name_list,
        default=(),
        metavar="NAME[,NAME...]",
        help="with --secure: make an API key for each tenant (AUTH_DIR/tenants/NAME.key)",
    )
    up.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the services write their logs (default: a temporary folder, kept)",
    )
    up.add_argument(
        "--shards",
        type=int,
        default=0,
        metavar="N",
        help="run N coordinator shards sharing the workers (docs/scaling.md); default: one "
        "coordinator",
    )
    up.add_argument(
        "--spares",
        type=int,
        default=1,
        metavar="M",
        help="with --shards: spare coordinators that take over a dead shard (default 1)",
    )
    up.set_defaults(handler=_cmd_up)


def _cmd_up(args: argparse.Namespace) -> int:
    require_mesh("up")
    auth_dir = _check_options(args)
    if args.shards:
        if args.shards < 1:
            raise ConfigError(f"--shards must be >= 1, got {args.shards}")
        return cmd_up_sharded(args, auth_dir)
    from hexgen_launch.cluster import LocalCluster, LocalClusterConfig  # noqa: PLC0415 - loads grpc
    from hexgen_launch.processes import port_after  # noqa: PLC0415

    cluster = LocalCluster(  # checks the cluster and the policy before starting anything
        LocalClusterConfig(
            cluster=args.cluster,
            **coordinator_fields(args),
            time_scale=args.time_scale,
            listen=args.listen,
            redis_url=args.redis_url,
            redis_prefix=args.redis_prefix,
            redis_cluster=args.redis_cluster,
            redis_maxmemory=args.redis_maxmemory,
            tuner=args.tuner,
            tuner_listen=args.tuner_listen,
            tuner_period_s=args.tuner_period_s,
            gateway=args.gateway,
            gateway_listen=args.gateway_listen,
            metrics_listen=args.metrics_listen,
            tuner_metrics_listen=port_after(args.metrics_listen, 1),
            worker_metrics_listen=port_after(args.metrics_listen, 2),
            log_dir=args.log_dir,
            keep_logs=True,
            auth_dir=auth_dir,
            tenants=args.tenants,
        )
    )

    def begin() -> None:
        info(f"{PROG}: starting {len(cluster.gpus)} simulated workers ({args.cluster}) ...")
        cluster.start()
        _print_up(cluster, args)

    def supervise() -> None:  # a service that dies is restarted, with backoff
        for line in cluster.supervise():
            info(f"{PROG}: {line}")

    return run_in_foreground(
        start=begin,
        poll=supervise,
        period_s=SUPERVISE_PERIOD_S,
        stop=cluster.stop,
        stopped=lambda: f"stopped ({_restart_summary(cluster.restarts)})",
    )


def _check_options(args: argparse.Namespace) -> Path | None:
    """What both meshes check of `up`'s options before anything starts, and where a secured
    mesh's credentials go (None: not secured): --auth-dir, else LOG_DIR/auth."""
    from hexgen_launch.security import is_loopback  # noqa: PLC0415 - loads the mesh

    exposed = [
        f"{flag} {value}"
        for flag, value in (
            ("--listen", args.listen),
            ("--tuner-listen", args.tuner_listen),
            ("--gateway-listen", args.gateway_listen),
            ("--metrics-listen", args.metrics_listen),
        )
        if not is_loopback(value)
    ]
    if exposed and not args.secure:
        raise ConfigError(
            f"{', '.join(exposed)}: a mesh reachable beyond this machine must run with "
            "--secure (API keys, TLS, mutual TLS for workers; metrics over HTTPS to API keys)"
        )
    if args.redis_cluster and args.redis_url is None:
        raise ConfigError("--redis-cluster: give --redis-url, a node of the Redis Cluster")
    if re.fullmatch(r"[1-9][0-9]*(b|kb|mb|gb|k|m|g)?", str(args.redis_maxmemory).lower()) is None:
        raise ConfigError(
            f"--redis-maxmemory: {args.redis_maxmemory!r} is not a size (e.g. 512mb, 4gb)"
        )
    if (args.auth_dir is not None or args.tenants) and not args.secure:
        raise ConfigError("--auth-dir and --tenants go with --secure")
    if not args.secure:
        return None
    if args.auth_dir is not None:
        return Path(args.auth_dir)
    if args.log_dir is None:
        raise ConfigError("--secure: give --auth-dir DIR (where the credentials go)")
    return Path(args.log_dir) / "auth"


SUPERVISE_PERIOD_S = 0.2
"""How often `up` looks for services that died (wall seconds)."""


def _prefix(args: argparse.Namespace) -> str:
    """The prefix the services run with: on a Redis Cluster the default one has a hash tag."""
    if args.redis_cluster and args.redis_prefix == DEFAULT_REDIS_PREFIX:
        from hexgen_launch.cluster_config import DEFAULT_CLUSTER_PREFIX  # noqa: PLC0415

        return DEFAULT_CLUSTER_PREFIX
    return str(args.redis_prefix)


def _restart_summary(restarts: dict[str, int]) -> str:
    done = [f"{key} {count}" for key, count in restarts.items() if count]
    return "restarts: " + (", ".join(done) if done else "none")


def _print_up(cluster: Any, args: argparse.Namespace) -> None:
    redis_note = (
        "given"
        if args.redis_url
        else f"private, maxmemory {args.redis_maxmemory} noeviction, append-only file fsynced "
        "always, removed on exit"
    )
    scheme = "https" if cluster.auth is not None else "http"  # secured: HTTPS, API keys
    coordinator_options = [
        f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
        for flag, value in (
            ("admission", args.admission),
            ("learns costs", "online" if args.learn_costs else None),
            ("output lengths", args.output_lengths),
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
            f"{'https' if cluster.auth is not None else 'http'}://{cluster.gateway_address}/v1"
            " (OpenAI-compatible)"
            if cluster.gateway_address
            else "off",
        ),
        (
            "metrics",
            f"{scheme}://{cluster.metrics_address}/metrics (Prometheus, coordinator)"
            + (
                f"; {scheme}://{cluster.tuner_metrics_address}/metrics (tuner)"
                if cluster.tuner_metrics_address
                else ""
            )
            + "; "
            + ", ".join(f"{scheme}://{a}/metrics" for a in cluster.worker_metrics_addresses)
            + " (workers)"
            + (
                f"; Authorization: Bearer <an operator's key, e.g. {cluster.auth.admin_key}>"
                if cluster.auth is not None
                else ""
            ),
        ),
        (
            "workers",
            f"door {cluster.worker_address}; "
            + (
                f"must show the token in {cluster.worker_token_file} (mode 0600)"
                if cluster.worker_token_file
                else "any may connect (no token)"
            )
            + (" and a client certificate (mutual TLS)" if cluster.auth is not None else ""),
        ),
        ("redis", f"{cluster.redis_url} ({redis_note}, keys {_prefix(args)}*)"),
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
    if cluster.auth is not None:
        rows[-1:-1] = [
            ("security", "TLS on every link, API keys (tenants, roles), Redis ACL users")
        ]
        rows[-1:-1] = usage_rows(cluster.auth, args.tenants)
    print(f"{PROG} up: the mesh is running")
    print_rows(rows, indent="  ")
    print("Ctrl-C stops it.", flush=True)
