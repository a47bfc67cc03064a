"""Local queue disciplines: the order in which one instance admits its waiting calls.

Most disciplines order by a key fixed when the call is queued: least laxity
``U = (now - a_r) + t - budget`` ranks calls the same way at every `now`, because `now` is
common to all of them, so "recompute urgency at every scheduling point" is a heap on
``a_r + budget - t``. VTC and QLM depend on state that moves, and keep their own structure.
"""

from __future__ import annotations

import heapq
import math
from abc import abstractmethod
from collections import deque
from typing import Final

from hexgen_flow.errors import ConfigError
from hexgen_flow.estimate import EstimateMode
from hexgen_flow.policies.base import LocalQueue
from hexgen_flow.runtime import CallTicket, PolicyContext

__all__ = [
    "AtlasQueue",
    "FcfsQueue",
    "KeyedQueue",
    "LeastLaxityQueue",
    "QlmQueue",
    "ShortestJobFirstQueue",
    "UrgencyQueue",
    "VirtualTokenCounterQueue",
]


class KeyedQueue(LocalQueue):
    """A heap on (key(ticket), seq): the smallest key is admitted first.

    Removal is lazy: a removed ticket's heap entry stays until it reaches the top. Every push
    gets its own token, so a ticket removed and pushed again (a deadline update) is ordered
    by its new key only.
    """

    def __init__(self, ctx: PolicyContext, instance: int) -> None:
        super().__init__(ctx, instance)
        self._heap: list[tuple[float, int, int, CallTicket]] = []
        self._members: dict[int, int] = {}  # seq -> token of the live push
        self._pushes = 0

    @abstractmethod
    def key(self, ticket: CallTicket) -> float:
        """Ordering key, computed once when the ticket is queued."""

    def push(self, ticket: CallTicket, now: float) -> None:
        k = self.key(ticket)
        ticket.key = k
        self._pushes += 1
        heapq.heappush(self._heap, (k, ticket.seq, self._pushes, ticket))
        self._members[ticket.seq] = self._pushes

    def _top(self) -> tuple[float, int, int, CallTicket] | None:
        heap, members = self._heap, self._members
        while heap and members.get(heap[0][1]) != heap[0][2]:
            heapq.heappop(heap)  # removed or pushed again since; dropped lazily
        return heap[0] if heap else None

    def peek(self, now: float) -> CallTicket | None:
        heap = self._heap
        if not heap:
            return None  # empty: `_top` would say so
        head = heap[0]
        if self._members.get(head[1]) == head[2]:
            return head[3]  # a live top: `_top` would return it as it is
        top = self._top()
        return top[3] if top else None

    def pop(self, now: float) -> CallTicket:
        heap = self._heap
        if self._members.get(heap[0][1]) != heap[0][2]:
            self._top()
        ticket = heapq.heappop(heap)[3]
        del self._members[ticket.seq]
        return ticket

    def remove(self, ticket: CallTicket) -> bool:
        return self._members.pop(ticket.seq, None) is not None

    def __len__(self) -> int:
        return len(self._members)


class FcfsQueue(KeyedQueue):
    """First come, first served (vLLM's default): release order, i.e. `ticket.seq`.

    A heap rather than a deque, so a call that comes back (redispatched from a lost worker,
    or re-queued) takes its release-order place, not the back of the line.
    """

    def key(self, ticket: CallTicket) -> float:
        return 0.0


class UrgencyQueue(KeyedQueue):
    """The paper's urgency priority (docs/algorithm.md §4.3): least laxity against the stage budget.

    Reads: `ticket.deadline_s` (a_r + SLO_stage, set by the run's StageBudget) and the
    call's estimate t on this instance. U = (now - a_r) + t - SLO_stage; the largest U is
    admitted first, i.e. the smallest ``deadline_s - t``.

    Parameters:
        estimate: "step" (the paper's t_g(s)) or "call" (the call's own tokens).
    """

    def __init__(
        self, ctx: PolicyContext, instance: int, *, estimate: EstimateMode = "step"
    ) -> None:
        super().__init__(ctx, instance)
        self._time = ctx.estimator.time_fn(estimate)
        self._singles = ctx.estimator.call_time_memo if estimate == "call" else None

    def key(self, ticket: CallTicket) -> float:
        return ticket.deadline_s - self._time(self.instance, ticket.call)

    def push(self, ticket: CallTicket, now: float) -> None:
        # `KeyedQueue.push` with `key` inlined, and `call_time`'s memo read first: every
        # call is queued here (a Python call costs about what each of them does)
        call = ticket.call
        memo, singles = self._singles, None
        if memo is not None:
            singles = memo.get((call.input_tokens, call.output_tokens))
        if singles is not None:
            k = ticket.deadline_s - singles[self.instance]
        else:
            k = ticket.deadline_s - self._time(self.instance, call)
        ticket.key = k
        self._pushes = pushes = self._pushes + 1
        heapq.heappush(self._heap, (k, ticket.seq, pushes, ticket))
        self._members[ticket.seq] = pushes


class LeastLaxityQueue(KeyedQueue):
    """Query-level least laxity first (the LLF baseline).

    Laxity = query deadline - now - (this call's estimate + `ticket.remaining_after_s`, the
    cluster-mean estimate of the longest path of stages still after this one); smallest
    laxity first.
    """

    def key(self, ticket: CallTicket) -> float:
        own = self.ctx.estimator.call_time(self.instance, ticket.call)
        return ticket.query_deadline_s - own - ticket.remaining_after_s


class ShortestJobFirstQueue(KeyedQueue):
    """Shortest estimated call first (on this instance, from the call's tokens)."""

    def key(self, ticket: CallTicket) -> float:
        return self.ctx.estimator.call_time(self.instance, ticket.call)


class VirtualTokenCounterQueue(LocalQueue):
    """Virtual token counter fairness (VTC, Sheng et al., OSDI 2024).

    Each client (the query, or its tenant) has a counter; the waiting call of the client
    with the smallest counter goes first (FIFO within a client; ties on the client's
    oldest waiting seq). Popping a call (the driver admits what it pops) adds
    ``input_tokens + output_weight * output_tokens`` to its client's counter. A client that
    had nothing waiting is lifted to the smallest counter among the clients that do, so
    idling earns no credit.

    Parameters:
        client: "query" or "tenant".
        output_weight: cost of an output token relative to an input token.
    """

    def __init__(
        self,
        ctx: PolicyContext,
        instance: int,
        *,
        client: str = "query",
        output_weight: float = 2.0,
    ) -> None:
        super().__init__(ctx, instance)
        if client not in ("query", "tenant"):
            raise ConfigError(f"client must be 'query' or 'tenant', got {client!r}")
        self._by_tenant = client == "tenant"
        self._output_weight = output_weight
        self._counters: dict[object, float] = {}
        self._waiting: dict[object, deque[CallTicket]] = {}
        self._active: list[tuple[float, int, object]] = []
        self._size = 0

    def _client(self, ticket: CallTicket) -> object:
        return ticket.tenant if self._by_tenant else ticket.query_seq

    def _valid_top(self) -> tuple[float, int, object] | None:
        heap = self._active
        while heap:
            counter, first_seq, client = heap[0]
            waiting = self._waiting.get(client)
            if waiting and counter == self._counters[client] and waiting[0].seq == first_seq:
                return heap[0]
            heapq.heappop(heap)  # stale: counter moved, head changed or client went idle
        return None

    def push(self, ticket: CallTicket, now: float) -> None:
        client = self._client(ticket)
        waiting = self._waiting.get(client)
        if waiting:
            waiting.append(ticket)
        else:
            top = self._valid_top()
            floor = top[0] if top else 0.0
            self._counters[client] = max(self._counters.get(client, 0.0), floor)
            self._waiting[client] = deque([ticket])
            heapq.heappush(self._active, (self._counters[client], ticket.seq, client))
        self._size += 1

    def peek(self, now: float) -> CallTicket | None:
        top = self._valid_top()
        return self._waiting[top[2]][0] if top else None

    def pop(self, now: float) -> CallTicket:
        top = self._valid_top()
        assert top is not None, "pop from an empty queue"
        client = top[2]
        waiting = self._waiting[client]
        ticket = waiting.popleft()
        call = ticket.call
        self._counters[client] += call.input_tokens + self._output_weight * call.output_tokens
        if waiting:
            heapq.heappush(self._active, (self._counters[client], waiting[0].seq, client))
        else:
            del self._waiting[client]
        self._size -= 1
        return ticket

    def remove(self, ticket: CallTicket) -> bool:
        client = self._client(ticket)
        waiting = self._waiting.get(client)
        if not waiting or ticket not in waiting:
            return False
        head = waiting[0] is ticket
        waiting.remove(ticket)
        if not waiting:
            del self._waiting[client]
        elif head:
            heapq.heappush(self._active, (self._counters[client], waiting[0].seq, client))
        self._size -= 1
        return True

    def __len__(self) -> int:
        return self._size


class QlmQueue(LocalQueue):
    """QLM-style request groups (Patke et al., SoCC 2024), as the paper's baseline uses it.

    Calls are grouped by their query's deadline into buckets of `bucket_s` seconds. The
    queue serves in arrival order while it is on time, and switches to earliest-deadline
    group first when the estimated waiting time of the queue exceeds the time left of its
    most urgent group. The waiting time is the summed estimates of the waiting calls
    divided by `parallelism`, the batch the instance is assumed to decode at.
    """

    def __init__(
        self,
        ctx: PolicyContext,
        instance: int,
        *,
        bucket_s: float = 10.0,
        parallelism: float = 8.0,
    ) -> None:
        super().__init__(ctx, instance)
        if bucket_s <= 0 or parallelism <= 0:
            raise ConfigError("bucket_s and parallelism must be > 0")
        self._bucket_s = bucket_s
        self._parallelism = parallelism
        self._fcfs: list[tuple[int, CallTicket]] = []
        self._edf: list[tuple[int, int, CallTicket]] = []
        self._members: set[int] = set()
        self._queued_work_s = 0.0

    def _group(self, ticket: CallTicket) -> int:
        return math.floor(ticket.query_deadline_s / self._bucket_s)

    def push(self, ticket: CallTicket, now: float) -> None:
        work = self.ctx.estimator.call_time(self.instance, ticket.call)
        ticket.key = work
        self._queued_work_s += work
        heapq.heappush(self._fcfs, (ticket.seq, ticket))
        heapq.heappush(self._edf, (self._group(ticket), ticket.seq, ticket))
        self._members.add(ticket.seq)

    def _clean(self) -> None:
        members = self._members
        while self._fcfs and self._fcfs[0][0] not in members:
            heapq.heappop(self._fcfs)
        while self._edf and self._edf[0][1] not in members:
            heapq.heappop(self._edf)

    def _choose(self, now: float) -> CallTicket | None:
        self._clean()
        if not self._members:
            return None
        group = self._edf[0][0]
        time_left = (group + 1) * self._bucket_s - now
        if self._queued_work_s / self._parallelism > time_left:
            return self._edf[0][2]
        return self._fcfs[0][1]

    def peek(self, now: float) -> CallTicket | None:
        return self._choose(now)

    def pop(self, now: float) -> CallTicket:
        ticket = self._choose(now)
        assert ticket is not None, "pop from an empty queue"
        self.remove(ticket)
        return ticket

    def remove(self, ticket: CallTicket) -> bool:
        if ticket.seq not in self._members:
            return False
        self._members.discard(ticket.seq)
        self._queued_work_s -= ticket.key
        if not self._members:
            self._queued_work_s = 0.0
        return True

    def __len__(self) -> int:
        return len(self._members)


_MAX_PROGRAMS: Final = 100_000
"""Programs (queries) whose attained service an `AtlasQueue` remembers; the oldest are
forgotten past this (a queue is never told when a query ends)."""


class AtlasQueue(LocalQueue):
    """Autellix's ATLAS: least attained service of the program first, in levels, starvation-proof.

    Autellix (Luo et al., 2025) prioritises each LLM call by the service its program (here:
    the query) has attained so far, so that short programs are not stuck behind long ones
    at the call or the program level. ATLAS, its form for programs whose calls fork and
    join, counts a program's service along its critical path: each stage (a fork's
    parallel calls are its threads) adds its longest call. Priorities are discretised into
    `levels` queues with boundaries `quantum_s` x `growth`^k seconds of attained service, FCFS
    within a queue; a call that has waited `starvation_ratio` x its program's attained
    service (at least `quantum_s`) is promoted to the top, ahead of the levels, in release
    order.

    Reads: the ticket's own fields only: `query_id`, `stage`, and of the calls this queue
    admitted (`on_admit`) their `finished_s` and `scheduled_s` (else `admitted_s`) once they
    finish: the service attained is measured, never estimated (no deadlines, no latency
    tables). Each instance's queue counts what its own instance served: Autellix's process
    table is global, but Autellix's load balancer keeps a long program's calls on one
    engine, so its queue there sees nearly all of it. A program's level is fixed when its
    call is queued (attained service grows only as calls finish); Autellix also demotes a
    running call that outlives its quantum, which needs preemption our engines do not do.
    Ties: release order.

    Parameters:
        quantum_s: attained seconds that end the first level (> 0).
        growth: each level's boundary over the previous one's (> 1).
        levels: number of priority levels (>= 1).
        starvation_ratio: a call waiting this many times its program's attained service
            (at least `quantum_s`) is promoted to the top (> 0).
    """

    def __init__(
        self,
        ctx: PolicyContext,
        instance: int,
        *,
        quantum_s: float = 2.0,
        growth: float = 2.0,
        levels: int = 8,
        starvation_ratio: float = 3.0,
    ) -> None:
        super().__init__(ctx, instance)
        if quantum_s <= 0:
            raise ConfigError(f"quantum_s must be > 0, got {quantum_s}")
        if growth <= 1:
            raise ConfigError(f"growth must be > 1, got {growth}")
        if levels < 1:
            raise ConfigError(f"levels must be >= 1, got {levels}")
        if starvation_ratio <= 0:
            raise ConfigError(f"starvation_ratio must be > 0, got {starvation_ratio}")
        self._quantum = quantum_s
        self._growth = growth
        self._levels = levels
        self._ratio = starvation_ratio
        self._queued: list[tuple[int, int, int, CallTicket]] = []  # (level, seq, token, t)
        self._starving: list[tuple[float, int, int, CallTicket]] = []  # (promote at, ...)
        self._promoted: list[tuple[int, int, CallTicket]] = []  # (seq, token, t)
        self._live: dict[int, int] = {}  # seq -> token of the live push
        self._up: set[int] = set()  # tokens promoted
        self._pushes = 0
        self._admitted: list[CallTicket] = []  # admitted here, service not counted yet
        self._stage_service: dict[tuple[str, int], float] = {}
        self.attained: dict[str, float] = {}
        """query_id -> seconds of service along its critical path, as finished here."""

    def level(self, attained_s: float) -> int:
        """The priority level of a program that has attained `attained_s` (0: the top)."""
        level, bound = 0, self._quantum
        while level < self._levels - 1 and attained_s >= bound:
            level += 1
            bound *= self._growth
        return level

    def _account(self) -> None:
        """Count the service of the admitted calls that have finished since."""
        admitted = self._admitted
        if not admitted:
            return
        keep = []
        stage_service, attained = self._stage_service, self.attained
        for t in admitted:
            finished = t.finished_s
            if finished is None:
                keep.append(t)
                continue
            start = t.scheduled_s if t.scheduled_s is not None else t.admitted_s
            if start is None:
                continue
            service = max(finished - start, 0.0)
            key = (t.query_id, t.stage)
            before = stage_service.get(key, 0.0)
            if service > before:
                stage_service[key] = service
                attained[t.query_id] = attained.get(t.query_id, 0.0) + service - before
        self._admitted = keep
        while len(attained) > _MAX_PROGRAMS:
            del attained[next(iter(attained))]
        while len(stage_service) > _MAX_PROGRAMS:
            del stage_service[next(iter(stage_service))]

    def push(self, ticket: CallTicket, now: float) -> None:
        self._account()
        attained = self.attained.get(ticket.query_id, 0.0)
        level = self.level(attained)
        ticket.key = level
        self._pushes += 1
        token = self._pushes
        heapq.heappush(self._queued, (level, ticket.seq, token, ticket))
        starve_at = now + self._ratio * max(attained, self._quantum)
        heapq.heappush(self._starving, (starve_at, ticket.seq, token, ticket))
        self._live[ticket.seq] = token

    def _top(self, now: float) -> tuple[CallTicket, bool] | None:
        """The next call and whether it was promoted; promotes the calls starving by now."""
        live, up = self._live, self._up
        starving, promoted = self._starving, self._promoted
        while starving and starving[0][0] <= now:
            _, seq, token, t = heapq.heappop(starving)
            if live.get(seq) == token:
                up.add(token)
                heapq.heappush(promoted, (seq, token, t))
        while promoted and live.get(promoted[0][0]) != promoted[0][1]:
            up.discard(heapq.heappop(promoted)[1])  # removed since
        if promoted:
            return promoted[0][2], True
        queued = self._queued
        while queued and (live.get(queued[0][1]) != queued[0][2] or queued[0][2] in up):
            heapq.heappop(queued)  # removed, pushed again, or promoted since
        return (queued[0][3], False) if queued else None

    def peek(self, now: float) -> CallTicket | None:
        top = self._top(now)
        return top[0] if top else None

    def pop(self, now: float) -> CallTicket:
        top = self._top(now)
        assert top is not None, "pop from an empty queue"
        ticket, promoted = top
        if promoted:
            self._up.discard(heapq.heappop(self._promoted)[1])
        else:
            heapq.heappop(self._queued)
        del self._live[ticket.seq]
        return ticket

    def remove(self, ticket: CallTicket) -> bool:
        return self._live.pop(ticket.seq, None) is not None

    def on_admit(self, ticket: CallTicket, now: float) -> None:
        self._admitted.append(ticket)

    def __len__(self) -> int:
        return len(self._live)
