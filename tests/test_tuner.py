"""The α tuner: the window of recent queries rebuilt from the real Redis streams, the runs
it keeps in Redis, the one α history (the coordinator's, which the tuner shows), its
decision rule, its replays in the simulator, and the TunerService over real gRPC. Runs
against the real Redis at HEXGEN_TEST_REDIS (default 127.0.0.1:6379), each test under its
own key prefix, deleted afterwards.

The paths that need a live coordinator (a run that tunes and pushes α with SetAlpha, "too
few queries") are covered by the mesh's end-to-end tests.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest
import redis.asyncio as aioredis

from hexgen_api.v1 import coordinator_pb2, tuner_pb2, tuner_pb2_grpc
from hexgen_client.client import CoordinatorClient
from hexgen_client.errors import CoordinatorError
from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.coordinator import Coordinator
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.traces import load_trace
from hexgen_flow.tuning import (
    AlphaPoint,
    Decision,
    Retune,
    TuningResult,
    TuningWindow,
    replay_window,
    retune,
)
from hexgen_flow.workload import Query
from hexgen_launch.processes import free_port
from hexgen_service import redis_schema as schema
from hexgen_service.convert import submit_from_query
from hexgen_service.healthcheck import check
from hexgen_service.server import GrpcServer
from hexgen_service.status import cluster_from_status
from hexgen_tuner.config import TunerConfig
from hexgen_tuner.service import SERVICE_NAME, TunerServicer
from hexgen_tuner.store import TunerStore, TuningRunRecord
from hexgen_tuner.tuner import AlphaTuner, decide, tuning_grid
from hexgen_tuner.window import (
    admitted_key,
    finished_key,
    read_sharded_window,
    read_window,
    window_from_entries,
)
from in_process_mesh import in_process_mesh

REDIS_URL = os.environ.get("HEXGEN_TEST_REDIS", "redis://127.0.0.1:6379/0")
TRACE = load_trace("trace1")


@pytest.fixture
async def redis_client() -> AsyncIterator[aioredis.Redis[bytes]]:
    client: aioredis.Redis[bytes] = aioredis.Redis.from_url(REDIS_URL)
    yield client
    await client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


@pytest.fixture
async def prefix(redis_client: aioredis.Redis[bytes]) -> AsyncIterator[str]:
    prefix = f"hf-test-tuner-{uuid.uuid4().hex[:8]}:"
    yield prefix
    keys = [k async for k in redis_client.scan_iter(match=f"{prefix}*")]
    if keys:
        await redis_client.delete(*keys)


async def add_finished(
    client: aioredis.Redis[bytes],
    prefix: str,
    query: Query,
    arrival_s: float,
    latency_s: float = 100.0,
    slo_s: float = 176.7,
) -> None:
    """One entry of the coordinator's finished stream, as the coordinator writes it."""
    await client.xadd(
        finished_key(prefix),
        {
            "query_id": query.query_id,
            "tenant": query.tenant,
            "arrival_s": repr(arrival_s),
            "finished_s": repr(arrival_s + latency_s),
            "slo_s": repr(slo_s),
            "submit": submit_from_query(query).SerializeToString(),
        },
    )


async def add_admitted(
    client: aioredis.Redis[bytes], prefix: str, query: Query, arrival_s: float, slo_s: float
) -> None:
    """One entry of the coordinator's admitted stream, as its submit script writes it."""
    await client.xadd(
        admitted_key(prefix),
        {
            "query_id": query.query_id,
            "tenant": query.tenant,
            "arrival_s": repr(arrival_s),
            "slo_s": repr(slo_s),
            "submit": submit_from_query(query).SerializeToString(),
        },
    )


# -------------------------------------------------------------------------------- window


async def test_window_rebuilds_queries_in_arrival_order_with_relative_times(
    redis_client: aioredis.Redis[bytes], prefix: str
) -> None:
    # Finish order differs from arrival order; times are cluster seconds since the epoch.
    arrivals = {0: 1000.0, 1: 1004.0, 2: 1001.0, 3: 1010.0}
    for index in (1, 0, 3, 2):
        query = replace(TRACE[index], tenant=f"tenant-{index % 2}")
        await add_finished(redis_client, prefix, query, arrivals[index], slo_s=150.0 + index)

    window = await read_window(redis_client, prefix, 200)

    assert [q.query_id for q in window.queries] == ["trace1-0", "trace1-2", "trace1-1", "trace1-3"]
    assert [q.arrival_s for q in window.queries] == [0.0, 1.0, 4.0, 10.0]
    assert [q.slo_s for q in window.queries] == [150.0, 152.0, 151.0, 153.0]
    assert all(q.slo_scale is None for q in window.queries)
    assert [q.tenant for q in window.queries] == ["tenant-0", "tenant-0", "tenant-1", "tenant-1"]
    for q in window.queries:  # the workflow survives the proto round trip
        original = TRACE[int(q.query_id.split("-")[1])]
        assert q.workflow == original.workflow
    assert window.qps == pytest.approx(3 / 10)
    assert window.span_s == 10.0
    assert window.skipped == 0


async def test_window_takes_the_newest_entries_and_skips_unreadable_ones(
    redis_client: aioredis.Redis[bytes], prefix: str
) -> None:
    for i in range(12):
        await add_finished(redis_client, prefix, TRACE[i], 10.0 * i)
    key = finished_key(prefix)
    await redis_client.xadd(key, {"query_id": "broken", "submit": b"\xff\x00 not a proto"})
    await redis_client.xadd(key, {"query_id": "no-submit", "arrival_s": "1"})
    await add_finished(redis_client, prefix, TRACE[3], 500.0)  # finished again, later

    window = await read_window(redis_client, prefix, 5)

    # The last 5 entries: queries 10, 11, two unreadable ones, query 3 again.
    assert window.skipped == 2
    assert [q.query_id for q in window.queries] == ["trace1-10", "trace1-11", "trace1-3"]
    assert [q.arrival_s for q in window.queries] == [0.0, 10.0, 400.0]


async def test_the_window_is_the_latest_admitted_queries_finished_or_not(
    redis_client: aioredis.Redis[bytes], prefix: str
) -> None:
    # Queries 0-5 admitted 10 s apart; 0-2 have finished, 3-5 are still running. Query 9 is
    # a workflow session: never in `admitted`, in `finished` once it ended (arrived at 25 s).
    for i in range(6):
        await add_admitted(redis_client, prefix, TRACE[i], 10.0 * i, 150.0 + i)
    for i in range(3):
        await add_finished(redis_client, prefix, TRACE[i], 10.0 * i, slo_s=150.0 + i)
    await add_finished(redis_client, prefix, TRACE[9], 25.0, slo_s=99.0)

    window = await read_window(redis_client, prefix, 4)

    # The last 4 by arrival over both streams, each once, running ones included.
    assert [q.query_id for q in window.queries] == ["trace1-9", "trace1-3", "trace1-4", "trace1-5"]
    assert [q.arrival_s for q in window.queries] == [0.0, 5.0, 15.0, 25.0]
    assert [q.slo_s for q in window.queries] == [99.0, 153.0, 154.0, 155.0]
    whole = await read_window(redis_client, prefix, 200)
    assert [q.query_id for q in whole.queries] == [
        "trace1-0", "trace1-1", "trace1-2", "trace1-9", "trace1-3", "trace1-4", "trace1-5"
    ]  # fmt: skip
    assert whole.skipped == 0
    # An entry of either stream that cannot be read is skipped and counted.
    await redis_client.xadd(admitted_key(prefix), {"query_id": "x", "arrival_s": "nan"})
    assert (await read_window(redis_client, prefix, 200)).skipped == 1


async def test_a_tuner_user_from_an_older_acl_still_reads_its_finished_queries(
    redis_client: aioredis.Redis[bytes], prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The ACL `hexgen-flow auth init` wrote before the admitted stream: finished only.
    user, password = f"tuner-old-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    await redis_client.acl_setuser(
        user,
        enabled=True,
        passwords=[f"+{password}"],
        reset_keys=True,
        keys=[f"%R~{prefix}finished"],
        commands=["-@all", "+xrevrange", "+xrange", "+ping"],
    )
    old: aioredis.Redis[bytes] = aioredis.Redis.from_url(
        REDIS_URL, username=user, password=password
    )
    try:
        await add_admitted(redis_client, prefix, TRACE[1], 10.0, 150.0)
        await add_finished(redis_client, prefix, TRACE[0], 0.0, slo_s=150.0)
        window = await read_window(old, prefix, 200)
        assert [q.query_id for q in window.queries] == ["trace1-0"]
        assert f"may not read '{prefix}admitted'" in caplog.text
    finally:
        await old.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose
        await redis_client.acl_deluser(user)


async def test_a_sharded_window_is_every_shards_traffic_on_one_clock(
    redis_client: aioredis.Redis[bytes], prefix: str
) -> None:
    # Shard a's clock started at Unix 1000, shard b's at 1005 (time scale 10 both); shard c
    # has never had a coordinator (no clock, no traffic).
    a, b, c = (f"{prefix}{{{name}}}:" for name in "abc")
    await redis_client.hset(f"{a}meta", mapping={"epoch_unix_s": "1000.0", "time_scale": "10"})
    await redis_client.hset(f"{b}meta", mapping={"epoch_unix_s": "1005.0", "time_scale": "10"})
    await add_admitted(redis_client, a, TRACE[0], 100.0, 150.0)  # Unix 1010
    await add_admitted(redis_client, b, TRACE[1], 0.0, 151.0)  # Unix 1005: 50 on a's clock
    await add_admitted(redis_client, b, TRACE[0], 70.0, 152.0)  # the same id, b's own query
    await add_finished(redis_client, a, TRACE[0], 100.0, slo_s=150.0)

    window = await read_sharded_window(redis_client, [a, b, c], 200)

    assert [(q.query_id, q.arrival_s, q.slo_s) for q in window.queries] == [
        ("trace1-1", 0.0, 151.0),
        ("trace1-0", 50.0, 150.0),  # a's, at 100 on a's clock
        ("trace1-0", 70.0, 152.0),  # b's, at 70 on b's clock = 120 on a's
    ]
    assert [q.query_id for q in (await read_sharded_window(redis_client, [a, b], 2)).queries] == [
        "trace1-0",
        "trace1-0",
    ]
    assert (await read_sharded_window(redis_client, [c], 200)).queries == ()


async def test_an_empty_stream_is_an_empty_window(
    redis_client: aioredis.Redis[bytes], prefix: str
) -> None:
    window = await read_window(redis_client, prefix, 200)
    assert window.queries == () and window.qps == 0.0 and window.span_s == 0.0


# ------------------------------------------------------------------------------- records


def _run(run_id: str, **changes: object) -> TuningRunRecord:
    run = TuningRunRecord(
        run_id=run_id,
        started_s=1_700_000_000.0,
        finished_s=1_700_000_001.5,
        window_queries=40,
        qps=0.5,
        curve=(AlphaPoint(0.0, 210.0, 150.0, 0.9), AlphaPoint(0.5, math.nan, 140.0, 0.95)),
        best_alpha=0.5,
        previous_alpha=0.3,
        applied=True,
        reason="alpha 0.3 -> 0.5",
    )
    return replace(run, **changes)  # type: ignore[arg-type]  # test data


async def test_runs_are_kept_newest_first_capped_and_survive_a_restart(
    redis_client: aioredis.Redis[bytes], prefix: str
) -> None:
    store = TunerStore(redis_client, prefix, runs_kept=3)
    ids = [await store.next_run_id() for _ in range(5)]
    assert ids == [f"tune-{n:06d}" for n in range(1, 6)]
    for run_id in ids:
        await store.record_run(_run(run_id, previous_alpha=math.nan))

    restarted = TunerStore(redis_client, prefix, runs_kept=3)  # a new tuner process
    runs = await restarted.runs(20)
    assert [r.run_id for r in runs] == ["tune-000005", "tune-000004", "tune-000003"]
    assert [r.run_id for r in await restarted.runs(1)] == ["tune-000005"]
    assert await restarted.next_run_id() == "tune-000006"  # ids never repeat
    first = runs[0]
    assert first.curve[0] == AlphaPoint(0.0, 210.0, 150.0, 0.9)
    assert math.isnan(first.curve[1].p95_s)  # stored as JSON null
    assert math.isnan(first.previous_alpha)
    assert first.applied and first.reason == "alpha 0.3 -> 0.5"
    raw = await redis_client.lindex(restarted.runs_key, 0)
    assert raw is not None and b"NaN" not in raw  # strict JSON


# ------------------------------------------------------------------------------ decision


def _result(*points: tuple[float, float, float], window: int = 40) -> TuningResult:
    curve = tuple(AlphaPoint(a, p95, p95 * 0.7, att) for a, p95, att in points)
    best = min(curve, key=AlphaPoint.rank)
    return TuningResult(best, tuple(sorted(curve, key=lambda p: p.alpha)), window)


def test_decide_changes_alpha_only_for_a_strictly_better_one() -> None:
    result = _result((0.3, 200.0, 0.9), (0.5, 180.0, 0.95), (0.7, 190.0, 0.95))
    change = decide(result, 0.3)
    assert change.change and change.alpha == 0.5
    assert change.reason == "alpha 0.3 -> 0.5: P95 200.0 s -> P95 180.0 s over 40 queries"
    keep = decide(result, 0.5)
    assert not keep.change and keep.alpha == 0.5
    assert keep.reason == "alpha 0.5 is already the best (P95 180.0 s over 40 queries)"


def test_decide_keeps_the_current_alpha_on_a_tie() -> None:
    # 0.2 wins the tie-break (smaller alpha) but is no better than the current 0.6.
    result = _result((0.2, 180.0, 0.95), (0.6, 180.0, 0.95))
    decision = decide(result, 0.6)
    assert not decision.change and decision.alpha == 0.6
    assert "only ties" in decision.reason


def test_tuning_grid_adds_the_current_alpha() -> None:
    assert tuning_grid(0.5) == tuple(i / 10 for i in range(11))
    grid = tuning_grid(0.45)
    assert 0.45 in grid and len(grid) == 12 and list(grid) == sorted(grid)
    assert len(tuning_grid(math.nan)) == 11


# ------------------------------------------------------------------------------ replays


def _status(
    alpha: float = 0.5, policy: str = "hexgen-flow"
) -> coordinator_pb2.ClusterStatusResponse:
    gpus = ("A100", "A100", "A6000", "L40S")
    return coordinator_pb2.ClusterStatusResponse(
        instances=[
            coordinator_pb2.InstanceStatus(
                index=i, name=f"{g}#{i}", gpu=g, model="llama-3.1-70b", connected=True
            )
            for i, g in enumerate(gpus)
        ],
        policy="hexgen-flow",
        alpha=alpha,
        time_scale=1.0,
        slo_base_s=58.9,
    )


async def test_replaying_a_window_from_redis_gives_a_full_alpha_curve(
    redis_client: aioredis.Redis[bytes], prefix: str
) -> None:
    for i, query in enumerate(TRACE[:25]):
        await add_finished(redis_client, prefix, query, 2.0 * i, slo_s=176.7)
    window = await read_window(redis_client, prefix, 200)
    config = TunerConfig(redis_prefix=prefix, coordinator=f"127.0.0.1:{free_port()}")
    tuner = AlphaTuner(config, redis_client, CoordinatorClient(config.coordinator))

    result = tuner.replay_window(
        window, cluster_from_status(_status()), resolve_policy("hexgen-flow"), 0.45
    )

    assert result.window == 25
    alphas = [p.alpha for p in result.curve]
    assert {*(i / 10 for i in range(11)), 0.45} <= set(alphas)
    assert all(p.p95_s > 0 and 0 <= p.slo_attainment <= 1 for p in result.curve)
    assert result.best == min(result.curve, key=AlphaPoint.rank)


async def test_a_tuning_run_is_the_cores_retune_of_the_stream_window(
    redis_client: aioredis.Redis[bytes],
) -> None:
    # The stream entries as the coordinator writes them, read without Redis.
    entries = [
        (
            f"{i}-0".encode(),
            {
                b"query_id": q.query_id.encode(),
                b"arrival_s": repr(500.0 + 6.0 * i).encode(),
                b"finished_s": repr(600.0 + 6.0 * i).encode(),
                b"slo_s": b"176.7",
                b"submit": submit_from_query(q).SerializeToString(),
            },
        )
        for i, q in enumerate(TRACE[:24])
    ]
    window = window_from_entries(entries)
    core = TuningWindow.of((q, 500.0 + 6.0 * i, 176.7) for i, q in enumerate(TRACE[:24]))
    assert window.tuning == core
    config = TunerConfig(coordinator=f"127.0.0.1:{free_port()}", min_queries=20, tolerance=0.05)
    tuner = AlphaTuner(config, redis_client, CoordinatorClient(config.coordinator))
    cluster = cluster_from_status(_status())
    preset = resolve_policy("hexgen-flow")
    run = tuner.retune_window(window, cluster, preset, 0.45)
    again = retune(core, cluster, preset, 0.45, min_queries=20, tolerance=0.05)
    assert run == again and run.result is not None
    assert run.result == tuner.replay_window(window, cluster, preset, 0.45)
    too_few = tuner.retune_window(window_from_entries(entries[:5]), cluster, preset, 0.45)
    assert too_few.result is None and too_few.decision.reason == (
        "too few queries in the window (5 < 20)"
    )


# ----------------------------------------------------------------------------- service


@pytest.fixture
async def tuner_server(
    redis_client: aioredis.Redis[bytes], prefix: str
) -> AsyncIterator[tuple[str, AlphaTuner]]:
    """The real TunerService on a free port, its coordinator address unreachable."""
    config = TunerConfig(redis_prefix=prefix, coordinator=f"127.0.0.1:{free_port()}")
    coordinator = CoordinatorClient(config.coordinator, timeout_s=2.0)
    tuner = AlphaTuner(config, redis_client, coordinator, clock=lambda: 1234.5)
    address = f"127.0.0.1:{free_port()}"
    server = GrpcServer(
        address,
        lambda s: tuner_pb2_grpc.add_TunerServiceServicer_to_server(TunerServicer(tuner), s),
        [SERVICE_NAME],
        grace_s=0.1,
    )
    await server.start()
    yield address, tuner
    await server.stop()
    await coordinator.close()


async def test_retune_without_a_coordinator_records_why(
    tuner_server: tuple[str, AlphaTuner],
) -> None:
    address, tuner = tuner_server
    assert await asyncio.to_thread(check, address, SERVICE_NAME) is None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = tuner_pb2_grpc.TunerServiceStub(channel)
        run = (await stub.Retune(tuner_pb2.RetuneRequest())).run
        assert run.run_id == "tune-000001"
        assert run.reason.startswith(f"cannot reach the coordinator at {tuner.config.coordinator}")
        assert not run.applied and math.isnan(run.previous_alpha)
        assert run.started_s == run.finished_s == 1234.5 and run.window_queries == 0

        listed = await stub.ListTuningRuns(tuner_pb2.ListTuningRunsRequest())
        assert [r.run_id for r in listed.runs] == ["tune-000001"]
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.ListTuningRuns(tuner_pb2.ListTuningRunsRequest(limit=-1))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        # The α and its history are the coordinator's: with it away, none is known.
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.GetAlpha(tuner_pb2.GetAlphaRequest())
        assert unknown.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"the coordinator at {tuner.config.coordinator} keeps it" in str(
            unknown.value.details()
        )
    # The tuner wrote its runs and their counter, no α history of its own.
    assert set(await tuner.redis.keys(f"{tuner.config.redis_prefix}*")) == {
        schema.key(tuner.config.redis_prefix, name).encode() for name in schema.TUNER_KEYS
    }


# ------------------------------------------------------------------ the one α history


async def test_a_tuning_run_and_an_operator_both_appear_in_order_in_the_one_history(
    redis_client: aioredis.Redis[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with in_process_mesh(("A100", "L40S"), "one-alpha", time_scale=200.0) as (
        coordinator,
        address,
    ):
        prefix = coordinator.config.redis_prefix
        started = coordinator.scheduler.alpha
        assert started is not None
        async with CoordinatorClient(address) as client:
            tuner = AlphaTuner(TunerConfig(redis_prefix=prefix, coordinator=address),
                               redis_client, client)  # fmt: skip
            door = f"127.0.0.1:{free_port()}"  # the tuner's, a real TunerService
            server = GrpcServer(
                door,
                lambda s: tuner_pb2_grpc.add_TunerServiceServicer_to_server(
                    TunerServicer(tuner), s
                ),
                [SERVICE_NAME],
                grace_s=0.1,
            )
            await server.start()
            # A tuning run whose replays (stubbed: the rest of the run is real) choose 0.3.
            point = AlphaPoint(0.3, 100.0, 70.0, 1.0)
            chosen = Retune(Decision(0.3, True, "test: 0.3 is best"),
                            TuningResult(point, (point,), 20))  # fmt: skip
            monkeypatch.setattr(tuner, "retune_window", lambda *_: chosen)
            before = time.time()
            run = await tuner.tune_once()
            assert run.applied and run.best_alpha == 0.3, run.reason
            # An operator sets α after it, with a reason of its own.
            await client.set_alpha(0.7, "operator: back to 0.7")
            after = time.time()

            async with grpc.aio.insecure_channel(door) as channel:
                stub = tuner_pb2_grpc.TunerServiceStub(channel)
                got = await stub.GetAlpha(tuner_pb2.GetAlphaRequest())
            await server.stop()
            assert got.alpha == 0.7 == (await client.status()).alpha
            assert [(c.alpha, c.reason) for c in got.history] == [
                (started, "the default of policy hexgen-flow, at start"),
                (0.3, run.run_id),
                (0.7, "operator: back to 0.7"),
            ]
            times = [c.time_s for c in got.history]  # Unix seconds, as the tuner's runs
            assert times == sorted(times) and before - 60 < times[0] <= times[-1] <= after + 1
            assert before <= times[1] <= run.finished_s <= times[2]

            # The coordinator's own door: the same history, on both clocks, the latest few.
            history = await client.alpha_history()
            clock = coordinator.clock
            assert history.alpha == 0.7
            assert [(c.alpha, c.reason, c.unix_s) for c in history.changes] == [
                (c.alpha, c.reason, c.time_s) for c in got.history
            ]
            for c in history.changes:
                assert c.unix_s == pytest.approx(clock.wall_time(c.time_s))
            latest = await client.alpha_history(limit=2)
            assert [c.reason for c in latest.changes] == [run.run_id, "operator: back to 0.7"]
            with pytest.raises(CoordinatorError) as bad:
                await client.alpha_history(limit=-1)
            assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
        # One history: the coordinator's; the tuner kept none.
        assert await redis_client.lrange(schema.key(prefix, schema.ALPHA_HISTORY), 0, -1) == [
            schema.encode_alpha_change(c.time_s, c.alpha, c.reason).encode()
            for c in history.changes
        ]
        assert not await redis_client.exists(schema.key(prefix, schema.RETIRED_KEYS[0]))


async def test_a_coordinator_records_the_alpha_it_starts_with_when_it_is_new(
    redis_client: aioredis.Redis[bytes], prefix: str
) -> None:
    async def start(**config: object) -> list[tuple[float, str]]:
        coordinator = Coordinator(
            CoordinatorConfig(listen=f"127.0.0.1:{free_port()}", redis_prefix=prefix,
                              cluster="A100,L40S", **config),  # type: ignore[arg-type]
            redis_client,
        )  # fmt: skip
        await coordinator.start()
        try:
            history = await coordinator.alpha_history(0)
        finally:
            await coordinator.stop()
        return [(c.alpha, c.reason) for c in history.changes]

    first = await start()
    default = first[0][0]
    assert first == [(default, "the default of policy hexgen-flow, at start")]
    assert await start() == first  # the same α again: nothing new
    assert await start(alpha=0.45) == [*first, (0.45, "--alpha at start")]
    # Without --alpha it takes the kept one (none was set: the policy's default) again.
    assert (await start())[-1] == (default, "the default of policy hexgen-flow, at start")
    assert await start(policy="vllm") == await start()  # no α, nothing recorded


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            ["--window", "10", "--min-queries", "20"],
            "--min-queries (20) must not exceed --window (10)",
        ),
        (["--tolerance", "1.5"], "--tolerance must be in [0, 1), got 1.5"),
    ],
)
def test_tuner_command_line_errors_exit_2_with_one_line(args: list[str], error: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hexgen_tuner", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr == f"hexgen-tuner: error: {error}\n"


def test_the_tuner_replays_with_what_the_coordinator_learned() -> None:
    """An instance whose costs the coordinator learned (``--learn-costs``; ClusterStatus
    carries the factors) is replayed as learned: the tuner's engines and policies run its
    calibration scaled by them, as the coordinator's dispatcher believes it."""
    status = _status()
    plain = cluster_from_status(status)
    slow = status.instances[3]  # the L40S: learned 3x slower prefill, 1.5x slower decode
    slow.learned_prefill_factor, slow.learned_decode_factor, slow.learned_calls = 3.0, 1.5, 40
    status.instances[2].learned_prefill_factor = 2.0  # no calls yet: not learned
    learned = cluster_from_status(status)
    expected = plain.instances[3].latency.rescaled(3.0, 1.5)
    for tokens in ((2_000, 50), (12_000, 300)):
        assert learned.instances[3].latency.single_s(*tokens) == expected.single_s(*tokens)
        assert learned.instances[3].latency.single_s(*tokens) > plain.instances[3].latency.single_s(
            *tokens
        )
    assert learned.instances[:3] == plain.instances[:3]
    assert cluster_from_status(status, learned=False).instances == plain.instances
    window = TuningWindow.of((q, 6.0 * i, 176.7) for i, q in enumerate(TRACE[:24]))
    preset = resolve_policy("hexgen-flow")
    as_calibrated = replay_window(window, plain, preset, 0.5)
    as_learned = replay_window(window, learned, preset, 0.5)
    assert as_learned.curve != as_calibrated.curve
