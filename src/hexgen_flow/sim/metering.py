"""What a simulated engine reports of each finished call: the measurement a real worker makes.

`MeteredEngine` wraps any engine model and measures, as a worker beside a real engine can
from the calls it hands over and gets back (nothing of the engine's insides), each call's
service time (the engine taking it to its last token), the mean number of calls the engine
held meanwhile and the mean KV tokens they held (time integrals over the call's service,
divided by it; a call holds its prompt and half its output), and the calls the engine took
meanwhile with their prompt tokens. The simulator hands these to the scheduler's cost
learner (`GlobalScheduler.observe_cost`) when the run learns costs (`SimConfig.learn_costs`);
without learning the engines run unwrapped and this costs nothing.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from hexgen_flow.learning import CallCost
from hexgen_flow.runtime import CallTicket
from hexgen_flow.sim.engines import EngineModel

__all__ = ["MeteredEngine"]


class MeteredEngine:
    """An engine model that also measures each call's `CallCost` (see the module)."""

    def __init__(self, engine: EngineModel, instance: int) -> None:
        self.engine = engine
        self.instance = instance
        self.kv_capacity = engine.kv_capacity
        self.max_batch = engine.max_batch
        self._step_tokens = int(getattr(engine, "max_num_batched_tokens", 0))
        """The engine's chunked-prefill budget per step (0: it prefills alone)."""
        self._area = 0.0  # integral of the calls held over time, up to _t
        self._kv_area = 0.0  # integral of the KV tokens they hold, up to _t
        self._kv = 0.0  # KV tokens the calls held now hold
        self._held = 0  # calls held now
        self._t = 0.0
        self._log: deque[CallTicket] = deque()  # calls taken, oldest first
        self._log_base = 0  # the position of _log[0] among every call taken
        self._started: dict[CallTicket, tuple[float, float, int]] = {}
        """The integrals when each call was taken, and its position in the log."""
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

    def _meter(self, now: float) -> None:
        if now > self._t:
            dt = now - self._t
            self._area += self._held * dt
            self._kv_area += self._kv * dt
            self._t = now

    @staticmethod
    def _kv_of(ticket: CallTicket) -> float:
        call = ticket.call
        return call.input_tokens + call.output_tokens / 2

    def fits(self, ticket: CallTicket) -> bool:
        return self.engine.fits(ticket)

    def admit(self, ticket: CallTicket, now: float) -> None:
        self._meter(now)
        self.engine.admit(ticket, now)
        self._held += 1
        self._kv += self._kv_of(ticket)
        self._log.append(ticket)
        position = self._log_base + len(self._log) - 1
        self._started[ticket] = (self._area, self._kv_area, position)

    def abort(self, ticket: CallTicket, now: float) -> bool:
        self._meter(now)
        if self._started.pop(ticket, None) is not None:
            self._held -= 1
            self._kv -= self._kv_of(ticket)
        return self.engine.abort(ticket, now)

    def next_event_s(self) -> float:
        return self.engine.next_event_s()

    def peek_event_s(self) -> float:
        return self.engine.peek_event_s()

    def advance(self, now: float) -> list[CallTicket]:
        self._meter(now)
        done = self.engine.advance(now)
        for ticket in done:
            started = self._started.pop(ticket, None)
            if started is None:
                continue
            self._held -= 1
            self._kv -= self._kv_of(ticket)
            area0, kv0, position = started
            admitted, finished = ticket.admitted_s, ticket.finished_s
            if admitted is None or finished is None:
                continue
            # From its first step: a wait in the engine's own waiting list is queueing.
            start = ticket.scheduled_s if ticket.scheduled_s is not None else admitted
            service = finished - start
            span = now - admitted
            # The calls taken after it, whose prompts shared its steps (the uncached part,
            # as far as the engine has started them).
            log, others, tokens = self._log, 0, 0
            for k in range(position + 1 - self._log_base, len(log)):
                other = log[k]
                others += 1
                tokens += other.call.input_tokens - other.cached_tokens
            call = ticket.call
            self._costs[ticket] = CallCost(
                self.instance,
                call.input_tokens,
                call.output_tokens,
                service,
                max((self._area - area0) / span, 1.0) if span > 0 else 1.0,
                (self._kv_area - kv0) / span if span > 0 else self._kv_of(ticket),
                ticket.cached_tokens,
                others,
                tokens,
                self._step_tokens,
            )
        log, held = self._log, self._started
        while log and log[0] not in held:  # nobody still held was taken before it
            log.popleft()
            self._log_base += 1
        return done

    def take_cost(self, ticket: CallTicket) -> CallCost | None:
        """The cost measured for `ticket`, once (None if it did not finish here)."""
        return self._costs.pop(ticket, None)
