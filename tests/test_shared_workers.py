"""Two coordinator shards sharing their workers, as real processes on one real Redis.

Coordinators ``s0`` and ``s1`` keep their workflows under their own prefixes (``hf:{s0}:``,
``hf:{s1}:``); ``s1`` starts a few seconds after ``s0``, so the shards' clocks have different
epochs. Three simulated workers each connect to both (``--coordinator`` twice). The tests
replay trace3 split over the shards with the SAME query ids on both (so call ids collide on
every worker) and check that each shard completed each of its own calls once, with its own
call's tokens and times on its own clock, and that `check-state` is clean for each prefix;
that a shard sees the calls the other shard put on a shared worker (ClusterStatus's
``others_in_flight``); and that a worker refuses coordinators whose welcomes disagree.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import redis

from hexgen_api.v1 import coordinator_pb2
from hexgen_client.client import CoordinatorClient
from hexgen_flow.workload import Query
from hexgen_launch.processes import ManagedProcess, RedisServer, free_port, stop_processes
from hexgen_launch.replay import replay
from replay_on_redis import assert_each_call_completed_once, trace3_replay
from up_runner import check_state

CLUSTER = "A100,A6000,L40S,A100"
"""Slot 3 stays free: the worker of the mismatch test takes it."""
WORKER_SLOTS = {0: "A100", 1: "A6000", 2: "L40S"}
TIME_SCALE = 20.0
PER_SHARD = 10
QPS = 1.0
START_TIMEOUT_S = 45.0
REPLAY_TIMEOUT_S = 45.0
"""A replay that loses a call never ends: fail instead."""


@dataclass
class Shard:
    name: str
    prefix: str
    listen: str
    worker_door: str
    process: ManagedProcess


@dataclass
class SharedMesh:
    redis_url: str
    shards: list[Shard]
    workers: list[ManagedProcess]
    logs: Path


def _coordinator(name: str, redis_url: str, logs: Path, *, time_scale: float = TIME_SCALE) -> Shard:
    listen, door = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    prefix = f"hf:{{{name}}}:"
    argv = [
        sys.executable, "-m", "hexgen_coordinator",
        "--listen", listen,
        "--worker-listen", door,
        "--redis-url", redis_url,
        "--redis-prefix", prefix,
        "--cluster", CLUSTER,
        "--time-scale", repr(time_scale),
        "--admission", "off",
        "--log-level", "WARNING",
    ]  # fmt: skip
    process = ManagedProcess(f"coordinator {name}", argv, logs / f"coordinator-{name}.log")
    process.start()
    return Shard(name, prefix, listen, door, process)


def _worker_argv(worker_id: str, slot: int, gpu: str, doors: list[str]) -> list[str]:
    coordinators = [arg for door in doors for arg in ("--coordinator", door)]
    return [
        sys.executable, "-m", "hexgen_worker",
        *coordinators,
        "--worker-id", worker_id,
        "--slot", str(slot),
        "--gpu", gpu,
        "--log-level", "WARNING",
    ]  # fmt: skip


async def _statuses(
    shards: list[Shard],
) -> list[coordinator_pb2.ClusterStatusResponse]:
    replies = []
    for shard in shards:
        async with CoordinatorClient(shard.listen) as client:
            replies.append(await client.wait_ready(START_TIMEOUT_S))
    return replies


def _wait_connected(mesh: SharedMesh) -> None:
    """Until both coordinators see every worker, by the same worker id in the same slot."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        statuses = asyncio.run(_statuses(mesh.shards))
        held = [{i.index: i.worker_id for i in s.instances if i.connected} for s in statuses]
        if all(h == {slot: f"shared-{slot}" for slot in WORKER_SLOTS} for h in held):
            return
        for proc in [s.process for s in mesh.shards] + mesh.workers:
            assert proc.running, proc.failure("exited").args[0]
        assert time.monotonic() < deadline, f"workers not connected to both shards: {held}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedMesh]:
    logs = tmp_path_factory.mktemp("shared-workers")
    with RedisServer(appendfsync=None) as server:
        first = _coordinator("s0", server.url, logs)
        processes = [first.process]
        try:
            asyncio.run(_statuses([first]))  # up: its clock's epoch is fixed in Redis
            time.sleep(1.0)  # so that the second shard's epoch is clearly later
            second = _coordinator("s1", server.url, logs)
            processes.append(second.process)
            doors = [first.worker_door, second.worker_door]
            workers = []
            for slot, gpu in WORKER_SLOTS.items():
                argv = _worker_argv(f"shared-{slot}", slot, gpu, doors)
                worker = ManagedProcess(f"worker {slot}", argv, logs / f"worker-{slot}.log")
                worker.start()
                workers.append(worker)
                processes.append(worker)
            shared = SharedMesh(server.url, [first, second], workers, logs)
            _wait_connected(shared)
            yield shared
        finally:
            stop_processes(reversed(processes), grace_s=5.0)


def _shard_queries() -> tuple[list[Query], list[Query]]:
    """trace3's first 2 x PER_SHARD queries, half to each shard, the second half renamed to
    the first half's ids: the same query (and call) ids on both shards."""
    queries, _ = trace3_replay("shared", 2 * PER_SHARD)
    first, second = queries[:PER_SHARD], queries[PER_SHARD:]
    return first, [replace(q, query_id=p.query_id) for q, p in zip(second, first, strict=True)]


def _calls(queries: list[Query]) -> dict[str, int]:
    """Each call's id and its output tokens (what the simulated engine reports)."""
    return {
        f"{q.query_id}/{k}.{i}": call.output_tokens
        for q in queries
        for k, stage in enumerate(q.workflow.stages)
        for i, call in enumerate(stage.calls)
    }


def test_a_replay_split_over_two_shards_completes_each_call_once_on_its_own_shard(
    mesh: SharedMesh,
) -> None:
    workloads = _shard_queries()

    async def main() -> list[float]:
        clients = [CoordinatorClient(shard.listen) for shard in mesh.shards]
        try:
            runs = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        replay(client, queries, QPS, seed=k, retry_s=30)
                        for k, (client, queries) in enumerate(zip(clients, workloads, strict=True))
                    )
                ),
                REPLAY_TIMEOUT_S,
            )
            for run in runs:
                assert run.completed == run.num_queries == PER_SHARD
            # both clocks read at (nearly) the same instant
            return [(await c.status()).now_s for c in clients]
        finally:
            for client in clients:
                await client.close()

    now_s = asyncio.run(main())
    # s0's epoch is earlier: its clock reads more; the gap is what an untranslated time
    # would be off by on one of the shards.
    gap_s = now_s[0] - now_s[1]
    assert gap_s > 15.0, f"the shards' clocks are too close ({gap_s:.1f} s) to tell"
    client = redis.Redis.from_url(mesh.redis_url)
    try:
        for shard, queries in zip(mesh.shards, workloads, strict=True):
            expected = _calls(queries)
            entries = client.xrange(shard.prefix + "completions")
            assert_each_call_completed_once(entries, set(expected))
            instances = set()
            for _, fields in entries:
                record = {k.decode(): v.decode() for k, v in fields.items()}
                # this shard's own call ran, not the other shard's call of the same id
                assert int(record["output_tokens"]) == expected[record["call_id"]], record
                released, began, ended = (
                    float(record[f]) for f in ("released_s", "started_s", "finished_s")
                )
                # on this shard's clock: started after the release (in the queue for well
                # under a second here), not a clock gap before or after it
                assert released - 1e-3 <= began < released + gap_s / 2, record
                assert began <= ended, record
                instances.add(record["instance"])
            assert len(instances) >= 2, instances  # the shard used several shared workers
    finally:
        client.close()
    for shard in mesh.shards:
        code, report = check_state(mesh.redis_url, "--prefix", shard.prefix)
        assert code == 0, report
        counted = report["queries"]  # the other tests' too, when they ran first
        assert isinstance(counted, int) and counted >= PER_SHARD, report
        assert report["running"] == 0, report


def test_a_shard_sees_the_calls_the_other_shard_put_on_a_shared_worker(
    mesh: SharedMesh,
) -> None:
    queries, _ = trace3_replay("seen", 4)
    first, second = mesh.shards

    async def main() -> tuple[coordinator_pb2.InstanceStatus, int]:
        async with (
            CoordinatorClient(first.listen) as busy,
            CoordinatorClient(second.listen) as idle,
        ):
            run = asyncio.create_task(replay(busy, queries, 2.0, seed=3, retry_s=30))
            seen: tuple[coordinator_pb2.InstanceStatus, int] | None = None
            while not run.done() and seen is None:
                status = await idle.status()
                for inst in status.instances:
                    if inst.others_in_flight > 0:
                        seen = (inst, status.queries_running)
                await asyncio.sleep(0.05)
            metrics = await asyncio.wait_for(run, REPLAY_TIMEOUT_S)
            assert metrics.completed == len(queries)
            assert seen is not None, "s1 never saw s0's calls on a shared worker"
            # once s0's calls are done, the next heartbeats clear them from s1's view
            deadline = time.monotonic() + 10.0
            while any(i.in_flight for i in (await idle.status()).instances):
                assert time.monotonic() < deadline, "s1 still counts s0's finished calls"
                await asyncio.sleep(0.1)
            return seen

    inst, s1_running = asyncio.run(main())
    # s1 runs nothing: every call its dispatcher counts on that worker is s0's
    assert s1_running == 0
    assert inst.in_flight == inst.others_in_flight > 0
    assert inst.outstanding_s > 0.0
    # with the weights s0 charged them (hexgen-flow's tail weight: how late each query is
    # heading, > 0), which the worker reported with them
    assert inst.others_weight > 0.0
    assert inst.worker_id.startswith("shared-")


def test_a_worker_refuses_coordinators_whose_welcomes_disagree(mesh: SharedMesh) -> None:
    odd = _coordinator("odd", mesh.redis_url, mesh.logs, time_scale=7.0)
    try:
        asyncio.run(_statuses([odd]))
        doors = [mesh.shards[0].worker_door, odd.worker_door]
        done = subprocess.run(
            _worker_argv("mismatch", 3, "A100", doors),
            capture_output=True,
            text=True,
            timeout=45,
            check=False,
        )
    finally:
        stop_processes([odd.process], grace_s=5.0)
    assert done.returncode == 2, done.stderr
    refusal = next(line for line in done.stderr.splitlines() if "welcome.time_scale" in line)
    assert "cannot serve the welcome of coordinator" in refusal
    for door, scale in ((mesh.shards[0].worker_door, "20.0"), (odd.worker_door, "7.0")):
        assert f"coordinator {door} says {scale}" in refusal, refusal
