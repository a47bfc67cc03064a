"""What the scheduler believes of a call's output length, when it is not told it.

A declared workflow carries each call's expected output tokens; a real agent knows only the
request's ``max_tokens``. How much the scheduler may know (`OutputLengths`):

- ``known``: the declared (a trace's recorded) lengths, as every figure before this module;
- ``max-tokens``: every call as long as its cap (`MaxTokensBelief`; a trace has no caps, so
  one stated cap for every call): what a router that plans by the request alone sees;
- ``learned``: `OutputLengthPredictor`, per step type, learned from the calls that finished,
  starting cold from a stated prior (`REPRESENTATIVE_TOKENS`: the typical output of each
  CHESS step type; `DEFAULT_PRIOR_TOKENS` for another type).

**Which quantile, and why.** A belief is used where a call's length matters for lateness:
its dispatch (the work it adds to an instance), its urgency (its stage's deadline), its
stage budget (the time the rest of its workflow needs) and admission (whether the query can
meet its SLO). An underestimate is the costly error there: the call is placed where it will
finish late and its query is admitted as if it had time to spare; a cap-sized
overestimate makes every call look equally long and turns dispatch into least-work. So the
predictor believes the 75th percentile of the recent lengths of the call's step type
(`DEFAULT_QUANTILE`), never more than the call's cap: three calls in four are no longer
than believed.

A query's belief is taken when it arrives (`believe`): its whole workflow, every stage
budget and the admission check plan with the same lengths; the engines always generate the
true ones.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections import deque
from collections.abc import Mapping

from hexgen_flow.errors import ConfigError
from hexgen_flow.estimate import REPRESENTATIVE_TOKENS
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_PRIOR_TOKENS",
    "DEFAULT_QUANTILE",
    "MaxTokensBelief",
    "OutputLengthPredictor",
    "OutputLengths",
    "believed_query",
]

DEFAULT_QUANTILE = 0.75
"""The quantile of recent lengths believed (see the module docstring)."""
DEFAULT_WINDOW = 256
"""Recent lengths kept per step type."""
MIN_OBSERVED = 4
"""Lengths of a step type seen before the predictor trusts them over the prior."""
DEFAULT_PRIOR_TOKENS = 256
"""The prior of a step type without a representative length."""
DEFAULT_MAX_TOKENS = 2048
"""The cap believed for every call under ``max-tokens`` when the workload states none."""


class OutputLengths(enum.Enum):
    """How much the scheduler knows of output lengths (``--output-lengths``)."""

    KNOWN = "known"
    LEARNED = "learned"
    MAX_TOKENS = "max-tokens"

    @classmethod
    def parse(cls, text: str) -> OutputLengths:
        try:
            return cls(text)
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ConfigError(f"output lengths must be one of {names}, got {text!r}") from None


SERVED_OUTPUT_LENGTHS = (OutputLengths.KNOWN.value, OutputLengths.LEARNED.value)
"""What a coordinator's ``--output-lengths`` takes (``max-tokens`` is what ``known`` is when
clients declare their calls' caps, as they do to a coordinator)."""


class OutputLengthPredictor:
    """The believed output length of a call by its step type (see the module docstring)."""

    def __init__(
        self,
        quantile: float = DEFAULT_QUANTILE,
        window: int = DEFAULT_WINDOW,
        prior: Mapping[str, int] | None = None,
        cap: int | None = None,
        *,
        within_declared: bool = False,
    ) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ConfigError(f"quantile must be in (0, 1], got {quantile}")
        if window < MIN_OBSERVED:
            raise ConfigError(f"window must be >= {MIN_OBSERVED}, got {window}")
        if cap is not None and cap < 1:
            raise ConfigError(f"cap must be >= 1, got {cap}")
        self.quantile = quantile
        self.window = window
        self.cap = cap
        """The most any call is believed to generate (its max_tokens), if stated."""
        self.within_declared = within_declared
        """Whether a call's declared output tokens are its cap (a request's max_tokens, as a
        coordinator gets them): never believe more. Off where the declared length is what
        the call will generate (a trace replayed in the simulator), which the belief must
        not see."""
        self._prior = (
            dict(prior)
            if prior is not None
            else {s: t[1] for s, t in REPRESENTATIVE_TOKENS.items()}
        )
        self._seen: dict[str, deque[int]] = {}
        self._cache: dict[str, int] = {}

    def predict(self, step: str) -> int:
        """The believed output tokens of a call of type `step` (at least 1)."""
        cached = self._cache.get(step)
        if cached is not None:
            return cached
        seen = self._seen.get(step)
        if seen is None or len(seen) < MIN_OBSERVED:
            value = self._prior.get(step, DEFAULT_PRIOR_TOKENS)
        else:
            ordered = sorted(seen)
            value = ordered[min(len(ordered) - 1, math.ceil(self.quantile * len(ordered)) - 1)]
        if self.cap is not None:
            value = min(value, self.cap)
        value = max(1, value)
        self._cache[step] = value
        return value

    def observe(self, step: str, output_tokens: int) -> None:
        """A call of type `step` finished having generated `output_tokens`."""
        if output_tokens < 0:
            return
        seen = self._seen.get(step)
        if seen is None:
            seen = self._seen[step] = deque(maxlen=self.window)
        seen.append(output_tokens)
        self._cache.pop(step, None)

    def state(self) -> dict[str, str]:
        """Each step type's recent lengths, oldest first, as a JSON list: what a coordinator
        keeps across restarts (`restore`)."""
        return {step: json.dumps(list(seen)) for step, seen in self._seen.items()}

    def restore(self, states: Mapping[str, str]) -> list[str]:
        """Carry on from `states` (`state`): each step type's kept lengths come before any
        seen since (the newest `window` stay). A value that is not a JSON list of
        non-negative integers is ignored. Returns the step types restored."""
        restored = []
        for step, text in states.items():
            try:
                kept = json.loads(text)
            except ValueError:
                continue
            if not isinstance(kept, list) or not all(type(n) is int and n >= 0 for n in kept):
                continue
            seen = deque(kept, maxlen=self.window)
            seen.extend(self._seen.get(step, ()))
            self._seen[step] = seen
            self._cache.pop(step, None)
            restored.append(step)
        return restored

    def believe(self, call: LLMCall) -> LLMCall:
        predicted = self.predict(call.step)
        if self.within_declared and call.output_tokens < predicted:
            predicted = call.output_tokens
        return dataclasses.replace(call, output_tokens=predicted)


class MaxTokensBelief:
    """Every call believed as long as its cap (one stated cap: traces carry none)."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_tokens < 1:
            raise ConfigError(f"max tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens

    def believe(self, call: LLMCall) -> LLMCall:
        return dataclasses.replace(call, output_tokens=self.max_tokens)

    def observe(self, step: str, output_tokens: int) -> None:
        """Nothing to learn: the cap is all it plans with."""


def believed_query(query: Query, belief: OutputLengthPredictor | MaxTokensBelief) -> Query:
    """`query` with every call's output tokens as `belief` has them now."""
    stages = tuple(
        Stage(stage.step, tuple(belief.believe(c) for c in stage.calls), stage.after)
        for stage in query.workflow.stages
    )
    return dataclasses.replace(query, workflow=Workflow(stages))
