"""Coordinator overhead at a steady completion rate, on the real mesh.

For each target rate it starts a `LocalCluster` (private redis-server, the coordinator and
four simulated workers as separate processes) at a time scale so high that the engines
finish calls within milliseconds, submits trace3 queries at a steady pace sized for that
many call completions per second, waits until all have finished, and prints what the
coordinator measured of itself (`ClusterStatus.overhead`): call completion received ->
the calls it releases handed to their workers' streams, and query submitted -> its first
calls handed out. Goal: p50 <= 1 ms and p99 <= 5 ms at 500 completions/s; sustain 1,000.

    .venv/bin/python benchmarks/coordinator_overhead.py [--rates 500 1000] [--seconds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from hexgen_api.v1 import coordinator_pb2
from hexgen_client.client import CoordinatorClient
from hexgen_client.cluster import LocalCluster, LocalClusterConfig
from hexgen_flow.traces import load_trace, take_queries
from hexgen_service.convert import submit_from_query

TIME_SCALE = 2000.0


async def drive(
    address: str, rate: float, seconds: float
) -> tuple[float, coordinator_pb2.CoordinatorOverhead]:
    trace = load_trace("trace3")
    calls_per_query = sum(q.workflow.num_calls for q in trace) / len(trace)
    qps = rate / calls_per_query
    queries = take_queries(trace, max(1, round(qps * seconds)))
    async with CoordinatorClient(address) as client:
        stub = client.stub
        started = time.perf_counter()
        pending = []
        for i, query in enumerate(queries):
            delay = started + i / qps - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            pending.append(asyncio.ensure_future(stub.SubmitQuery(submit_from_query(query))))
        await asyncio.gather(*pending)
        while True:
            status = await client.status()
            if status.queries_finished >= len(queries):
                break
            await asyncio.sleep(0.05)
        elapsed = time.perf_counter() - started
    return status.overhead.completions / elapsed, status.overhead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[500.0, 1000.0],
        help="target call completions per second",
    )
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each run")
    args = parser.parse_args()
    print(
        f"{'target/s':>9} {'achieved/s':>10} | completion->dispatch ms p50 / p99 / max "
        f"| submit->dispatch ms p50 / p99 / max"
    )
    for rate in args.rates:
        config = LocalClusterConfig(listen="127.0.0.1:0", tuner=False, time_scale=TIME_SCALE)
        with LocalCluster(config) as mesh:
            achieved, overhead = asyncio.run(drive(mesh.coordinator_address, rate, args.seconds))
        c = overhead.completion_to_dispatch_ms
        s = overhead.submit_to_dispatch_ms
        print(
            f"{rate:9.0f} {achieved:10.0f} | {c.p50:8.2f} / {c.p99:6.2f} / {c.max:6.1f} "
            f"| {s.p50:8.2f} / {s.p99:6.2f} / {s.max:6.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
