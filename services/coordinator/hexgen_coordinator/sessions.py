"""Workflow sessions: workflows whose calls arrive as the client learns them.

A real agent cannot write every prompt before its first call runs: the candidate prompt
holds the schema that linking chose, the revise prompt the error a candidate produced. A
session is a query like any other (the same admission, Redis scripts, release rule,
stage budgets and dispatch), opened with the workflow it **expects** (a named template
such as ``chess``, or explicit stages with expected token sizes); its calls wait, held,
until the client gives them:

- **OpenWorkflow** admits the expected workflow (`Admission.submit`), so the stage
  budgets split the SLO over the stages ahead from the start. Idempotent on the id.
- **RunCall** gives one call of a named stage and streams that call's events. The stage
  is the first of that name that still takes calls; a call beyond its expected ones joins
  it; a name the workflow does not expect adds a stage at the end, released at once. A
  stage whose given calls all finished takes no more (the next call of its name goes to
  the next round, e.g. the second revise round). Giving a call of a stage closes the
  stages it waits for: their calls never given are **skipped** (they complete without
  running, which is what releases the stage).
- **CloseWorkflow** (or `idle_timeout_s` wall seconds without a call) closes the session:
  every call never given is skipped and the query succeeds when its last given call
  finishes. While open, a session never finishes on its own: the client may still add.
- A query submitted whole (SubmitQuery) is the special case with every call given at
  submission and no session to close.

A call given after the workflow's deadline still runs: its stage deadline is the
workflow's, already past, so every deadline-ordered queue serves it first among the
late; the client sees ``deadline_s`` in the past on the first response.

The requests come decoded (`client_messages.OpenWorkflow`, `client_messages.RunCall`: the
servicer decodes them through `hexgen_coordinator.client_wire`), and what a session keeps
in Redis is `hexgen_coordinator.session_store`'s to encode: no protobuf here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence

from hexgen_coordinator.admission import Admission, limits_of
from hexgen_coordinator.client_messages import (
    CallSubmitted,
    EventKind,
    GivenCall,
    OpenWorkflow,
    QueryEvent,
    QueryInfo,
    QueryState,
    RunCall,
    opened_fields,
)
from hexgen_coordinator.completions import Completions
from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.dispatch import Dispatch
from hexgen_coordinator.events import WATCH_BUFFER, check_not_behind, record_event
from hexgen_coordinator.ledger import (
    ActiveQuery,
    Calls,
    Clock,
    Queries,
    call_id_of,
    chat_bytes,
)
from hexgen_coordinator.redis_retry import until_stored
from hexgen_coordinator.session_store import (
    GIVE_APPLIED,
    GIVE_DUPLICATE,
    GiveMode,
    SessionStore,
)
from hexgen_coordinator.views import QueryViews
from hexgen_coordinator.write_behind import WriteBehind
from hexgen_flow.protocol import (
    Action,
    CallGiven,
    Park,
    ReleaseStage,
    Scheduler,
    SessionClosed,
    released_tickets,
)
from hexgen_flow.protocol import Dispatch as DispatchCall
from hexgen_flow.workload import LLMCall, Query, canonical_step
from hexgen_service.convert import MAX_TOKENS_PER_CALL, check_text
from hexgen_service.errors import FailedPreconditionError, InvalidFieldError

__all__ = ["Sessions"]

log = logging.getLogger("hexgen_coordinator.coordinator")  # the coordinator's one logger


_STATE_NAMES = {
    QueryState.SUCCEEDED: "succeeded",
    QueryState.CANCELLED: "cancelled",
    QueryState.FAILED: "failed",
}
CHARS_PER_TOKEN = 4
"""A prompt's token estimate when the client gives none: characters / 4."""
DEFAULT_OUTPUT_TOKENS = 256
"""max_tokens of a call of a stage the workflow did not expect, when the client gives none."""


class Sessions:
    def __init__(
        self,
        config: CoordinatorConfig,
        core: Scheduler,
        store: SessionStore,
        queries: Queries,
        calls: Calls,
        clock: Clock,
        admission: Admission,
        dispatch: Dispatch,
        completions: Completions,
        writes: WriteBehind,
        views: QueryViews,
    ) -> None:
        self.config = config
        self.core = core
        self.scheduler = core.policy
        """Read only here (a stage's revised budget, for the answer's deadline)."""
        self.store = store
        self.queries = queries
        self.calls = calls
        self.clock = clock
        self.admission = admission
        self.dispatch = dispatch
        self.completions = completions
        self.writes = writes
        self.views = views
        self.limits = limits_of(config)

    # ------------------------------------------------------------------ open

    async def open(self, opened: OpenWorkflow) -> tuple[QueryInfo, bool]:
        """Open (or find) a workflow session; InvalidFieldError names a bad field."""
        with opened_fields():  # the submission's field names, as this request has them
            return await self.admission.submit(
                opened.expected, session_idle_s=opened.idle_timeout_s, names=opened.names
            )

    # ------------------------------------------------------------------ calls

    async def run_call(self, request: RunCall) -> AsyncIterator[CallSubmitted | QueryEvent]:
        """Give a call of an open session; its events until it finishes (or the query ends):
        first `CallSubmitted` (with the call's CALL_SUBMITTED event), then the call's events."""
        workflow_id, name, given = request.workflow_id, request.stage, request.call
        if not workflow_id:
            raise InvalidFieldError("workflow_id", "must not be empty")
        if not name or len(name) > self.limits.max_id_chars:
            raise InvalidFieldError(
                "stage", f"must be 1 to {self.limits.max_id_chars} characters, got {len(name)}"
            )
        check_text("stage", name, self.limits.max_id_bytes, self.limits)
        if given.step:
            check_text("call.step", given.step, self.limits.max_id_bytes, self.limits)
        limit = self.limits.max_prompt_bytes
        if limit is not None:
            # A chat call's messages are its prompt too (`prompt` is their rendering), and
            # its options (tools' JSON Schemas) are kept with them.
            messages = given.chat.messages if given.chat is not None else ()
            options = given.chat.options if given.chat is not None else None
            sizes = [
                ("call.prompt", len(given.prompt.encode("utf-8"))),
                ("call.messages", sum(m.ByteSize() for m in messages)),
                ("call.options", options.ByteSize() if options is not None else 0),
            ]
            for field, size in sizes:
                if size > limit:
                    raise InvalidFieldError(field, f"must be at most {limit} bytes, got {size}")
        for field in ("input_tokens", "output_tokens"):
            value = getattr(given, field)
            if not 0 <= value <= MAX_TOKENS_PER_CALL:
                raise InvalidFieldError(
                    f"call.{field}", f"must be in [0, {MAX_TOKENS_PER_CALL}], got {value}"
                )
        entry = await self._open_entry(workflow_id)
        queue: asyncio.Queue[QueryEvent | None] = asyncio.Queue(maxsize=WATCH_BUFFER)
        entry.watchers.add(queue)  # before the call is given: none of its events is missed
        try:
            async with entry.lock:
                await self._open_entry(workflow_id, entry)
                submitted, deadline = await self._give(entry, name, given)
            call_id = submitted.call_id
            yield CallSubmitted(submitted, deadline, entry.trace)
            while True:
                event = await queue.get()
                if event is None:
                    check_not_behind(queue, workflow_id)  # fell behind: RESOURCE_EXHAUSTED
                    return  # the query ended (its last event came first)
                if event is submitted:
                    continue  # the first response carried it
                if event.call_id == call_id:
                    yield event
                    if event.kind == EventKind.CALL_FINISHED:
                        return
                elif event.kind in (EventKind.FAILED, EventKind.CANCELLED):
                    yield event
                    return
        finally:
            entry.watchers.discard(queue)

    async def _open_entry(self, workflow_id: str, held: ActiveQuery | None = None) -> ActiveQuery:
        """The running session `workflow_id`; NOT_FOUND, or FAILED_PRECONDITION naming why
        it takes no calls."""
        entry = self.queries.active.get(workflow_id)
        if entry is None or (held is not None and entry is not held):
            info = await self.views.get_info(workflow_id)  # UnknownQueryError: NOT_FOUND
            state = _STATE_NAMES.get(info.state, "ended")
            raise FailedPreconditionError(
                f"workflow {workflow_id!r} has {state}: it takes no more calls"
            )
        if entry.session is None:
            raise FailedPreconditionError(
                f"query {workflow_id!r} was submitted whole (SubmitQuery); RunCall gives "
                "the calls of a workflow opened with OpenWorkflow"
            )
        if not entry.session.open:
            raise FailedPreconditionError(
                f"workflow {workflow_id!r} is closed: it finishes with the calls it has"
            )
        return entry

    @staticmethod
    def _shape(entry: ActiveQuery) -> Query | None:
        """The workflow as the session runs it (no call of a closed stage that was never
        given): what the `finished` stream keeps for the tuner's replays; None when nothing
        was given at all."""
        run, session = entry.run, entry.session
        assert session is not None and run.given is not None
        given = run.given
        dropped = {
            (k, i)
            for k in session.closed_stages
            for i in range(given[k], len(run.query.workflow.stages[k].calls))
        }
        workflow = run.query.workflow.without(dropped)
        if workflow is None:  # nothing given at all: there is nothing to replay
            return None
        return dataclasses.replace(run.query, workflow=workflow)

    def _stage_for(self, entry: ActiveQuery, name: str) -> tuple[int | None, list[int]]:
        """The stage a call named `name` goes to (None: a new one) and the stages that
        close because of it (see the module docstring)."""
        run, session = entry.run, entry.session
        assert session is not None and run.given is not None
        stages = run.query.workflow.stages
        matches = [k for k, n in enumerate(session.names) if n == name]
        if not matches:
            step = canonical_step(name)
            matches = [k for k, s in enumerate(stages) if s.step == step]
        closing: list[int] = []
        chosen = None
        for k in matches:
            if k in session.closed_stages or run.stage_finished_s[k] is not None:
                continue
            done = len(stages[k].calls) - run.stage_calls_left[k]
            if run.given[k] > 0 and done >= run.given[k]:
                closing.append(k)  # its calls all came back: this call is the next round
                continue
            chosen = k
            break
        if chosen is not None:
            ancestors, todo = set(), list(stages[chosen].after)
            while todo:
                a = todo.pop()
                if a not in ancestors:
                    ancestors.add(a)
                    todo.extend(stages[a].after)
            closing += [
                a
                for a in sorted(ancestors)
                if a not in session.closed_stages and run.stage_finished_s[a] is None
            ]
        return chosen, closing

    async def _give(
        self, entry: ActiveQuery, name: str, given: GivenCall
    ) -> tuple[QueryEvent, float]:
        """Give one call (the caller holds the query's lock): (its CALL_SUBMITTED event,
        its stage's deadline, or what it would get if released now)."""
        run, session, calls = entry.run, entry.session, self.calls
        assert session is not None and run.given is not None
        query_id = run.query.query_id
        now = self.clock.now()
        stage, closing = self._stage_for(entry, name)
        stages = run.query.workflow.stages
        expected = (
            stages[stage].calls[min(run.given[stage], len(stages[stage].calls) - 1)]
            if (stage is not None)
            else None
        )
        step = (
            canonical_step(given.step)
            if given.step
            else (stages[stage].step if stage is not None else canonical_step(name))
        )
        call = LLMCall(
            step,
            given.input_tokens or max(1, math.ceil(len(given.prompt) / CHARS_PER_TOKEN)),
            given.output_tokens or (expected.output_tokens if expected else DEFAULT_OUTPUT_TOKENS),
        )
        prompt_bytes = len(given.prompt.encode("utf-8")) + chat_bytes(given.chat)
        # A session is held to a submission's limits, call by call.
        admission = self.admission
        admission.check_call("call", call, len(given.prompt.encode("utf-8")))
        if stage is None and len(stages) >= self.config.max_stages:
            raise InvalidFieldError(
                "stage",
                f"the workflow has {len(stages)} stages, the most a workflow may have "
                f"(--max-stages): name a stage it has",
            )
        adds_call = stage is None or run.given[stage] >= len(stages[stage].calls)
        if adds_call and run.query.workflow.num_calls >= self.config.max_calls:
            raise InvalidFieldError(
                "call",
                f"the workflow has {run.query.workflow.num_calls} calls, the most a "
                "workflow may have (--max-calls)",
            )
        admission.check_room(run.query.tenant, prompt_bytes)
        if closing:
            session.closed_stages.update(closing)
            shape = self._shape(entry)
            await until_stored(
                f"closing stages of {query_id}",
                lambda: self.store.close_stages(query_id, closing, shape=shape),
            )
        mode: GiveMode
        if stage is None:
            stage = run.add_stage(call)
            session.names.append(name)
            entry.prompts.append((given.prompt,))
            index, mode = 0, "new"
        else:
            expected_calls = len(stages[stage].calls)
            index = run.give(stage, call)
            mode = "replace" if index < expected_calls else "join"
            texts = list(entry.prompts[stage])
            if index < len(texts):
                texts[index] = given.prompt
            else:
                texts.append(given.prompt)
            entry.prompts[stage] = tuple(texts)
        call_id = call_id_of(query_id, stage, index)
        chat = given.chat
        if chat is not None:
            entry.chats[call_id] = chat
        self.queries.hold_prompt(entry, call_id, prompt_bytes)
        # kept until the call completes: its prompt and chat part, unless all are empty
        prompt, kept_chat = (given.prompt, chat) if prompt_bytes else ("", None)
        shape = self._shape(entry)
        status = await until_stored(
            f"giving {call_id}",
            lambda: self.store.give(
                query_id,
                call_id,
                stage,
                call,
                mode,
                name=name,
                now=now,
                shape=shape,
                prompt=prompt,
                chat=kept_chat,
            ),
        )
        if status not in (GIVE_APPLIED, GIVE_DUPLICATE):
            log.error("redis refused to give %s (status %d)", call_id, status)
        session.last_call_wall = time.monotonic()
        session.last_done_s = max(session.last_done_s, now)
        record_event(entry, EventKind.CALL_SUBMITTED, now, stage=stage, call_id=call_id)
        submitted = entry.events[-1]
        actions: tuple[Action, ...] = ()
        ticket = calls.tickets.get(call_id)
        if mode == "new":  # the core releases the stage it added
            actions = self.core.handle(ReleaseStage(run, stage, now))
            ticket = released_tickets(actions)[0]
        elif ticket is not None:  # released and held: it may go now
            actions = self.core.handle(CallGiven(run, stage, index, call, now, ticket))
        elif run.stage_released_s[stage] is not None:  # joins a released stage
            actions = self.core.handle(CallGiven(run, stage, index, call, now, call_id=call_id))
            joined = actions[0]
            assert isinstance(joined, DispatchCall | Park)
            ticket = joined.ticket
            calls.add(ticket)  # named `call_id` by the core
        await self.completions.settle(entry, actions, now)
        self.writes.persist(entry, [])
        deadline = ticket.deadline_s if ticket else self.scheduler.budget.revise(run, stage, now)
        return submitted, deadline

    # ------------------------------------------------------------------ close

    async def close(self, workflow_id: str, reason: str = "closed by the client") -> QueryInfo:
        """Close a session (idempotent: a closed or ended one is returned as it is)."""
        if not workflow_id:
            raise InvalidFieldError("workflow_id", "must not be empty")
        entry = self.queries.active.get(workflow_id)
        if entry is None:
            return await self.views.get_info(workflow_id)
        if entry.session is None:
            raise FailedPreconditionError(
                f"query {workflow_id!r} was submitted whole (SubmitQuery): nothing to close"
            )
        async with entry.lock:
            session = entry.session
            if self.queries.active.get(workflow_id) is entry and session.open:
                await self._close(entry, reason)
        return await self.views.get_info(workflow_id)

    async def _close(self, entry: ActiveQuery, reason: str) -> None:
        run, session = entry.run, entry.session
        assert session is not None
        query_id = run.query.query_id
        if not any(run.given or ()):
            # Nothing was ever given: nothing ran, so it neither succeeded nor met its SLO
            # (a client that opened it and gave up, or whose every call was refused).
            await self._cancel_empty(entry, f"{reason}, with no call given")
            return
        stages = [
            k
            for k in range(len(run.query.workflow.stages))
            if k not in session.closed_stages and run.stage_finished_s[k] is None
        ]
        now = self.clock.now()
        # Nothing left running: the workflow ended with its last call, not when it was
        # closed (the client's think time after its last answer is not its latency).
        given = run.given or []
        running = any(  # a stage with a given call not done yet (skipped calls were not given)
            given[k]
            > len(stage.calls)
            - run.stage_calls_left[k]
            - sum(call_id_of(query_id, k, i) in session.skipped for i in range(len(stage.calls)))
            for k, stage in enumerate(run.query.workflow.stages)
        )
        when = now if running else session.last_done_s
        session.closed_stages.update(stages)
        shape = self._shape(entry)
        await until_stored(
            f"closing {query_id}",
            lambda: self.store.close_stages(
                query_id, stages, shape=shape, close_session=True, now=when
            ),
        )
        session.open = False
        actions = self.core.handle(SessionClosed(run, when))
        record_event(entry, EventKind.CLOSED, now, text=reason)
        await self._settle(entry, when, actions)

    async def _cancel_empty(self, entry: ActiveQuery, reason: str) -> None:
        """End a session that never got a call CANCELLED (the caller holds its lock)."""
        now = self.clock.now()
        query_id = entry.run.query.query_id
        await until_stored(
            f"cancelling {query_id}", lambda: self.store.store.cancel(query_id, now, reason)
        )
        assert entry.session is not None
        entry.session.open = False
        self.completions.drop_calls(entry)
        record_event(entry, EventKind.CANCELLED, now, text=reason)
        self.writes.persist(entry, [])
        await self.writes.flush()  # GetQuery reads a finished query's log from Redis
        self.completions.finish(entry, "cancelled")

    async def _settle(self, entry: ActiveQuery, now: float, actions: Sequence[Action] = ()) -> None:
        """Carry out `actions`, skip what the closed stages were never given, send what
        that releases, and end the query if nothing is left (the caller holds its lock)."""
        run = entry.run
        await self.completions.settle(entry, actions, now)
        self.writes.persist(entry, [])
        if run.finished_s is not None:
            record_event(entry, EventKind.SUCCEEDED, run.finished_s)
            self.writes.persist(entry, [])
            await self.writes.flush()  # GetQuery reads a finished query's log from Redis
            self.completions.finish(entry)

    async def settle_resumed(self) -> None:
        """After a restart: the sessions resumed with closed stages skip what those stages
        were never given (a crash between closing them and skipping would otherwise leave
        a closed session waiting for calls that never come)."""
        now = self.clock.now()
        for query_id, entry in list(self.queries.active.items()):
            if entry.session is None or not entry.session.closed_stages:
                continue
            async with entry.lock:
                if self.queries.active.get(query_id) is entry:
                    await self._settle(entry, now)

    async def close_idle(self) -> None:
        """Close the sessions idle for longer than their timeout, every second."""
        while True:
            await asyncio.sleep(1.0)
            wall = time.monotonic()
            idle = [
                (query_id, entry.session.idle_timeout_s)
                for query_id, entry in list(self.queries.active.items())
                if entry.session is not None
                and entry.session.open
                and wall - entry.session.last_call_wall > entry.session.idle_timeout_s
            ]
            for query_id, timeout in idle:
                try:
                    await self.close(query_id, f"idle for more than {timeout:g} s")
                except Exception:  # keep closing the others; this one is tried again
                    log.exception("closing idle session %s failed", query_id)
