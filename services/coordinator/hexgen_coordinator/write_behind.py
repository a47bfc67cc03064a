"""Write-behind: where calls went and each query's new events, written off the critical path.

The writes that decide what runs next (submission, completion, cancel) go to Redis through
`WorkflowStore` before the coordinator acts on them; this module only records what can be
rebuilt: which slot a call went to, a stage's budget and the event log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import redis.asyncio as aioredis

from hexgen_coordinator.ledger import ActiveQuery
from hexgen_coordinator.store import WorkflowStore
from hexgen_flow.runtime import CallTicket

__all__ = ["WriteBehind"]

log = logging.getLogger("hexgen_coordinator.coordinator")  # the coordinator's one logger


class WriteBehind:
    def __init__(self, redis: aioredis.Redis[bytes], store: WorkflowStore) -> None:
        self.redis = redis
        self.store = store
        self._pending_writes: list[tuple[ActiveQuery, list[CallTicket]]] = []
        self._writer: asyncio.Future[None] | None = None

    def persist(self, entry: ActiveQuery, tickets: Iterable[CallTicket]) -> None:
        """Record where calls went and the query's new events, behind the critical path.

        Writes of every query are gathered and sent in one pipeline per loop turn, after
        the calls were sent. A crash before the write loses no call: recovery
        (`hexgen_coordinator.recovery`) dispatches what Redis does not place, and workers
        reclaim what they hold.
        """
        self._pending_writes.append((entry, list(tickets)))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._write_behind())
            self._writer.add_done_callback(_log_failure)

    async def _write_behind(self) -> None:
        while self._pending_writes:
            batch, self._pending_writes = self._pending_writes, []
            async with self.redis.pipeline(transaction=False) as pipe:
                for entry, tickets in batch:
                    query_id = entry.run.query.query_id
                    qkey = self.store.qkey(query_id)
                    for ticket in tickets:
                        if ticket.instance >= 0:
                            pipe.hset(
                                qkey, f"c:{ticket.call_id}", f"{ticket.instance}:{ticket.seq}"
                            )
                        pipe.hset(qkey, f"s{ticket.stage}:dl", repr(ticket.deadline_s))
                    unsaved = entry.events[entry.saved :]
                    if unsaved:
                        pipe.rpush(
                            self.store.evkey(query_id), *[e.SerializeToString() for e in unsaved]
                        )
                        entry.saved = len(entry.events)
                await pipe.execute()

    async def flush(self) -> None:
        """Wait until every write behind has reached Redis."""
        while self._writer is not None and not self._writer.done():
            await asyncio.shield(self._writer)


def _log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("persisting failed: %s", task.exception())
