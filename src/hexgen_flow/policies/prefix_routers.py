"""Prefix-cache-aware routers that people run: the fair baselines once engines cache prefixes.

vLLM V1 caches prompt prefixes by default, and the production routers route for it. Both
routers here read where a query's calls went (`ClusterLoad.prefix_home`: the routing-side
index these routers keep in their approximate mode; none when the engines cache nothing, as
an operator who turned caching off would drop the prefix scorer too) and assume, as the
simulated engine does, that the query's calls of one step type share `DEFAULT_PREFIX_SHARE`
of their prompt (`hexgen_flow.prefix`). Neither knows GPU speeds or deadlines: that is the
point of comparing with them."""

from __future__ import annotations

from hexgen_flow.errors import ConfigError
from hexgen_flow.policies.base import Dispatcher
from hexgen_flow.prefix import DEFAULT_PREFIX_SHARE, checked_prefix_share
from hexgen_flow.runtime import CallTicket, PolicyContext

__all__ = ["KvOverlapDispatcher", "PrefixQueueDispatcher"]


class PrefixQueueDispatcher(Dispatcher):
    """llm-d's default scheduling profile: a queue scorer and a prefix-cache scorer, weighted.

    Each candidate gets ``queue_weight * queue + prefix_weight * prefix`` and the highest
    wins (ties: the lower index). ``queue`` is (most - its calls) / (most - fewest) over the
    candidates' calls in flight (1 for all when they are equal); ``prefix`` is the share of
    the call's prompt cached there: `prefix_share` on the instance the query's last call of
    the same step type went to, else 0. The default weights, 2 and 3, are llm-d's default
    profile: a cache hit outweighs an even spread. (llm-d's queue scorer reads the engines'
    waiting queues; the routers here all count calls in flight, as `least-requests` does.)

    Parameters:
        queue_weight, prefix_weight: the scorers' weights (>= 0).
        prefix_share: share of the prompt assumed cached at the query's step home.
    """

    def __init__(
        self,
        ctx: PolicyContext,
        *,
        queue_weight: float = 2.0,
        prefix_weight: float = 3.0,
        prefix_share: float = DEFAULT_PREFIX_SHARE,
    ) -> None:
        super().__init__(ctx)
        if queue_weight < 0 or prefix_weight < 0:
            raise ConfigError(
                f"weights must be >= 0, got queue {queue_weight}, prefix {prefix_weight}"
            )
        self._queue_weight = queue_weight
        self._prefix_score = prefix_weight * checked_prefix_share(prefix_share)

    def select(self, ticket: CallTicket, now: float) -> int:
        cands = self.candidates(ticket)
        load = self.ctx.load
        in_flight = load.in_flight
        most = max(in_flight[i] for i in cands)
        spread = most - min(in_flight[i] for i in cands)
        home = load.prefix_home(ticket)
        best, best_score = -1, float("-inf")
        for i in cands:
            queue = (most - in_flight[i]) / spread if spread else 1.0
            score = self._queue_weight * queue + (self._prefix_score if i == home else 0.0)
            if score > best_score:
                best, best_score = i, score
        return best


class KvOverlapDispatcher(Dispatcher):
    """NVIDIA Dynamo's KV router: the least prefill plus decode work, counted in KV tokens.

    Each candidate costs ``overlap_weight * new prefill tokens + decode tokens`` and the
    lowest wins (ties: the lower index): the prompt tokens it would compute (all of them,
    or the uncached part at the query's step home) and the tokens the instance would hold
    (`ClusterLoad.tokens_in_flight` plus this prompt). Dynamo counts both in KV blocks; the
    unit does not change the choice. Its default `overlap_weight` is 1.

    Parameters:
        overlap_weight: weight of the prefill term against the decode term (>= 0).
        prefix_share: share of the prompt assumed cached at the query's step home.
    """

    def __init__(
        self,
        ctx: PolicyContext,
        *,
        overlap_weight: float = 1.0,
        prefix_share: float = DEFAULT_PREFIX_SHARE,
    ) -> None:
        super().__init__(ctx)
        if overlap_weight < 0:
            raise ConfigError(f"overlap_weight must be >= 0, got {overlap_weight}")
        self._weight = overlap_weight
        self._uncached = 1.0 - checked_prefix_share(prefix_share)

    def select(self, ticket: CallTicket, now: float) -> int:
        call = ticket.call
        load = self.ctx.load
        tokens = load.tokens_in_flight
        home = load.prefix_home(ticket)
        prompt = call.input_tokens
        best, best_cost = -1, float("inf")
        for i in self.candidates(ticket):
            prefill = prompt * self._uncached if i == home else prompt
            cost = self._weight * prefill + tokens[i] + prompt
            if cost < best_cost:
                best, best_cost = i, cost
        return best
