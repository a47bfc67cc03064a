"""Domain model of an agentic workload: queries, their workflow DAGs, stages and LLM calls.

Everything here is immutable: a workload is data that the simulator, the tuner and (later)
the services read. Runtime state (which stage is released, what finished when) lives in
the driver that executes the workload, never on these objects.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from hexgen_flow.errors import WorkloadError

__all__ = [
    "DEFAULT_TENANT",
    "STANDARD_TEMPLATE",
    "STEP_TYPES",
    "LLMCall",
    "Query",
    "Stage",
    "Workflow",
    "canonical_step",
]

DEFAULT_TENANT = "default"
"""The tenant of a query that names none."""

# Canonical names of the CHESS pipeline's step types. Trace files spell them differently
# ("Information Retriever", "generate_candidate_llama-agent"); `canonical_step` maps them.
STEP_TYPES: tuple[str, ...] = (
    "information_retriever",
    "extract_keywords",
    "generate_candidate",
    "revise",
    "unit_tester",
    "generate_unit_test",
    "evaluate",
)

# The paper's fixed workflow template (docs/algorithm.md §4.1): the step types a CHESS query is
# expected to run, in order. The paper's stage budget and SLO_base are both defined on it.
STANDARD_TEMPLATE: tuple[str, ...] = (
    "information_retriever",
    "extract_keywords",
    "information_retriever",
    "information_retriever",
    "information_retriever",
    "generate_candidate",
    "revise",
    "revise",
    "revise",
    "revise",
    "unit_tester",
    "generate_unit_test",
    "unit_tester",
    "evaluate",
    "unit_tester",
)

_ALIASES = {
    "information retriever": "information_retriever",
    "ir": "information_retriever",
}


def canonical_step(name: str) -> str:
    """Map a step name as written in a trace to its canonical step type.

    Unknown names are kept (lower-cased, spaces as underscores): our own JSONL format may
    carry workflows that are not CHESS, and their steps are still valid step types.
    """
    key = name.strip().lower()
    if key in _ALIASES:
        return _ALIASES[key]
    if key.startswith("generate_candidate"):
        # CHESS names the candidate generators after the agent ("_llama-agent", ...):
        # they are one step type for estimation and budgeting.
        return "generate_candidate"
    return key.replace(" ", "_")


@dataclass(frozen=True, slots=True)
class LLMCall:
    """One LLM invocation as recorded or declared by the workflow."""

    step: str
    """Canonical step type (see `canonical_step`)."""
    input_tokens: int
    """Prompt length in tokens."""
    output_tokens: int
    """Generated tokens: recorded length in a trace, expected length in a live submission."""

    def __post_init__(self) -> None:
        if self.input_tokens < 1:
            raise WorkloadError(f"input_tokens must be >= 1, got {self.input_tokens}")
        if self.output_tokens < 1:
            raise WorkloadError(f"output_tokens must be >= 1, got {self.output_tokens}")


@dataclass(frozen=True, slots=True)
class Stage:
    """A set of calls released together: one call, or a parallel fan-out of calls.

    A stage is released when every stage in `after` has finished, and finishes when all of
    its calls have finished.
    """

    step: str
    """Step type shared by the stage's calls (the first call's type for mixed fan-outs)."""
    calls: tuple[LLMCall, ...]
    """The calls; more than one means they run in parallel."""
    after: tuple[int, ...] = ()
    """Indices (into `Workflow.stages`) of the stages that must finish first."""


@dataclass(frozen=True, slots=True)
class Workflow:
    """A DAG of stages, stored in a topological order (every dependency precedes its user)."""

    stages: tuple[Stage, ...]
    num_calls: int = field(init=False)
    """Total LLM calls over all stages."""
    dependents: tuple[tuple[int, ...], ...] = field(init=False)
    """For each stage, the stages that list it in `after` (derived, for release bookkeeping)."""

    def __post_init__(self) -> None:
        if not self.stages:
            raise WorkloadError("a workflow needs at least one stage")
        users: list[list[int]] = [[] for _ in self.stages]
        for index, stage in enumerate(self.stages):
            if not stage.calls:
                raise WorkloadError(f"stage {index} ({stage.step}) has no calls")
            for dep in stage.after:
                if not 0 <= dep < index:
                    raise WorkloadError(
                        f"stage {index} ({stage.step}) depends on stage {dep}, which is not "
                        "an earlier stage (stages must be listed in a topological order)"
                    )
                users[dep].append(index)
        object.__setattr__(self, "num_calls", sum(len(s.calls) for s in self.stages))
        object.__setattr__(self, "dependents", tuple(tuple(u) for u in users))

    @classmethod
    def chain(cls, stages: Sequence[tuple[LLMCall, ...]]) -> Workflow:
        """A linear workflow: each stage depends on the one before it."""
        return cls(
            tuple(
                # An empty stage gets step "" so that __post_init__ reports it (no IndexError).
                Stage(
                    step=calls[0].step if calls else "",
                    calls=tuple(calls),
                    after=(i - 1,) if i else (),
                )
                for i, calls in enumerate(stages)
            )
        )

    @property
    def roots(self) -> tuple[int, ...]:
        """Stages with no dependencies: released when the query arrives."""
        return tuple(i for i, s in enumerate(self.stages) if not s.after)

    def without(self, dropped: Collection[tuple[int, int]]) -> Workflow | None:
        """The workflow without the calls `dropped` names ((stage, index within it)): what
        a workflow session ran once its skipped calls are taken out. A stage left with no
        call goes, and the stages after it wait for what it waited for. None when no call
        is left."""
        if not dropped:
            return self
        kept: list[Stage] = []
        new_index: dict[int, tuple[int, ...]] = {}
        """Old stage index -> the new indices a dependency on it becomes."""
        for k, stage in enumerate(self.stages):
            after = tuple(sorted({j for a in stage.after for j in new_index[a]}))
            calls = tuple(c for i, c in enumerate(stage.calls) if (k, i) not in dropped)
            if not calls:
                new_index[k] = after
                continue
            new_index[k] = (len(kept),)
            kept.append(Stage(step=stage.step, calls=calls, after=after))
        return Workflow(tuple(kept)) if kept else None


@dataclass(frozen=True, slots=True)
class Query:
    """One user request: a workflow plus who asked and how fast it must finish."""

    query_id: str
    workflow: Workflow
    tenant: str = DEFAULT_TENANT
    """Client or tenant the query belongs to (per-tenant attainment, fairness policies)."""
    arrival_s: float | None = None
    """Explicit arrival time; None lets the arrival process choose."""
    slo_s: float | None = None
    """Explicit end-to-end SLO in seconds; None means slo_scale x SLO_base."""
    slo_scale: float | None = None
    """Per-query SLO scale (multi-tenant runs); None means the run's scale."""

    def __post_init__(self) -> None:
        if not self.query_id:
            raise WorkloadError("a query needs a non-empty query_id")
        if not self.tenant:
            raise WorkloadError(f"query {self.query_id}: tenant must be a non-empty string")
        # The chained comparisons are False for NaN too; an infinite time is no time.
        if self.arrival_s is not None and not 0 <= self.arrival_s < math.inf:
            raise WorkloadError(
                f"query {self.query_id}: arrival_s must be finite and >= 0, got {self.arrival_s}"
            )
        for name, value in (("slo_s", self.slo_s), ("slo_scale", self.slo_scale)):
            if value is not None and not 0 < value < math.inf:
                raise WorkloadError(
                    f"query {self.query_id}: {name} must be finite and > 0, got {value}"
                )
