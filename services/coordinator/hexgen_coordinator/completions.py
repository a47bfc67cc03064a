"""What workers report about their calls (started, tokens, finished), and cancellation.

A completion is applied in Redis first (`WorkflowStore.complete`, exactly once per call),
then in memory, under the query's lock (`hexgen_coordinator.ledger` says why).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TextIO

from hexgen_coordinator.client_messages import EventKind, QueryInfo
from hexgen_coordinator.dispatch import Dispatch
from hexgen_coordinator.events import end_watch, record_event
from hexgen_coordinator.ledger import (
    ActiveQuery,
    Calls,
    Clock,
    Queries,
    Slots,
    Tally,
    call_id_of,
    parse_call_id,
)
from hexgen_coordinator.links import WorkerLink
from hexgen_coordinator.redis_retry import until_stored
from hexgen_coordinator.store import COMPLETE_DUPLICATE, FailureResult, WorkflowStore
from hexgen_coordinator.views import QueryViews
from hexgen_coordinator.worker_messages import CancelRun, Finished, Started, Tokens
from hexgen_coordinator.write_behind import WriteBehind
from hexgen_flow.cluster import Cluster
from hexgen_flow.learning import CallCost, CostMeter, cost_journal_line
from hexgen_flow.protocol import (
    Action,
    CallDone,
    CallFailed,
    CallStarted,
    Cancel,
    Finish,
    QueryEnded,
    Redispatch,
    Scheduler,
    StageReleased,
)
from hexgen_flow.runtime import CallState, CallTicket
from hexgen_flow.sim.vllm_v1 import default_max_num_batched_tokens
from hexgen_service.redis_schema import CompletionEntry, encode_completion

__all__ = ["Completions"]

log = logging.getLogger("hexgen_coordinator.coordinator")  # the coordinator's one logger


class Completions:
    def __init__(
        self,
        cluster: Cluster,
        core: Scheduler,
        store: WorkflowStore,
        queries: Queries,
        calls: Calls,
        slots: Slots,
        tally: Tally,
        clock: Clock,
        dispatch: Dispatch,
        writes: WriteBehind,
        views: QueryViews,
        max_attempts: int = 3,
        cost_journal: TextIO | None = None,
    ) -> None:
        self.max_attempts = max_attempts
        """Failed attempts after which a call's query ends FAILED."""
        self.cluster = cluster
        self.core = core
        self.store = store
        self.queries = queries
        self.calls = calls
        self.slots = slots
        self.tally = tally
        self.clock = clock
        self.dispatch = dispatch
        self.writes = writes
        self.views = views
        self.meters = (
            [
                CostMeter(i, default_max_num_batched_tokens(spec))
                for i, spec in enumerate(cluster.instances)
            ]
            if core.policy.learner is not None
            else None
        )
        """What each call costs its instance (`CallCost`), for the scheduler's cost learner
        (`--learn-costs`); None: it does not learn. Each instance's engine is taken to
        prefill in chunks of vLLM's default token budget for its GPU, as vLLM serves."""
        self.cost_journal = cost_journal
        """Where each call's `CallCost` is appended (``--cost-journal``); None: nowhere."""

    def _journal(self, cost: CallCost) -> None:
        """Append `cost` to the cost journal; a journal that cannot be written (a full
        disk) is given up with one warning, never at the cost of the completion."""
        assert self.cost_journal is not None
        try:
            self.cost_journal.write(cost_journal_line(cost))
        except (OSError, ValueError) as exc:  # ValueError: the file was closed
            log.warning("cost journal given up: %s", exc)
            self.cost_journal = None

    def _meter_dropped(self, ticket: CallTicket, slot: int) -> None:
        """A call left its worker without a result to learn from."""
        if self.meters is not None and 0 <= slot < len(self.meters):
            self.meters[slot].dropped(ticket, self.clock.now())

    def on_started(self, link: WorkerLink, msg: Started) -> None:
        clock = self.clock
        ticket = self.calls.tickets.get(msg.call_id)
        entry = self.queries.active.get(ticket.query_id) if ticket else None
        if ticket is None or entry is None:
            return
        if ticket.instance == link.slot:
            # running: no longer moved on a new deadline
            self.core.handle(CallStarted(ticket, clock.now()))
            if self.meters is not None:
                self.meters[link.slot].taken(ticket, clock.now())
        record_event(
            entry,
            EventKind.CALL_STARTED,
            clock.now(),
            stage=ticket.stage,
            call_id=msg.call_id,
            instance=self.cluster.instances[link.slot].name,
        )
        self.writes.persist(entry, [])  # a crash keeps the start in the log

    def on_tokens(self, link: WorkerLink, msg: Tokens) -> None:
        ticket = self.calls.tickets.get(msg.call_id)
        entry = self.queries.active.get(ticket.query_id) if ticket else None
        if ticket is None or entry is None or not entry.watchers:
            return
        record_event(
            entry,
            EventKind.CALL_TOKENS,
            self.clock.now(),
            stage=ticket.stage,
            call_id=msg.call_id,
            text=msg.text,
        )

    def _stale(self, link: WorkerLink, ticket: CallTicket, attempt: int) -> str | None:
        """Why a report about `ticket` from `link` is not the one the coordinator waits
        for (None: it is): the call was dispatched elsewhere, or again since."""
        if ticket.instance >= 0:
            if ticket.instance != link.slot:
                return f"the call is on slot {ticket.instance}, not {link.slot}"
        elif self.calls.adoptable.get(ticket.call_id) != link.slot:
            return "the call waits to be dispatched again"
        if attempt and ticket.attempt and attempt != ticket.attempt:
            return f"attempt {attempt} is not the latest ({ticket.attempt})"
        return None

    async def on_finished(self, link: WorkerLink, msg: Finished) -> None:
        t0 = time.perf_counter()
        queries, calls = self.queries, self.calls
        call_id = msg.call_id
        try:
            query_id, stage, _ = parse_call_id(call_id)
        except ValueError:
            log.warning("worker %s reported a malformed call id %r", link.worker_id, call_id)
            link.ack(call_id)
            return
        entry = queries.active.get(query_id)
        if entry is None:  # finished, cancelled or unknown: nothing to apply
            link.ack(call_id)
            return
        async with entry.lock:
            ticket = calls.tickets.get(call_id)
            if ticket is None:  # already applied (a resend)
                link.ack(call_id)
                return
            stale = self._stale(link, ticket, msg.attempt)
            if stale is not None:
                log.info("ignored a result of %s from %s: %s", call_id, link.worker_id, stale)
                link.ack(call_id)  # the worker forgets it; the latest attempt will report
                return
            if msg.error:
                await self._failed(entry, ticket, link, msg)
                return
            now = self.clock.now()
            run = entry.run
            calls.drop_adoptable(call_id)  # resent after a restart: nothing to reclaim
            # A ticket resumed after a restart sits on no instance until reclaimed; the
            # worker that reports the result is the one that ran it.
            ran_on = ticket.instance if ticket.instance >= 0 else link.slot
            inst = self.cluster.instances[ran_on] if ran_on >= 0 else None
            record = encode_completion(
                CompletionEntry(
                    query_id=query_id,
                    call_id=call_id,
                    stage=stage,
                    step=ticket.call.step,
                    input_tokens=ticket.call.input_tokens,
                    output_tokens=msg.output_tokens or ticket.output_tokens,
                    instance=inst.name if inst else "",
                    gpu=inst.gpu if inst else "",
                    released_s=ticket.released_s,
                    started_s=msg.started_s,
                    finished_s=msg.finished_s or now,
                )
            )
            dependents = run.query.workflow.dependents[stage]
            # The core's release rule decides; Redis applies it (and memory, by `CallDone`
            # below, from the very same state).
            effect = run.completion_effect(stage)
            result = await until_stored(
                f"completing {call_id}",
                lambda: self.store.complete(
                    query_id,
                    call_id,
                    stage,
                    dependents,
                    effect,
                    now,
                    record,
                    slot=link.slot,
                    attempt=msg.attempt if ticket.attempt else 0,
                ),
            )
            link.ack(call_id)
            if result.status == COMPLETE_DUPLICATE:
                # Redis has it and memory does not: an earlier try's reply was lost on the
                # way back (Redis went away after applying it). Memory catches up.
                log.info("completion of %s was already in redis; applying it in memory", call_id)
            elif not result.applied:
                log.warning(
                    "redis refused the completion of %s (status %d)", call_id, result.status
                )
                return
            calls.forget(call_id)
            queries.drop_prompt(entry, call_id)  # Redis's copy went with the completion
            self.tally.call_completed()
            if msg.output_tokens > 0:  # what it generated, not what was declared
                ticket.output_tokens = msg.output_tokens  # (what learned lengths learn)
            cost = None
            if self.meters is not None and ran_on >= 0:
                ticket.cached_tokens = max(msg.cached_tokens, 0)  # as the engine says
                # The worker's own times where it gives them: the engine's service alone.
                service = (
                    msg.finished_s - msg.started_s if msg.finished_s > msg.started_s > 0 else None
                )
                # and its time to first token, which tells its prefill from its decode
                first_token = (
                    msg.first_token_s - msg.started_s
                    if service is not None and msg.finished_s >= msg.first_token_s > msg.started_s
                    else None
                )
                cost = self.meters[ran_on].finished(ticket, now, service, first_token)
                if cost is not None and self.cost_journal is not None:
                    self._journal(cost)
            # The very effect Redis applied (evaluated once, above; the query's lock held).
            actions = self.core.handle(CallDone(ticket, now, cost, effect))
            if entry.session is not None:
                entry.session.last_done_s = now
            record_event(
                entry,
                EventKind.CALL_FINISHED,
                now,
                stage=stage,
                call_id=call_id,
                instance=inst.name if inst else "",
                text=msg.text,
                finished=msg,
            )
            span = calls.close_span(call_id)
            if span is not None:
                self.dispatch.end_call_span(span, msg, inst.model if inst else "")
            stage_finished = run.stage_finished_s[stage] is not None
            if stage_finished:
                record_event(entry, EventKind.STAGE_FINISHED, now, stage=stage)
                self.dispatch.end_stage_span(entry, stage, now)
                released_s = run.stage_released_s[stage]
                if released_s is not None:
                    step = run.query.workflow.stages[stage].step
                    self.tally.metrics.stage_finished(step, now - released_s)
            released = await self.settle(entry, actions, now)
            if released:
                self.tally.completion_dispatch(time.perf_counter() - t0)
            if run.finished_s is not None:
                record_event(entry, EventKind.SUCCEEDED, now)
            self.writes.persist(entry, [])
            if run.finished_s is not None:
                self.finish(entry)

    async def settle(
        self, entry: ActiveQuery, actions: Sequence[Action], now: float
    ) -> list[CallTicket]:
        """Carry out the core's actions of an event of `entry`'s query (`Dispatch.carry_out`:
        released calls registered and sent, waiting calls revised); in a workflow session,
        then skip every call of a closed stage that was never given (it completes without
        running, which may release more, carried out the same way). Returns every call
        released (the caller holds the lock)."""
        out: list[CallTicket] = []
        tried: set[str] = set()  # a skip Redis refused is not tried again in this loop
        while True:
            for rest in self.dispatch.carry_out(actions, now):
                if not isinstance(rest, Finish):  # the caller reads run.finished_s
                    raise AssertionError(f"unexpected action after a completion: {rest!r}")
            out.extend(t for a in actions if isinstance(a, StageReleased) for t in a.tickets)
            session = entry.session
            if session is None or not session.closed_stages:
                return out
            run, tickets = entry.run, self.calls.tickets
            query_id = run.query.query_id
            unwanted = [
                ticket
                for k in sorted(session.closed_stages)
                if run.stage_released_s[k] is not None and run.stage_finished_s[k] is None
                for index in range(
                    run.given[k] if run.given else 0, len(run.query.workflow.stages[k].calls)
                )
                if (ticket := tickets.get(call_id_of(query_id, k, index))) is not None
                and ticket.call_id not in tried
            ]
            if not unwanted:
                return out
            skipped: list[Action] = []
            for ticket in unwanted:
                tried.add(ticket.call_id)
                skipped += await self._skip(entry, ticket, now)
            actions = skipped

    async def _skip(self, entry: ActiveQuery, ticket: CallTicket, now: float) -> list[Action]:
        """Complete a session's call that was never given (its stage is closed)."""
        run, call_id = entry.run, ticket.call_id
        query_id = run.query.query_id
        dependents = run.query.workflow.dependents[ticket.stage]
        effect = run.completion_effect(ticket.stage)
        result = await until_stored(
            f"skipping {call_id}",
            lambda: self.store.complete(
                query_id, call_id, ticket.stage, dependents, effect, now, {}
            ),
        )
        if not (result.applied or result.status == COMPLETE_DUPLICATE):
            log.warning("redis refused to skip %s (status %d)", call_id, result.status)
            return []
        self.calls.forget(call_id)
        self.queries.drop_prompt(entry, call_id)
        assert entry.session is not None
        entry.session.skipped.add(call_id)
        # On no instance: no load to free; the effect Redis applied, not evaluated again.
        actions = self.core.handle(CallDone(ticket, now, effect=effect))
        record_event(
            entry,
            EventKind.CALL_SKIPPED,
            now,
            stage=ticket.stage,
            call_id=call_id,
            text="the session moved on without it",
        )
        if run.stage_finished_s[ticket.stage] is not None:
            record_event(entry, EventKind.STAGE_FINISHED, now, stage=ticket.stage)
            self.dispatch.end_stage_span(entry, ticket.stage, now)
        return list(actions)

    async def _failed(
        self, entry: ActiveQuery, ticket: CallTicket, link: WorkerLink, msg: Finished
    ) -> None:
        """An attempt of a call failed: retry it elsewhere after a backoff, or, at the
        attempt limit, end the query FAILED (the caller holds the query's lock)."""
        call_id = ticket.call_id
        result = await self._count_failure(
            entry,
            ticket,
            slot=link.slot,
            attempt=msg.attempt if ticket.attempt else 0,
            where=link.worker_id,
            ran_on=link.slot,
            error=msg.error,
        )
        link.ack(call_id)
        if result.query_failed:
            return
        if not result.retry:
            log.warning("redis refused the failure of %s (status %d)", call_id, result.status)
            return
        failed_on = ticket.instance if ticket.instance >= 0 else link.slot
        self._meter_dropped(ticket, link.slot)
        # off the failing instance while it waits (BACKOFF)
        self.core.handle(CallFailed(ticket, self.clock.now()))
        self.writes.persist(entry, [ticket])
        delay = min(0.1 * 2 ** (result.failures - 1), 2.0)  # wall seconds
        asyncio.get_running_loop().call_later(
            delay, self._retry, ticket, failed_on, f"engine error: {msg.error}"
        )

    async def lost_while_running(
        self, ticket: CallTicket, slot: int, attempt: int, reason: str
    ) -> None:
        """The worker on `slot` died (its stream ended, its heartbeats stopped, or it came
        back without the call) while running `ticket`'s call: that counts as a failed
        attempt, as an engine error does, so that a call that kills whatever runs it ends
        its query FAILED after ``--max-call-attempts`` instead of going round for ever.
        Otherwise the call goes out again after the same backoff. The ticket is off the
        instance already (`hexgen_coordinator.workers`)."""
        active, call_id = self.queries.active, ticket.call_id
        entry = active.get(ticket.query_id)
        if entry is None:
            return
        async with entry.lock:
            if (
                active.get(ticket.query_id) is not entry
                or self.calls.tickets.get(call_id) is not ticket
            ):
                return  # the query ended, or the call completed (a result resent), meanwhile
            self._meter_dropped(ticket, slot)
            why = f"its worker died while running it ({reason})"
            result = await self._count_failure(
                entry,
                ticket,
                # Any slot: the placement written behind may already say the call is on
                # none; the attempt tells this run from a later one.
                slot=-1,
                attempt=attempt,
                where=f"slot {slot}",
                ran_on=slot,
                error=why,
            )
            if result.query_failed:
                return
            if not result.retry:  # done, or not from that dispatch: nothing to count
                log.info("lost run of %s not counted (status %d)", call_id, result.status)
            delay = min(0.1 * 2 ** (result.failures - 1), 2.0) if result.retry else 0.0
            asyncio.get_running_loop().call_later(delay, self._retry, ticket, slot, why)

    async def _count_failure(
        self,
        entry: ActiveQuery,
        ticket: CallTicket,
        *,
        slot: int,
        attempt: int,
        where: str,
        ran_on: int,
        error: str,
    ) -> FailureResult:
        """Count a failed attempt of `ticket`'s call in Redis (from `slot` and `attempt`,
        -1 / 0: any), log it, count it on instance `ran_on` and in the query's events; at
        the attempt limit the query ends FAILED here (the caller holds its lock)."""
        call_id = ticket.call_id
        now = self.clock.now()
        limit = self.max_attempts
        reason = f"call {call_id} failed {limit} times; last error: {error}"
        result = await until_stored(
            f"failing {call_id}",
            lambda: self.store.fail_call(
                ticket.query_id,
                call_id,
                slot=slot,
                attempt=attempt,
                max_attempts=limit,
                now=now,
                reason=reason,
            ),
        )
        if not (result.retry or result.query_failed):
            return result
        log.warning(
            "call %s failed on %s (%d of %d attempts): %s",
            call_id,
            where,
            result.failures,
            limit,
            error,
        )
        instance = self.cluster.instances[ran_on].name if ran_on >= 0 else ""
        self.tally.metrics.calls_failed.labels(instance).inc()
        record_event(
            entry,
            EventKind.CALL_FAILED,
            now,
            stage=ticket.stage,
            call_id=call_id,
            instance=instance,
            text=error,
        )
        if result.query_failed:
            self.drop_calls(entry)
            record_event(entry, EventKind.FAILED, now, text=reason)
            self.writes.persist(entry, [])
            await self.writes.flush()  # GetQuery reads a finished query's log from Redis
            self.tally.query_failed()
            self.finish(entry, "failed")
        return result

    def _retry(self, ticket: CallTicket, avoid: int, reason: str) -> None:
        entry = self.queries.active.get(ticket.query_id)
        if entry is None or self.calls.tickets.get(ticket.call_id) is not ticket:
            return  # the query ended meanwhile
        if ticket.state is not CallState.BACKOFF:
            return  # sent again meanwhile
        now = self.clock.now()
        self.dispatch.carry_out(
            self.core.handle(Redispatch(ticket, now, avoid)), now, reason=reason
        )

    def drop_calls(self, entry: ActiveQuery) -> None:
        """The query ended early: the core withdraws its calls (`QueryEnded`), those on
        workers are aborted, and `Calls` forgets them all."""
        links = self.slots.links
        for action in self.core.handle(QueryEnded(entry.run, self.clock.now())):
            assert isinstance(action, Cancel)
            ticket = action.ticket
            if action.instance >= 0:
                link = links[action.instance]
                if link is not None:
                    link.send(CancelRun(ticket.call_id))
                self._meter_dropped(ticket, action.instance)
        self.calls.forget_query(entry.run.query.query_id)

    def finish(self, entry: ActiveQuery, outcome: str = "succeeded") -> None:
        """Forget a query that ended (`outcome`: succeeded, failed or cancelled)."""
        run = entry.run
        for stage in list(entry.stage_spans):
            self.dispatch.end_stage_span(entry, stage, self.clock.now())
        entry.span.end()
        for watcher in entry.watchers:
            end_watch(watcher)
        self.queries.end(entry)  # its prompts too: Redis's went with the script that ended it
        # only a query that succeeded has a latency (the `finished` stream counts these)
        latency = run.finished_s - run.arrival_s if run.finished_s is not None else None
        self.tally.query_ended(run.query.tenant, outcome, latency, run.slo_s)

    async def cancel(self, query_id: str) -> QueryInfo:
        active = self.queries.active
        entry = active.get(query_id)
        if entry is None:
            return await self.views.get_info(query_id)  # raises UnknownQueryError if none
        async with entry.lock:
            if active.get(query_id) is not entry:  # ended while we waited for the lock
                return await self.views.get_info(query_id)
            now = self.clock.now()
            await self.store.cancel(query_id, now)  # Redis away: UNAVAILABLE, retryable
            self.drop_calls(entry)
            record_event(entry, EventKind.CANCELLED, now)
            self.writes.persist(entry, [])
            await self.writes.flush()
            self.finish(entry, "cancelled")
        return await self.views.get_info(query_id)
