"""Learned output lengths on a real coordinator (`--output-lengths learned`) with real
workers: clients declare caps (an agent's max_tokens); the coordinator plans each call with
a length it learns from the calls that finished, never above the cap, while every engine is
still asked for the cap and the worker's queue is told the belief."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_client import CoordinatorClient
from hexgen_flow.lengths import OutputLengthPredictor
from hexgen_flow.workload import LLMCall, Query, Workflow
from in_process_mesh import drop_keys, in_process_mesh, serving
from redis_here import needs_redis

pytestmark = needs_redis

K = cpb.QueryEventKind
CAP = 48
"""Every call's declared output tokens: what the simulated engines generate, and more than
the cold belief of a keyword extraction (the step's typical answer)."""


async def test_the_coordinator_learns_lengths_under_the_caps_its_clients_declare() -> None:
    async with in_process_mesh(
        ["A100", "A6000"], "learned-lengths", time_scale=500.0, output_lengths="learned"
    ) as (coordinator, address):
        belief = coordinator.core.lengths
        assert isinstance(belief, OutputLengthPredictor) and belief.within_declared
        cold = belief.predict("extract_keywords")
        assert cold < CAP  # the cap, not the belief, is what was declared
        queries = [
            Query(
                f"learned-{i}",
                Workflow.chain(
                    [(LLMCall("extract_keywords", 300, CAP),), (LLMCall("revise", 400, CAP),)]
                ),
                slo_s=600.0,
            )
            for i in range(5)
        ]
        async with CoordinatorClient(address) as client:
            first = queries[0].query_id
            await client.submit(queries[0])
            run = coordinator.active[first].run
            # planned with the belief, declared with the cap
            assert run.query.workflow.stages[0].calls[0].output_tokens == cold
            assert coordinator.core.declared(run).workflow.stages[0].calls[0].output_tokens == CAP
            for query in queries[1:]:
                await client.submit(query)
            for query in queries:
                for _ in range(400):
                    info = (await client.get(query.query_id)).query
                    if info.state == cpb.QUERY_STATE_SUCCEEDED:
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError(f"{query.query_id} did not finish: {info}")
            finished = [
                e
                for q in queries
                for e in (await client.get(q.query_id)).events
                if e.kind == K.QUERY_EVENT_KIND_CALL_FINISHED
            ]
        # every engine was asked for the cap and generated it (the simulated engine runs
        # what it is asked), and the coordinator learned that
        assert len(finished) == 10 and {e.output_tokens for e in finished} == {CAP}
        assert belief.predict("extract_keywords") == CAP


async def _until_done(client: CoordinatorClient, query_ids: list[str]) -> None:
    for query_id in query_ids:
        async for _event in client.watch(query_id):
            pass


async def test_a_restarted_coordinator_carries_on_from_what_it_learned() -> None:
    """What the belief learned is kept in Redis: a coordinator started on it believes the
    same, and a query it resumes is planned with that belief (the engines still asked for
    the cap) and stays best-effort if it was admitted so."""
    prefix = f"hf-lengths-restart-{uuid.uuid4().hex[:8]}:"
    config: dict[str, Any] = {
        "time_scale": 500.0,
        "output_lengths": "learned",
        "admission": "best-effort",
    }
    gpus = ["A100", "A6000"]
    try:
        async with serving(gpus, prefix, **config) as (first, address):
            async with CoordinatorClient(address) as client:
                taught = [
                    Query(
                        f"teach-{i}",
                        Workflow.chain([(LLMCall("revise", 300, CAP),)]),
                        slo_s=600.0,
                    )
                    for i in range(5)
                ]
                for query in taught:
                    await client.submit(query)
                await _until_done(client, [q.query_id for q in taught])
            belief = first.core.lengths
            assert isinstance(belief, OutputLengthPredictor)
            assert belief.predict("revise") == CAP < OutputLengthPredictor().predict("revise")
        # No workers now: what is submitted stays running when this coordinator stops.
        async with serving(gpus, prefix, workers=False, **config) as (second, address):
            belief = second.core.lengths
            assert isinstance(belief, OutputLengthPredictor)
            assert belief.predict("revise") == CAP  # kept across the restart
            big = LLMCall("revise", 30_000, 4 * CAP)
            async with CoordinatorClient(address) as client:
                for i in range(12):  # a backlog at normal urgency
                    await client.submit(
                        Query(f"load-{i}", Workflow.chain([(big,) * 4]), slo_s=3600.0)
                    )
                await client.submit(Query("late", Workflow.chain([(big,)]), slo_s=60.0))
            assert second.active["late"].run.best_effort  # the backlog makes it miss
        async with serving(gpus, prefix, workers=False, **config) as (third, _):
            run = third.active["late"].run
            assert run.best_effort and run.deadline_s > run.arrival_s + 3600.0
            planned = run.query.workflow.stages[0].calls[0]
            assert planned.output_tokens == CAP  # believed: what the revisions generated
            assert third.core.declared(run).workflow.stages[0].calls[0].output_tokens == 4 * CAP
            (ticket,) = third.core.runs[run]
            assert ticket.output_tokens == 4 * CAP  # the engine is still asked for the cap
            others = [third.active[f"load-{i}"].run for i in range(12)]
            assert not any(r.best_effort for r in others)
    finally:
        await drop_keys(prefix)
