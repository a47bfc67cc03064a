"""Non-stationary arrivals: a schedule of phases, each with its own arrival rate and workload.

A phase runs for a duration or for a number of queries, at rate `qps` (a Gamma renewal
process, `arrival_cv` as in `SimConfig`), on the queries of one or more traces. Several
traces are interleaved in turn (one query of each), so a phase of ``trace1, trace2`` is a mix,
not one trace and then the other. Each trace is read in file order across the whole
schedule, cycling when it runs out (a repeated query gets ``<id>#<round>``, as
`take_queries` names it), so two phases of one trace never replay the same queries first.

`PhaseSchedule.build(seed)` gives every query an explicit ``arrival_s``: the simulator, the
online tuner and the benchmark read the same arrivals, and the same seed gives the same run.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from hexgen_flow.errors import ConfigError
from hexgen_flow.sim.arrivals import renewal_times
from hexgen_flow.traces import load_trace
from hexgen_flow.workload import Query

__all__ = ["Phase", "PhaseSchedule", "ScheduledRun"]


@dataclass(frozen=True, slots=True)
class Phase:
    """One stretch of steady traffic."""

    qps: float
    """Mean arrival rate, queries per second."""
    traces: tuple[str, ...]
    """Built-in trace names or files, interleaved in turn."""
    duration_s: float | None = None
    """How long the phase lasts (arrivals before its end belong to it)."""
    num_queries: int | None = None
    """How many queries it has (it ends at its last arrival). Exactly one of the two."""
    arrival_cv: float = 1.0
    """Coefficient of variation of the gaps (1 = Poisson)."""
    label: str = ""
    """How reports name it (default: rate and traces)."""

    def __post_init__(self) -> None:
        if not self.qps > 0:
            raise ConfigError(f"a phase's qps must be > 0, got {self.qps}")
        if not self.traces:
            raise ConfigError("a phase needs at least one trace")
        if (self.duration_s is None) == (self.num_queries is None):
            raise ConfigError("a phase needs either duration_s or num_queries, not both")
        if self.duration_s is not None and not 0 < self.duration_s < float("inf"):
            raise ConfigError(f"a phase's duration must be finite and > 0, got {self.duration_s}")
        if self.num_queries is not None and self.num_queries < 1:
            raise ConfigError(f"a phase's num_queries must be >= 1, got {self.num_queries}")
        if not self.arrival_cv > 0:
            raise ConfigError(f"a phase's arrival cv must be > 0, got {self.arrival_cv}")

    @property
    def name(self) -> str:
        return self.label or f"{'+'.join(self.traces)} @ {self.qps:g} q/s"


@dataclass(frozen=True, slots=True)
class ScheduledRun:
    """The queries of a schedule, with their arrivals, and where each phase lies."""

    queries: tuple[Query, ...]
    """In arrival order, each with an explicit ``arrival_s``."""
    phase_of: tuple[int, ...]
    """The phase index of each query of `queries`."""
    bounds_s: tuple[tuple[float, float], ...]
    """(start, end) of each phase, seconds."""

    @property
    def mean_qps(self) -> float:
        """Queries over the schedule's length (what a `SimConfig` of this run is labelled)."""
        return len(self.queries) / self.bounds_s[-1][1] if self.bounds_s[-1][1] > 0 else 1.0

    def phase_queries(self, phase: int) -> tuple[Query, ...]:
        return tuple(q for q, k in zip(self.queries, self.phase_of, strict=True) if k == phase)

    def phase_by_id(self) -> dict[str, int]:
        return {q.query_id: k for q, k in zip(self.queries, self.phase_of, strict=True)}


@dataclass(frozen=True, slots=True)
class PhaseSchedule:
    """Phases back to back; phase k starts where phase k - 1 ends."""

    phases: tuple[Phase, ...]

    def __post_init__(self) -> None:
        if not self.phases:
            raise ConfigError("a schedule needs at least one phase")

    def build(
        self, seed: int = 0, traces: Mapping[str, Sequence[Query]] | None = None
    ) -> ScheduledRun:
        """The run's queries with their arrivals. One generator, seeded with `seed`, draws
        every gap in phase order: same schedule and seed, same run. `traces` supplies trace
        contents by name (default: `load_trace`)."""
        rng = random.Random(seed)
        pools: dict[str, Sequence[Query]] = {}
        cursor: dict[str, int] = {}
        queries: list[Query] = []
        phase_of: list[int] = []
        bounds: list[tuple[float, float]] = []
        start = 0.0
        for k, phase in enumerate(self.phases):
            if phase.duration_s is not None:
                times = renewal_times(
                    start, phase.qps, phase.arrival_cv, rng, until_s=start + phase.duration_s
                )
                end = start + phase.duration_s
            else:
                times = renewal_times(
                    start, phase.qps, phase.arrival_cv, rng, count=phase.num_queries
                )
                end = times[-1]
            for n, t in enumerate(times):
                name = phase.traces[n % len(phase.traces)]
                if name not in pools:
                    pools[name] = traces[name] if traces is not None else load_trace(name)
                    if not pools[name]:
                        raise ConfigError(f"trace {name} holds no queries")
                pool = pools[name]
                i = cursor.get(name, 0)
                cursor[name] = i + 1
                query = pool[i % len(pool)]
                rnd = i // len(pool)
                qid = query.query_id if rnd == 0 else f"{query.query_id}#{rnd}"
                queries.append(replace(query, query_id=qid, arrival_s=t))
                phase_of.append(k)
            bounds.append((start, end))
            start = end
        if not queries:
            raise ConfigError("the schedule has no arrivals (phases too short for their rates)")
        return ScheduledRun(tuple(queries), tuple(phase_of), tuple(bounds))
