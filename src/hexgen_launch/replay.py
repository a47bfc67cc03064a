"""`replay`: drive a running cluster with a workload the way ``hexgen-flow simulate`` does.

The queries are submitted at the simulator's arrival times for the same seed (converted to
wall time with the coordinator's time scale), each is followed until it ends, and the run's
`RunMetrics` come from the times the coordinator reports (cluster seconds), so the numbers
compare directly with ``simulate``'s. Query ids are the caller's (``take_queries`` gives
the simulator's), and submission is idempotent on them: replaying the same queries into the
same coordinator again submits nothing new and reports the earlier results (counted in
``extra["resubmitted"]``).

Under overload the coordinator's admission control refuses submissions
(RESOURCE_EXHAUSTED): they are counted as rejected, not retried (unless `retry_rejected`,
which waits for the coordinator's retry-after hint). A submission that finds the
coordinator unavailable (restarting, or its Redis unreachable) is retried with exponential
back-off for up to `retry_s`. The metrics count what was admitted: ``num_queries`` and
``slo_attainment`` are over the admitted queries, and ``extra`` says ``submitted``,
``admitted``, ``rejected``, ``failed`` (ended FAILED) and ``best_effort`` (admitted at the
lowest urgency).

A query followed across a coordinator restart that outlasted its retention is NOT_FOUND
when the coordinator is back: it is reported from its terminal event if the watch saw one,
and otherwise ends the run with that error (`_await_end`).
"""

from __future__ import annotations

import asyncio
import random
import sys
from collections.abc import Sequence

import grpc
from tqdm import tqdm

from hexgen_api.v1 import coordinator_pb2
from hexgen_client.client import CoordinatorClient
from hexgen_client.convert import STATE_AFTER, TERMINAL_EVENTS, TERMINAL_STATES
from hexgen_client.errors import (
    CoordinatorError,
    CoordinatorOverloadedError,
    CoordinatorUnavailableError,
)
from hexgen_flow.errors import ConfigError
from hexgen_flow.metrics import RunMetrics
from hexgen_flow.workload import Query
from hexgen_launch.measure import arrival_schedule, default_slo_s, policy_alpha, run_metrics

__all__ = ["replay"]

_RETRY_PAUSE_S = 0.5
_BACKOFF_FIRST_S = 0.1
_BACKOFF_MAX_S = 2.0


async def replay(
    client: CoordinatorClient,
    queries: Sequence[Query],
    qps: float,
    *,
    seed: int = 0,
    arrival_cv: float = 1.0,
    slo_scale: float | None = None,
    progress: bool = False,
    retry_s: float = 30.0,
    retry_rejected: bool = False,
) -> RunMetrics:
    """Replay `queries` at `qps` into the coordinator behind `client`; wait for all of them.

    `slo_scale` None leaves queries without an SLO of their own to the coordinator's
    default scale. `progress` shows a tqdm bar on stderr. While the coordinator is
    unreachable (a restart) or answers UNAVAILABLE, submissions and watches are retried
    for up to `retry_s` wall seconds before `CoordinatorUnavailableError` is raised. A
    submission refused by admission control counts as rejected; with `retry_rejected` it is
    submitted again after the coordinator's retry-after hint, for up to `retry_s` after its
    arrival.
    """
    if not queries:
        raise ConfigError("no queries to replay")
    ids = [q.query_id for q in queries]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise ConfigError(f"query id {duplicate!r} appears twice; replayed ids must be unique")
    schedule = arrival_schedule(queries, qps, arrival_cv, seed)
    status = await client.status()
    time_scale = status.time_scale if status.time_scale > 0 else 1.0

    loop = asyncio.get_running_loop()
    infos: dict[int, coordinator_pb2.QueryInfo] = {}
    rejected: set[int] = set()
    best_effort: set[int] = set()
    resubmitted = 0
    bar = tqdm(
        total=len(queries), desc="replay", unit="query", file=sys.stderr, disable=not progress
    )

    async def follow(index: int, admitted: coordinator_pb2.QueryInfo) -> None:
        infos[index] = await _await_end(client, queries[index].query_id, retry_s, admitted)
        bar.update(1)

    async def submit_and_follow(index: int) -> None:
        nonlocal resubmitted
        response = await _submit(client, queries[index], slo_scale, retry_s, retry_rejected)
        if response is None:
            rejected.add(index)
            bar.update(1)
            return
        resubmitted += not response.created
        if response.query.best_effort:
            best_effort.add(index)
        await follow(index, response.query)

    tasks: list[asyncio.Task[None]] = []
    started = loop.time()
    try:
        for arrival_s, index in schedule:
            delay = started + arrival_s / time_scale - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if retry_rejected:
                # Retries wait for their hint without holding back later arrivals.
                tasks.append(asyncio.create_task(submit_and_follow(index)))
            else:
                response = await _submit(client, queries[index], slo_scale, retry_s, False)
                if response is None:
                    rejected.add(index)
                    bar.update(1)
                else:
                    resubmitted += not response.created
                    if response.query.best_effort:
                        best_effort.add(index)
                    tasks.append(asyncio.create_task(follow(index, response.query)))
            # A follower that failed fails the run now, not after every submission.
            for task in tasks:
                if task.done() and task.exception() is not None:
                    await task
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        bar.close()

    final = await client.status()
    ordered = [infos[i] for i in range(len(queries)) if i in infos]
    extra: dict[str, object] = {
        "submitted": len(queries),
        "admitted": len(ordered),
        "rejected": len(rejected),
        "failed": sum(info.state == coordinator_pb2.QUERY_STATE_FAILED for info in ordered),
        "best_effort": len(best_effort | {i for i, info in infos.items() if info.best_effort}),
    }
    if resubmitted:
        extra["resubmitted"] = resubmitted
    if final.alpha != status.alpha:
        extra["alpha_at_start"] = status.alpha
    return run_metrics(
        ordered,
        policy=final.policy,
        alpha=policy_alpha(final.policy, final.alpha),
        qps=qps,
        num_queries=len(ordered),
        slo_s=(
            slo_scale * final.slo_base_s
            if slo_scale is not None
            else default_slo_s(queries, ordered)
        ),
        extra=extra,
    )


async def _submit(
    client: CoordinatorClient,
    query: Query,
    slo_scale: float | None,
    retry_s: float,
    retry_rejected: bool,
) -> coordinator_pb2.SubmitQueryResponse | None:
    """The coordinator's answer to the submission of `query`, None when it refused it.

    UNAVAILABLE (the coordinator restarting, or its Redis unreachable) is retried with
    exponential back-off (0.1 s doubling to 2 s, jittered) for up to `retry_s`; a refusal
    is retried after its retry-after hint only with `retry_rejected`, within `retry_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_s
    backoff = _BACKOFF_FIRST_S
    while True:
        try:
            return await client.submit(query, slo_scale=slo_scale)
        except CoordinatorUnavailableError:
            if loop.time() >= deadline:
                raise
            pause = backoff * random.uniform(0.5, 1.0)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)
        except CoordinatorOverloadedError as exc:
            hint = exc.retry_after_s if exc.retry_after_s is not None else _RETRY_PAUSE_S
            if not retry_rejected or loop.time() + hint >= deadline:
                return None
            pause = hint
        await asyncio.sleep(max(0.0, min(pause, deadline - loop.time())))


async def _await_end(
    client: CoordinatorClient,
    query_id: str,
    retry_s: float,
    admitted: coordinator_pb2.QueryInfo,
) -> coordinator_pb2.QueryInfo:
    """The query's final `QueryInfo`, once it has succeeded, failed or been cancelled.
    Watches its events until the terminal one (re-watching after a dropped stream: the
    coordinator replays past events first), then reads its state.

    A query whose terminal event arrived but whose state could not be read before the
    coordinator went away may have expired (its retention over) by the time it is back: it
    is then reported from `admitted` (what the submission answered) and that event, the
    time of which is its finish. One that vanished without a terminal event seen is not
    covered for: NOT_FOUND is raised, as for a lost query."""
    loop = asyncio.get_running_loop()
    unreachable_since: float | None = None
    terminal: coordinator_pb2.QueryEvent | None = None
    while True:
        try:
            async for event in client.watch(query_id):
                unreachable_since = None  # it answered: an outage later starts a new count
                if event.kind in TERMINAL_EVENTS:
                    terminal = event
            info = (await client.get(query_id)).query
            if info.state in TERMINAL_STATES:
                return info
            unreachable_since = None
        except CoordinatorUnavailableError:
            now = loop.time()
            if unreachable_since is None:
                unreachable_since = now
            elif now - unreachable_since >= retry_s:
                raise
        except CoordinatorError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND or terminal is None:
                raise
            return _ended_as(admitted, terminal)
        await asyncio.sleep(_RETRY_PAUSE_S)


def _ended_as(
    admitted: coordinator_pb2.QueryInfo, terminal: coordinator_pb2.QueryEvent
) -> coordinator_pb2.QueryInfo:
    """`admitted` as its terminal event left it: its state and finish time (the stage and
    call counts stay as admitted; a failure's reason is in the coordinator's log only)."""
    info = coordinator_pb2.QueryInfo()
    info.CopyFrom(admitted)
    info.state = STATE_AFTER[terminal.kind]
    info.finished_s = terminal.time_s
    if info.state == coordinator_pb2.QUERY_STATE_SUCCEEDED:
        info.stages_done, info.calls_done = info.stages_total, info.calls_total
    return info
