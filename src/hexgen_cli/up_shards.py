"""``hexgen-flow up --shards N``: a local sharded mesh (`hexgen_client.sharded_mesh`).

N coordinator shards and ``--spares`` spare coordinators on one Redis (a private one unless
``--redis-url``), one simulated worker per instance linked to every coordinator, one tuner
for every shard and the gateway given every coordinator. The banner's ``coordinator`` row is
every coordinator's address, comma-separated: what ``replay``, ``run`` and the clients take
(each redirects what is not its shard's). A coordinator that dies is not restarted: a spare
takes its shard over (docs/scaling.md, "Shards, leases and takeover"); `up` reports what
exited. Plaintext on loopback only, for now: ``--secure`` and ``--redis-cluster`` are
refused with ``--shards``.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import time
from pathlib import Path

from hexgen_cli.options import PROG, info, print_rows
from hexgen_flow.errors import ConfigError

__all__ = ["cmd_up_sharded"]

_POLL_S = 0.2


def _coordinator_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The coordinators' options from `up`'s (the cluster and time scale go separately)."""
    out = ["--policy", args.policy, "--slo-scale", repr(args.slo_scale)]
    if args.alpha is not None:
        out += ["--alpha", repr(args.alpha)]
    out += ["--admission", args.admission or "off"]
    if args.retention_s is not None:
        out += ["--retention-s", repr(args.retention_s)]
    if args.max_call_attempts is not None:
        out += ["--max-call-attempts", str(args.max_call_attempts)]
    if args.calibration is not None:
        out += ["--calibration", args.calibration]
    return tuple(out)


def cmd_up_sharded(args: argparse.Namespace) -> int:
    refused = [
        flag
        for flag, given in (
            ("--secure", args.secure),
            ("--redis-cluster", args.redis_cluster),
            ("--auth-dir", args.auth_dir is not None),
            ("--tenants", bool(args.tenants)),
        )
        if given
    ]
    if refused:
        raise ConfigError(f"--shards: not yet with {', '.join(refused)} (docs/scaling.md)")
    if args.spares < 0:
        raise ConfigError(f"--spares must be >= 0, got {args.spares}")
    from hexgen_client.processes import RedisServer  # noqa: PLC0415 - loads the mesh
    from hexgen_client.sharded_mesh import (  # noqa: PLC0415
        LocalShardedMesh,
        ShardedMeshConfig,
    )

    logs = args.log_dir or Path(tempfile.mkdtemp(prefix="hexgen-flow-logs-"))
    redis = RedisServer(appendfsync="always") if args.redis_url is None else None

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    mesh = None
    try:
        redis_url = args.redis_url if redis is None else redis.start()
        mesh = LocalShardedMesh(
            ShardedMeshConfig(
                redis_url,
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
            )
        )
        info(f"{PROG}: starting {args.shards} shard(s) and {args.spares} spare(s) ...")
        mesh.start()
        _print(mesh, args, redis_url, logs)
        reported: set[str] = set()
        while True:
            for proc in mesh.exited():
                if proc.name not in reported:
                    reported.add(proc.name)
                    info(f"{PROG}: {proc.name} exited (code {proc.returncode}); not restarted")
            time.sleep(_POLL_S)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        info(f"{PROG}: stopping ...")
        return 0
    finally:
        if mesh is not None:
            mesh.stop()
        if redis is not None:
            redis.stop()
        signal.signal(signal.SIGTERM, previous)


def _print(mesh: object, args: argparse.Namespace, redis_url: str, logs: Path) -> None:
    from hexgen_client.sharded_mesh import LocalShardedMesh  # noqa: PLC0415

    assert isinstance(mesh, LocalShardedMesh)
    holders = mesh.holders()
    roles = []
    for c in mesh.coordinators:
        held = [k for k, h in enumerate(holders) if h == c.listen]
        role = f"shard {held[0]} ({mesh.config.prefixes[held[0]]})" if held else "spare"
        roles.append(f"{c.listen} {role}, workers' door {c.worker_door}")
    rows = [
        ("coordinator", mesh.client_addresses),
        ("shards", "; ".join(roles)),
        ("tuner", f"{mesh.tuner_address} (every shard)" if mesh.tuner_address else "off"),
        (
            "gateway",
            f"http://{mesh.gateway_address}/v1 (OpenAI-compatible)"
            if mesh.gateway_address
            else "off",
        ),
        ("redis", f"{redis_url} (keys hf:{{sK}}:*; the tuner's hf:tuner:*)"),
        ("instances", f"{args.cluster}: simulated engines, each linked to every coordinator"),
        ("time scale", f"{args.time_scale:g} cluster seconds per wall second"),
        ("supervision", "none: a spare takes over a dead coordinator's shard"),
        ("logs", str(logs)),
    ]
    print(f"{PROG} up: the sharded mesh is running")
    print_rows(rows, indent="  ")
    print("Ctrl-C stops it.", flush=True)
