"""Stage budgets: how much of a query's remaining SLO its newly released stage may use."""

from __future__ import annotations

from typing import Literal

from hexgen_flow.errors import ConfigError
from hexgen_flow.estimate import REPRESENTATIVE_TOKENS, EstimateMode
from hexgen_flow.policies.base import StageBudget
from hexgen_flow.runtime import PolicyContext, QueryRun
from hexgen_flow.workload import STANDARD_TEMPLATE, LLMCall

__all__ = ["DagStageBudget", "EndToEndBudget", "TemplateStageBudget"]


class TemplateStageBudget(StageBudget):
    """The paper's proportional split over a fixed template (docs/algorithm.md §4.1)::

        SLO_stage = (SLO_q - elapsed_q) * t̄(s_k) / (t̄(s_k) + sum of t̄(s) for s in R(q))

    R(q) is the query's own copy of the standard template: releasing a stage removes one
    occurrence of its step type (a parallel stage counts once); reaching the first
    unit_tester drops the remaining revise rounds. t̄ is the cluster-mean step estimate.

    Parameters:
        estimate: "step" (the paper) or "call" (t̄ of the stage's own slowest call).
        shared_template: reproduce the authors' bug of one template list shared by every
            query, which empties it after the first query and turns the budget into the
            query's whole remaining SLO (docs/algorithm.md §4.1, §9).
    """

    def __init__(
        self,
        ctx: PolicyContext,
        *,
        estimate: EstimateMode = "step",
        shared_template: bool = False,
    ) -> None:
        super().__init__(ctx)
        self._mode = estimate
        self._step_mean = {
            step: ctx.estimator.mean_time(LLMCall(step, *REPRESENTATIVE_TOKENS[step]), "step")
            for step in set(STANDARD_TEMPLATE)
        }
        self._shared: list[str] | None = list(STANDARD_TEMPLATE) if shared_template else None

    def costs_changed(self) -> None:
        self._step_mean = {
            step: self.ctx.estimator.mean_time(LLMCall(step, *REPRESENTATIVE_TOKENS[step]), "step")
            for step in set(STANDARD_TEMPLATE)
        }

    def _mean_step(self, step: str, call: LLMCall) -> float:
        cached = self._step_mean.get(step)
        if cached is None:
            cached = self.ctx.estimator.mean_time(call, "step")
            self._step_mean[step] = cached
        return cached

    def start(self, run: QueryRun) -> None:
        run.budget_state = self._shared if self._shared is not None else list(STANDARD_TEMPLATE)

    def deadline(self, run: QueryRun, stage: int, now: float) -> float:
        template: list[str] = run.budget_state
        step = run.query.workflow.stages[stage].calls[0].step
        if step in template:
            template.remove(step)
        if step == "unit_tester" and "revise" in template:
            template[:] = [s for s in template if s != "revise"]
        return self._split(run, stage, now, template)

    def revise(self, run: QueryRun, stage: int, now: float) -> float:
        # A released stage already took its step off the query's template; one not
        # released yet is priced without its own occurrence in the rest.
        template: list[str] = list(run.budget_state or ())
        if run.stage_released_s[stage] is None:
            step = run.query.workflow.stages[stage].calls[0].step
            if step in template:
                template.remove(step)
        return self._split(run, stage, now, template)

    def _split(self, run: QueryRun, stage: int, now: float, template: list[str]) -> float:
        calls = run.query.workflow.stages[stage].calls
        if self._mode == "step":
            own = self._mean_step(calls[0].step, calls[0])
        else:
            own = max(self.ctx.estimator.mean_time(c, "call") for c in calls)
        step_mean = self._step_mean
        rest = sum(step_mean[s] for s in template)
        remaining = run.deadline_s - now
        return now + remaining * own / (own + rest)


class EndToEndBudget(StageBudget):
    """Every stage may use the query's whole remaining SLO: the stage deadline is the query's.

    With the urgency queue this is end-to-end least laxity, oldest query first; it is what
    the authors' shared-template code effectively ran (docs/algorithm.md §9).
    """

    def deadline(self, run: QueryRun, stage: int, now: float) -> float:
        return run.deadline_s


class DagStageBudget(StageBudget):
    """Stage budgets from the query's own DAG (docs/algorithm.md §4.2).

    With tail(k) the longest path of cluster-mean estimates from stage k to the end of the
    query's actual workflow (parallel branches are not double counted) and t̄(k) the stage's
    own estimate, a stage released at `now` gets:

    - ``split="proportional"``: the paper's proportional share of the time left,
      ``SLO_stage = (deadline_q - now) * t̄(k) / tail(k)``;
    - ``split="latest-start"``: all of the query's slack, i.e. the deadline is the latest
      finish that still leaves the rest of the DAG its estimated time,
      ``deadline = deadline_q - (tail(k) - t̄(k))``. With the urgency queue this is
      query-level least laxity, aware of how much of the workflow is left.

    Both are re-derived from the time actually left at every release, so a late stage
    shrinks every later stage's budget. Proportional splits protect early stages' share in
    light load; latest-start serves the queries closest to missing their deadline, which is
    what keeps the tail short once queues form (docs/algorithm.md §9).

    Parameters:
        estimate: "call" (per-call estimates from tokens) or "step".
        split: "latest-start" or "proportional".
    """

    def __init__(
        self,
        ctx: PolicyContext,
        *,
        estimate: EstimateMode = "call",
        split: Literal["latest-start", "proportional"] = "latest-start",
    ) -> None:
        super().__init__(ctx)
        if split not in ("latest-start", "proportional"):
            raise ConfigError(f"split must be 'latest-start' or 'proportional', got {split!r}")
        self._mode: EstimateMode = estimate
        self._proportional = split == "proportional"
        self._plans = ctx.estimator.plan_memo

    def deadline(self, run: QueryRun, stage: int, now: float) -> float:
        # Every stage is released here once, right after the scheduler planned the
        # workflow: the plan's cache is read first (a Python call costs what reading does)
        workflow = run.query.workflow
        plan = self._plans.get((id(workflow), self._mode))
        if plan is None:
            plan = self.ctx.estimator.plan(workflow, self._mode)
        own, tail = plan.stage_s[stage], plan.tail_s[stage]
        if self._proportional:
            return now + (run.deadline_s - now) * own / tail
        return run.deadline_s - (tail - own)
