"""Continuous-batching execution model of one serving instance: the simulated engine.

What it models (and what it leaves out), per instance:

- Admission reserves KV-cache slots for the call's input + output tokens, up to the
  instance's capacity and at most `max_batch` calls. Calls are never preempted, so a call
  is admitted only when its whole reservation fits (vLLM would preempt and recompute).
- Prefill is serial and pauses decoding, as in vLLM's prefill-first scheduling: the prefill
  backlog drains call after call, and the calls whose prefill is done join the decode batch
  together when the backlog is empty.
- Decoding runs every admitted call together. A call needs its batch-1 decode seconds
  (single-request latency minus prefill, from the measured tables), stretched by the
  profiled per-token slowdown at the current batch size B.

Decode progress is tracked on a virtual clock V: while B calls decode, V advances at
1 / slowdown(B) per second, and a call that joined at V0 finishes when V reaches V0 + its
decode seconds. Every event is O(log B); nothing is simulated token by token.
"""

from __future__ import annotations

import heapq
from typing import Final

from hexgen_flow.cluster import InstanceSpec
from hexgen_flow.runtime import CallTicket

__all__ = ["BatchingEngineModel"]

_EPS: Final = 1e-9


class BatchingEngineModel:
    """Execution state of one instance; the caller drives it with times it chooses."""

    __slots__ = (
        "_clock",
        "_decoding",
        "_prefill_end",
        "_prefilling",
        "_slowdown",
        "_split",
        "_v",
        "kv_capacity",
        "kv_used",
        "max_batch",
        "running",
    )

    preemptions = 0
    """This model never preempts (the `EngineModel` interface asks every model)."""

    def __init__(self, spec: InstanceSpec) -> None:
        self.kv_capacity = spec.kv_cache_tokens
        self.max_batch = spec.max_batch
        self._slowdown = spec.latency.slowdown_table(spec.max_batch)
        self._split = spec.latency.split
        self.kv_used = 0
        self.running = 0
        """Admitted calls not yet finished (prefilling or decoding)."""
        self._v = 0.0
        self._clock = 0.0
        self._prefill_end = 0.0
        self._prefilling: list[tuple[float, CallTicket]] = []
        self._decoding: list[tuple[float, int, CallTicket]] = []

    def fits(self, ticket: CallTicket) -> bool:
        call = ticket.call
        return (
            self.running < self.max_batch
            and self.kv_used + call.input_tokens + ticket.output_tokens <= self.kv_capacity
        )

    def admit(self, ticket: CallTicket, now: float) -> None:
        """Start `ticket` at `now` (the caller checked `fits`)."""
        self._sync(now)
        call = ticket.call
        out = ticket.output_tokens  # what it really generates (its call may hold a belief)
        prefill, decode = self._split(call.input_tokens, out)
        self.kv_used += call.input_tokens + out
        self.running += 1
        ticket.admitted_s = now
        start = self._prefill_end if self._prefilling else now
        self._prefill_end = start + prefill
        self._prefilling.append((decode, ticket))

    def abort(self, ticket: CallTicket, now: float) -> bool:
        """Stop a running call at `now` and free its KV slots; False if it is not here.

        The prefill time already planned for it is not given back: the backlog it was in
        keeps its length.
        """
        self._sync(now)
        for i, (_, held) in enumerate(self._prefilling):
            if held is ticket:
                del self._prefilling[i]
                break
        else:
            for i, entry in enumerate(self._decoding):
                if entry[2] is ticket:
                    self._decoding[i] = self._decoding[-1]
                    self._decoding.pop()
                    heapq.heapify(self._decoding)
                    break
            else:
                return False
        call = ticket.call
        self.kv_used -= call.input_tokens + ticket.output_tokens
        self.running -= 1
        return True

    def next_event_s(self) -> float:
        """When the state next changes by itself (prefill drained or a call finishes)."""
        if self._prefilling:
            return self._prefill_end
        if self._decoding:
            batch = len(self._decoding)
            return self._clock + (self._decoding[0][0] - self._v) * self._slowdown[batch]
        return float("inf")

    def peek_event_s(self) -> float:
        """`next_event_s` (which has no side effects in this model)."""
        return self.next_event_s()

    def advance(self, now: float) -> list[CallTicket]:
        """Move the engine to `now`; return the calls that finished, in finishing order."""
        self._sync(now)
        done: list[CallTicket] = []
        decoding = self._decoding
        limit = self._v + _EPS * max(1.0, self._v)
        while decoding and decoding[0][0] <= limit:
            ticket = heapq.heappop(decoding)[2]
            call = ticket.call
            self.kv_used -= call.input_tokens + ticket.output_tokens
            self.running -= 1
            ticket.finished_s = now
            done.append(ticket)
        return done

    def _sync(self, now: float) -> None:
        if now <= self._clock:
            return
        if self._prefilling:
            if self._prefill_end > now:
                self._clock = now  # decoding stays paused behind the prefill backlog
                return
            self._clock = self._prefill_end
            v = self._v
            for decode, ticket in self._prefilling:
                if ticket.first_token_s is None:
                    ticket.first_token_s = self._clock  # the backlog's prefill drained
                heapq.heappush(self._decoding, (v + decode, ticket.seq, ticket))
            self._prefilling.clear()
        if self._decoding:
            self._v += (now - self._clock) / self._slowdown[len(self._decoding)]
        self._clock = now
