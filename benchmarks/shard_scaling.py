"""What a coordinator shard costs: 1, 2, 4 independent coordinators on one Redis.

Sharded coordinators (routing a workflow to its shard, workers shared by shards, takeover)
are not built yet; what exists is that each coordinator keeps its state under a key prefix,
so N coordinators with prefixes ``hf:{s0}:``, ``hf:{s1}:``, ... share nothing but the Redis
server (on a Redis Cluster, each hash tag's slot lives on one master). This measures that:
for each N it starts one private redis-server and N coordinators (as
`coordinator_overhead.wire_run` does, each with its own prefix and worker door), and drives
every shard at ``--rate-per-shard`` completions/s with instant workers that answer over the
real WorkerService protocol (`coordinator_overhead.drive_wire`), all at once.

A shard's driver (its instant workers and its query submitter) is a process of its own, so
that `--pin` can put it on its shard's core and so that no one driver loop caps the total:
a driver costs 0.3-0.55 CPU ms per completion (printed), so one loop for all shards would
saturate one core at roughly 2,000-3,000 completions/s (measured on 2 cores: four drivers
in one loop reached 1,130/s, as processes did, on 0.34 cores).

For each N it prints the total completions/s achieved; per shard the wire-to-wire p50/p99
(completion sent -> released call received, both gRPC hops) and the in-handler p50/p99
(`ClusterStatus.overhead`); and CPU time, read from /proc/PID/stat (utime + stime, every
thread) from the moment all workers are connected to the moment the shard's drive ends,
divided by the completions: the coordinator's and its driver's CPU ms per completion, the
redis-server's (all shards together), with Redis commands per completion (those a script
runs included), and how busy the whole machine was. CPU time, not wall time, is the
per-shard cost: on a small machine shared with other work, wall time says how busy the
cores were.

    .venv/bin/python benchmarks/shard_scaling.py [--shards 1 2 4] [--rate-per-shard 300]
        [--seconds 20] [--appendfsync none|everysec|always] [--pin]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import redis

from coordinator_overhead import CLUSTER, TICK_S, coordinator_argv, cpu_s, drive_wire
from hexgen_api.v1 import coordinator_pb2
from hexgen_flow.metrics import percentile
from hexgen_launch.processes import RedisServer, free_port
from hexgen_service.event_loop import run as run_loop


def pin_process(pid: int, core: int) -> None:
    """Pin every thread of `pid` (gRPC's too: affinity is per thread) to `core`."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), {core})


def machine_busy_s() -> float:
    """CPU seconds every core of this machine has spent busy (not idle or waiting on I/O)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) * TICK_S


@dataclass
class ShardResult:
    shard: int
    achieved: float  # completions/s over the drive's wall time
    wire_p50: float
    wire_p99: float
    overhead: bytes  # coordinator_pb2.CoordinatorOverhead, serialised
    driver_cpu_s: float


def _drive_shard(
    shard: int,
    port: int,
    worker_port: int,
    rate: float,
    seconds: float,
    core: int | None,
    barrier: Barrier,
    results: Queue[ShardResult],
) -> None:
    """One shard's driver (a process of its own): instant workers and a steady submitter."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    began = [0.0]

    async def ready() -> None:  # every shard's workers connected: all start together
        await asyncio.to_thread(barrier.wait, 120)
        began[0] = time.process_time()

    achieved, wire, overhead = run_loop(
        drive_wire(
            f"127.0.0.1:{port}", f"127.0.0.1:{worker_port}", CLUSTER, rate, seconds, None, ready
        )
    )
    results.put(
        ShardResult(
            shard,
            achieved,
            percentile(wire, 50),
            percentile(wire, 99),
            overhead.SerializeToString(),
            time.process_time() - began[0],
        )
    )


def _wait_listening(port: int, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"a coordinator exited with code {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"no coordinator listening on port {port} after {timeout_s:.0f} s")


@dataclass
class Run:
    shards: int
    elapsed_s: float  # barrier -> last drive's end
    results: list[ShardResult]
    coordinator_cpu_s: list[float]
    redis_cpu_s: float
    redis_commands: int
    machine_busy_s: float  # every process on the machine, this benchmark's and others'

    @property
    def completions(self) -> list[int]:
        return [_overhead(r).completions for r in self.results]


def _overhead(result: ShardResult) -> coordinator_pb2.CoordinatorOverhead:
    return coordinator_pb2.CoordinatorOverhead.FromString(result.overhead)


def run(shards: int, rate: float, seconds: float, appendfsync: str | None, pin: bool) -> Run:
    """One private redis-server, `shards` coordinators each with its prefix, all driven."""
    cores = sorted(os.sched_getaffinity(0))
    ctx = mp.get_context("spawn")  # no fork of a process that has imported grpc
    with RedisServer(appendfsync=appendfsync) as redis_server:
        assert redis_server.process is not None and redis_server.process.pid is not None
        redis_pid = redis_server.process.pid
        doors = [(free_port(), free_port()) for _ in range(shards)]
        coordinators = [
            subprocess.Popen(
                coordinator_argv(
                    port, worker_port, redis_server.url, ("--redis-prefix", f"hf:{{s{k}}}:")
                ),
            )
            for k, (port, worker_port) in enumerate(doors)
        ]
        barrier = ctx.Barrier(shards + 1)
        results: Queue[ShardResult] = ctx.Queue()
        drivers: list[Any] = []
        try:
            for k, ((port, _), process) in enumerate(zip(doors, coordinators, strict=True)):
                _wait_listening(port, process, 120)
                if pin:
                    pin_process(process.pid, cores[k % len(cores)])
            for k, (port, worker_port) in enumerate(doors):
                core = cores[k % len(cores)] if pin else None
                args = (k, port, worker_port, rate, seconds, core, barrier, results)
                drivers.append(ctx.Process(target=_drive_shard, args=args, daemon=True))
                drivers[-1].start()
            barrier.wait(180)
            commands = redis.Redis.from_url(redis_server.url).info("stats")
            before = [cpu_s(p.pid) for p in coordinators]
            redis_before, busy = cpu_s(redis_pid), machine_busy_s()
            started = time.perf_counter()
            after = list(before)
            got: list[ShardResult] = []
            for _ in range(shards):
                result = results.get(timeout=seconds * 10 + 120)
                after[result.shard] = cpu_s(coordinators[result.shard].pid)
                got.append(result)
            elapsed = time.perf_counter() - started
            redis_cpu, busy = cpu_s(redis_pid) - redis_before, machine_busy_s() - busy
            stats = redis.Redis.from_url(redis_server.url).info("stats")
            ops = int(stats["total_commands_processed"] - commands["total_commands_processed"])
            for driver in drivers:
                driver.join(timeout=30)
        finally:
            for process in coordinators:
                process.terminate()
            for process in coordinators:
                process.wait(timeout=30)
            for driver in drivers:
                if driver.is_alive():
                    driver.kill()
    got.sort(key=lambda r: r.shard)
    cpu = [a - b for a, b in zip(after, before, strict=True)]
    return Run(shards, elapsed, got, cpu, redis_cpu, ops, busy)


def _ms_per(cpu: float, completions: int) -> float:
    return cpu * 1e3 / max(completions, 1)


def report(r: Run, rate: float) -> None:
    total = sum(r.completions)
    achieved = sum(x.achieved for x in r.results)
    print(
        f"\n{r.shards} shard(s): target {rate * r.shards:.0f}/s, achieved {achieved:.0f}/s "
        f"({total} completions)"
    )
    print(
        f"{'shard':>6} {'done':>6} {'compl/s':>7} | wire ms p50 / p99 | in-handler ms "
        f"p50 / p99 | CPU ms/completion coordinator  driver | coordinator cores"
    )
    for res, done, cpu in zip(r.results, r.completions, r.coordinator_cpu_s, strict=True):
        c = _overhead(res).completion_to_dispatch_ms
        print(
            f"{'s' + str(res.shard):>6} {done:6d} {res.achieved:7.0f} | {res.wire_p50:7.2f} / "
            f"{res.wire_p99:6.2f} | {c.p50:13.2f} / {c.p99:5.2f} | "
            f"{_ms_per(cpu, done):28.3f} {_ms_per(res.driver_cpu_s, done):7.3f} | "
            f"{cpu / r.elapsed_s:17.2f}"
        )
    print(
        f"redis-server: {_ms_per(r.redis_cpu_s, total):.3f} CPU ms/completion, "
        f"{r.redis_commands / max(total, 1):.1f} commands/completion, "
        f"{r.redis_cpu_s / r.elapsed_s:.2f} cores, {r.redis_commands / r.elapsed_s:.0f} "
        f"commands/s; the machine was busy {r.machine_busy_s / r.elapsed_s:.2f} cores",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--rate-per-shard", type=float, default=300.0, help="completions/s each shard is driven at"
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each run")
    parser.add_argument(
        "--appendfsync",
        choices=("always", "everysec", "none"),
        default="none",
        help="the private Redis's append-only file fsync policy (default none: no file)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin coordinator k and its driver to core k (mod the cores this may use)",
    )
    args = parser.parse_args()
    appendfsync = None if args.appendfsync == "none" else args.appendfsync
    print(
        f"redis appendfsync: {args.appendfsync}; {len(os.sched_getaffinity(0))} cores; "
        f"{args.rate_per_shard:.0f} completions/s per shard for {args.seconds:.0f} s"
        f"{'; pinned' if args.pin else ''}"
    )
    runs = []
    for shards in args.shards:
        print(f"running {shards} shard(s) ...", file=sys.stderr, flush=True)
        runs.append(run(shards, args.rate_per_shard, args.seconds, appendfsync, args.pin))
        report(runs[-1], args.rate_per_shard)
    print(
        f"\n{'shards':>6} {'target/s':>8} {'achieved/s':>10} | CPU ms/completion: "
        f"coordinator (mean, max) redis driver | cores used: coordinators redis drivers machine"
    )
    for r in runs:
        total = sum(r.completions)
        per = [_ms_per(c, n) for c, n in zip(r.coordinator_cpu_s, r.completions, strict=True)]
        driver_cpu = sum(x.driver_cpu_s for x in r.results)
        print(
            f"{r.shards:6d} {args.rate_per_shard * r.shards:8.0f} "
            f"{sum(x.achieved for x in r.results):10.0f} | {sum(per) / len(per):25.3f} "
            f"{max(per):5.3f} {_ms_per(r.redis_cpu_s, total):5.3f} "
            f"{_ms_per(driver_cpu, total):6.3f} | "
            f"{sum(r.coordinator_cpu_s) / r.elapsed_s:23.2f} "
            f"{r.redis_cpu_s / r.elapsed_s:5.2f} {driver_cpu / r.elapsed_s:7.2f} "
            f"{r.machine_busy_s / r.elapsed_s:7.2f}"
        )


if __name__ == "__main__":
    main()
