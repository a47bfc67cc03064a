"""llm-d's predicted-latency router: a latency model learnt online from what it observed.

What llm-d does (its "Latency Predictor" architecture page and "Predicted Latency-Based
Routing" guide; the gateway-api-inference-extension's latency-predictor sidecars): the
endpoint picker sends every finished request's observed TTFT and TPOT, with the features
it saw when it placed the request (the pod's KV-cache use, waiting and running requests,
the prompt's length and its prefix-cache score), to a training sidecar that refits a
model (XGBoost, in its guides) every few seconds from a bounded
sample of recent requests. For each new request the prediction sidecars predict TTFT and
TPOT on every candidate pod from its current state; the scorer routes to a pod with
headroom against the request's TTFT/TPOT SLO (headers on the request), and without SLOs
(SLO = 0) to the pod with the lowest predicted latency. It sees one request at a time: no
workflow, no deadline of a stage, no latency table; and it assumes a homogeneous pool
(one model for every pod), which our heterogeneous clusters are not, so ours fits one
model per instance.

How `PredictedLatencyDispatcher` follows it, with what our dispatchers can see:

- Features at dispatch, on instance i: ``T`` the tokens of its calls in flight (tens of
  thousands: the KV cache they hold or will, llm-d's KV-cache-use feature; our ledger does
  not split waiting from running), ``p`` the prompt tokens it would compute (thousands:
  the whole prompt, or the uncached share at the query's prefix home,
  `ClusterLoad.prefix_home`: llm-d's prefix-cache score as a feature), ``o`` the output
  tokens (hundreds: the client's max tokens, which a router reads off the request).
- The model: TTFT = a p + b T (the prompt, and the work ahead of it), TPOT (per hundred
  tokens) = c + d T (decode slows with the KV it shares a batch with), predicted latency
  = TTFT + o TPOT. The router observes only when a call was sent and when it finished
  (`Dispatcher.on_complete`), so both are fitted jointly on that end-to-end latency:
  least squares on (p, T, o, o T) over the last `window` calls of the instance, refitted
  every `warmup` of them (llm-d refits every few seconds on a bounded sample), with a
  ridge of weight `ridge` towards the coefficients pooled over every instance, and the
  coefficients clipped at 0 (no negative cost).
- Cold start: from a neutral prior (coefficients 0), knowing nothing of the calibration
  (`ctx.estimator` is never read). An instance with fewer than `warmup` observations is
  predicted by the pooled model (the average of the others); while the pool too has
  fewer, the router explores: fewest calls in flight, ties the lower index.
- Scoring: without SLOs (`ttft_slo_s` and `tpot_slo_s` 0, the default), the lowest
  predicted latency. With SLOs, the lowest predicted latency among the candidates whose
  predicted TTFT and TPOT meet them (positive headroom); when none does, the lowest
  predicted latency anyway (llm-d would shed a request of negative priority; a workflow's
  call cannot be shed). Deterministic where llm-d draws among the pods with headroom.
  Ties: the lower index.

On our simulated clusters (docs/experiments/2026-12-05-stronger-baselines.md) the greedy
choice on a model learnt only from its own placements concentrates load on the instance it
believes fastest until the fit catches up (little exploration); the ridge towards the pool
softens this, and the results vary more from row to row than the other routers'.
"""

from __future__ import annotations

from collections import deque

from hexgen_flow.errors import ConfigError
from hexgen_flow.policies.base import Dispatcher
from hexgen_flow.prefix import DEFAULT_PREFIX_SHARE, checked_prefix_share
from hexgen_flow.runtime import CallTicket, PolicyContext

__all__ = ["PredictedLatencyDispatcher", "WindowedFit"]

_FEATURES = 4
_MAX_PENDING = 100_000
"""Calls dispatched and not finished that are remembered (a coordinator's cancelled calls
never finish: the oldest are forgotten past this)."""


class WindowedFit:
    """Least squares on the last `window` observations, refitted every `every` of them, as
    llm-d's training sidecar refits on a bounded sample of recent requests: ridge towards a
    prior (the pool's coefficients, or 0), coefficients clipped at 0 (no negative cost)."""

    __slots__ = ("count", "every", "samples", "theta")

    def __init__(self, window: int, every: int) -> None:
        self.samples: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self.every = every
        self.theta = [0.0] * _FEATURES
        self.count = 0
        """Observations so far."""

    def observe(self, x: tuple[float, ...], y: float, prior: list[float], ridge: float) -> None:
        self.samples.append((x, y))
        self.count += 1
        if self.count % self.every == 0:
            self.refit(prior, ridge)

    def refit(self, prior: list[float], ridge: float) -> None:
        """theta = argmin sum (y - theta . x)^2 + ridge |theta - prior|^2, clipped at 0."""
        k = _FEATURES
        a = [[ridge if r == c else 0.0 for c in range(k)] for r in range(k)]
        b = [ridge * prior[r] for r in range(k)]
        for x, y in self.samples:
            for r in range(k):
                xr = x[r]
                b[r] += xr * y
                row = a[r]
                for c in range(k):
                    row[c] += xr * x[c]
        self.theta = [max(v, 0.0) for v in _solve(a, b)]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """a x = b by Gaussian elimination with partial pivoting (a is positive definite)."""
    k = len(b)
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(col + 1, k):
            f = a[r][col] / a[col][col]
            for c in range(col, k):
                a[r][c] -= f * a[col][c]
            b[r] -= f * b[col]
    x = [0.0] * k
    for r in range(k - 1, -1, -1):
        x[r] = (b[r] - sum(a[r][c] * x[c] for c in range(r + 1, k))) / a[r][r]
    return x


class PredictedLatencyDispatcher(Dispatcher):
    """llm-d's predicted-latency router: lowest TTFT + TPOT x tokens, learnt online per instance.

    Reads: `ClusterLoad.tokens_in_flight`, `ClusterLoad.in_flight` (to explore),
    `ClusterLoad.prefix_home`, the call's tokens, and what it observed of the calls it
    placed (sent at dispatch, finished at `on_complete`); never the estimator or the
    calibration. Model, cold start and scoring: the module docstring (``TTFT = a p + b T``,
    ``TPOT = c + d T`` per hundred output tokens, least squares on each call's end-to-end
    latency over a window). Ties: the lower index.

    Parameters:
        ttft_slo_s: the requests' TTFT SLO in seconds (0: none).
        tpot_slo_s: the requests' TPOT SLO in seconds per output token (0: none).
        warmup: observations an instance needs before its own model is used, and between
            two refits (>= 1).
        window: the observations each instance's fit keeps (>= 1; the pool keeps this
            many per instance).
        ridge: weight of the pooled coefficients in each instance's fit (> 0).
        prefix_share: share of the prompt assumed cached at the query's step home.
    """

    def __init__(
        self,
        ctx: PolicyContext,
        *,
        ttft_slo_s: float = 0.0,
        tpot_slo_s: float = 0.0,
        warmup: int = 10,
        window: int = 200,
        ridge: float = 1.0,
        prefix_share: float = DEFAULT_PREFIX_SHARE,
    ) -> None:
        super().__init__(ctx)
        if ttft_slo_s < 0 or tpot_slo_s < 0:
            raise ConfigError(
                f"ttft_slo_s and tpot_slo_s must be >= 0, got {ttft_slo_s} and {tpot_slo_s}"
            )
        if warmup < 1:
            raise ConfigError(f"warmup must be >= 1, got {warmup}")
        if window < 1:
            raise ConfigError(f"window must be >= 1, got {window}")
        if ridge <= 0:
            raise ConfigError(f"ridge must be > 0, got {ridge}")
        self._ridge = ridge
        self._ttft_slo = ttft_slo_s
        self._tpot_slo = tpot_slo_s * 100.0  # per hundred tokens, as the model's TPOT
        self._warmup = warmup
        self._uncached = 1.0 - checked_prefix_share(prefix_share)
        every = max(1, min(warmup, window))
        self.pooled = WindowedFit(window * len(ctx.cluster), every)
        """Fitted on every instance's calls: the model of an instance still warming up
        (the average of the others)."""
        self.models = [WindowedFit(window, every) for _ in range(len(ctx.cluster))]
        """One model per instance, fitted on the calls it finished."""
        self._pending: dict[int, tuple[int, float, tuple[float, ...]]] = {}
        """seq -> (instance, dispatched at, features) of the calls in flight."""

    def _features(self, ticket: CallTicket, i: int, home: int | None) -> tuple[float, ...]:
        call = ticket.call
        p = call.input_tokens * (self._uncached if i == home else 1.0) / 1000.0
        o = call.output_tokens / 100.0
        t = self.ctx.load.tokens_in_flight[i] / 10000.0
        return (p, t, o, t * o)

    def _theta(self, i: int) -> list[float]:
        own = self.models[i]
        return own.theta if own.count >= self._warmup else self.pooled.theta

    def select(self, ticket: CallTicket, now: float) -> int:
        load = self.ctx.load
        home = load.prefix_home(ticket)
        in_flight, tokens = load.in_flight, load.tokens_in_flight
        ttft_slo, tpot_slo = self._ttft_slo, self._tpot_slo
        slo = ttft_slo > 0.0 or tpot_slo > 0.0
        prompt = ticket.call.input_tokens / 1000.0
        out = ticket.call.output_tokens / 100.0
        best, best_latency, best_meets = -1, float("inf"), False
        explore = self.pooled.count < self._warmup
        for i in self.candidates(ticket):
            if explore:  # nothing learnt anywhere yet: fewest calls in flight
                if best < 0 or in_flight[i] < in_flight[best]:
                    best = i
                continue
            th = self._theta(i)
            p = prompt * self._uncached if i == home else prompt
            ttft = th[0] * p + th[1] * tokens[i] / 10000.0
            tpot = th[2] + th[3] * tokens[i] / 10000.0
            latency = ttft + out * tpot
            meets = slo and (ttft_slo <= 0.0 or ttft <= ttft_slo)
            meets = meets and (tpot_slo <= 0.0 or tpot <= tpot_slo)
            if (meets and not best_meets) or (meets == best_meets and latency < best_latency):
                best, best_latency, best_meets = i, latency, meets
        self._remember(ticket, best, home, now)
        return best

    def _remember(self, ticket: CallTicket, i: int, home: int | None, now: float) -> None:
        pending = self._pending
        pending.pop(ticket.seq, None)  # a redispatch: the new placement counts
        pending[ticket.seq] = (i, now, self._features(ticket, i, home))
        if len(pending) > _MAX_PENDING:
            del pending[next(iter(pending))]

    def on_complete(self, ticket: CallTicket, now: float) -> None:
        seen = self._pending.pop(ticket.seq, None)
        if seen is None:
            return
        instance, sent, x = seen
        if instance != ticket.instance:
            return  # moved since (`GlobalScheduler.move`): not what was predicted
        latency = now - sent
        pooled = self.pooled
        pooled.observe(x, latency, [0.0] * _FEATURES, 1e-6)
        # an instance's prior is the pool: what every instance taught it so far
        self.models[instance].observe(x, latency, pooled.theta, self._ridge)
