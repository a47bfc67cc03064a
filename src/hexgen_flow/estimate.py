"""Execution-time estimates that the policies plan with (docs/algorithm.md §2).

Two granularities, chosen per policy by its ``estimate`` parameter:

- ``step``: the paper's t_g(s), one latency per (GPU type, step type), measured at the step's
  representative token counts. A step type the table does not know falls back to the call's
  own tokens.
- ``call``: the call's own single-request latency from its token counts (this project's addition).

Every policy in a run shares one `Estimator`, so comparisons between policies are never a
comparison between estimates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final, Literal

from hexgen_flow.cluster import Cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.latency import LatencyModel
from hexgen_flow.workload import STANDARD_TEMPLATE, LLMCall, Workflow

__all__ = ["REPRESENTATIVE_TOKENS", "EstimateMode", "Estimator", "WorkflowPlan"]

PLAN_CACHE_MAX: Final = 4096
"""Workflow plans kept before the cache starts over (a plan holds its workflow alive)."""

CALL_CACHE_MAX: Final = 1 << 16
"""Token counts whose call estimates (per instance, cluster mean) are kept before those
caches start over."""

EstimateMode = Literal["step", "call"]

# Typical (input, output) tokens per CHESS step type (docs/algorithm.md §1).
REPRESENTATIVE_TOKENS: dict[str, tuple[int, int]] = {
    "information_retriever": (308, 5),
    "extract_keywords": (667, 45),
    "generate_candidate": (11748, 678),
    "revise": (5963, 79),
    "unit_tester": (275, 4),
    "generate_unit_test": (1109, 103),
    "evaluate": (961, 22),
}

TimeFn = Callable[[int, LLMCall], float]


class WorkflowPlan:
    """Cluster-mean time estimates over one workflow's DAG.

    `stage_s[k]` is the estimate of stage k (its slowest call: a fan-out runs in parallel);
    `tail_s[k]` is the longest path of estimates from stage k (included) to the end, i.e.
    the least time the query still needs once stage k is released.
    """

    __slots__ = ("stage_s", "tail_s", "workflow")

    def __init__(self, workflow: Workflow, stage_s: list[float]) -> None:
        self.workflow = workflow  # keeps the object alive while its id() keys the cache
        tail = list(stage_s)
        dependents = workflow.dependents
        for k in range(len(stage_s) - 1, -1, -1):
            after = dependents[k]
            if len(after) == 1:  # a chain, the usual case
                tail[k] = stage_s[k] + tail[after[0]]
            elif after:
                tail[k] = stage_s[k] + max(tail[j] for j in after)
        self.stage_s = tuple(stage_s)
        self.tail_s = tuple(tail)


class Estimator:
    """Single-request time estimates for each instance of one cluster."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._models = [inst.latency for inst in cluster.instances]
        self._n = len(self._models)
        self._step_cache: dict[tuple[int, str], float] = {}
        self._plans: dict[tuple[int, str], WorkflowPlan] = {}
        self._singles: dict[tuple[int, int], tuple[float, ...]] = {}
        """`call_time` on every instance by (input, output) tokens."""
        self._call_means: dict[tuple[int, int], float] = {}
        """Cluster-mean ``call`` estimates by (input, output) tokens: a plan is rebuilt for
        every query of a workflow (`forget` drops it when the query ends), from these."""

    @property
    def call_time_memo(self) -> dict[tuple[int, int], tuple[float, ...]]:
        """`call_time` on every instance by (input, output) tokens, as far as computed: the
        same dict for the estimator's life (cleared, never replaced), so a per-call path
        may hold it and read it before calling `call_time` (read-only outside)."""
        return self._singles

    @property
    def plan_memo(self) -> dict[tuple[int, str], WorkflowPlan]:
        """`plan`'s cache by (id(workflow), mode): the same dict for the estimator's life,
        like `call_time_memo` (read-only outside)."""
        return self._plans

    @property
    def models(self) -> tuple[LatencyModel, ...]:
        """The latency model of each instance as the scheduler believes it: the cluster's
        calibration until `recalibrate` (an online learner) says otherwise."""
        return tuple(self._models)

    def recalibrate(self, instance: int, model: LatencyModel) -> None:
        """Believe `model` for `instance` from now on; every estimate is recomputed."""
        self._models[instance] = model
        self._step_cache.clear()
        self._plans.clear()
        self._singles.clear()
        self._call_means.clear()

    def call_time(self, instance: int, call: LLMCall) -> float:
        """Single-request latency of `call` on `instance` from its own token counts."""
        singles = self._singles.get((call.input_tokens, call.output_tokens))
        if singles is None:
            singles = self._singles_of(call)
        return singles[instance]

    def _singles_of(self, call: LLMCall) -> tuple[float, ...]:
        key = (call.input_tokens, call.output_tokens)
        if len(self._singles) >= CALL_CACHE_MAX:  # a service sees endless token counts
            self._singles.clear()
        singles = self._singles[key] = tuple(m.single_s(*key) for m in self._models)
        return singles

    def step_time(self, instance: int, call: LLMCall) -> float:
        """The paper's t_g(s): latency of the call's step type at its representative tokens."""
        key = (instance, call.step)
        cached = self._step_cache.get(key)
        if cached is None:
            tokens = REPRESENTATIVE_TOKENS.get(call.step)
            if tokens is None:
                cached = self.call_time(instance, call)
                # Not cached: an unknown step's estimate depends on the call, not the step.
                return cached
            cached = self._models[instance].single_s(*tokens)
            self._step_cache[key] = cached
        return cached

    def time_fn(self, mode: EstimateMode) -> TimeFn:
        """The estimate function a policy configured with `mode` should call."""
        if mode == "call":
            return self.call_time
        if mode == "step":
            return self.step_time
        raise ConfigError(f"estimate must be 'step' or 'call', got {mode!r}")

    def mean_time(self, call: LLMCall, mode: EstimateMode) -> float:
        """Cluster-mean estimate t̄ (mean over the cluster's instances)."""
        if mode == "call":
            key = (call.input_tokens, call.output_tokens)
            mean = self._call_means.get(key)
            if mean is None:
                if len(self._call_means) >= CALL_CACHE_MAX:  # a service sees endless counts
                    self._call_means.clear()
                mean = self._call_means[key] = self._mean(self.call_time, call)
            return mean
        return self._mean(self.time_fn(mode), call)

    def _mean(self, fn: TimeFn, call: LLMCall) -> float:
        return sum(fn(i, call) for i in range(self._n)) / self._n

    def slo_base(self) -> float:
        """SLO_base: the standard template's cluster-mean step times, summed.

        See docs/algorithm.md §5.
        """
        return sum(
            self.mean_time(LLMCall(step, *REPRESENTATIVE_TOKENS[step]), "step")
            for step in STANDARD_TEMPLATE
        )

    def plan(self, workflow: Workflow, mode: EstimateMode) -> WorkflowPlan:
        """The workflow's per-stage and remaining-path estimates (cached per workflow)."""
        key = (id(workflow), mode)
        plan = self._plans.get(key)
        if plan is None:
            mean = self.mean_time
            # A plan is built for every query: `mean_time`'s memo of the "call" means is read
            # here, and a stage's slowest call is found in the loop (max's first largest).
            means = self._call_means if mode == "call" else {}
            stage_s = []
            for stage in workflow.stages:
                slowest = -math.inf
                for c in stage.calls:
                    t = means.get((c.input_tokens, c.output_tokens))
                    if t is None:
                        t = mean(c, mode)
                    slowest = t if t > slowest else slowest
                stage_s.append(slowest)
            plan = WorkflowPlan(workflow, stage_s)
            if len(self._plans) >= PLAN_CACHE_MAX:  # a service plans endless workflows
                self._plans.clear()
            self._plans[key] = plan
        return plan

    @property
    def plans_cached(self) -> int:
        """Workflows whose plans are cached."""
        return len({key[0] for key in self._plans})

    def forget(self, workflow: Workflow) -> None:
        """Drop `workflow`'s cached plans (its query ended): a service holds only the plans
        of the workflows it runs, and a full garbage collection walks no finished one."""
        for mode in ("step", "call"):
            self._plans.pop((id(workflow), mode), None)
