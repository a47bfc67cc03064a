"""Write-behind: where calls went and each query's new events, written off the critical path.

The writes that decide what runs next (submission, completion, failure, cancel) go to Redis
through `WorkflowStore` before the coordinator acts on them; this module only records what
can be rebuilt: which slot and attempt a call went to, a stage's budget and the event log.
Placements have fields of their own (`WorkflowStore.place_commands`), which no completion
reads as done, so a write that lands late cannot undo a completion; a write for a query that has
ended renews its keys' retention window, so none of it outlives the query.

Events are written as the client API's ``QueryEvent`` bytes (`client_wire.event_to_bytes`),
the form every coordinator version reads back: this module, which writes the log, and
`views`, which reads it, are the coordinator's only users of `client_wire` beside the
servicer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping

from hexgen_coordinator.client_wire import event_to_bytes
from hexgen_coordinator.ledger import ActiveQuery
from hexgen_coordinator.redis_retry import REDIS_UNAVAILABLE
from hexgen_coordinator.store import Placement, WorkflowStore
from hexgen_flow.runtime import CallTicket

__all__ = ["WriteBehind"]

log = logging.getLogger("hexgen_coordinator.coordinator")  # the coordinator's one logger


class WriteBehind:
    def __init__(self, store: WorkflowStore, active: Mapping[str, ActiveQuery]) -> None:
        self.store = store
        self.active = active
        """The running queries (the ledger's): a query not in it has ended."""
        self._pending_writes: list[tuple[ActiveQuery, list[CallTicket]]] = []
        self._writer: asyncio.Future[None] | None = None

    def persist(self, entry: ActiveQuery, tickets: Iterable[CallTicket]) -> None:
        """Record where calls went and the query's new events, behind the critical path.

        Writes of every query are gathered and sent in one pipeline per loop turn, after
        the calls were sent. A crash before the write loses no call: recovery
        (`hexgen_coordinator.recovery`) dispatches what Redis does not place, and workers
        reclaim what they hold. While Redis is away the writes wait and are sent again.
        """
        self._pending_writes.append((entry, list(tickets)))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._write_behind())
            self._writer.add_done_callback(_log_failure)

    async def _write_behind(self) -> None:
        delay = 0.1
        while self._pending_writes:
            batch, self._pending_writes = self._pending_writes, []
            merged: dict[str, tuple[ActiveQuery, dict[str, Placement], dict[int, float]]] = {}
            for entry, tickets in batch:
                query_id = entry.run.query.query_id
                _, placements, deadlines = merged.setdefault(query_id, (entry, {}, {}))
                for ticket in tickets:
                    placements[ticket.call_id] = Placement(
                        ticket.instance, ticket.seq, ticket.attempt
                    )
                    deadlines[ticket.stage] = ticket.deadline_s
            saved = {query_id: entry.saved for query_id, (entry, _, _) in merged.items()}
            try:
                commands = []
                for query_id, (entry, placements, deadlines) in merged.items():
                    unsaved = [event_to_bytes(e) for e in entry.events[entry.saved :]]
                    entry.saved = len(entry.events)
                    ended = self.active.get(query_id) is not entry
                    commands += self.store.place_commands(
                        query_id, placements, deadlines, unsaved, ended=ended
                    )
                await self.store.write(commands)
            except REDIS_UNAVAILABLE as exc:
                # Redis is away: keep the batch (ahead of what came since) and try again.
                for query_id, (entry, _, _) in merged.items():
                    entry.saved = min(entry.saved, saved[query_id])
                self._pending_writes[:0] = batch
                log.warning("redis unavailable for the write-behind (%s); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            delay = 0.1

    async def flush(self) -> None:
        """Wait until every write behind has reached Redis."""
        while self._writer is not None and not self._writer.done():
            await asyncio.shield(self._writer)


def _log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("persisting failed: %s", task.exception())
