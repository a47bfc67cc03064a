"""A coordinator holds nothing of a query after it ends: a long-running service must not
grow with the queries it has served (and every object it keeps is one more for each full
garbage collection to walk: `hexgen_service.gc_tuning`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from hexgen_api.v1 import coordinator_pb2
from hexgen_client.client import CoordinatorClient
from hexgen_coordinator.coordinator import Coordinator
from hexgen_flow.workload import LLMCall, Query, Workflow
from in_process_mesh import in_process_mesh
from redis_here import needs_redis

pytestmark = needs_redis


@pytest.fixture(params=["off", "reject"])
async def served(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Coordinator, str]]:
    async with in_process_mesh(
        ("A100", "L40S"), "memory-test", time_scale=500.0, admission=request.param
    ) as served:
        yield served


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
    assert len(coordinator.scheduler.load.prefix_homes) == 0
    # The backlog model drops ended queries when it next predicts (each submission): at
    # most the query that ended since the last one is left; with admission off it tracks none.
    tracked = {run.query.query_id for run in coordinator._admission.model.tracked()}
    assert tracked <= ({"mem-last"} if coordinator.config.admission != "off" else set())
