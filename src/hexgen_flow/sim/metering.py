"""What a simulated engine reports of each finished call: the measurement a real worker makes.

`MeteredEngine` wraps any engine model and hands the calls it takes and returns to a
`hexgen_flow.learning.CostMeter`, which measures each call's `CallCost` as a worker beside
a real engine can. The simulator gives these to the scheduler's cost learner
(`GlobalScheduler.observe_cost`) when the run learns costs (`SimConfig.learn_costs`);
without learning the engines run unwrapped and this costs nothing.
"""

from __future__ import annotations

from typing import Any

from hexgen_flow.learning import CallCost, CostMeter
from hexgen_flow.runtime import CallTicket
from hexgen_flow.sim.engines import EngineModel

__all__ = ["MeteredEngine"]


class MeteredEngine:
    """An engine model whose calls a `CostMeter` measures (see the module)."""

    def __init__(self, engine: EngineModel, instance: int, declared: int | None = None) -> None:
        self.engine = engine
        self.declared = declared
        """The output tokens every call is declared at, which a worker's engine is asked
        for while the call is held (a coordinator learning output lengths asks for its
        clients' cap and hears what a call generated only when it is back); None: each
        call's own, as when the lengths are known."""
        self.kv_capacity = engine.kv_capacity
        self.max_batch = engine.max_batch
        # The engine's chunked-prefill budget per step, where it has one.
        self.meter = CostMeter(instance, int(getattr(engine, "max_num_batched_tokens", 0)))
        self._costs: dict[CallTicket, CallCost] = {}

    def __getattr__(self, name: str) -> Any:  # what else an engine model offers (`progress`)
        return getattr(self.engine, name)

    @property
    def running(self) -> int:
        return self.engine.running

    @running.setter
    def running(self, value: int) -> None:
        self.engine.running = value

    @property
    def preemptions(self) -> int:
        return self.engine.preemptions

    @preemptions.setter
    def preemptions(self, value: int) -> None:
        self.engine.preemptions = value

    @property
    def kv_used(self) -> int:
        return self.engine.kv_used

    def fits(self, ticket: CallTicket) -> bool:
        return self.engine.fits(ticket)

    def admit(self, ticket: CallTicket, now: float) -> None:
        self.engine.admit(ticket, now)
        self.meter.taken(ticket, now, self.declared)

    def abort(self, ticket: CallTicket, now: float) -> bool:
        self.meter.dropped(ticket, now)
        return self.engine.abort(ticket, now)

    def next_event_s(self) -> float:
        return self.engine.next_event_s()

    def peek_event_s(self) -> float:
        return self.engine.peek_event_s()

    def advance(self, now: float) -> list[CallTicket]:
        done = self.engine.advance(now)
        for ticket in done:
            finished = ticket.finished_s
            start = ticket.scheduled_s if ticket.scheduled_s is not None else ticket.admitted_s
            service = finished - start if finished is not None and start is not None else None
            cost = self.meter.finished(ticket, now, service)
            if cost is not None:
                self._costs[ticket] = cost
        return done

    def take_cost(self, ticket: CallTicket) -> CallCost | None:
        """The cost measured for `ticket`, once (None if it did not finish here)."""
        return self._costs.pop(ticket, None)
