"""Hostile load: what one tenant's request can still do to everyone else, measured.

Two parts:

- ``sim``: fair admission in the simulator (`hexgen_flow.sim.admitting`). trace1 on the
  paper's cluster A100,A100,A6000,L40S at 3 q/s (an overload: admission control refuses most
  queries), the arrivals split between tenant ``a`` and tenant ``b`` (four to one, and nine
  to one): per tenant, the queries admitted and within their SLO when the coordinator sees
  one tenant (every query's work counts against every other) and when it sees two (another
  tenant's work counts at most its share of the cluster), and with ``b`` of weight 3.
- ``mesh``: a real mesh (`LocalCluster`: private Redis, coordinator, four simulated workers,
  A100,A100,A6000,L40S, time scale 20) under the hostile requests one at a time:

  1. one call of 100 input / 100,000 output tokens with the default SLO, then with an
     SLO it can meet; while it runs, a small query of its tenant and of another: how long
     each took to be admitted, and its latency against its SLO;
  2. sixteen concurrent 60 MB submissions, sixteen 6 MB GetQuery, sixteen 7 MB
     submissions: the coordinator's resident memory before and after, the longest stall
     of its event loop meanwhile (its ``hexgen_flow_event_loop_lag_seconds``), and the
     longest ClusterStatus round trip a separate process saw (which adds waiting behind
     the flood's own requests, and the two cores the flood keeps busy);
  3. a tenant that submits query after query with 1 MiB prompts against a quota of
     8 MiB: admitted and refused, what Redis holds of its prompts at the end of the burst
     and after its queries ended, and `check-state`;
  4. a call that kills every worker that starts it, beside 20 queries: kills, how the
     poisoned query ended, how many of the others succeeded.

    .venv/bin/python benchmarks/hostile_load.py [--part sim|mesh|all] [--json]

The figures are in the closing note of the change that added them and in
docs/admission.md ("Fair and local").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import redis
from prometheus_client.parser import text_string_to_metric_families

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import coordinator_pb2_grpc as cpb_grpc
from hexgen_api.v1 import workflow_pb2 as wfpb
from hexgen_client.client import CoordinatorClient
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.sim.admitting import AdmittingSimulation
from hexgen_flow.sim.simulator import SimConfig
from hexgen_flow.traces import load_trace, take_queries
from hexgen_launch.cluster import LocalCluster, LocalClusterConfig

PAPER = "A100,A100,A6000,L40S"
SUBMIT = "/hexgen_flow.v1.CoordinatorService/SubmitQuery"
GET = "/hexgen_flow.v1.CoordinatorService/GetQuery"
QUOTA = 8 << 20


# ------------------------------------------------------------------------------ the simulator


def _weights(b: float) -> Callable[[str], float]:
    return lambda tenant: b if tenant == "b" else 1.0


def sim_fairness() -> list[dict[str, Any]]:
    base = take_queries(load_trace("trace1"), 200)
    rows = []
    for every in (5, 10):  # one arrival in `every` is b's
        b_ids = {str(i) for i in range(0, 200, every)}
        for label, tenants, weight_b in (("one tenant", False, 1.0), ("fair", True, 1.0),
                                         ("fair, b weight 3", True, 3.0)):  # fmt: skip
            queries = [
                replace(
                    q,
                    query_id=str(i),
                    tenant=("b" if str(i) in b_ids else "a") if tenants else "x",
                )
                for i, q in enumerate(base)
            ]
            sim = AdmittingSimulation(
                queries,
                parse_cluster(PAPER),
                resolve_policy("hexgen-flow"),
                SimConfig(3.0, 3.0, 0),
                weight_of=_weights(weight_b),
            )
            outcomes = {o.query_id: o for o in sim.run().outcomes}
            row: dict[str, Any] = {"b_share": f"1 in {every}", "admission": label}
            for tenant, ids in (("a", {str(i) for i in range(200)} - b_ids), ("b", b_ids)):
                row[f"{tenant}_queries"] = len(ids)
                row[f"{tenant}_admitted"] = sum(i in outcomes for i in ids)
                row[f"{tenant}_met"] = sum(outcomes[i].met_slo for i in ids if i in outcomes)
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------ the mesh


def _workflow(*calls: tuple[int, int, str]) -> wfpb.Workflow:
    return wfpb.Workflow(
        stages=[
            wfpb.Stage(
                id=f"s{k}",
                step="revise",
                after=[f"s{k - 1}"] if k else [],
                calls=[wfpb.LLMCall(input_tokens=i, output_tokens=o, prompt=p)],
            )
            for k, (i, o, p) in enumerate(calls)
        ]
    )


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


_PROBE = """
import sys, time, grpc
from hexgen_api.v1 import coordinator_pb2 as cpb, coordinator_pb2_grpc as g
stub = g.CoordinatorServiceStub(grpc.insecure_channel(sys.argv[1]))
end, worst, n = time.monotonic() + float(sys.argv[2]), 0.0, 0
while time.monotonic() < end:
    t = time.monotonic(); stub.ClusterStatus(cpb.ClusterStatusRequest(), timeout=30)
    worst = max(worst, time.monotonic() - t); n += 1; time.sleep(0.02)
print(worst, n)
"""


async def _ended(client: CoordinatorClient, query_id: str) -> cpb.QueryInfo:
    async for _ in client.watch(query_id):
        pass
    return (await client.get(query_id)).query


async def _oversized(address: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with grpc.aio.insecure_channel(address) as channel, CoordinatorClient(address) as client:
        stub: Any = cpb_grpc.CoordinatorServiceStub(channel)
        huge = _workflow((100, 100_000, "write a novel"))
        try:
            await stub.SubmitQuery(
                cpb.SubmitQueryRequest(query_id="huge", workflow=huge, tenant="a")
            )
            out["default_slo"] = "admitted"
        except grpc.aio.AioRpcError as exc:
            out["default_slo"] = f"{exc.code().name}: {(exc.details() or '')[:90]}"
        answer = await stub.SubmitQuery(
            cpb.SubmitQueryRequest(query_id="huge", workflow=huge, tenant="a", slo_s=20_000)
        )
        out["long_slo"] = "best-effort" if answer.query.best_effort else "admitted"
        async for event in client.watch("huge"):
            if event.kind == cpb.QUERY_EVENT_KIND_CALL_STARTED:
                break
        for tenant in ("a", "b"):
            t0 = time.monotonic()
            request = cpb.SubmitQueryRequest(
                query_id=f"small-{tenant}", workflow=_workflow((10, 5, "hi")), tenant=tenant
            )
            await stub.SubmitQuery(request)
            admitted_ms = (time.monotonic() - t0) * 1e3
            info = await _ended(client, f"small-{tenant}")
            out[f"small_{tenant}"] = {
                "admitted_ms": round(admitted_ms, 1),
                "state": cpb.QueryState.Name(info.state),
                "latency_s": round(info.finished_s - info.arrival_s, 2),
                "slo_s": round(info.slo_s, 1),
            }
        await client.cancel("huge")
    return out


def _flood(address: str, method: str, body: bytes, n: int = 16) -> dict[str, int]:
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)])
    rpc: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
        method, request_serializer=None, response_deserializer=None
    )

    def one(_: int) -> str:
        try:
            rpc(body, timeout=60)
        except grpc.RpcError as exc:
            assert isinstance(exc, grpc.Call)
            return exc.code().name
        return "OK"

    with ThreadPoolExecutor(n) as pool:
        codes = list(pool.map(one, range(n)))
    channel.close()
    return {code: codes.count(code) for code in set(codes)}


def _lag_buckets(cluster: LocalCluster) -> dict[float, float]:
    """The coordinator's event-loop lag histogram: cumulative count by upper bound."""
    url = f"http://{cluster.metrics_address}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "hexgen_flow_event_loop_lag_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                out[float(sample.labels["le"])] = sample.value
    return out


def _longest_lag(before: dict[float, float], after: dict[float, float]) -> str:
    """The bucket the longest lag between two scrapes fell in."""
    counts = {le: after[le] - before.get(le, 0.0) for le in after}
    total = counts[float("inf")]
    bounds = sorted(counts)
    for low, high in zip([0.0, *bounds], bounds, strict=False):
        if counts[high] == total:
            return f"{low * 1e3:g}-{high * 1e3:g} ms"
    return "?"


def _memory(cluster: LocalCluster) -> dict[str, Any]:
    assert cluster.coordinator is not None and cluster.coordinator.pid is not None
    pid, address = cluster.coordinator.pid, cluster.coordinator_address
    big = "x" * (60 << 20)
    submission = cpb.SubmitQueryRequest(
        query_id="big", workflow=_workflow((10, 5, big))
    ).SerializeToString()
    del big
    long_id = cpb.GetQueryRequest(query_id="q" * (6 << 20)).SerializeToString()
    too_long = cpb.SubmitQueryRequest(
        query_id="long", workflow=_workflow((10, 5, "y" * (7 << 20)))
    ).SerializeToString()
    start = _rss_mb(pid)
    lag_before = _lag_buckets(cluster)
    probe = subprocess.Popen(
        [sys.executable, "-c", _PROBE, address, "12"], stdout=subprocess.PIPE, text=True
    )
    time.sleep(0.5)
    out: dict[str, Any] = {"rss_before_mb": round(start)}
    out["60MB SubmitQuery x16"] = _flood(address, SUBMIT, submission)
    out["6MB GetQuery x16"] = _flood(address, GET, long_id)
    out["7MB SubmitQuery x16"] = _flood(address, SUBMIT, too_long)
    worst, probes = probe.communicate()[0].split()
    out["longest_event_loop_lag"] = _longest_lag(lag_before, _lag_buckets(cluster))
    out["longest_status_round_trip_ms"] = round(float(worst) * 1e3, 1)
    out["status_probes"] = int(probes)
    time.sleep(8.0)  # the heap trimmer looks every second, again after a burst
    out["rss_after_mb"] = round(_rss_mb(pid))
    return out


async def _tenant_bytes(cluster: LocalCluster) -> dict[str, Any]:
    address = cluster.coordinator_address
    assert cluster.redis_url is not None
    r = redis.Redis.from_url(cluster.redis_url)
    prefix = cluster.config.redis_prefix
    prompt = "z" * (1 << 20)
    admitted = refused = 0
    async with grpc.aio.insecure_channel(address) as channel, CoordinatorClient(address) as client:
        stub: Any = cpb_grpc.CoordinatorServiceStub(channel)
        for n in range(30):
            request = cpb.SubmitQueryRequest(
                query_id=f"t{n}",
                tenant="flood",
                workflow=_workflow((300_000, 200, prompt), (300_000, 200, prompt)),
                slo_s=7200,
            )
            try:
                await stub.SubmitQuery(request)
                admitted += 1
            except grpc.aio.AioRpcError as exc:
                refused += exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        held = sum(r.memory_usage(k) or 0 for k in r.scan_iter(match=f"{prefix}pr:t*"))
        await asyncio.gather(*(_ended(client, f"t{n}") for n in range(30) if n < admitted))
    left = sum(1 for _ in r.scan_iter(match=f"{prefix}pr:*"))
    check = subprocess.run(
        [sys.executable, "-m", "hexgen_cli", "check-state", "--redis-url", cluster.redis_url,
         "--prefix", prefix, "--json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    report = json.loads(check.stdout)
    return {
        "quota_mib": QUOTA >> 20,
        "admitted": admitted,
        "refused": refused,
        "prompts_held_mib": round(held / 2**20, 2),
        "prompt_keys_after": left,
        "check_state": "clean" if check.returncode == 0 else report["problems"],
    }


async def _crash_loop(cluster: LocalCluster) -> dict[str, Any]:
    address = cluster.coordinator_address
    slot_of = {s.name: s.index for s in cluster.status().instances}
    kills = 0

    async def kill_whoever_runs_it(client: CoordinatorClient) -> None:
        nonlocal kills
        async for event in client.watch("poison"):
            if event.kind == cpb.QUERY_EVENT_KIND_CALL_STARTED:
                worker = cluster.workers[slot_of[event.instance]]
                if worker.running:
                    worker.send(signal.SIGKILL)  # the supervisor restarts it
                    kills += 1

    async def supervise() -> None:
        while True:
            cluster.supervise()
            await asyncio.sleep(0.2)

    async with grpc.aio.insecure_channel(address) as channel, CoordinatorClient(address) as client:
        stub: Any = cpb_grpc.CoordinatorServiceStub(channel)
        supervisor = asyncio.create_task(supervise())
        await stub.SubmitQuery(
            cpb.SubmitQueryRequest(
                query_id="poison", workflow=_workflow((2000, 4000, "boom")), slo_s=3600
            )
        )
        killer = asyncio.create_task(kill_whoever_runs_it(client))
        for n in range(20):
            await stub.SubmitQuery(
                cpb.SubmitQueryRequest(
                    query_id=f"ok{n}", workflow=_workflow((1500, 60, "a"), (800, 30, "b"))
                )
            )
        poison = await asyncio.wait_for(_ended(client, "poison"), 120)
        others = [await asyncio.wait_for(_ended(client, f"ok{n}"), 120) for n in range(20)]
        await asyncio.wait_for(killer, 10)
        supervisor.cancel()
    return {
        "kills": kills,
        "poison": cpb.QueryState.Name(poison.state),
        "reason": poison.failure_reason,
        "others_succeeded": sum(o.state == cpb.QUERY_STATE_SUCCEEDED for o in others),
        "others": len(others),
    }


def mesh() -> dict[str, Any]:
    cluster = LocalCluster(
        LocalClusterConfig(
            cluster=PAPER,
            time_scale=20.0,
            tuner=False,
            metrics_listen="127.0.0.1:0",
            max_call_attempts=3,
            coordinator_args=("--max-tenant-prompt-bytes", str(QUOTA), "--log-level", "WARNING"),
        )
    )
    cluster.start()
    try:
        figures: dict[str, Any] = {}
        figures["oversized"] = asyncio.run(_oversized(cluster.coordinator_address))
        figures["memory"] = _memory(cluster)
        figures["tenant_bytes"] = asyncio.run(_tenant_bytes(cluster))
        figures["crash_loop"] = asyncio.run(_crash_loop(cluster))
        return figures
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("sim", "mesh", "all"), default="all")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    out: dict[str, Any] = {}
    if args.part in ("sim", "all"):
        out["sim_fairness"] = sim_fairness()
    if args.part in ("mesh", "all"):
        out["mesh"] = mesh()
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for row in out.get("sim_fairness", []):
        print(
            f"b {row['b_share']:<9} {row['admission']:<17} "
            f"a: {row['a_admitted']:>3} admitted / {row['a_met']:>3} met of {row['a_queries']}   "
            f"b: {row['b_admitted']:>3} admitted / {row['b_met']:>3} met of {row['b_queries']}"
        )
    for name, figures in out.get("mesh", {}).items():
        print(f"{name}: {json.dumps(figures)}")


if __name__ == "__main__":
    main()
