"""What the Text-to-SQL agent returns (`hexgen_sql.agent`), and its vote.

Standard library only (like the rest of `hexgen_sql` but the agent itself): a
result can be built, read and voted on without the ``openai`` package.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hexgen_sql.evaluate import results_match
from hexgen_sql.prompts import SYNTHETIC_LABEL
from hexgen_sql.sandbox import QueryResult

__all__ = [
    "AgentResult",
    "CallRecord",
    "Candidate",
    "StageTiming",
    "needs_revision",
    "vote",
]


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One LLM call: its stage, prompt, answer and the usage the server reported."""

    stage: str
    prompt: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    start_s: float
    end_s: float
    """Wall seconds since the question started."""
    round: int = 0
    """0, or the revise round the call belongs to."""
    query_id: str | None = None
    deadline_s: float | None = None
    """The gateway's ``X-Hexgen-Deadline-S`` (cluster seconds), when it sent one."""


@dataclass(slots=True)
class Candidate:
    """A candidate query as it stands: `round` 0 as generated, r after the r-th revision;
    `history` holds every (round, sql, error) it went through."""

    index: int
    sql: str
    error: str | None = None
    round: int = 0
    result: QueryResult | None = None
    history: list[tuple[int, str, str | None]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"sql": self.sql, "error": self.error, "round": self.round}


@dataclass(frozen=True, slots=True)
class StageTiming:
    stage: str
    start_s: float
    end_s: float
    calls: int

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "start_s": self.start_s, "end_s": self.end_s,
                "calls": self.calls}  # fmt: skip


@dataclass(slots=True)
class AgentResult:
    question: str
    workflow: str
    sql: str
    columns: list[str]
    rows: list[tuple[Any, ...]]
    candidates: list[Candidate]
    stages: list[StageTiming]
    calls: list[CallRecord]
    latency_s: float
    """Wall seconds, first call to the vote."""
    time_scale: float = 1.0
    slo_s: float | None = None
    deadline_s: float | None = None
    """The workflow's deadline (cluster seconds) as closing it reported, else the first
    call's ``X-Hexgen-Deadline-S`` (its stage's deadline); None from other servers."""
    error: str | None = None
    """Why no candidate ran, when none did."""
    closed: dict[str, Any] | None = None
    """The gateway's answer to closing the workflow (state, arrival_s, finished_s, slo_s,
    deadline_s, calls_done, ...); None when the server has no such endpoint."""

    @property
    def cluster_latency_s(self) -> float:
        """The workflow's latency on the cluster clock, as SLOs are given: the coordinator's
        finished_s - arrival_s when the close told them, else wall seconds x time scale."""
        closed = self.closed or {}
        arrival, finished = closed.get("arrival_s"), closed.get("finished_s")
        if isinstance(arrival, int | float) and isinstance(finished, int | float) and finished:
            return float(finished - arrival)
        return self.latency_s * self.time_scale

    @property
    def synthetic(self) -> bool:
        """Whether any answer came from the simulated engine's synthetic responder."""
        return any(c.text.startswith(SYNTHETIC_LABEL) for c in self.calls)

    @property
    def slo_met(self) -> bool | None:
        return None if self.slo_s is None else self.cluster_latency_s <= self.slo_s

    def to_json(self) -> dict[str, Any]:
        return {
            "question": self.question,
            "workflow": self.workflow,
            "sql": self.sql,
            "columns": self.columns,
            "rows": [[_json_value(v) for v in row] for row in self.rows],
            "candidates": [c.to_json() for c in self.candidates],
            "stages": [s.to_json() for s in self.stages],
            "latency_s": self.latency_s,
            "cluster_latency_s": self.cluster_latency_s,
            "time_scale": self.time_scale,
            "slo_s": self.slo_s,
            "slo_met": self.slo_met,
            "deadline_s": self.deadline_s,
            "error": self.error,
            "synthetic": self.synthetic,
            "closed": self.closed,
        }


def _json_value(value: Any) -> Any:
    return value.hex() if isinstance(value, bytes) else value


def needs_revision(candidate: Candidate) -> bool:
    """A candidate that failed, or ran and found nothing."""
    return candidate.error is not None or (
        candidate.result is not None and not candidate.result.rows
    )


def vote(results: Sequence[QueryResult | None]) -> int | None:
    """The index of the chosen result: the earliest member of the largest group of equal
    result sets (`results_match`, as multisets); results with rows beat empty ones; None
    when nothing ran."""
    ran = [(i, r) for i, r in enumerate(results) if r is not None]
    pool = [(i, r) for i, r in ran if r.rows] or ran
    groups: list[list[tuple[int, QueryResult]]] = []
    for i, result in pool:
        for group in groups:
            if results_match(result, group[0][1]):
                group.append((i, result))
                break
        else:
            groups.append([(i, result)])
    if not groups:
        return None
    # max keeps the first of equal sizes: groups are in order of their earliest member
    return max(groups, key=len)[0][0]
