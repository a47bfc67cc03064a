"""The scheduling protocol: events in, frozen actions out.

`Scheduler.handle` is the one way a driver changes what the scheduler holds. It takes an
event (a query submitted, a call started or done, an instance lost or back, a tick, α
changed, ...) and returns the actions it decided, in the order the driver carries them out:
queue a stage's calls where they were dispatched, tell an instance a waiting call's new
deadline, move a call, park it, finish a query, cancel its calls. The simulator
(`hexgen_flow.sim.simulator`) and the coordinator (`hexgen_coordinator`) are two drivers of
it: the simulator applies actions to its engine models' queues in simulated time, the
coordinator sends them to its workers' streams and keeps Redis in step. Neither decides
anything a policy would: which released calls still wait (the core's `CallState`), when a
stage's budget is revised, where a call goes, what a best-effort query is (a
`QueryState` and a flag, not a driver's deadline trick) all live here, once, and
tests/test_protocol_conformance.py drives both with one event sequence and compares what
they did.

Lifecycles are enums on the state objects (`hexgen_flow.runtime`): a `QueryRun` is
WAITING (best-effort, held) → RUNNING → FINISHED or ENDED; a `CallTicket` is HELD (a
session's call without its prompt), PARKED, RESERVED (after a restart) → QUEUED → RUNNING
→ DONE, with BACKOFF after a failed attempt and DROPPED when its query ended early.

Events and actions are frozen: named tuples, because the simulator makes two events and an
action or two for every call it simulates and a named tuple is built in about half the time
of a frozen dataclass (compare them by type and fields: two named tuples of different types
with equal fields are equal as tuples). The tickets and runs they carry are the scheduler's
mutable state objects (a driver reads them; only the scheduler changes their placement and
lifecycle).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from hexgen_flow.admission import BEST_EFFORT_DELAY_S
from hexgen_flow.learning import CallCost
from hexgen_flow.lengths import MaxTokensBelief, OutputLengthPredictor, believed_query
from hexgen_flow.policies.base import NoInstanceError
from hexgen_flow.runtime import CallState, CallTicket, CompletionEffect, QueryRun, QueryState
from hexgen_flow.scheduler import CallMoved, DeadlineChanged, GlobalScheduler
from hexgen_flow.workload import LLMCall, Query

__all__ = [
    "Action",
    "Admitted",
    "Adopt",
    "AlphaChanged",
    "CallDone",
    "CallFailed",
    "CallGiven",
    "CallMoved",
    "CallStarted",
    "CallState",
    "Cancel",
    "DeadlineChanged",
    "Dispatch",
    "Event",
    "Finish",
    "GraceOver",
    "InstanceBack",
    "InstanceLost",
    "Lost",
    "OthersReported",
    "Park",
    "QueryEnded",
    "QueryState",
    "Redispatch",
    "ReleaseStage",
    "Resume",
    "Resumed",
    "Scheduler",
    "SessionClosed",
    "StageReleased",
    "Start",
    "StoredRun",
    "StoredStage",
    "Submit",
    "Tick",
]

# ---------------------------------------------------------------------------- events


class Submit(NamedTuple):
    """A query arrives and is admitted (admission control, `hexgen_flow.admission`, decided
    before). `best_effort`: it waits (WAITING) until `Start`, and its calls then come after
    every query held to its SLO. `session`: a workflow session, whose calls wait for their
    prompts (`CallGiven`) and which stays open until the driver ends it."""

    query: Query
    order: int
    """The query's arrival order (`QueryRun.index`): the tie-breaker between queries."""
    now: float
    slo_s: float
    best_effort: bool = False
    session: bool = False


class Start(NamedTuple):
    """A WAITING (best-effort) query may run now: its root stages are released."""

    run: QueryRun
    now: float


class CallStarted(NamedTuple):
    """The call's engine started it: from now on it stays where it is."""

    ticket: CallTicket
    now: float


class CallDone(NamedTuple):
    """The call finished (or a session's call was skipped, on no instance): the stage
    counts it, which may finish the stage (revising the query's waiting calls), release
    stages that waited for it, and finish the query. `cost`: what it cost its instance, as
    the driver measured it (`hexgen_flow.learning.CostMeter`), for cost learning.
    `effect`: the call's `QueryRun.completion_effect` where the driver evaluated it to
    apply it elsewhere first (the coordinator's Redis completion script): the core applies
    that very effect instead of evaluating the release rule again."""

    ticket: CallTicket
    now: float
    cost: CallCost | None = None
    effect: CompletionEffect | None = None


class CallFailed(NamedTuple):
    """An attempt of the call failed on its instance: off the ledger (BACKOFF) until
    `Redispatch`."""

    ticket: CallTicket
    now: float


class Redispatch(NamedTuple):
    """Send a call again (after its backoff, or from where it waited): to another instance
    than `avoid` where another can take it."""

    ticket: CallTicket
    now: float
    avoid: int = -1


class InstanceLost(NamedTuple):
    """An instance went away: it takes nothing more; its waiting calls are dispatched
    elsewhere and its running ones are lost (`Lost`)."""

    instance: int
    now: float


class InstanceBack(NamedTuple):
    """An instance (re)joined. `lacking`: calls the scheduler has there that it does not
    hold (it restarted): a waiting one is sent again, a running one is lost. Then every
    parked call that can go is dispatched."""

    instance: int
    now: float
    lacking: tuple[CallTicket, ...] = ()


class OthersReported(NamedTuple):
    """What other drivers (coordinator shards sharing the instance) have in flight on
    `instance`, as its latest report says: the dispatcher counts it as load there."""

    instance: int
    in_flight: int
    outstanding_s: float
    tokens: int
    weight: float = 0.0
    weighted_outstanding_s: float = 0.0


class Tick(NamedTuple):
    """Time passed: parked calls that an instance can take now are dispatched."""

    now: float


class AlphaChanged(NamedTuple):
    """The dispatcher's α from now on (the online tuner's knob); ConfigError when the
    policy has none or the value is out of range."""

    alpha: float


class QueryEnded(NamedTuple):
    """The driver ended a query early (cancelled, or failed by its driver): its calls are
    withdrawn (`Cancel` for those on an instance) and the scheduler forgets it."""

    run: QueryRun
    now: float


class ReleaseStage(NamedTuple):
    """A session added a stage that waits for nothing: it is released now."""

    run: QueryRun
    stage: int
    now: float


class CallGiven(NamedTuple):
    """A session's client gave call `index` of `stage` (its prompt came): a HELD ticket
    of it is dispatched; past the stage's expected calls, a new ticket joins the stage."""

    run: QueryRun
    stage: int
    position: int
    """The call's index within its stage."""
    call: LLMCall
    now: float
    ticket: CallTicket | None = None
    call_id: str = ""


class SessionClosed(NamedTuple):
    """A workflow session takes no more calls (its client closed it, or it idled): the
    query finishes with its last call, at `now` when none is left (`Finish`)."""

    run: QueryRun
    now: float


class StoredStage(NamedTuple):
    """A stage of a query as a driver's store kept it (`Resume`)."""

    calls_left: int
    deps_left: int
    released_s: float | None = None
    finished_s: float | None = None
    deadline_s: float | None = None
    """The deadline its calls were given (None: not kept; the budget's is used)."""


class StoredRun(NamedTuple):
    """A running query as a driver's store kept it: what `Resume` rebuilds it from."""

    query: Query
    """As its client declared it (the scheduler plans it with what it believes now)."""
    order: int
    arrival_s: float
    slo_s: float
    calls_left: int
    stages: tuple[StoredStage, ...]
    done: frozenset[tuple[int, int]] = frozenset()
    """(stage, index) of each call finished (or a session's call skipped)."""
    placed: Mapping[tuple[int, int], tuple[int, int]] = {}
    """(stage, index) -> (release order, instance) where a call was last dispatched; a
    call missing here gets a new release order and may be reclaimed by no worker."""
    best_effort: bool = False
    given: tuple[int, ...] | None = None
    """A workflow session's calls given so far per stage; None: not a session."""


class Resume(NamedTuple):
    """A restarted driver found running queries in its store: the scheduler rebuilds each
    (`StoredRun`) and takes up its released calls not done. With `reserve`, a call that
    was dispatched waits (RESERVED) for that instance's worker to reclaim it (`Adopt`)
    until `GraceOver`; the others park (or are HELD: a session's call not given). The
    actions: a `Resumed` per query, in `runs`' order."""

    runs: tuple[StoredRun, ...]
    reserve: bool = True


class Adopt(NamedTuple):
    """A worker that came back still holds a RESERVED call: it goes on that instance's
    ledger (QUEUED)."""

    ticket: CallTicket
    instance: int
    now: float


class GraceOver(NamedTuple):
    """No more reclaiming after a restart: RESERVED calls park, and parked calls go out."""

    now: float


Event = (
    Submit
    | Start
    | CallStarted
    | CallDone
    | CallFailed
    | Redispatch
    | InstanceLost
    | InstanceBack
    | Tick
    | OthersReported
    | AlphaChanged
    | QueryEnded
    | ReleaseStage
    | CallGiven
    | SessionClosed
    | Resume
    | Adopt
    | GraceOver
)

# ---------------------------------------------------------------------------- actions


class Admitted(NamedTuple):
    """A submitted query is the scheduler's now: `run` is its state (first action of
    `Submit`)."""

    run: QueryRun


class StageReleased(NamedTuple):
    """A stage was released: each of its calls is QUEUED on its `instance` (queue it
    there), PARKED (no instance can take it now) or HELD (a session's call without its
    prompt yet)."""

    run: QueryRun
    stage: int
    tickets: tuple[CallTicket, ...]


class Dispatch(NamedTuple):
    """A released call goes to `instance` (a parked, given, retried or resent call; or a
    call redispatched from `source`, an instance lost or being avoided)."""

    ticket: CallTicket
    instance: int
    source: int = -1


class Park(NamedTuple):
    """No instance can take the call now: it waits, in release order."""

    ticket: CallTicket
    source: int = -1


class Lost(NamedTuple):
    """The call was running on `instance`, which lost it: a failed attempt (BACKOFF); the
    driver counts it and sends `Redispatch` after its backoff."""

    ticket: CallTicket
    instance: int


class Cancel(NamedTuple):
    """The call's query ended early: abort it on `instance` (-1: it was on none)."""

    ticket: CallTicket
    instance: int


class Resumed(NamedTuple):
    """A stored query is the scheduler's again (`Resume`): `run` is its state, `tickets`
    its released calls not done (RESERVED, PARKED or HELD)."""

    run: QueryRun
    tickets: tuple[CallTicket, ...]


class Finish(NamedTuple):
    """The query's last call finished at `now`."""

    run: QueryRun
    now: float


Action = (
    Admitted
    | StageReleased
    | Dispatch
    | Park
    | DeadlineChanged
    | CallMoved
    | Lost
    | Cancel
    | Resumed
    | Finish
)
"""What `Scheduler.handle` returns. `DeadlineChanged` (tell the call's instance; a queue
re-orders it) and `CallMoved` (take it off `source`, queue it on `target`) come from
`GlobalScheduler.revise_waiting`."""

_HELD: Final = CallState.HELD
_PARKED: Final = CallState.PARKED
_RESERVED: Final = CallState.RESERVED
_QUEUED: Final = CallState.QUEUED
_RUNNING: Final = CallState.RUNNING
_BACKOFF: Final = CallState.BACKOFF
_DONE: Final = CallState.DONE
_DROPPED: Final = CallState.DROPPED
"""The call states as module constants: an enum member read through its class is a
descriptor call, and the simulator reads these for every call."""

NO_ACTIONS: Final[tuple[Action, ...]] = ()

LengthBelief = OutputLengthPredictor | MaxTokensBelief
"""What a scheduler may believe of output lengths (`Scheduler.lengths`)."""


class Scheduler:
    """The scheduler as drivers see it: `handle(event) -> actions`.

    It wraps one `GlobalScheduler` (the policies: dispatch, stage budgets, cost learning)
    and owns what the drivers used to keep apart: each running query's released calls and
    their lifecycle, the parked calls in release order, best-effort queries. `policy`
    stays readable (its load ledger, estimator, α, learner); a driver changes nothing
    through it.
    """

    def __init__(self, policy: GlobalScheduler, lengths: LengthBelief | None = None) -> None:
        self.policy = policy
        self.lengths = lengths
        """What the scheduler believes of output lengths (`hexgen_flow.lengths`): a query
        is planned as `believe` has it when it is submitted, and every finished call
        teaches it; None: each call's declared length is believed."""
        self.runs: dict[QueryRun, list[CallTicket]] = {}
        """Each query the scheduler holds (WAITING or RUNNING) and its released calls not
        known done (pruned as its stages finish)."""
        self._parked: dict[int, CallTicket] = {}
        """PARKED calls by release order (`seq`)."""
        self._declared: dict[QueryRun, Query] = {}
        """A query planned with believed output lengths, as declared: what its calls'
        engines are asked for (`CallTicket.output_tokens`)."""
        self.observer: Callable[[Event, tuple[Action, ...]], None] | None = None
        """Called with every event and the actions it returned (a conformance test's or a
        trace's recorder); None: nothing is called."""
        self._handlers: dict[type, Callable[[Any], tuple[Action, ...]]] = {
            Submit: self._submit,
            Start: self._start,
            CallStarted: self._call_started,
            CallDone: self._call_done,
            CallFailed: self._call_failed,
            Redispatch: self._redispatch,
            InstanceLost: self._instance_lost,
            InstanceBack: self._instance_back,
            Tick: self._tick,
            OthersReported: self._others_reported,
            AlphaChanged: self._alpha_changed,
            QueryEnded: self._query_ended,
            ReleaseStage: self._release_stage,
            CallGiven: self._call_given,
            SessionClosed: self._session_closed,
            Resume: self._resume,
            Adopt: self._adopt,
            GraceOver: self._grace_over,
        }

    def handle(self, event: Event) -> tuple[Action, ...]:
        """Apply `event`; return the actions the driver carries out, in order."""
        actions = self._handlers[type(event)](event)
        if self.observer is not None:
            self.observer(event, actions)
        return actions

    # The simulator hands two events per call it simulates; these are `handle` of them,
    # without building the event where nobody observes it (the same handlers, the same
    # actions: about 4 % of the simulator's instructions).

    def call_started(self, ticket: CallTicket, now: float) -> tuple[Action, ...]:
        """`handle(CallStarted(ticket, now))`."""
        if self.observer is not None:
            return self.handle(CallStarted(ticket, now))
        if ticket.state is _QUEUED:
            ticket.state = _RUNNING
        return NO_ACTIONS

    def call_done(
        self, ticket: CallTicket, now: float, cost: CallCost | None = None
    ) -> tuple[Action, ...]:
        """`handle(CallDone(ticket, now, cost))`."""
        if self.observer is not None:
            return self.handle(CallDone(ticket, now, cost))
        return self._done(ticket, now, cost)

    # ------------------------------------------------------------------ queries

    def believe(self, query: Query) -> Query:
        """`query` as the scheduler plans it now: with the output lengths it believes (a
        driver's admission control plans with this too). Changes nothing."""
        if self.lengths is None:
            return query
        return believed_query(query, self.lengths)

    def declared(self, run: QueryRun) -> Query:
        """The query `run` runs, as its client declared it (`run.query` is what the
        scheduler plans with: believed output lengths where it learns them)."""
        return self._declared.get(run, run.query)

    def _admit(
        self,
        declared: Query,
        order: int,
        arrival_s: float,
        slo_s: float,
        *,
        session: bool,
        best_effort: bool,
    ) -> QueryRun:
        """A new run of `declared`, planned with the output lengths believed now (a
        session's calls come one by one, each with its own declared length: believed as
        declared); a best-effort one comes after every query held to its SLO in each
        deadline-ordered queue and budget. What `Submit` and `Resume` both start from."""
        query = declared if session else self.believe(declared)
        run = self.policy.admit(query, order, arrival_s, slo_s)
        if query is not declared:
            self._declared[run] = declared
        if best_effort:
            run.best_effort = True
            run.deadline_s += BEST_EFFORT_DELAY_S
        return run

    def _submit(self, e: Submit) -> tuple[Action, ...]:
        run = self._admit(
            e.query, e.order, e.now, e.slo_s, session=e.session, best_effort=e.best_effort
        )
        if e.session:
            run.start_session()
        self.runs[run] = []
        if e.best_effort:
            run.state = QueryState.WAITING
            return (Admitted(run),)
        out: list[Action] = [Admitted(run)]
        self._release_roots(run, e.now, out)
        return tuple(out)

    def _start(self, e: Start) -> tuple[Action, ...]:
        run = e.run
        if run.state is not QueryState.WAITING:
            return NO_ACTIONS
        run.state = QueryState.RUNNING
        out: list[Action] = []
        self._release_roots(run, e.now, out)
        return tuple(out)

    def _release_roots(self, run: QueryRun, now: float, out: list[Action]) -> None:
        for k in run.query.workflow.roots:
            out.append(self._released(run, k, self.policy.release(run, k, now)))

    def _released(self, run: QueryRun, stage: int, tickets: list[CallTicket]) -> StageReleased:
        self.runs[run].extend(tickets)
        self._note_parked(tickets)
        if self._declared:
            self._as_declared(run, tickets)
        return StageReleased(run, stage, tuple(tickets))

    def _as_declared(self, run: QueryRun, tickets: Sequence[CallTicket]) -> None:
        """Calls planned with believed lengths ask their engines for the declared ones."""
        declared = self._declared.get(run)
        if declared is not None:
            stages = declared.workflow.stages
            for t in tickets:
                t.output_tokens = stages[t.stage].calls[t.index].output_tokens

    def _query_ended(self, e: QueryEnded) -> tuple[Action, ...]:
        run = e.run
        tickets = self.runs.pop(run, None)
        if tickets is None:
            return NO_ACTIONS
        out: list[Action] = []
        for t in tickets:
            if t.state in (_DONE, _DROPPED):
                continue
            out.append(Cancel(t, t.instance))
            self.policy.withdraw(t)
            self._parked.pop(t.seq, None)
            t.state = _DROPPED
        run.state = QueryState.ENDED
        self._declared.pop(run, None)
        self.policy.forget(run.query)
        return tuple(out)

    # ------------------------------------------------------------------ calls

    def _call_started(self, e: CallStarted) -> tuple[Action, ...]:
        if e.ticket.state is _QUEUED:
            e.ticket.state = _RUNNING
        return NO_ACTIONS

    def _call_done(self, e: CallDone) -> tuple[Action, ...]:
        return self._done(*e)

    def _done(
        self,
        ticket: CallTicket,
        now: float,
        cost: CallCost | None,
        effect: CompletionEffect | None = None,
    ) -> tuple[Action, ...]:
        # Runs for every call: `_released` and the grouping by stage are inlined.
        if cost is not None:
            self.policy.observe_cost(cost)
        if self.lengths is not None:
            self.lengths.observe(ticket.call.step, ticket.output_tokens)
        ticket.state = _DONE
        if self._parked:
            self._parked.pop(ticket.seq, None)
        released = self.policy.complete(ticket, now, effect)
        run = ticket.run
        assert run is not None, "CallDone needs the ticket's QueryRun"
        stage_done = run.stage_finished_s[ticket.stage] is not None
        if not stage_done and not released:
            return NO_ACTIONS
        if run.finished_s is not None:
            return self._finished(run)
        revised = self._revise(run, now) if stage_done else NO_ACTIONS
        if not released:
            return revised
        self.runs[run].extend(released)
        for t in released:
            if t.state is _PARKED:
                self._parked[t.seq] = t
        if self._declared:
            self._as_declared(run, released)
        first = released[0].stage
        if first == released[-1].stage:  # released stage by stage: this is one stage
            return (*revised, StageReleased(run, first, tuple(released)))
        out: list[Action] = list(revised)
        start = 0
        for i in range(1, len(released) + 1):
            if i == len(released) or released[i].stage != released[start].stage:
                out.append(StageReleased(run, released[start].stage, tuple(released[start:i])))
                start = i
        return tuple(out)

    def _finished(self, run: QueryRun) -> tuple[Action, ...]:
        assert run.finished_s is not None
        run.state = QueryState.FINISHED
        self.runs.pop(run, None)
        self._declared.pop(run, None)
        self.policy.forget(run.query)
        return (Finish(run, run.finished_s),)

    def _note_parked(self, tickets: Iterable[CallTicket]) -> None:
        parked = self._parked
        for t in tickets:
            if t.state is _PARKED:
                parked[t.seq] = t

    def _revise(self, run: QueryRun, now: float) -> tuple[Action, ...]:
        """A stage of `run` finished: its calls released and not started get the deadline
        their stage gets from the time left (`GlobalScheduler.revise_waiting`), and may
        move to an instance that meets it."""
        tickets = self.runs.get(run)
        if not tickets:
            return NO_ACTIONS
        # Identity tests: an enum member's hash is a Python call.
        done, running = _DONE, _RUNNING
        kept = [t for t in tickets if t.state is not done]
        self.runs[run] = kept
        waiting = [t for t in kept if t.state is not running]  # DROPPED: its run is gone
        if not waiting:
            return NO_ACTIONS
        load = self.policy.load
        movable = None if load.all_available else load.available.__getitem__
        return self.policy.revise_waiting(waiting, now, movable)

    def _call_failed(self, e: CallFailed) -> tuple[Action, ...]:
        ticket = e.ticket
        self.policy.withdraw(ticket)
        ticket.state = _BACKOFF
        return NO_ACTIONS

    def _redispatch(self, e: Redispatch) -> tuple[Action, ...]:
        ticket = e.ticket
        if ticket.state in (_DONE, _DROPPED, _HELD):
            return NO_ACTIONS
        source = ticket.instance
        self.policy.withdraw(ticket)
        return (self._place(ticket, e.now, avoid=e.avoid, source=source),)

    def _place(
        self, ticket: CallTicket, now: float, *, avoid: int = -1, source: int = -1
    ) -> Action:
        """Dispatch `ticket` (off every ledger), to another instance than `avoid` where
        another can take it; park it where none can."""
        policy = self.policy
        load = policy.load
        try:
            if avoid >= 0 and load.available[avoid]:
                load.set_available(avoid, False)
                try:
                    instance = policy.dispatch(ticket, now)
                except NoInstanceError:
                    instance = -1  # the only instance that can take it gets it again
                finally:
                    load.set_available(avoid, True)
                if instance < 0:
                    instance = policy.dispatch(ticket, now)
            else:
                instance = policy.dispatch(ticket, now)
        except NoInstanceError:
            ticket.state = _PARKED
            self._parked[ticket.seq] = ticket
            return Park(ticket, source)
        ticket.state = _QUEUED
        self._parked.pop(ticket.seq, None)
        return Dispatch(ticket, instance, source)

    # ------------------------------------------------------------------ instances

    def _on_instance(self, instance: int) -> list[CallTicket]:
        return sorted(
            (t for tickets in self.runs.values() for t in tickets if t.instance == instance),
            key=lambda t: t.seq,
        )

    def _instance_lost(self, e: InstanceLost) -> tuple[Action, ...]:
        i, policy = e.instance, self.policy
        load = policy.load
        load.set_available(i, False)
        load.report_others(i, 0, 0.0, 0)  # whoever comes back reports its own
        there = self._on_instance(i)
        out: list[Action] = []
        for t in there:
            if t.state is _RUNNING:
                policy.withdraw(t)
                t.state = _BACKOFF
                out.append(Lost(t, i))
        for t in there:
            if t.state is _QUEUED:
                policy.withdraw(t)
                out.append(self._place(t, e.now, source=i))
        return tuple(out)

    def _instance_back(self, e: InstanceBack) -> tuple[Action, ...]:
        i = e.instance
        self.policy.load.set_available(i, True)
        out: list[Action] = []
        for t in e.lacking:
            if t.instance != i:
                continue
            if t.state is _RUNNING:
                self.policy.withdraw(t)
                t.state = _BACKOFF
                out.append(Lost(t, i))
        for t in e.lacking:
            if t.instance == i and t.state is _QUEUED:
                out.append(Dispatch(t, i))  # it is charged there already: sent again
        self._dispatch_parked(e.now, out)
        return tuple(out)

    def _tick(self, e: Tick) -> tuple[Action, ...]:
        out: list[Action] = []
        self._dispatch_parked(e.now, out)
        return tuple(out)

    def _others_reported(self, e: OthersReported) -> tuple[Action, ...]:
        self.policy.load.report_others(
            e.instance, e.in_flight, e.outstanding_s, e.tokens, e.weight, e.weighted_outstanding_s
        )
        return NO_ACTIONS

    def _dispatch_parked(self, now: float, out: list[Action]) -> None:
        """Dispatch the parked calls an instance can take, in release order."""
        if not self._parked:
            return
        policy = self.policy
        for seq in sorted(self._parked):
            ticket = self._parked[seq]
            try:
                instance = policy.dispatch(ticket, now)
            except NoInstanceError:
                continue
            del self._parked[seq]
            ticket.state = _QUEUED
            out.append(Dispatch(ticket, instance))

    @property
    def parked(self) -> Sequence[CallTicket]:
        """The parked calls, in release order."""
        return [self._parked[s] for s in sorted(self._parked)]

    def _alpha_changed(self, e: AlphaChanged) -> tuple[Action, ...]:
        self.policy.set_alpha(e.alpha)
        return NO_ACTIONS

    # ------------------------------------------------------------------ sessions

    def _release_stage(self, e: ReleaseStage) -> tuple[Action, ...]:
        run = e.run
        return (self._released(run, e.stage, self.policy.release(run, e.stage, e.now)),)

    def _call_given(self, e: CallGiven) -> tuple[Action, ...]:
        ticket = e.ticket
        if ticket is None:  # joins a released stage beyond its expected calls
            ticket = self.policy.release_call(e.run, e.stage, e.position, e.now)
            ticket.call_id = e.call_id
            self.runs.setdefault(e.run, []).append(ticket)
            if ticket.instance >= 0:
                ticket.state = _QUEUED
                return (Dispatch(ticket, ticket.instance),)
            ticket.state = _PARKED
            self._parked[ticket.seq] = ticket
            return (Park(ticket),)
        if ticket.state is not _HELD:
            return NO_ACTIONS
        ticket.call = e.call  # as given (a session's calls are believed as declared)
        ticket.output_tokens = e.call.output_tokens
        return (self._place(ticket, e.now),)

    def _session_closed(self, e: SessionClosed) -> tuple[Action, ...]:
        run = e.run
        run.end_session(e.now)
        if run.finished_s is None:
            return NO_ACTIONS
        return self._finished(run)

    # ------------------------------------------------------------------ restarts

    def _resume(self, e: Resume) -> tuple[Action, ...]:
        policy = self.policy
        # Calls dispatched before keep their release order; the others get new ones after
        # every kept one (of every query in the event).
        kept = [seq for stored in e.runs for seq, _ in stored.placed.values()]
        if kept:
            policy.next_seq = max(policy.next_seq, max(kept) + 1)
        out: list[Action] = []
        for stored in e.runs:
            run, tickets = self._rebuild(stored, e.reserve)
            out.append(Resumed(run, tuple(tickets)))
        return tuple(out)

    def _rebuild(self, stored: StoredRun, reserve: bool) -> tuple[QueryRun, list[CallTicket]]:
        """`stored`'s run and its released calls not done, as `Submit` and the stages'
        releases since would have left them (the budget replayed in release order)."""
        policy = self.policy
        run = self._admit(
            stored.query,
            stored.order,
            stored.arrival_s,
            stored.slo_s,
            session=stored.given is not None,
            best_effort=stored.best_effort,  # released already: it runs (RUNNING), last
        )
        query = run.query
        if stored.given is not None:
            run.given = list(stored.given)
        run.calls_left = stored.calls_left
        released: list[tuple[float, int]] = []
        for k, stage in enumerate(stored.stages):
            run.stage_calls_left[k] = stage.calls_left
            run.deps_left[k] = stage.deps_left
            run.stage_finished_s[k] = stage.finished_s
            if stage.released_s is not None:
                released.append((stage.released_s, k))
        stages = query.workflow.stages
        plan = policy.estimator.plan(query.workflow, "call")
        tickets: list[CallTicket] = []
        for released_s, k in sorted(released):
            run.stage_released_s[k] = released_s
            computed = policy.budget.deadline(run, k, released_s)  # replays budget state
            if run.stage_finished_s[k] is not None:
                continue
            kept_deadline = stored.stages[k].deadline_s
            deadline = kept_deadline if kept_deadline is not None else computed
            remaining = plan.tail_s[k] - plan.stage_s[k]
            for index, call in enumerate(stages[k].calls):
                if (k, index) in stored.done:
                    continue
                given = run.is_given(k, index)
                placed = stored.placed.get((k, index)) if given else None
                if placed is not None and placed[0] >= 0 and placed[1] >= 0:
                    seq, slot = placed
                else:  # never placed, or between attempts: a new release order
                    seq, slot = policy.next_seq, -1
                    policy.next_seq += 1
                t = CallTicket(seq, run, k, call, released_s, deadline, remaining, index)
                if not given:
                    t.state = _HELD
                elif slot >= 0 and reserve:
                    t.state = _RESERVED
                else:
                    t.state = _PARKED
                    self._parked[seq] = t
                tickets.append(t)
        self.runs[run] = tickets
        if self._declared:
            self._as_declared(run, tickets)
        return run, tickets

    def _adopt(self, e: Adopt) -> tuple[Action, ...]:
        ticket = e.ticket
        self.policy.charge(ticket, e.instance, e.now)
        ticket.state = _QUEUED
        self._parked.pop(ticket.seq, None)
        return NO_ACTIONS

    def _grace_over(self, e: GraceOver) -> tuple[Action, ...]:
        for tickets in self.runs.values():
            for t in tickets:
                if t.state is _RESERVED:
                    t.state = _PARKED
                    self._parked[t.seq] = t
        out: list[Action] = []
        self._dispatch_parked(e.now, out)
        return tuple(out)


def released_tickets(actions: Iterable[Action]) -> list[CallTicket]:
    """The tickets `actions` released, in order (every `StageReleased`'s)."""
    return [t for a in actions if isinstance(a, StageReleased) for t in a.tickets]
