"""The three policy families and their one-method contracts.

- `Dispatcher`: which instance a released call goes to (global, once per call).
- `LocalQueue`: in which order an instance admits its waiting calls.
- `StageBudget`: the deadline of a stage when it is released (the per-stage share of the
  query's remaining SLO that urgency-based queues order by).

Policies are pure functions of the state they are given and of the injected clock (`now`)
and random generator; they never read a wall clock, a global, or `id()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from mypy_extensions import mypyc_attr  # scripts/compile_core.py

from hexgen_flow.runtime import CallTicket, PolicyContext, QueryRun

__all__ = ["Dispatcher", "LocalQueue", "NoInstanceError", "StageBudget"]


@mypyc_attr(native_class=False)  # an exception: a plain class (scripts/compile_core.py)
class NoInstanceError(RuntimeError):
    """No available instance can serve a call right now (a service's workers are away);
    the driver keeps the call until one can."""


@mypyc_attr(allow_interpreted_subclasses=True)  # scripts/compile_core.py
class Dispatcher(ABC):
    """Chooses the instance for each released call."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def select(self, ticket: CallTicket, now: float) -> int:
        """Index of an instance that can serve `ticket.call` (see `ClusterLoad.can_serve`)."""

    def weight(self, ticket: CallTicket, now: float) -> float:
        """What a second of delay to `ticket` costs, once it is placed on `ticket.instance`
        (`ClusterLoad.weight_in_flight` sums it). Every call weighs 1 unless the
        dispatcher weighs delays by how late a query runs (`MarginalLatencyDispatcher`)."""
        return 1.0

    def on_complete(self, ticket: CallTicket, now: float) -> None:  # noqa: B027 - optional hook
        """`ticket` finished at `now` on `ticket.instance` (`GlobalScheduler.complete`, after
        the ledger dropped it; never for a ticket on no instance's ledger). A dispatcher
        that learns from what it observed (`predicted-latency`) updates here; the ledger
        stays the driver's. Every dispatcher but those does nothing."""

    def costs_changed(self) -> None:  # noqa: B027 - optional hook
        """The estimator's latency models changed (an online learner refitted them,
        `GlobalScheduler.observe_cost`): rebuild whatever was computed from them. A
        dispatcher that reads `ctx.estimator` at every call has nothing to do."""

    def candidates(self, ticket: CallTicket) -> range | list[int]:
        """The filter step: instances whose KV cache can hold the call at all."""
        load = self.ctx.load
        if load.fits_everywhere(ticket.call):
            return range(len(load.kv_tokens))
        fitting = [i for i in range(len(load.kv_tokens)) if load.can_serve(i, ticket.call)]
        if not fitting:
            raise NoInstanceError(f"no available instance can hold {ticket.call}")
        return fitting


@mypyc_attr(allow_interpreted_subclasses=True)  # scripts/compile_core.py
class LocalQueue(ABC):
    """Waiting calls of one instance, in the order the instance should admit them.

    The contract, checked for every registered queue by one conformance test:
    `peek(now)` returns the ticket `pop(now)` would remove; the order is total and stable
    (ties break on `ticket.seq`); `remove` forgets a ticket wherever it is.
    """

    def __init__(self, ctx: PolicyContext, instance: int) -> None:
        self.ctx = ctx
        self.instance = instance

    @abstractmethod
    def push(self, ticket: CallTicket, now: float) -> None: ...

    @abstractmethod
    def peek(self, now: float) -> CallTicket | None:
        """The next call to admit, or None when empty."""

    @abstractmethod
    def pop(self, now: float) -> CallTicket:
        """Remove and return `peek(now)`; the caller has checked the queue is not empty."""

    @abstractmethod
    def remove(self, ticket: CallTicket) -> bool:
        """Forget a waiting ticket (cancel, redispatch); False if it was not here."""

    @abstractmethod
    def __len__(self) -> int: ...

    def on_admit(self, ticket: CallTicket, now: float) -> None:  # noqa: B027 - optional hook
        """Called when a popped ticket starts running (accounting queues such as VTC)."""


@mypyc_attr(allow_interpreted_subclasses=True)  # scripts/compile_core.py
class StageBudget(ABC):
    """Sets the deadline of each stage of a query when it is released."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx

    def start(self, run: QueryRun) -> None:  # noqa: B027 - optional hook
        """Called once when the query arrives, before its first stage is released."""

    def costs_changed(self) -> None:  # noqa: B027 - optional hook
        """The estimator's latency models changed (`Dispatcher.costs_changed`)."""

    @abstractmethod
    def deadline(self, run: QueryRun, stage: int, now: float) -> float:
        """Absolute deadline of `stage` of `run`, released at `now`."""

    def revise(self, run: QueryRun, stage: int, now: float) -> float:
        """The deadline `stage` gets from the time left at `now`, for a stage released
        earlier (its calls still wait) or not released yet; changes no state (`deadline`
        may: it is called once per release). Stateless budgets are their `deadline`."""
        return self.deadline(run, stage, now)
