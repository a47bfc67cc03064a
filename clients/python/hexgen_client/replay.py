"""`replay`: drive a running cluster with a workload the way ``hexgen-flow simulate`` does.

The queries are submitted at the simulator's arrival times for the same seed (converted to
wall time with the coordinator's time scale), each is followed until it ends, and the run's
`RunMetrics` come from the times the coordinator reports (cluster seconds), so the numbers
compare directly with ``simulate``'s. Query ids are the caller's (``take_queries`` gives
the simulator's), and submission is idempotent on them: replaying the same queries into the
same coordinator again submits nothing new and reports the earlier results (counted in
``extra["resubmitted"]``).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from tqdm import tqdm

from hexgen_api.v1 import coordinator_pb2
from hexgen_client.client import CoordinatorClient
from hexgen_client.convert import (
    TERMINAL_STATES,
    arrival_schedule,
    default_slo_s,
    policy_alpha,
    run_metrics,
)
from hexgen_client.errors import CoordinatorUnavailableError
from hexgen_flow.errors import ConfigError
from hexgen_flow.metrics import RunMetrics
from hexgen_flow.workload import Query

__all__ = ["replay"]

_RETRY_PAUSE_S = 0.5


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
) -> RunMetrics:
    """Replay `queries` at `qps` into the coordinator behind `client`; wait for all of them.

    `slo_scale` None leaves queries without an SLO of their own to the coordinator's
    default scale. `progress` shows a tqdm bar on stderr. While the coordinator is
    unreachable (a restart), submissions and watches are retried for up to `retry_s` wall
    seconds before `CoordinatorUnavailableError` is raised.
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
    resubmitted = 0
    bar = tqdm(
        total=len(queries), desc="replay", unit="query", file=sys.stderr, disable=not progress
    )

    async def follow(index: int) -> None:
        infos[index] = await _await_end(client, queries[index].query_id, retry_s)
        bar.update(1)

    tasks: list[asyncio.Task[None]] = []
    started = loop.time()
    try:
        for arrival_s, index in schedule:
            delay = started + arrival_s / time_scale - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            response = await _submit(client, queries[index], slo_scale, retry_s)
            resubmitted += not response.created
            tasks.append(asyncio.create_task(follow(index)))
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
    ordered = [infos[i] for i in range(len(queries))]
    extra: dict[str, object] = {}
    if resubmitted:
        extra["resubmitted"] = resubmitted
    if final.alpha != status.alpha:
        extra["alpha_at_start"] = status.alpha
    return run_metrics(
        ordered,
        policy=final.policy,
        alpha=policy_alpha(final.policy, final.alpha),
        qps=qps,
        num_queries=len(queries),
        slo_s=(
            slo_scale * final.slo_base_s
            if slo_scale is not None
            else default_slo_s(queries, ordered)
        ),
        extra=extra,
    )


async def _submit(
    client: CoordinatorClient, query: Query, slo_scale: float | None, retry_s: float
) -> coordinator_pb2.SubmitQueryResponse:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_s
    while True:
        try:
            return await client.submit(query, slo_scale=slo_scale)
        except CoordinatorUnavailableError:
            if loop.time() >= deadline:
                raise
        await asyncio.sleep(_RETRY_PAUSE_S)


async def _await_end(
    client: CoordinatorClient, query_id: str, retry_s: float
) -> coordinator_pb2.QueryInfo:
    """The query's final `QueryInfo`, once it has succeeded or been cancelled. Watches its
    events until the terminal one (re-watching after a dropped stream: the coordinator
    replays past events first), then reads its state."""
    loop = asyncio.get_running_loop()
    unreachable_since: float | None = None
    while True:
        try:
            async for _event in client.watch(query_id):
                pass
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
        await asyncio.sleep(_RETRY_PAUSE_S)
