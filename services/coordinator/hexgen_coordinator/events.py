"""A running query's event log: recording an event, and watching the log.

An `ActiveQuery` keeps the events logged since this coordinator took the query (the write
behind copies them to Redis) and the queues of its watchers; a finished query's log is
read back from Redis alone.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator

from hexgen_coordinator.client_messages import EventKind, QueryEvent
from hexgen_coordinator.ledger import ActiveQuery, Queries
from hexgen_coordinator.views import QueryViews
from hexgen_coordinator.worker_messages import Finished
from hexgen_coordinator.write_behind import WriteBehind
from hexgen_service.errors import OverloadedError

__all__ = [
    "WATCH_BUFFER",
    "WATCH_RETRY_S",
    "check_not_behind",
    "end_watch",
    "record_event",
    "watch",
]

WATCH_BUFFER = 10_000
"""Events a watcher may fall behind by; one that falls further has its stream ended with
RESOURCE_EXHAUSTED (it can watch again: past events come back from the log)."""
WATCH_RETRY_S = 1.0
"""The ``retry-after-s`` hint of a watch ended for falling behind."""

log = logging.getLogger(__name__)

_fell_behind: weakref.WeakSet[asyncio.Queue[QueryEvent | None]] = weakref.WeakSet()
"""Watchers whose stream was ended for falling behind (not because their query ended)."""


def record_event(
    entry: ActiveQuery,
    kind: EventKind,
    now: float,
    *,
    stage: int = -1,
    call_id: str = "",
    instance: str = "",
    text: str = "",
    finished: Finished | None = None,
) -> None:
    """Log an event and hand it to the watchers; `finished` (CALL_FINISHED) is the
    worker's report, whose finish reason, tool calls and token counts the event carries.

    One object per event: the same `QueryEvent` is logged and given to every watcher (the
    servicer encodes it for each stream, the write-behind for Redis)."""
    event = QueryEvent(
        query_id=entry.run.query.query_id,
        kind=kind,
        time_s=now,
        sequence=entry.event_base + len(entry.events),
        stage=stage,
        call_id=call_id,
        instance=instance,
        text=text,
        finish_reason=finished.finish_reason if finished else "",
        tool_calls=finished.tool_calls if finished else (),
        prompt_tokens=finished.prompt_tokens if finished else 0,
        output_tokens=finished.output_tokens if finished else 0,
    )
    if kind != EventKind.CALL_TOKENS:  # token chunks are live only
        entry.events.append(event)
    for watcher in list(entry.watchers):
        try:
            watcher.put_nowait(event)
        except asyncio.QueueFull:  # a watcher that stopped reading: its stream ends
            entry.watchers.discard(watcher)
            _fell_behind.add(watcher)
            end_watch(watcher)
            log.warning(
                "a watcher of query %s fell more than %d events behind: its stream ends "
                "(RESOURCE_EXHAUSTED; watching again replays the log)",
                event.query_id,
                WATCH_BUFFER,
            )


def end_watch(watcher: asyncio.Queue[QueryEvent | None]) -> None:
    """End a watcher's stream (what it has not read yet is dropped if its buffer is full)."""
    while True:
        try:
            watcher.put_nowait(None)
            return
        except asyncio.QueueFull:
            watcher.get_nowait()


def check_not_behind(watcher: asyncio.Queue[QueryEvent | None], query_id: str) -> None:
    """For a watcher whose stream got its end (None): `OverloadedError` (RESOURCE_EXHAUSTED
    with a ``retry-after-s`` hint) when that end came because it fell behind, not because
    its query ended."""
    if watcher in _fell_behind:
        raise OverloadedError(
            f"watch: query {query_id!r}: this watcher fell more than {WATCH_BUFFER} events "
            "behind (the coordinator's watch buffer) and its stream was ended; watch again "
            "to replay the log and go on",
            WATCH_RETRY_S,
        )


async def watch(
    query_id: str, queries: Queries, views: QueryViews, writes: WriteBehind
) -> AsyncIterator[QueryEvent]:
    """The query's events so far, then live ones until it ends."""
    entry = queries.active.get(query_id)
    if entry is None:
        await views.get_info(query_id)  # NOT_FOUND if unknown
        # A query that ended a moment ago may still have its last events behind: read the
        # log once they are in Redis, or the watcher sees it stop before its end.
        await writes.flush()
        for event in await views.logged_events(query_id):
            yield event
        return
    queue: asyncio.Queue[QueryEvent | None] = asyncio.Queue(maxsize=WATCH_BUFFER)
    past = list(entry.events)  # snapshot and subscribe with no await in between
    entry.watchers.add(queue)
    try:
        if entry.event_base:
            for event in await views.logged_events(query_id, entry.event_base):
                yield event
        for event in past:
            yield event
        while True:
            live = await queue.get()
            if live is None:
                check_not_behind(queue, query_id)
                return
            yield live
    finally:
        entry.watchers.discard(queue)
