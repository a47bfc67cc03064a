"""``hexgen-flow up --shards N``: a local sharded mesh (`hexgen_launch.sharded_mesh`).

N coordinator shards and ``--spares`` spare coordinators on one Redis (a private one unless
``--redis-url``; with ``--redis-cluster`` that URL is a node of a Redis Cluster, each shard's
hash tag in its prefix), one simulated worker per instance linked to every coordinator, one
tuner for every shard and the gateway given every coordinator. The banner's ``coordinator``
row is every coordinator's address, comma-separated: what ``replay``, ``run`` and the
clients take (each redirects what is not its shard's). A coordinator that dies is not
restarted: a spare takes its shard over (docs/scaling.md, "Shards, leases and takeover");
`up` reports what exited. ``--secure`` runs it as ``up --secure`` runs one coordinator (the
same credentials, `up`'s `_check_options` says where), with a Redis ACL for every shard.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from hexgen_cli.auth import usage_rows
from hexgen_cli.foreground import run_in_foreground
from hexgen_cli.options import PROG, info, print_rows
from hexgen_cli.up_settings import coordinator_fields
from hexgen_flow.errors import ConfigError

__all__ = ["cmd_up_sharded"]

_POLL_S = 0.2


def _coordinator_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The coordinators' options from `up`'s (the cluster and time scale go separately),
    rendered from the coordinator's settings as `up` renders its one coordinator's
    (`hexgen_launch.cluster_config.coordinator_config`: the defaults that differ with
    shards are said there)."""
    from hexgen_launch.cluster_config import (  # noqa: PLC0415 - loads the mesh's plumbing
        LocalClusterConfig,
        sharded_coordinator_args,
    )

    return sharded_coordinator_args(LocalClusterConfig(**coordinator_fields(args)))


def cmd_up_sharded(args: argparse.Namespace, auth_dir: Path | None) -> int:
    """`up --shards`, with `up`'s options checked (`auth_dir`: secured, its credentials)."""
    if args.spares < 0:
        raise ConfigError(f"--spares must be >= 0, got {args.spares}")
    from hexgen_launch.sharded_mesh import (  # noqa: PLC0415 - loads the mesh
        LocalShardedMesh,
        ShardedMeshConfig,
    )

    logs = args.log_dir or Path(tempfile.mkdtemp(prefix="hexgen-flow-logs-"))
    mesh = LocalShardedMesh(
        ShardedMeshConfig(
            args.redis_url or "",  # none given: a private one
            logs,
            shards=args.shards,
            spares=args.spares,
            cluster=args.cluster,
            calibration=args.calibration,
            time_scale=args.time_scale,
            extra_coordinator_args=_coordinator_args(args),
            tuner=args.tuner,
            tuner_period_s=args.tuner_period_s,
            gateway=args.gateway,
            redis_cluster=args.redis_cluster,
            auth_dir=auth_dir,
            tenants=args.tenants,
        )
    )

    reported: set[str] = set()

    def begin() -> None:
        info(f"{PROG}: starting {args.shards} shard(s) and {args.spares} spare(s) ...")
        mesh.start()
        _print(mesh, args, logs)

    def report_exits() -> None:
        for proc in mesh.exited():
            if proc.name not in reported:
                reported.add(proc.name)
                info(f"{PROG}: {proc.name} exited (code {proc.returncode}); not restarted")

    # the private Redis stops with the mesh
    return run_in_foreground(start=begin, poll=report_exits, period_s=_POLL_S, stop=mesh.stop)


def _print(mesh: object, args: argparse.Namespace, logs: Path) -> None:
    from hexgen_launch.sharded_mesh import LocalShardedMesh  # noqa: PLC0415

    assert isinstance(mesh, LocalShardedMesh)
    holders = mesh.holders()
    roles = []
    for c in mesh.coordinators:
        held = [k for k, h in enumerate(holders) if h == c.listen]
        role = f"shard {held[0]} ({mesh.config.prefixes[held[0]]})" if held else "spare"
        roles.append(f"{c.listen} {role}, workers' door {c.worker_door}")
    secure = mesh.auth is not None
    redis_keys = f"keys hf:{{sK}}:*; the tuner's {mesh.config.tuner_prefix}tuner:*"
    if mesh.redis_server is not None:
        redis_note = "private, append-only file fsynced always, removed on exit"
        if secure:
            redis_note += ", one ACL user per service with every shard's keys"
    else:
        redis_note = "a node of a Redis Cluster" if args.redis_cluster else "given"
    rows = [
        ("coordinator", mesh.client_addresses),
        ("shards", "; ".join(roles)),
        ("tuner", f"{mesh.tuner_address} (every shard)" if mesh.tuner_address else "off"),
        (
            "gateway",
            f"{'https' if secure else 'http'}://{mesh.gateway_address}/v1 (OpenAI-compatible)"
            if mesh.gateway_address
            else "off",
        ),
        ("redis", f"{mesh.redis_url} ({redis_note}; {redis_keys})"),
        (
            "instances",
            f"{args.cluster}: simulated engines, each linked to every coordinator"
            + (" with a client certificate and the workers' token" if secure else ""),
        ),
        ("time scale", f"{args.time_scale:g} cluster seconds per wall second"),
        ("supervision", "none: a spare takes over a dead coordinator's shard"),
        ("logs", str(logs)),
    ]
    if mesh.auth is not None:
        rows[-1:-1] = [
            ("security", "TLS on every link, API keys (tenants, roles), Redis ACL users"),
            *usage_rows(mesh.auth, args.tenants),
        ]
    print(f"{PROG} up: the sharded mesh is running")
    print_rows(rows, indent="  ")
    print("Ctrl-C stops it.", flush=True)
