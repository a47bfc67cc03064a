"""A shard's coordinator SIGKILLed mid-replay: what the takeover costs the workflows.

Three runs of the same replay (trace3's first `--queries` queries at `--qps`, seed 0, the
cluster A100,A100,A6000,L40S of simulated workers at `--time-scale`), each on its own
private redis-server (`hexgen_launch.sharded_mesh.LocalShardedMesh`):

1. **one coordinator**: a single shard, no spare (the lease costs one script every
   `ttl / 3`; otherwise this is the plain single-coordinator mesh);
2. **two shards and a spare**, the workers shared by all three coordinators, undisturbed;
3. the same with shard 0's coordinator SIGKILLed `--kill-at-s` wall seconds into the
   replay: the spare takes shard 0 over when its lease expires and resumes it from Redis
   (the workers hand it the shard's calls).

The client is given every coordinator's address and follows their redirects
(`CoordinatorClient`). For each run it prints the workflow latency P95/P50/mean and SLO
attainment (cluster seconds, from the coordinators' own times), the wall time, and for the
third how long the shard had no coordinator; then it checks that every call completed
exactly once in its shard's ``completions`` stream and that ``check-state`` is clean for
every shard. Issue 12's goal: the third run's P95 within 10 % of the first's.

    .venv/bin/python benchmarks/shard_takeover.py [--queries 200] [--qps 0.5]
        [--time-scale 10] [--kill-at-s 15] [--lease-ttl-s 2]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hexgen_client.client import CoordinatorClient
from hexgen_flow.metrics import RunMetrics
from hexgen_flow.traces import load_trace, take_queries
from hexgen_flow.workload import Query
from hexgen_launch.processes import RedisServer
from hexgen_launch.replay import replay
from hexgen_launch.sharded_mesh import LocalShardedMesh, ShardedMeshConfig


@dataclass
class Outcome:
    label: str
    metrics: RunMetrics
    wall_s: float
    gap_s: float | None = None
    """Wall seconds from the kill to the spare holding the shard."""


def _queries(n: int) -> list[Query]:
    return take_queries(load_trace("trace3"), n)


def _check(mesh: LocalShardedMesh, queries: list[Query]) -> None:
    """Every call completed once in its shard's stream; check-state clean per shard."""
    expected = {
        f"{q.query_id}/{k}.{i}"
        for q in queries
        for k, stage in enumerate(q.workflow.stages)
        for i in range(len(stage.calls))
    }
    done = mesh.completed_calls()
    assert set(done) == expected, "calls lost or unknown calls completed"
    assert max(done.values()) == 1, "a call completed more than once"
    for prefix in mesh.config.prefixes:
        checked = subprocess.run(
            [sys.executable, "-m", "hexgen_cli", "check-state", "--redis-url",
             mesh.config.redis_url, "--prefix", prefix],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert checked.returncode == 0, checked.stdout + checked.stderr


def _run(
    config: ShardedMeshConfig, queries: list[Query], qps: float, kill_at_s: float | None
) -> Outcome:
    with LocalShardedMesh(config) as mesh:
        time.sleep(2.0)  # every worker linked to every coordinator
        gap: list[float] = []

        def kill() -> None:
            gap.append(mesh.kill_shard(0))

        async def drive() -> RunMetrics:
            async with CoordinatorClient(mesh.client_addresses) as client:
                return await replay(client, queries, qps, seed=0, retry_s=120, progress=True)

        timer = threading.Timer(kill_at_s, kill) if kill_at_s is not None else None
        started = time.monotonic()
        if timer is not None:
            timer.start()
        metrics = asyncio.run(drive())
        wall = time.monotonic() - started
        if timer is not None:
            timer.join()
        _check(mesh, queries)
        label = f"{config.shards} shard(s), {config.spares} spare(s)"
        if kill_at_s is not None:
            label += f", shard 0 killed at {kill_at_s:g} s"
        return Outcome(label, metrics, wall, gap[0] if gap else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--qps", type=float, default=0.5)
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--kill-at-s", type=float, default=15.0)
    parser.add_argument("--lease-ttl-s", type=float, default=2.0)
    parser.add_argument("--resume-grace-s", type=float, default=1.0)
    args = parser.parse_args()
    queries = _queries(args.queries)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="shard-takeover-") as tmp:
        for shards, spares, kill in ((1, 0, None), (2, 1, None), (2, 1, args.kill_at_s)):
            with RedisServer(appendfsync=None) as server:
                config = ShardedMeshConfig(
                    server.url,
                    Path(tmp) / f"{shards}-{spares}",
                    shards=shards,
                    spares=spares,
                    time_scale=args.time_scale,
                    lease_ttl_s=args.lease_ttl_s,
                    resume_grace_s=args.resume_grace_s,
                )
                outcomes.append(_run(config, queries, args.qps, kill))
    print(
        f"\n{args.queries} trace3 queries at {args.qps:g} q/s, time scale {args.time_scale:g}, "
        f"lease {args.lease_ttl_s:g} s, resume grace {args.resume_grace_s:g} s"
    )
    print("| run | P95 | P50 | mean | SLO attainment | wall | no coordinator for |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for o in outcomes:
        lat = o.metrics.latency_summary()
        gap = f"{o.gap_s:.1f} s" if o.gap_s is not None else ""
        print(
            f"| {o.label} | {lat['p95']:.1f} s | {lat['p50']:.1f} s | {lat['mean']:.1f} s | "
            f"{100 * o.metrics.slo_attainment:.1f} % | {o.wall_s:.0f} s | {gap} |"
        )
    base, sharded, killed = (o.metrics.latency_summary()["p95"] for o in outcomes)
    print(f"P95 of two shards / one coordinator: {sharded / base:.3f}")
    print(f"P95 of two shards with the kill / one coordinator: {killed / base:.3f} (goal <= 1.10)")
    print("every call completed once; check-state clean for every shard")


if __name__ == "__main__":
    main()
