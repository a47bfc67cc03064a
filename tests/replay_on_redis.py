"""What the tests of a mesh on someone else's Redis share (a Redis Cluster, Redis behind
Sentinel): the replayed workload, the local mesh pointed at that Redis, and the check that
every call of the replay completed exactly once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from hexgen_flow.traces import load_trace, take_queries
from hexgen_flow.workload import Query
from hexgen_launch.cluster import LocalClusterConfig

__all__ = ["assert_each_call_completed_once", "mesh_config", "trace3_replay"]


def trace3_replay(tag: str, num_queries: int) -> tuple[list[Query], set[str]]:
    """trace3's first `num_queries` queries, their ids prefixed with ``tag/``, and the ids of
    every call they hold (``QUERY/STAGE.INDEX``, as the coordinator names calls)."""
    queries = [
        replace(q, query_id=f"{tag}/{q.query_id}")
        for q in take_queries(load_trace("trace3"), num_queries)
    ]
    calls = {
        f"{q.query_id}/{k}.{i}"
        for q in queries
        for k, stage in enumerate(q.workflow.stages)
        for i in range(len(stage.calls))
    }
    return queries, calls


def mesh_config(redis_url: str, time_scale: float, **options: Any) -> LocalClusterConfig:
    """A local mesh on the Redis at `redis_url`: a tuner that runs only when asked (Retune),
    every query admitted (the point is where its state goes); `options` add to it."""
    return LocalClusterConfig(
        listen="127.0.0.1:0",
        tuner_listen="127.0.0.1:0",
        redis_url=redis_url,
        time_scale=time_scale,
        tuner_period_s=3600,
        start_timeout_s=60,
        admission="off",
        **options,
    )


def assert_each_call_completed_once(
    entries: Iterable[tuple[object, dict[bytes, bytes]]], calls: set[str]
) -> None:
    """The coordinator's ``completions`` stream (XRANGE entries) holds each of `calls` once."""
    done = Counter(fields[b"call_id"].decode() for _, fields in entries)
    assert set(done) == calls, "calls lost or unknown calls completed"
    assert all(n == 1 for n in done.values()), "a call completed more than once"
