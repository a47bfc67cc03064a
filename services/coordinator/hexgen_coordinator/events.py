"""A running query's event log: recording an event, and watching the log.

An `ActiveQuery` keeps the events logged since this coordinator took the query (the write
behind copies them to Redis) and the queues of its watchers; a finished query's log is
read back from Redis alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_coordinator.ledger import ActiveQuery, Ledger
from hexgen_coordinator.store import WorkflowStore
from hexgen_coordinator.views import QueryViews
from hexgen_coordinator.write_behind import WriteBehind

__all__ = ["WATCH_BUFFER", "end_watch", "record_event", "watch"]

WATCH_BUFFER = 10_000
"""Events a watcher may fall behind by; one that falls further has its stream ended (it
can watch again: past events come back from the log)."""

K = cpb.QueryEventKind


def record_event(
    entry: ActiveQuery,
    kind: cpb.QueryEventKind.ValueType,
    now: float,
    *,
    stage: int = -1,
    call_id: str = "",
    instance: str = "",
    text: str = "",
) -> None:
    event = cpb.QueryEvent(
        query_id=entry.run.query.query_id,
        kind=kind,
        time_s=now,
        stage=stage,
        call_id=call_id,
        instance=instance,
        text=text,
        sequence=entry.event_base + len(entry.events),
    )
    if kind != K.QUERY_EVENT_KIND_CALL_TOKENS:  # token chunks are live only
        entry.events.append(event)
    for watcher in list(entry.watchers):
        try:
            watcher.put_nowait(event)
        except asyncio.QueueFull:  # a watcher that stopped reading: its stream ends
            entry.watchers.discard(watcher)
            end_watch(watcher)


def end_watch(watcher: asyncio.Queue[cpb.QueryEvent | None]) -> None:
    """End a watcher's stream (what it has not read yet is dropped if its buffer is full)."""
    while True:
        try:
            watcher.put_nowait(None)
            return
        except asyncio.QueueFull:
            watcher.get_nowait()


async def watch(
    query_id: str, ledger: Ledger, store: WorkflowStore, views: QueryViews, writes: WriteBehind
) -> AsyncIterator[cpb.QueryEvent]:
    """The query's events so far, then live ones until it ends."""
    entry = ledger.active.get(query_id)
    if entry is None:
        await views.get_info(query_id)  # NOT_FOUND if unknown
        # A query that ended a moment ago may still have its last events behind: read the
        # log once they are in Redis, or the watcher sees it stop before its end.
        await writes.flush()
        for raw in await store.events(query_id):
            yield cpb.QueryEvent.FromString(raw)
        return
    queue: asyncio.Queue[cpb.QueryEvent | None] = asyncio.Queue(maxsize=WATCH_BUFFER)
    past = list(entry.events)  # snapshot and subscribe with no await in between
    entry.watchers.add(queue)
    try:
        if entry.event_base:
            stored = await store.events(query_id)
            for raw in stored[: entry.event_base]:
                yield cpb.QueryEvent.FromString(raw)
        for event in past:
            yield event
        while True:
            live = await queue.get()
            if live is None:
                return
            yield live
    finally:
        entry.watchers.discard(queue)
