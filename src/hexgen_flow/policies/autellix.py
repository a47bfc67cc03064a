"""Autellix's load balancer (preset `autellix`, with the `atlas` queue in `queues.py`).

Autellix (Luo et al., "Autellix: An Efficient Serving Engine for LLM Agents as General
Programs", 2025) serves agentic programs: it keeps a process table of every program's
calls and schedules each engine's calls by the service their program has attained so far
(PLAS for single-threaded programs, ATLAS for programs whose calls fork and join: the
`atlas` queue). Its load balancer routes for KV-cache locality: calls of one program share
long prefixes (its history), calls of different programs share little (a system prompt),
so a long call goes to the engine its program's earlier calls ran on, and a short one,
where a recomputed prefix costs little, to the least loaded engine. It knows no
deadlines, no latency tables and no GPU speeds.
"""

from __future__ import annotations

from hexgen_flow.errors import ConfigError
from hexgen_flow.policies.base import Dispatcher
from hexgen_flow.runtime import CallTicket, PolicyContext

__all__ = ["AutellixDispatcher"]

_MAX_PROGRAMS = 100_000
"""Program homes remembered (the oldest are forgotten past this: a dispatcher is never told
when a query ends)."""


class AutellixDispatcher(Dispatcher):
    """Autellix's load balancer: long calls stay on their program's engine, short go to the idlest.

    Reads: `ClusterLoad.in_flight`, `ClusterLoad.prefix_caching`, the call's prompt tokens
    and its query (the program). Rule: a call of at least `long_tokens` prompt tokens goes
    to its program's engine (where the program's first long call went) when that engine
    can take it; any other call, and a long call of a program with no engine yet (which
    then gets this one), goes to the candidate with the fewest calls in flight, ties the
    lower index. Without prefix caching there is no locality to keep: every call goes to
    the least loaded.

    Parameters:
        long_tokens: prompt tokens from which a call is long and kept on its program's
            engine (Autellix's threshold: 2048).
    """

    def __init__(self, ctx: PolicyContext, *, long_tokens: int = 2048) -> None:
        super().__init__(ctx)
        if long_tokens < 0:
            raise ConfigError(f"long_tokens must be >= 0, got {long_tokens}")
        self._long = long_tokens
        self._homes: dict[str, int] = {}
        """query_id -> the engine its long calls run on (the process table's engine)."""

    def select(self, ticket: CallTicket, now: float) -> int:
        load = self.ctx.load
        cands = self.candidates(ticket)
        long = load.prefix_caching and ticket.call.input_tokens >= self._long
        if long:
            home = self._homes.get(ticket.query_id)
            if home is not None and home in cands:
                return home
        in_flight = load.in_flight
        best = min(cands, key=in_flight.__getitem__)
        if long:
            homes = self._homes
            homes[ticket.query_id] = best
            if len(homes) > _MAX_PROGRAMS:
                del homes[next(iter(homes))]
        return best
