"""Dispatch policies: which instance each released call goes to."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final, Literal

from hexgen_flow.errors import ConfigError
from hexgen_flow.estimate import EstimateMode
from hexgen_flow.policies.base import Dispatcher
from hexgen_flow.prefix import DEFAULT_PREFIX_SHARE, checked_prefix_share
from hexgen_flow.runtime import CallTicket, PolicyContext
from hexgen_flow.workload import LLMCall

__all__ = [
    "MAX_TAIL_POWER",
    "LeastRequestsDispatcher",
    "LeastWorkDispatcher",
    "MarginalLatencyDispatcher",
    "PowerOfTwoDispatcher",
    "RoundRobinDispatcher",
    "WorkloadBalancedDispatcher",
]


MAX_TAIL_POWER: Final = 8.0
"""Largest tail weight exponent accepted: beyond it one late query outweighs everything."""

SPLITS_MAX: Final = 1 << 16
"""(input, output) token pairs `MarginalLatencyDispatcher` keeps the splits of."""


class RoundRobinDispatcher(Dispatcher):
    """Instances in turn (vLLM's and most routers' default).

    Reads: nothing but its own cursor. Skips instances whose KV cache cannot hold the call.
    """

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._next = 0

    def select(self, ticket: CallTicket, now: float) -> int:
        load = self.ctx.load
        n = len(load.kv_tokens)
        for _ in range(n):
            i = self._next
            self._next = (i + 1) % n
            if load.can_serve(i, ticket.call):
                return i
        return self.candidates(ticket)[0]  # raises: nothing can serve the call


class PowerOfTwoDispatcher(Dispatcher):
    """Ray Serve's power of two choices on in-flight calls.

    Reads: `ClusterLoad.in_flight`. Samples two distinct candidates with the run's seeded
    generator and keeps the one with fewer calls in flight (the lower index on a tie).
    """

    def select(self, ticket: CallTicket, now: float) -> int:
        cands = self.candidates(ticket)
        if len(cands) == 1:
            return cands[0]
        a, b = self.ctx.rng.sample(cands, 2)
        in_flight = self.ctx.load.in_flight
        if in_flight[a] != in_flight[b]:
            return a if in_flight[a] < in_flight[b] else b
        return min(a, b)


class LeastRequestsDispatcher(Dispatcher):
    """Least outstanding requests: the production routers' load-aware default (the vLLM
    production stack's router, llm-d's queue-depth scorer).

    Reads: `ClusterLoad.in_flight`, the calls dispatched to each instance and not yet
    finished (queued or running). Rule: the candidate with the fewest; ties: the lower index.
    Blind to GPU speed and call size by design: that is what these routers count.
    """

    def select(self, ticket: CallTicket, now: float) -> int:
        in_flight = self.ctx.load.in_flight
        return min(self.candidates(ticket), key=in_flight.__getitem__)


class LeastWorkDispatcher(Dispatcher):
    """Least outstanding estimated work (the LLF baseline's dispatcher).

    Reads: `ClusterLoad.outstanding_s`, the summed single-request estimates of the calls in
    flight on each instance, in that instance's own seconds. Ties: the lower index.
    """

    def select(self, ticket: CallTicket, now: float) -> int:
        work = self.ctx.load.outstanding_s
        return min(self.candidates(ticket), key=work.__getitem__)


class WorkloadBalancedDispatcher(Dispatcher):
    """The paper's workload-balanced score (docs/algorithm.md §3.1), with this project's knobs.

    With b the baseline instance (index 0), t_i the estimate of the call on instance i and
    W_i the work charged to instance i::

        score_i = alpha * t_b / t_i  -  (1 - alpha) * weight[gpu_i] * W_i / W_ref

    and the call goes to the highest score (ties: the lower index).

    Parameters:
        alpha: 1 sends every call to its fastest GPU type, 0 balances work only.
        estimate: "step" (the paper's per-step-type t_g(s)) or "call" (the call's tokens).
        work: "cumulative" (the paper: W_i only grows, by t_i of every call dispatched) or
            "outstanding" (`ClusterLoad.outstanding_s`: work in flight, freed on completion).
        reference: "baseline" (the paper: W_ref = W_b, and an idle baseline takes the call)
            or "mean" (W_ref = mean W over the candidates; all idle: speed alone decides).
        load_weights: per-GPU-type multiplier of the load term (the May-2025 code's 0.5 for
            A6000/L40S); types not listed weigh 1.
    """

    def __init__(
        self,
        ctx: PolicyContext,
        *,
        alpha: float = 0.5,
        estimate: EstimateMode = "step",
        work: Literal["cumulative", "outstanding"] = "cumulative",
        reference: Literal["baseline", "mean"] = "baseline",
        load_weights: Mapping[str, float] | None = None,
    ) -> None:
        super().__init__(ctx)
        if not 0.0 <= alpha <= 1.0:
            raise ConfigError(f"alpha must be in [0, 1], got {alpha}")
        if work not in ("cumulative", "outstanding"):
            raise ConfigError(f"work must be 'cumulative' or 'outstanding', got {work!r}")
        if reference not in ("baseline", "mean"):
            raise ConfigError(f"reference must be 'baseline' or 'mean', got {reference!r}")
        self._work = [0.0] * len(ctx.cluster)
        self._alpha = alpha
        self._time = ctx.estimator.time_fn(estimate)
        self._cumulative = work == "cumulative"
        self._baseline_ref = reference == "baseline"
        weights = dict(load_weights or {})
        self._weights = [float(weights.get(inst.gpu, 1.0)) for inst in ctx.cluster.instances]

    @property
    def alpha(self) -> float:
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        # The cumulative ledger balances work at this α's split; under a new α the history
        # would pull every new call towards the instances "behind" on the old split until
        # it rebalanced (an online re-tune from 0.5 to 0.55 sent P95 from ~300 s to 1,774 s
        # in the shifting-load bench). A new α starts a new balance.
        if value != self._alpha:
            self._work = [0.0] * len(self._work)
        self._alpha = value

    def select(self, ticket: CallTicket, now: float) -> int:
        call = ticket.call
        time = self._time
        cands = self.candidates(ticket)
        work = self._work if self._cumulative else self.ctx.load.outstanding_s
        # b is instance 0 unless the call does not fit there; then the first that fits.
        b = cands[0]
        if self._baseline_ref:
            ref = work[b]
            if ref <= 0.0:
                return self._charge(b, time(b, call))
        else:
            ref = sum(work[i] for i in cands) / len(cands)
        alpha = self.alpha
        t_b = time(b, call)
        best, best_score, best_t = -1, float("-inf"), 0.0
        for i in cands:
            t_i = time(i, call)
            score = alpha * t_b / t_i
            if ref > 0.0:
                score -= (1.0 - alpha) * self._weights[i] * work[i] / ref
            if score > best_score:
                best, best_score, best_t = i, score, t_i
        return self._charge(best, best_t)

    def _charge(self, instance: int, t: float) -> int:
        self._work[instance] += t
        return instance


class MarginalLatencyDispatcher(Dispatcher):
    """Workload balance on marginal latency: HexGen-Flow's dispatcher (docs/algorithm.md §3.2).

    On a continuous-batching instance a call does not wait behind the work already there:
    it joins the batch, decodes at the batch's pace and slows everyone else down. So the
    speed-versus-load trade-off is scored in seconds, per call, from its own tokens. With B
    the calls in flight on instance i (`ClusterLoad.in_flight`), f_i the instance's decode
    slowdown at a batch size, p_i and d_i the call's prefill and batch-1 decode time on i::

        own_i   = p_i + d_i * f_i(B + 1)                   # the call's own latency there
        delay_i = (f_i(B + 1) - f_i(B)) * share * W_i      # everyone else's decode stretches
                  + p_i * B                                # and pauses for its prefill
        score_i = alpha * own_i + (1 - alpha) * delay_i    # lowest wins

    Ties (where f_i is flat) go to the fewer calls in flight, then the lower index. f_i never
    falls with B (`hexgen_flow.latency.monotone_slowdown`), so no term rewards a bigger batch.

    W_i is the outstanding work on i (`ClusterLoad.outstanding_s`); `share` is the part of
    it still ahead when the call arrives (half, for calls uniformly far along).

    Tail weight (`tail_power` p > 0): a second of delay does not cost the same to every
    query. What decides a P95 (and an SLO) is the queries already running late, so each
    call's seconds are weighted by how late its query is heading::

        w = ((now - arrival + own + remaining) / slo) ** p

    (the query's projected latency if this call takes `own` and the rest of its DAG its
    single-request estimate, as a fraction of its SLO). The score becomes
    alpha * w_self,i * own_i + (1 - alpha) * delay_i with B and W_i in delay_i replaced by
    the weighted sums of the calls in flight (`ClusterLoad.weight_in_flight`,
    `weighted_outstanding_s`; each call keeps the weight it had when dispatched,
    `Dispatcher.weight`; another coordinator shard's calls weigh what their shared worker
    reports, `others_weight`). Scoring the sum of w * latency is the marginal change of
    sum(latency ** (p + 1)), a norm that leans towards the slowest queries as p grows, so
    a late query's call goes where it finishes soonest, and calls with time to spare keep
    off the instances that serve late ones. p = 0 is the unweighted score above.

    Prefix affinity: on the instance where the query's last call of the same step type went
    (`ClusterLoad.prefix_home`; none when the engines cache no prefixes), the engine
    probably still caches the prompt prefix they share, so p_i there is only the uncached
    part, (1 - prefix_share) * p_i, in both terms. No separate weight: a cache hit is worth
    the prefill seconds it saves, which is large on a slow-prefill GPU and small on a fast
    one, and is traded against speed and load in the same unit.

    Parameters:
        alpha: 1 picks the instance where the call itself finishes first; 0 the one where it
            delays the other calls least.
        share: fraction of the outstanding work assumed still to run.
        prefix_share: fraction of a call's prompt assumed cached where its query's last call
            of the same step type went (`hexgen_flow.prefix`); 0 ignores prefix caches.
        tail_power: p of the tail weight; 0 weighs every call's seconds alike.
    """

    def __init__(
        self,
        ctx: PolicyContext,
        *,
        alpha: float = 0.5,
        share: float = 0.5,
        prefix_share: float = DEFAULT_PREFIX_SHARE,
        tail_power: float = 0.0,
    ) -> None:
        super().__init__(ctx)
        if not 0.0 <= alpha <= 1.0:
            raise ConfigError(f"alpha must be in [0, 1], got {alpha}")
        if not 0.0 <= share <= 1.0:
            raise ConfigError(f"share must be in [0, 1], got {share}")
        if not 0.0 <= tail_power <= MAX_TAIL_POWER:
            raise ConfigError(f"tail_power must be in [0, {MAX_TAIL_POWER:g}], got {tail_power}")
        self.alpha = alpha
        self._share = share
        self._uncached = 1.0 - checked_prefix_share(prefix_share)
        self._power = float(tail_power)
        instances = ctx.cluster.instances
        self._rebuild()
        self._all = range(len(instances))
        self._chosen: tuple[CallTicket, float, int, int, bool, int] | None = None
        """(ticket, now, instance, calls in flight there, prefix caching, prefix homes'
        changes) of the last `select`, and `_chosen_w` the tail weight it gave: `weight`
        right after it (`GlobalScheduler.charge`) reads the weight back when nothing it
        depends on moved."""
        self._chosen_w = 1.0

    def _rebuild(self) -> None:
        """The per-instance terms `select` reads, from the estimator's models."""
        share = self._share
        models = self.ctx.estimator.models
        instances = self.ctx.cluster.instances
        self._split = [model.split for model in models]
        # One extra entry: B + 1 may exceed max_batch while calls queue.
        self._slowdown = [
            model.slowdown_table(inst.max_batch + 1)
            for model, inst in zip(models, instances, strict=True)
        ]
        self._rows = [
            (tuple((table[b + 1], (table[b + 1] - table[b]) * share) for b in range(cap + 1)), cap)
            for table, cap in ((table, len(table) - 2) for table in self._slowdown)
        ]
        """Per instance, (f(B + 1), (f(B + 1) - f(B)) x share) for B = 0 .. cap, and cap, the
        largest B its slowdown table scores (B + 1 is its last entry): `select`'s terms of
        the batch, computed once per model."""
        self._splits: dict[tuple[int, int], tuple[tuple[float, float], ...]] = {}
        """(p_i, d_i) on every instance by the call's (input, output) tokens."""
        self._chosen = None

    def costs_changed(self) -> None:
        self._rebuild()

    def _splits_of(self, call: LLMCall) -> tuple[tuple[float, float], ...]:
        key = (call.input_tokens, call.output_tokens)
        splits = self._splits.get(key)
        if splits is None:
            if len(self._splits) >= SPLITS_MAX:  # a service sees endless token counts
                self._splits.clear()
            splits = self._splits[key] = tuple(split(*key) for split in self._split)
        return splits

    def select(self, ticket: CallTicket, now: float) -> int:
        # `_own` and `_tail_weight` inlined (this runs for every call on every instance);
        # the arithmetic is theirs, operation for operation.
        call = ticket.call
        load = self.ctx.load
        in_flight = load.in_flight
        alpha, power = self.alpha, self._power
        # `load.prefix_home(ticket)` and `PrefixHomes.get`, inlined
        home = None
        if load.prefix_caching:
            steps = load.prefix_homes.homes.get(ticket.query_id)
            if steps is not None:
                home = steps.get(call.step)
        weights, weighted_work = load.weight_in_flight, load.weighted_outstanding_s
        others, others_work = load.others_in_flight, load.others_outstanding_s
        # Calls another driver placed weigh what their worker reports, the weights their
        # coordinators charged; where it reports none (a worker older than the report),
        # each counts as this driver's average call. Unweighted, every call weighs 1 and
        # the sums are B and W_i.
        reported = load.others_weight if power else None
        reported_work = load.others_weighted_outstanding_s
        # Only this driver's calls (the simulator's case): every term of another driver's
        # is 0, whatever the mean, and is left out (not read at all when none was reported).
        alone = not load.others_reported or not (
            any(others) or any(others_work) or (reported is not None and any(reported))
        )
        mean = 1.0
        if power and not alone:
            own_calls = sum(in_flight) - sum(others)
            if own_calls > 0:
                mean = sum(weights) / own_calls
        # The tail weight's terms that do not depend on the instance (`_tail_weight`).
        run = ticket.run
        slo = elapsed = rest = 0.0
        if power and run is not None:
            slo = run.deadline_s - run.arrival_s
            elapsed = now - run.arrival_s
            rest = ticket.remaining_after_s
        tailed = 0.0 < slo < math.inf
        if load.all_available and call.input_tokens + call.output_tokens <= load.min_kv_tokens:
            cands: range | list[int] = self._all
        else:
            cands = self.candidates(ticket)
        splits = self._splits.get((call.input_tokens, call.output_tokens)) or self._splits_of(call)
        uncached, rows = self._uncached, self._rows
        pow_ = math.pow
        delay = 1.0 - alpha
        best, best_score, best_n, best_w = -1, math.inf, 0, 1.0
        for i in cands:
            n = in_flight[i]
            prefill, decode = splits[i]
            if i == home:
                prefill *= uncached
            batch_rows, cap = rows[i]
            b = n if n < cap else cap
            after, stretch = batch_rows[b]  # f(B + 1), and share x what B + 1 costs B
            own = prefill + decode * after
            w = 1.0
            if tailed:
                late = (elapsed + own + rest) / slo
                w = pow_(0.0 if late < 0.0 else late, power)
            score = alpha * w * own
            if b:
                if alone:
                    batch = weights[i] * b / n  # B, weighted, capped
                    work = weighted_work[i]  # W_i, weighted
                else:
                    if reported is not None and reported[i] > 0.0:
                        batch_others, work_others = reported[i], reported_work[i]
                    else:
                        batch_others, work_others = mean * others[i], mean * others_work[i]
                    batch = (weights[i] + batch_others) * b / n
                    work = weighted_work[i] + work_others
                score += delay * (stretch * work + prefill * batch)
            # Equal scores (a flat stretch of the slowdown curve): the fewer calls in flight,
            # then the lower index, so a tie never piles calls onto the first instance.
            if score < best_score or (score == best_score and n < best_n):
                best, best_score, best_n, best_w = i, score, n, w
        caching, changes = load.prefix_caching, load.prefix_homes.changes
        self._chosen = (ticket, now, best, best_n, caching, changes)
        self._chosen_w = best_w
        return best

    def _own(
        self, i: int, call: LLMCall, home: int | None, n: int
    ) -> tuple[float, float, int, float]:
        """(p_i, own_i, B, f_i(B + 1) - f_i(B)) of `call` on instance i with n calls in
        flight there: B is n capped at the slowdown table, p_i the uncached part at home."""
        prefill, decode = self._splits_of(call)[i]
        if i == home:
            prefill *= self._uncached
        table = self._slowdown[i]
        b = min(n, len(table) - 2)
        after = table[b + 1]
        return prefill, prefill + decode * after, b, after - table[b]

    def _tail_weight(self, ticket: CallTicket, own: float, now: float) -> float:
        run = ticket.run
        if not self._power or run is None:
            return 1.0
        slo = run.deadline_s - run.arrival_s
        if not 0.0 < slo < math.inf:
            return 1.0
        late = (now - run.arrival_s + own + ticket.remaining_after_s) / slo
        return math.pow(max(late, 0.0), self._power)

    def weight(self, ticket: CallTicket, now: float) -> float:
        if not self._power:
            return 1.0
        i = ticket.instance
        load = self.ctx.load
        n = load.in_flight[i]
        # `select` weighed it on this very state (one tuple comparison: a ticket equals
        # only itself)
        if self._chosen == (ticket, now, i, n, load.prefix_caching, load.prefix_homes.changes):
            return self._chosen_w
        # prefix_home is still the previous call's home: this one is not charged yet
        _, own, _, _ = self._own(i, ticket.call, load.prefix_home(ticket), n)
        return self._tail_weight(ticket, own, now)
