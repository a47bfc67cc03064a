"""Coordinator overhead at a steady completion rate, on the real mesh.

For each target rate it starts a `LocalCluster` (private redis-server, the coordinator and
four simulated workers as separate processes) at a time scale so high that the engines
finish calls within milliseconds, submits trace3 queries at a steady pace sized for that
many call completions per second, waits until all have finished, and prints what the
coordinator measured of itself (`ClusterStatus.overhead`): call completion received ->
the calls it releases handed to their workers' streams, and query submitted -> its first
calls handed out. Goal: p50 <= 1 ms and p99 <= 5 ms at 500 completions/s; sustain 1,000.

It then measures the same wire to wire: the coordinator alone (with its private
redis-server) serves instant workers that this script runs over the real WorkerService
protocol, each answering a dispatched call with its CallFinished at once; a call's wire
time is from the moment its releasing completion was written to the worker stream to the
moment the released call's DispatchCall arrived, so it includes both gRPC hops, protobuf
and this script's own event loop on the same two cores. Beside it: the coordinator's own
in-handler figures, its CPU per completion (/proc), and its garbage collections over the run
(scraped from its `hexgen_flow_gc_pause_seconds` histogram), so that a slow call can be told
from a collection that stalled the loop.

    .venv/bin/python benchmarks/coordinator_overhead.py [--rates 500 1000] [--seconds 15]
        [--appendfsync always|everysec|none] [--modes open secure]

Each table is printed for both modes: ``open`` (plaintext, no keys: `hexgen-flow up`) and
``secure`` (`hexgen-flow up --secure`: TLS on both doors, an API key checked on every
client RPC, workers over mutual TLS with the token, Redis logged in as an ACL user).

Redis's durability is part of the price: with ``--appendfsync always`` (what `hexgen-flow up`
runs, so that a Redis killed -9 loses no acknowledged write) every reply waits for an fsync
of the append-only file; ``everysec`` or ``none`` show the coordinator's own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import NamedTuple

import grpc
from prometheus_client.parser import text_string_to_metric_families

from hexgen_api.v1 import coordinator_pb2, worker_pb2, worker_pb2_grpc
from hexgen_client.client import CoordinatorClient
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.metrics import percentile
from hexgen_flow.traces import load_trace, take_queries
from hexgen_launch.cluster import LocalCluster, LocalClusterConfig
from hexgen_launch.cluster_config import redis_login, secure_argv
from hexgen_launch.processes import RedisServer, free_port
from hexgen_service.auth import read_secret
from hexgen_service.auth_dir import AuthDir
from hexgen_service.convert import submit_from_query
from hexgen_service.event_loop import run as run_loop
from hexgen_service.worker_token import TOKEN_METADATA

TIME_SCALE = 2000.0
CLUSTER = "A100,A100,A6000,L40S"
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


STALL_S = 0.005
"""A wire-to-wire call or a garbage collection longer than this counts as a stall."""


class GcCount(NamedTuple):
    """The coordinator's garbage collections over a run, from its metrics."""

    collections: int
    full: int
    """Generation-2 collections (the ones that walk every surviving object)."""
    stalls: int
    """Collections longer than `STALL_S`."""


def gc_count(metrics_text: str) -> GcCount:
    """Collections, full ones and those over `STALL_S`, from a Prometheus text exposition
    holding `hexgen_flow_gc_pause_seconds` (buckets include `STALL_S`)."""
    collections = full = within = 0
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "hexgen_flow_gc_pause_seconds":
            continue
        for sample in family.samples:
            n = int(sample.value)
            if sample.name.endswith("_count"):
                collections += n
                full += n if sample.labels.get("generation") == "2" else 0
            elif sample.name.endswith("_bucket") and float(sample.labels["le"]) == STALL_S:
                within += n
    return GcCount(collections, full, collections - within)


def _gc_now(metrics_url: str) -> GcCount:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        return gc_count(response.read().decode())


class WireRun(NamedTuple):
    """One wire-to-wire run (`wire_run`)."""

    achieved: float
    """Completions per second."""
    wire_ms: list[float]
    overhead: coordinator_pb2.CoordinatorOverhead
    cpu_s: float
    """The coordinator's CPU seconds over the drive (NaN where /proc is not there)."""
    gc: GcCount
    """The coordinator's collections over the drive."""


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) that process `pid` has used so far (Linux:
    /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # fields[0] is field 3 (state)
    return (int(fields[11]) + int(fields[12])) * TICK_S


async def drive(
    address: str, rate: float, seconds: float, auth: AuthDir | None = None
) -> tuple[float, coordinator_pb2.CoordinatorOverhead]:
    trace = load_trace("trace3")
    calls_per_query = sum(q.workflow.num_calls for q in trace) / len(trace)
    qps = rate / calls_per_query
    queries = take_queries(trace, max(1, round(qps * seconds)))
    async with _client(address, auth) as client:
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


def _client(address: str, auth: AuthDir | None) -> CoordinatorClient:
    if auth is None:
        return CoordinatorClient(address)
    return CoordinatorClient(
        address, api_key=read_secret(auth.admin_key, "admin key"), tls_ca=auth.ca
    )


class InstantWorkers:
    """Workers that finish every call the moment it arrives, over the real protocol, and
    time each stage's first dispatch from the completion that released it."""

    def __init__(self, address: str, cluster: str, auth: AuthDir | None = None) -> None:
        self.address = address
        self.auth = auth
        self.instances = parse_cluster(cluster).instances
        self.sent_at: dict[str, float] = {}  # query id -> its latest completion sent
        self.seen: set[tuple[str, int]] = set()
        self.wire_ms: list[float] = []
        self.completions = 0

    async def run_slot(self, slot: int, stop: asyncio.Event) -> None:
        inst = self.instances[slot]
        out: asyncio.Queue[worker_pb2.ConnectRequest] = asyncio.Queue()
        out.put_nowait(
            worker_pb2.ConnectRequest(
                hello=worker_pb2.WorkerHello(
                    worker_id=f"instant-{slot}",
                    slot=slot,
                    gpu=inst.gpu,
                    engine=worker_pb2.ENGINE_KIND_SIMULATED,
                    kv_cache_tokens=inst.kv_cache_tokens,
                    max_batch=inst.max_batch,
                )
            )
        )

        async def requests() -> AsyncIterator[worker_pb2.ConnectRequest]:
            while True:
                yield await out.get()

        async def heartbeats() -> None:
            while True:
                await asyncio.sleep(0.25)
                out.put_nowait(worker_pb2.ConnectRequest(heartbeat=worker_pb2.WorkerHeartbeat()))

        auth = self.auth
        channel = (
            grpc.aio.insecure_channel(self.address)
            if auth is None
            else grpc.aio.secure_channel(
                self.address,
                grpc.ssl_channel_credentials(
                    auth.ca.read_bytes(),
                    auth.worker_key.read_bytes(),
                    auth.worker_cert.read_bytes(),
                ),
            )
        )
        metadata = (
            None if auth is None else ((TOKEN_METADATA, read_secret(auth.worker_token, "token")),)
        )
        async with channel:
            stream = worker_pb2_grpc.WorkerServiceStub(channel).Connect(
                requests(), metadata=metadata
            )
            beat = asyncio.create_task(heartbeats())
            stopped = asyncio.create_task(stop.wait())
            try:
                async for message in _until(stream, stopped):
                    if message.WhichOneof("message") != "dispatch":
                        continue
                    d = message.dispatch
                    now = time.perf_counter()
                    key = (d.query_id, d.stage)
                    if d.stage > 0 and key not in self.seen and d.query_id in self.sent_at:
                        self.wire_ms.append((now - self.sent_at[d.query_id]) * 1e3)
                    self.seen.add(key)
                    finished = worker_pb2.CallFinished(
                        call_id=d.call_id, output_tokens=d.output_tokens, attempt=d.attempt
                    )
                    self.sent_at[d.query_id] = time.perf_counter()
                    out.put_nowait(worker_pb2.ConnectRequest(finished=finished))
                    self.completions += 1
            finally:
                beat.cancel()
                stream.cancel()


async def _until(
    stream: AsyncIterable[worker_pb2.ConnectResponse], stopped: asyncio.Task[bool]
) -> AsyncIterator[worker_pb2.ConnectResponse]:
    iterator = aiter(stream)
    while True:
        nxt = asyncio.ensure_future(anext(iterator))
        await asyncio.wait({nxt, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not nxt.done():
            nxt.cancel()
            return
        yield nxt.result()


async def drive_wire(
    address: str,
    worker_door: str,
    cluster: str,
    rate: float,
    seconds: float,
    auth: AuthDir | None = None,
    ready: Callable[[], Awaitable[object]] | None = None,
) -> tuple[float, list[float], coordinator_pb2.CoordinatorOverhead]:
    """`ready`: awaited once every instant worker is connected, before the drive starts."""
    workers = InstantWorkers(worker_door, cluster, auth)
    stop = asyncio.Event()
    async with _client(address, auth) as client:
        await client.wait_ready(timeout_s=30)
        tasks = [
            asyncio.create_task(workers.run_slot(i, stop)) for i in range(len(workers.instances))
        ]
        while not all(i.connected for i in (await client.status()).instances):
            await asyncio.sleep(0.05)
        if ready is not None:
            await ready()
        achieved, overhead = await drive(address, rate, seconds, auth)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    return achieved, workers.wire_ms, overhead


def coordinator_argv(
    port: int, worker_port: int, redis_url: str, extra: tuple[str, ...] = ()
) -> list[str]:
    """The command line of a benchmark coordinator on 127.0.0.1 (`CLUSTER`, admission off,
    `TIME_SCALE`), with `extra` arguments appended."""
    return [sys.executable, "-m", "hexgen_coordinator", "--listen", f"127.0.0.1:{port}",
            "--worker-listen", f"127.0.0.1:{worker_port}",
            "--redis-url", redis_url, "--cluster", CLUSTER, "--admission", "off",
            "--time-scale", repr(TIME_SCALE), "--log-level", "ERROR", *extra]  # fmt: skip


def wire_run(
    rate: float,
    seconds: float,
    appendfsync: str | None,
    auth: AuthDir | None = None,
    coordinator_args: tuple[str, ...] = (),
) -> WireRun:
    """One wire-to-wire run: a private redis-server, the coordinator (with its workers'
    door apart, and its metrics served), instant workers; `auth`: secured. The CPU seconds
    and the collections count from its workers connected to its last query finished."""
    cluster = CLUSTER
    acl = auth.redis_acl if auth is not None else None
    with RedisServer(appendfsync=appendfsync, aclfile=acl) as redis_server:
        port, worker_port, metrics_port = free_port(), free_port(), free_port()
        coordinator_args = (*coordinator_args, "--metrics-listen", f"127.0.0.1:{metrics_port}")
        secure: list[str] = []
        redis_url = redis_server.url
        if auth is not None:
            redis_url, login = redis_login(redis_url, auth, "coordinator")
            secure = [*login, *secure_argv(auth, "coordinator"),
                      "--worker-token-file", str(auth.worker_token)]  # fmt: skip
        coordinator = subprocess.Popen(
            coordinator_argv(port, worker_port, redis_url, (*secure, *coordinator_args))
        )
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        began: list[float] = []
        gc_before: list[GcCount] = []

        async def ready() -> None:
            began.append(_cpu_or_nan(coordinator.pid))
            gc_before.append(await asyncio.to_thread(_gc_now, url))

        try:
            achieved, wire, overhead = run_loop(
                drive_wire(
                    f"127.0.0.1:{port}",
                    f"127.0.0.1:{worker_port}",
                    cluster,
                    rate,
                    seconds,
                    auth,
                    ready,
                )
            )
            cpu = _cpu_or_nan(coordinator.pid) - began[0]
            gc = GcCount(*(a - b for a, b in zip(_gc_now(url), gc_before[0], strict=True)))
            return WireRun(achieved, wire, overhead, cpu, gc)
        finally:
            coordinator.terminate()
            coordinator.wait(timeout=30)


def _cpu_or_nan(pid: int) -> float:
    try:
        return cpu_s(pid)
    except OSError:  # no /proc (not Linux)
        return float("nan")


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
    parser.add_argument(
        "--appendfsync",
        choices=("always", "everysec", "none"),
        default="always",
        help="the private Redis's append-only file fsync policy (none: no file; default "
        "always, as `hexgen-flow up` runs it)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=("open", "secure"),
        default=["open", "secure"],
        help="open: plaintext, no keys; secure: TLS, API keys, mutual TLS, Redis ACL "
        "(default both)",
    )
    parser.add_argument(
        "--no-gc-tuning",
        action="store_true",
        help="run the wire-to-wire coordinators with Python's default garbage collector "
        "(hexgen_service.gc_tuning off), to see what the tuning buys",
    )
    parser.add_argument(
        "--no-pipelined-redis",
        action="store_true",
        help="run the wire-to-wire coordinators with redis-py's pooled client on the "
        "completion path (hexgen_coordinator.pipelined_redis off), to see what it buys",
    )
    args = parser.parse_args()
    coordinator_args = tuple(
        flag
        for flag, wanted in (
            ("--no-gc-tuning", args.no_gc_tuning),
            ("--no-pipelined-redis", args.no_pipelined_redis),
        )
        if wanted
    )
    appendfsync = None if args.appendfsync == "none" else args.appendfsync
    print(f"redis appendfsync: {args.appendfsync}")
    with tempfile.TemporaryDirectory(prefix="hexgen-bench-auth-") as folder:
        auth = AuthDir(Path(folder) / "auth")
        auth.init()
        modes = {mode: (auth if mode == "secure" else None) for mode in args.modes}
        print(
            f"{'mode':>6} {'target/s':>9} {'achieved/s':>10} | completion->dispatch ms "
            f"p50 / p99 / max | submit->dispatch ms p50 / p99 / max"
        )
        for mode, mode_auth in modes.items():
            for rate in args.rates:
                config = LocalClusterConfig(
                    listen="127.0.0.1:0",
                    tuner=False,
                    time_scale=TIME_SCALE,
                    admission="off",
                    redis_appendfsync=appendfsync,
                    auth_dir=mode_auth.path if mode_auth is not None else None,
                )
                with LocalCluster(config) as mesh:
                    achieved, overhead = run_loop(
                        drive(mesh.coordinator_address, rate, args.seconds, mode_auth)
                    )
                c = overhead.completion_to_dispatch_ms
                s = overhead.submit_to_dispatch_ms
                print(
                    f"{mode:>6} {rate:9.0f} {achieved:10.0f} | {c.p50:8.2f} / {c.p99:6.2f} / "
                    f"{c.max:6.1f} | {s.p50:8.2f} / {s.p99:6.2f} / {s.max:6.1f}",
                    flush=True,
                )
        print()
        print(
            f"{'mode':>6} {'target/s':>9} {'achieved/s':>10} | wire to wire ms p50 / p99 / "
            f"max (n) > 5 ms | in-handler ms p50 / p99 / max | coordinator CPU ms per "
            f"completion (completions per core-second) | GC collections (full) > 5 ms"
        )
        for mode, mode_auth in modes.items():
            for rate in args.rates:
                run = wire_run(rate, args.seconds, appendfsync, mode_auth, coordinator_args)
                wire, gc = run.wire_ms, run.gc
                cpu_ms = run.cpu_s * 1e3 / max(1, run.overhead.completions)
                c = run.overhead.completion_to_dispatch_ms
                slow = sum(1 for ms in wire if ms > STALL_S * 1e3)
                print(
                    f"{mode:>6} {rate:9.0f} {run.achieved:10.0f} | "
                    f"{percentile(wire, 50):8.2f} / {percentile(wire, 99):6.2f} / "
                    f"{max(wire):6.1f} ({len(wire)}) {slow:5d} | {c.p50:8.2f} / {c.p99:6.2f} / "
                    f"{c.max:6.1f} | {cpu_ms:6.3f} ({1e3 / cpu_ms:5.0f}) | "
                    f"{gc.collections:6d} ({gc.full}) {gc.stalls:4d}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
