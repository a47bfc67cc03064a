"""Admission control through real processes: a coordinator (``python -m
hexgen_coordinator``) and two simulated A100 workers on the Redis at 127.0.0.1:6379 (a
private key prefix per test), driven by ``hexgen-flow replay`` and the Python client.

- overload: 100 trace3 queries at 20 q/s into two A100s through ``hexgen-flow replay
  --json`` (without admission control every one misses its SLO), one worker SIGKILLed
  mid-run and started again a second later, as a supervisor would: every query is either
  completed or rejected, none fails, and >= 90 % of the admitted meet their SLO;
- a steady light load: admitted almost whole (a backlog that outlived its queries once
  refused more and more of it);
- best-effort: 30 of those queries admitted whole, the queries predicted to miss held back
  (none of their calls done when the others end; then cancelled), the others keep their SLO;
- per-tenant and cluster-wide limits on running queries: RESOURCE_EXHAUSTED with a
  retry-after hint;
- `replay` itself against a stand-in client: refusals counted, retried only when asked,
  UNAVAILABLE retried, FAILED queries counted.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import coordinator_pb2_grpc as cpb_grpc
from hexgen_client.client import CoordinatorClient
from hexgen_client.errors import CoordinatorOverloadedError, CoordinatorUnavailableError
from hexgen_flow.traces import load_trace, take_queries
from hexgen_flow.workload import Query
from hexgen_launch.replay import replay
from hexgen_service.convert import submit_from_query
from host_stalls import HostStalls
from process_mesh import MeshFactory, meshes
from redis_here import REDIS_URL, needs_redis
from up_runner import check_state

CLUSTER = "A100,A100"
TIME_SCALE = 10.0
GRADED_TIME_SCALE = 5.0
"""For the runs graded against the SLO under overload: a host's stalls count this many times
over on the cluster clock."""


pytestmark = needs_redis


@pytest.fixture
def mesh_factory(tmp_path: Path) -> Iterator[MeshFactory]:
    """``mesh_factory(coordinator_args, workers=2, time_scale=TIME_SCALE)``: a coordinator
    and its workers as processes (`process_mesh.ProcessMesh`), stopped after the test."""
    yield from meshes(tmp_path)


def _queries(n: int, tag: str) -> list[Query]:
    return [
        replace(q, query_id=f"{tag}/{q.query_id}") for q in take_queries(load_trace("trace3"), n)
    ]


# ------------------------------------------------------------------------------ overload


def test_overload_with_a_worker_killed_rejects_the_excess_and_keeps_the_slo(
    mesh_factory: MeshFactory,
) -> None:
    # --admission reject (the default), with 20 % of the SLO kept for the failure: the calls
    # in flight on the killed worker start again from scratch elsewhere. (With 10 % kept, 15
    # of 17 admitted met their SLO; the rule before docs/admission.md's change admitted 7.)
    # Time scale 5, not the mesh's 10: the cluster clock multiplies a loaded host's stalls
    # and the killed worker's restart by the scale (on a 2-core machine this run's P95 was
    # 109 s at 5, 117 s at 10 and 135 s at 20 of the 120 s SLO; at 20, 12 of 14 met it).
    mesh = mesh_factory(["--admission-slack", "0.8"], time_scale=GRADED_TIME_SCALE)
    with HostStalls() as stalls:
        cli = subprocess.Popen(
            [
                sys.executable, "-m", "hexgen_cli", "replay",
                "--trace", "trace3", "--num-queries", "100", "--qps", "20",
                "--coordinator", mesh.address, "--json", "--no-progress",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            started = time.monotonic()
            # The arrivals take 5 cluster seconds (1 s wall); 3 s wall in, the admitted
            # queries are running: a refused submission carries a retry-after hint.
            time.sleep(3.0)
            with grpc.insecure_channel(mesh.address) as channel:
                stub = cpb_grpc.CoordinatorServiceStub(channel)
                extra = submit_from_query(_queries(1, "late")[0])
                with pytest.raises(grpc.RpcError) as refused:
                    stub.SubmitQuery(extra, timeout=5)
            call = cast(grpc.Call, refused.value)
            assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, call.details()
            retry_after = dict(call.trailing_metadata() or ())["retry-after-s"]
            assert 0 < float(retry_after) <= 600
            # Mid-run, one worker dies; its calls go to the other; it comes back 1 s later.
            assert mesh.status().instances[1].in_flight > 0, "nothing running on the worker"
            mesh.kill_worker(1)
            time.sleep(1.0)
            mesh.start_worker(1)
            out, err = cli.communicate(timeout=240)
            wall = time.monotonic() - started
        finally:
            if cli.poll() is None:
                cli.kill()
                cli.wait()
    assert cli.returncode == 0, err.decode()
    doc = json.loads(out)
    status = mesh.status()
    # The host's stalls, taken off each latency (see the best-effort run below).
    epoch = mesh.epoch_unix_s()
    met = [
        q["latency_s"]
        - stalls.lost_on_cluster_clock(
            epoch, GRADED_TIME_SCALE, q["arrival_s"], q["arrival_s"] + q["latency_s"]
        )
        <= q["slo_s"]
        for q in doc["queries"]
    ]
    print(
        f"\n100 trace3 queries at 20 q/s on {CLUSTER}, worker 1 SIGKILLed 3 s in: "
        f"{doc['submitted']} submitted, {doc['admitted']} admitted, {doc['rejected']} "
        f"rejected, {doc['completed']} completed, {doc['failed']} failed; SLO "
        f"{doc['slo_s']:.1f} s, attainment of the admitted {100 * doc['slo_attainment']:.1f} %, "
        f"P95 {doc['latency_s']['p95']:.1f} s; coordinator counted {status.queries_rejected} "
        f"rejections; {wall:.1f} s wall, of which the host stood still "
        f"{stalls.total_s:.2f} s ({len(stalls.intervals)} stalls; with them taken off, "
        f"{sum(met)} of {len(met)} within their SLO)"
    )
    assert doc["submitted"] == 100
    assert doc["completed"] + doc["rejected"] == 100
    assert doc["failed"] == 0 and doc["best_effort"] == 0
    assert doc["rejected"] > 0 and doc["completed"] >= 5
    assert doc["num_queries"] == doc["admitted"] == doc["completed"]
    assert len(met) == doc["admitted"] and sum(met) >= 0.9 * len(met)
    assert status.queries_rejected == doc["rejected"] + 1  # the late one
    assert status.queries_running == 0
    code, report = check_state(REDIS_URL, "--prefix", mesh.prefix)
    assert code == 0, report
    assert report["running"] == 0 and report["queries"] == doc["admitted"], report


def test_a_steady_light_load_is_admitted_almost_whole(mesh_factory: MeshFactory) -> None:
    # 40 trace1 queries at 0.15 q/s: the simulator, with and without the same admission rule,
    # has every query within its SLO and refuses at most one. The coordinator once counted
    # each admitted query's work twice in the backlog and let half of it outlive the query,
    # so under steady arrivals the backlog only grew and it refused more and more.
    mesh = mesh_factory([])
    proc = subprocess.run(
        [
            sys.executable, "-m", "hexgen_cli", "replay",
            "--trace", "trace1", "--num-queries", "40", "--qps", "0.15",
            "--coordinator", mesh.address, "--json", "--no-progress",
        ],
        capture_output=True,
        timeout=300,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    doc = json.loads(proc.stdout)
    print(
        f"\n40 trace1 queries at 0.15 q/s on {CLUSTER}: {doc['admitted']} admitted, "
        f"{doc['rejected']} rejected, attainment of the admitted "
        f"{100 * doc['slo_attainment']:.1f} %, P95 {doc['latency_s']['p95']:.1f} s"
    )
    assert doc["submitted"] == 40 and doc["failed"] == 0
    assert doc["admitted"] >= 37, doc
    assert doc["slo_attainment"] >= 0.95
    assert mesh.status().queries_running == 0


# ----------------------------------------------------------------------------- best effort


async def test_best_effort_admits_everything_and_keeps_the_slo_of_the_predicted(
    mesh_factory: MeshFactory,
) -> None:
    # Each second the host stands still puts `time_scale` cluster seconds on every query in
    # flight. With the default slack the normal queries ran at up to 0.9 of their SLO here,
    # and twice in CI (at time scale 20, then 10) 7 of 12 met it: never here, not even with
    # both cores busy; a 4 s SIGSTOP of every process at time scale 10 made 2 of 12 miss
    # by 8-14 % with those 40 s taken off their latency. So this run keeps 20 % of the SLO
    # for the host (`--admission-slack 0.8`, as for a lost worker), runs at time scale 5,
    # takes the stalls a separate process saw off each latency, and prints what it took.
    mesh = mesh_factory(
        ["--admission", "best-effort", "--admission-slack", "0.8"],
        time_scale=GRADED_TIME_SCALE,
    )
    scale = GRADED_TIME_SCALE
    queries = _queries(30, "best-effort")

    async def follow(client: CoordinatorClient, query_id: str) -> cpb.QueryInfo:
        async for _event in client.watch(query_id):
            pass
        return (await client.get(query_id)).query

    with HostStalls() as stalls:
        async with CoordinatorClient(mesh.address) as client:
            answers, followers = [], []
            for q in queries:  # 20 q/s on the cluster clock
                answers.append(await client.submit(q))
                followers.append(asyncio.create_task(follow(client, q.query_id)))
                await asyncio.sleep(1 / 20 / scale)
            is_best = [a.query.best_effort for a in answers]
            normal = await asyncio.gather(
                *(f for f, b in zip(followers, is_best, strict=True) if not b)
            )
            # Held back: when the last query at normal urgency ends, the best-effort ones
            # have barely started. Then they are cancelled: how long they take is not
            # this test's question.
            best_then = [
                (await client.get(a.query.query_id)).query
                for a, b in zip(answers, is_best, strict=True)
                if b
            ]
            for info in best_then:
                if info.state == cpb.QUERY_STATE_RUNNING:
                    await client.cancel(info.query_id)
            await asyncio.gather(*followers)
    assert all(a.created for a in answers)
    assert all(i.state == cpb.QUERY_STATE_SUCCEEDED for i in normal)
    epoch = mesh.epoch_unix_s()
    latency = [
        i.finished_s
        - i.arrival_s
        - stalls.lost_on_cluster_clock(epoch, scale, i.arrival_s, i.finished_s)
        for i in normal
    ]
    met = [lat <= i.slo_s for lat, i in zip(latency, normal, strict=True)]
    calls_done = sum(i.calls_done for i in best_then)
    calls_total = sum(i.calls_total for i in best_then)
    print(
        f"\n30 trace3 queries at 20 q/s, best-effort: {len(normal)} at normal urgency "
        f"({sum(met)} met their SLO), {len(best_then)} best-effort, which had run "
        f"{calls_done} of their {calls_total} calls when the last normal one ended; host "
        f"stalls {stalls.total_s:.2f} s wall in {len(stalls.intervals)}; latency / SLO of "
        f"the normal, stalls taken off: "
        f"{[round(lat / i.slo_s, 2) for lat, i in zip(latency, normal, strict=True)]}"
    )
    assert best_then and normal and sum(met) >= 0.9 * len(normal)
    assert calls_done <= 0.25 * calls_total
    # Their SLO stays the real one, for reporting.
    assert {a.query.slo_s for a in answers} == {normal[0].slo_s}
    assert mesh.status().queries_rejected == 0


# ------------------------------------------------------------------------ running limits


async def test_per_tenant_and_cluster_limits_on_running_queries(
    mesh_factory: MeshFactory,
) -> None:
    # No workers: admitted queries wait parked, so they stay running.
    mesh = mesh_factory(
        ["--admission", "off", "--max-tenant-queries", "2", "--max-running-queries", "3"],
        workers=0,
    )
    base = _queries(1, "limits")[0]

    def query(n: int, tenant: str) -> Query:
        return replace(base, query_id=f"limits/{tenant}/{n}", tenant=tenant)

    async with CoordinatorClient(mesh.address) as client:
        for n in range(2):
            assert (await client.submit(query(n, "a"))).created
        with pytest.raises(CoordinatorOverloadedError) as tenant_full:
            await client.submit(query(2, "a"))
        assert "tenant 'a'" in tenant_full.value.details
        assert tenant_full.value.retry_after_s is not None and tenant_full.value.retry_after_s > 0
        # Another tenant still gets in, up to the cluster's limit.
        assert (await client.submit(query(0, "b"))).created
        with pytest.raises(CoordinatorOverloadedError) as cluster_full:
            await client.submit(query(1, "b"))
        assert "3 queries are running" in cluster_full.value.details
        # A resubmission of a running query is answered, not refused.
        again = await client.submit(query(0, "a"))
        assert not again.created
        # Cancelling one frees a place.
        await client.cancel(query(0, "a").query_id)
        assert (await client.submit(query(2, "a"))).created
        status = await client.status()
    assert status.queries_rejected == 2
    assert status.queries_running == 3
    await asyncio.sleep(0)


# ------------------------------------------------------------ the client, without a mesh


class _FakeCoordinator:
    """A `CoordinatorClient` stand-in: refuses each query's first `refusals` submissions
    (RESOURCE_EXHAUSTED, retry after 10 ms) after `outages` UNAVAILABLE answers."""

    def __init__(self, refusals: int, outages: int = 0) -> None:
        self.refusals = refusals
        self.outages = outages
        self.attempts: dict[str, int] = {}
        self.address = "fake"

    async def status(self) -> cpb.ClusterStatusResponse:
        return cpb.ClusterStatusResponse(policy="hexgen-flow", time_scale=1000.0, slo_base_s=10)

    async def submit(self, query: Query, **_: object) -> cpb.SubmitQueryResponse:
        n = self.attempts[query.query_id] = self.attempts.get(query.query_id, 0) + 1
        if n <= self.outages:
            raise CoordinatorUnavailableError(self.address, "redis unavailable: down, retry")
        if n <= self.outages + self.refusals:
            raise CoordinatorOverloadedError(self.address, "overloaded", 0.01)
        return cpb.SubmitQueryResponse(created=True, query=cpb.QueryInfo(query_id=query.query_id))

    async def watch(self, query_id: str) -> AsyncIterator[cpb.QueryEvent]:
        for _ in ():
            yield cpb.QueryEvent()

    async def get(self, query_id: str) -> cpb.GetQueryResponse:
        failed = query_id.endswith("-1")
        info = cpb.QueryInfo(
            query_id=query_id,
            state=cpb.QUERY_STATE_FAILED if failed else cpb.QUERY_STATE_SUCCEEDED,
            arrival_s=1.0,
            finished_s=0.0 if failed else 5.0,
            slo_s=30.0,
        )
        return cpb.GetQueryResponse(query=info)


async def test_replay_counts_refusals_and_retries_them_only_when_asked() -> None:
    queries = _queries(4, "fake")
    refused = await replay(cast(Any, _FakeCoordinator(refusals=1)), queries, qps=100.0)
    assert refused.extra["rejected"] == 4 and refused.extra["admitted"] == 0
    assert refused.completed == 0 and math.isnan(refused.slo_attainment)

    fake = _FakeCoordinator(refusals=2, outages=2)
    retried = await replay(cast(Any, fake), queries, qps=100.0, retry_rejected=True)
    assert set(fake.attempts.values()) == {5}
    extra = retried.extra
    assert (extra["submitted"], extra["admitted"], extra["rejected"]) == (4, 4, 0)
    # trace3-1 ended FAILED: admitted, not completed, and it counts against attainment.
    assert extra["failed"] == 1 and retried.completed == 3
    assert retried.num_queries == 4 and retried.slo_attainment == 0.75
