"""What `real_engine_replay.py` measures and predicts of a run, and how it reports them: the
calls' times, the figures held to the bound, the side-by-side table, and runs kept as JSON
for ``--predict-from``."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hexgen_flow.metrics import percentile
from hexgen_flow.workload import Query

__all__ = [
    "HEADLINE",
    "LABELS",
    "CallTimes",
    "RunResult",
    "dump_calls",
    "errors",
    "figures",
    "load_measured",
    "save_measured",
    "table",
]

HEADLINE = ("call_p50_s", "call_p95_s", "workflow_p95_s")
"""The figures the prediction is held to (docs/real-engines.md, "Predicted vs measured")."""
LABELS = {
    "call_p50_s": "per-call latency P50 (s)",
    "call_p95_s": "per-call latency P95 (s)",
    "workflow_p95_s": "workflow latency P95 (s)",
    "workflow_p50_s": "  workflow latency P50 (s)",
    "call_mean_s": "  per-call latency mean (s)",
    "service_p50_s": "  per-call service P50 (s)",
    "service_p95_s": "  per-call service P95 (s)",
    "wait_p95_s": "  per-call wait P95 (s)",
    "makespan_s": "  makespan (s)",
}
"""Row labels; indented rows are context, not held to the bound."""


@dataclasses.dataclass(frozen=True, slots=True)
class CallTimes:
    """One call's times (cluster seconds): released (dispatched), started, finished."""

    call_id: str
    released_s: float
    started_s: float
    finished_s: float

    @property
    def latency_s(self) -> float:
        return self.finished_s - self.released_s


@dataclasses.dataclass(frozen=True, slots=True)
class RunResult:
    """What one side (measured or predicted) saw of a run."""

    workflow_s: tuple[float, ...]
    """End-to-end latency of every workflow."""
    calls: tuple[CallTimes, ...]
    makespan_s: float
    arrivals: dict[str, float]
    """query id -> arrival time (s from the first arrival)."""
    cpu: dict[str, float] = dataclasses.field(default_factory=dict)
    """Where the machine's CPU went during a measured replay: seconds of wall time; CPU
    seconds of the vLLM servers, and seconds their threads were ready to run but waited
    for a core; CPU seconds of the mesh (coordinator, workers, this process); the load
    average before and after (empty for a prediction)."""
    met_slo: tuple[bool, ...] = ()
    """Whether each workflow finished within its SLO (in `workflow_s`'s order)."""

    @property
    def attainment(self) -> float:
        """Share of the workflows that finished within their SLO."""
        return sum(self.met_slo) / len(self.met_slo) if self.met_slo else math.nan


def figures(result: RunResult) -> dict[str, float]:
    """The compared figures of a run."""
    calls = [c.latency_s for c in result.calls]
    service = [c.finished_s - c.started_s for c in result.calls]
    wait = [c.started_s - c.released_s for c in result.calls]
    return {
        "call_p50_s": percentile(calls, 50),
        "call_p95_s": percentile(calls, 95),
        "workflow_p95_s": percentile(result.workflow_s, 95),
        "workflow_p50_s": percentile(result.workflow_s, 50),
        "call_mean_s": sum(calls) / len(calls) if calls else math.nan,
        "service_p50_s": percentile(service, 50),
        "service_p95_s": percentile(service, 95),
        "wait_p95_s": percentile(wait, 95),
        "makespan_s": result.makespan_s,
    }


def dump_calls(
    path: Path, queries: Sequence[Query], measured: RunResult, predicted: RunResult
) -> None:
    """Every call's tokens and times, measured and predicted, as JSON lines (--out-dir)."""
    tokens = {
        f"{q.query_id}/{k}.{i}": (call.step, call.input_tokens, call.output_tokens)
        for q in queries
        for k, stage in enumerate(q.workflow.stages)
        for i, call in enumerate(stage.calls)
    }
    simulated = {c.call_id: c for c in predicted.calls}
    with path.open("w") as out:
        for m in sorted(measured.calls, key=lambda c: c.released_s):
            p = simulated.get(m.call_id)
            step, n_in, n_out = tokens[m.call_id]
            row = {"call_id": m.call_id, "step": step, "input_tokens": n_in,
                   "output_tokens": n_out, "measured": dataclasses.astuple(m)[1:],
                   "predicted": dataclasses.astuple(p)[1:] if p else None}  # fmt: skip
            out.write(json.dumps(row) + "\n")


def errors(measured: dict[str, float], predicted: dict[str, float]) -> dict[str, float]:
    """predicted / measured - 1 per figure."""
    return {k: predicted[k] / measured[k] - 1 if measured[k] > 0 else math.nan for k in measured}


def table(run: dict[str, Any]) -> list[str]:
    rows = [("figure", "measured", "predicted", "error")]
    for key, label in LABELS.items():
        m, p, e = run["measured"][key], run["predicted"][key], run["error"][key]
        rows.append(
            (label, f"{m:.3f}", f"{p:.3f}", f"{100 * e:+.1f} %" if math.isfinite(e) else "-")
        )
    return aligned(rows)


def aligned(rows: Sequence[Sequence[str]]) -> list[str]:
    """`rows` (the header first) as text lines: the first column left-aligned, the others
    right-aligned, each as wide as its widest cell."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return [
        "  ".join([r[0].ljust(widths[0]), *(r[c].rjust(widths[c]) for c in range(1, len(r)))])
        for r in rows
    ]


def save_measured(path: Path, n: int, qps: float, result: RunResult) -> None:
    """A measured run as JSON, for `--predict-from`."""
    doc = {
        "instances": n,
        "qps": qps,
        "workflow_s": result.workflow_s,
        "calls": [dataclasses.astuple(c) for c in result.calls],
        "makespan_s": result.makespan_s,
        "arrivals": result.arrivals,
        "cpu": result.cpu,
        "met_slo": result.met_slo,
    }
    path.write_text(json.dumps(doc))


def load_measured(path: Path) -> tuple[int, float, RunResult]:
    doc = json.loads(path.read_text())
    result = RunResult(
        workflow_s=tuple(doc["workflow_s"]),
        calls=tuple(CallTimes(*row) for row in doc["calls"]),
        makespan_s=doc["makespan_s"],
        arrivals=doc["arrivals"],
        cpu=doc.get("cpu", {}),
        met_slo=tuple(doc.get("met_slo", ())),
    )
    return doc["instances"], doc["qps"], result
