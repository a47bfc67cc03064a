"""Plays the simulator's part for dispatcher tests: numbered tickets and the load ledger.

Shared by the dispatcher tests (tests/test_dispatch.py, the prefix-aware routers' files), so
each checks its policy against the same bookkeeping the simulator does.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from hexgen_flow.cluster import Cluster
from hexgen_flow.estimate import Estimator
from hexgen_flow.runtime import CallTicket, ClusterLoad, PolicyContext, QueryRun
from hexgen_flow.workload import LLMCall, Query, Workflow

__all__ = ["Driver", "context"]


def context(cluster: Cluster, seed: int = 0) -> PolicyContext:
    """A fresh policy context on `cluster`: its estimator, an empty ledger, a seeded rng."""
    return PolicyContext(cluster, Estimator(cluster), ClusterLoad(cluster), random.Random(seed))


class Driver:
    """Numbers tickets and keeps the load ledger, as the simulator does."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.seq = 0

    def ticket(
        self,
        call: LLMCall,
        query: str | None = None,
        *,
        arrival_s: float = 0.0,
        slo_s: float = 100.0,
        remaining_after_s: float = 0.0,
    ) -> CallTicket:
        """A released ticket for `call`, of its own query unless `query` names one (which
        arrived at `arrival_s` with an SLO of `slo_s`)."""
        name = query if query is not None else f"q{self.seq}"
        run = QueryRun(Query(name, Workflow.chain([(call,)])), self.seq, arrival_s, slo_s)
        t = CallTicket(self.seq, run, 0, call, 0.0, 100.0, remaining_after_s)
        self.seq += 1
        return t

    def place(
        self,
        instance: int,
        call: LLMCall,
        query: str | None = None,
        *,
        weigh: Any = None,
        now: float = 0.0,
        **run: float,
    ) -> CallTicket:
        """Put a call in flight on `instance` (work_s as the simulator sets it; the weight
        `weigh`'s `Dispatcher.weight` gives it at `now`, 1 without one)."""
        t = self.ticket(call, query, **run)
        self.commit(t, instance, weigh, now)
        return t

    def dispatch(self, policy: Any, calls: Sequence[LLMCall]) -> list[int]:
        """Dispatch `calls` one by one (nothing completes); the chosen instances."""
        out = []
        for call in calls:
            t = self.ticket(call)
            i = policy.select(t, 0.0)
            assert isinstance(i, int)
            out.append(self.commit(t, i, policy))
        return out

    def commit(self, t: CallTicket, i: int, weigh: Any = None, now: float = 0.0) -> int:
        """Record the dispatcher's choice `i` for `t` in the load ledger (`Scheduler.charge`'s
        bookkeeping)."""
        t.instance = i
        t.work_s = self.ctx.estimator.call_time(i, t.call)
        if weigh is not None:
            t.weight = weigh.weight(t, now)
        self.ctx.load.on_dispatch(t)
        return i
