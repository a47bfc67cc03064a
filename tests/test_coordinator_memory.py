"""A coordinator holds nothing of a query after it ends: a long-running service must not
grow with the queries it has served (and every object it keeps is one more for each full
garbage collection to walk: `hexgen_service.gc_tuning`)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc
import pytest
import redis.asyncio as aioredis

from hexgen_api.v1 import coordinator_pb2, coordinator_pb2_grpc, worker_pb2_grpc
from hexgen_client.client import CoordinatorClient
from hexgen_client.processes import free_port
from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.coordinator import Coordinator
from hexgen_coordinator.service import CoordinatorServicer, WorkerServicer
from hexgen_flow.workload import LLMCall, Query, Workflow
from hexgen_service.server import GrpcServer
from hexgen_worker.config import WorkerConfig
from hexgen_worker.worker import Worker
from redis_here import REDIS_URL, needs_redis

pytestmark = needs_redis


@pytest.fixture(params=["off", "reject"])
async def served(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Coordinator, str]]:
    import asyncio

    redis: aioredis.Redis[bytes] = aioredis.Redis.from_url(REDIS_URL)
    prefix = f"hf-memory-test-{uuid.uuid4().hex[:8]}:"
    address = f"127.0.0.1:{free_port()}"
    config = CoordinatorConfig(
        listen=address,
        redis_prefix=prefix,
        cluster="A100,L40S",
        time_scale=500.0,
        admission=request.param,
    )
    coordinator = Coordinator(config, redis)
    await coordinator.start()

    def register(server: grpc.aio.Server) -> None:
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(
            CoordinatorServicer(coordinator), server
        )
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(coordinator), server)

    server = GrpcServer(address, register, ["hexgen_flow.v1.CoordinatorService"], grace_s=0.2)
    await server.start()
    workers = [
        Worker(WorkerConfig(coordinator=address, worker_id=f"mem-{slot}", slot=slot, gpu=gpu))
        for slot, gpu in enumerate(("A100", "L40S"))
    ]
    tasks = [asyncio.create_task(w.run()) for w in workers]
    try:
        for w in workers:
            await asyncio.wait_for(w.welcomed.wait(), 20)
        yield coordinator, address
    finally:
        for w in workers:
            w.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        await coordinator.stop()
        await server.stop()
        keys = [k async for k in redis.scan_iter(match=f"{prefix}*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


async def test_nothing_of_an_ended_query_stays_in_the_coordinator(
    served: tuple[Coordinator, str],
) -> None:
    coordinator, address = served
    small = LLMCall("information_retriever", 308, 5)
    async with CoordinatorClient(address) as client:
        for i in range(6):
            query = Query(f"mem-{i}", Workflow.chain([(small,), (small, small), (small,)]))
            events = [e async for e in client.run(query)]
            assert events[-1].kind == coordinator_pb2.QUERY_EVENT_KIND_SUCCEEDED
        await client.submit(Query("mem-last", Workflow.chain([(small,)])))  # admission predicts
        async for _ in client.watch("mem-last"):
            pass
    assert coordinator.active == {} and coordinator.tickets == {}
    assert coordinator.scheduler.estimator.plans_cached == 0
    # The backlog model drops ended queries when it next predicts (each submission): at
    # most the query that ended since the last one is left; with admission off it tracks none.
    tracked = {run.query.query_id for run in coordinator._admission.model.tracked()}
    assert tracked <= ({"mem-last"} if coordinator.config.admission != "off" else set())
