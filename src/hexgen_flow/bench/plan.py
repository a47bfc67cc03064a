"""What the benchmark runs: the plan (`BenchPlan`), its full and quick instances, and the
list of pool tasks a plan expands to."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hexgen_flow.calibration import DEFAULT_CALIBRATION
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.sim.engines import DEFAULT_ENGINE_MODEL

__all__ = [
    "BAND_PRESETS",
    "BASELINE",
    "FLAGSHIP",
    "FULL_PLAN",
    "LOAD_AWARE",
    "NEAR_BEST",
    "OPTIONAL_PARTS",
    "QUICK_PLAN",
    "TENANTS",
    "BenchPlan",
    "Task",
    "plan_tasks",
    "saturation",
]

BASELINE = "vllm"
"""The preset every speedup and goodput ratio is measured against."""
FLAGSHIP = "hexgen-flow"
"""The preset the summary is about."""
LOAD_AWARE: tuple[str, ...] = (
    "ray-serve",
    "least-requests",
    "least-work",
    "llf",
    "llm-d",
    "dynamo",
    "llm-d-predicted",
    "autellix",
)
"""The load-aware router presets: the routers people run instead of round-robin. Every
ratio over `BASELINE` is reported beside the ratio over the best of these in the plan (per
matrix row the lowest P95, per goodput trace the highest goodput)."""
NEAR_BEST = 0.02
"""`FLAGSHIP` counts as tied with the best preset when its P95 is within this fraction."""
TENANTS: tuple[tuple[str, float], ...] = (("strict", 1.0), ("relaxed", 2.0))
"""Multi-tenant run: (tenant, SLO scale), assigned to the queries alternately."""
BAND_PRESETS: tuple[str, ...] = (BASELINE, *LOAD_AWARE, FLAGSHIP)
"""What the sensitivity band (bench/band.py) runs: the flagship and both kinds of baseline."""
OPTIONAL_PARTS = (
    "band",
    "slo_sweep",
    "load_sweep",
    "multi_tenant",
    "simulator_speed",
    "shifting_load",
)
"""The parts a plan may leave out, by their key in results.json. The matrix and goodput are
always run: the headline and the README's figures come from them."""


@dataclass(frozen=True, slots=True)
class BenchPlan:
    """What the benchmark runs. Every field has the full benchmark's value as default."""

    name: str = "full"
    presets: tuple[str, ...] = tuple(PRESETS)
    """Presets compared everywhere; must include `BASELINE`."""
    traces: tuple[str, ...] = ("trace1", "trace2", "trace3")
    clusters: tuple[tuple[str, str], ...] = (
        ("x1", "A100,A100,A6000,L40S"),
        ("x2", "A100,A100,A6000,L40S,A100,A100,A6000,L40S"),
    )
    """(label, cluster spec); the first is the cluster of the goodput and sweep parts."""
    calibration: str = DEFAULT_CALIBRATION
    """Where every simulation's latency numbers come from (``--calibration``)."""
    planner_calibration: str | None = None
    """What every policy, the α tuner and admission believe (``--planner-calibration``);
    None: each simulation's own calibration (an exact planner)."""
    planner_error: tuple[tuple[str, float, float], ...] = ()
    """(GPU type, prefill factor, decode factor) the planner misjudges (``--planner-error``)."""
    learn_costs: bool = False
    """Whether the scheduler learns each instance's costs online (``--learn-costs``)."""
    output_lengths: str = "known"
    """What the scheduler knows of output lengths (``--output-lengths``:
    `hexgen_flow.lengths.OutputLengths`)."""
    engine: str = DEFAULT_ENGINE_MODEL
    """The simulated engine model of every instance (``--engine``)."""
    prefix_caching: bool = True
    """Prefix caching in that engine model: on, as vLLM V1 serves by default
    (``--no-prefix-caching`` turns it off; the band runs both)."""
    qps: tuple[float, ...] = (0.5, 1.0)
    """Arrival rates of the matrix (queries/s)."""
    seed: int = 0
    slo_scale: float = 3.0
    arrival_cv: float = 1.0
    goodput_presets: tuple[str, ...] | None = None
    """Presets of the goodput part (a subset of `presets` that includes `BASELINE`); None:
    all of `presets`. The goodput searches are the slowest tasks by far."""
    goodput_queries: int = 1000
    goodput_target: float = 0.95
    """Share of queries that must meet the SLO."""
    goodput_max_qps: float = 2.0
    goodput_resolution: float = 0.005
    parts: tuple[str, ...] = OPTIONAL_PARTS
    """Which of `OPTIONAL_PARTS` to run besides the matrix and goodput."""
    sweep_trace: str = "trace3"
    slo_sweep_scales: tuple[float, ...] = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0)
    slo_sweep_queries: int = 1000
    slo_sweep_qps: float = 0.15
    load_sweep_qps: tuple[float, ...] = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
    load_sweep_queries: int = 500
    tenant_queries: int = 1000
    tenant_qps: float = 0.15
    speed_queries: int = 2000
    speed_qps: float = 0.5
    speed_alpha: float = 0.5
    band_calibrations: tuple[str, ...] = ("aiconfigurator", "chess-measured")
    """The sensitivity band's calibrations (besides `calibration`, which comes first)."""
    band_prefix_caching: tuple[bool, ...] = (True, False)
    """The band's engine settings: prefix caching on and off (besides `prefix_caching`,
    which comes first; an engine model without a prefix cache runs off only)."""
    band_seeds: tuple[int, ...] = (0, 1, 2)
    band_clusters: tuple[tuple[str, str], ...] = (
        ("x1", "A100,A100,A6000,L40S"),
        ("x2", "A100,A100,A6000,L40S,A100,A100,A6000,L40S"),
        ("H100x4", "H100,H100,H100,H100"),
        ("A100x4", "A100,A100,A100,A100"),
    )
    """(label, cluster spec) of the band: the matrix's clusters and homogeneous ones."""

    def __post_init__(self) -> None:
        if BASELINE not in self.presets:
            raise ValueError(f"a bench plan must include the {BASELINE!r} preset")
        if self.goodput_presets is not None and (
            BASELINE not in self.goodput_presets
            or not set(self.goodput_presets) <= set(self.presets)
        ):
            raise ValueError(
                f"goodput_presets must be a subset of presets that includes {BASELINE!r}"
            )
        unknown = set(self.parts) - set(OPTIONAL_PARTS)
        if unknown:
            raise ValueError(f"unknown bench parts {sorted(unknown)}; known: {OPTIONAL_PARTS}")

    @property
    def runs_band(self) -> bool:
        """Whether the band runs: asked for, and a load-aware router to measure against."""
        return "band" in self.parts and any(p in LOAD_AWARE for p in self.presets)

    @property
    def band_calibration_list(self) -> tuple[str, ...]:
        """`calibration`, then the other `band_calibrations`, each once."""
        return tuple(dict.fromkeys((self.calibration, *self.band_calibrations)))

    @property
    def band_caching_list(self) -> tuple[bool, ...]:
        """`prefix_caching`, then the other `band_prefix_caching`, each once; only off when
        the engine model has no prefix cache."""
        if self.engine != "vllm-v1":
            return (False,)
        return tuple(dict.fromkeys((self.prefix_caching, *self.band_prefix_caching)))

    @property
    def goodput_policies(self) -> tuple[str, ...]:
        """The presets of the goodput part, in `presets` order."""
        chosen = self.presets if self.goodput_presets is None else self.goodput_presets
        return tuple(p for p in self.presets if p in chosen)


FULL_PLAN = BenchPlan()
QUICK_PLAN = BenchPlan(
    name="quick",
    presets=(FLAGSHIP, "llf", BASELINE, "least-requests"),
    traces=("trace1",),
    clusters=(("x1", "A100,A100,A6000,L40S"),),
    qps=(0.5,),
    goodput_queries=200,
    goodput_resolution=0.02,
    slo_sweep_scales=(1.0, 3.0),
    slo_sweep_queries=100,
    load_sweep_qps=(0.1, 0.5),
    load_sweep_queries=100,
    tenant_queries=100,
    speed_queries=300,
    band_seeds=(0, 1),
    band_clusters=(("x1", "A100,A100,A6000,L40S"), ("H100x4", "H100,H100,H100,H100")),
    # The shifting-load scenarios run their own phases for minutes even when small; their
    # smoke run is tests/test_shifting_load.py's.
    parts=tuple(p for p in OPTIONAL_PARTS if p != "shifting_load"),
)


@dataclass(frozen=True, slots=True)
class Task:
    """One unit of work for a pool worker: a pure function of its fields."""

    kind: str
    """"run" (one simulation, alpha auto-tuned first if the preset has one) or "goodput"."""
    key: tuple[Any, ...]
    """Where the result goes: (part, ...)."""
    trace: str
    cluster: str
    preset: str
    qps: float
    num_queries: int | None
    seed: int
    slo_scale: float
    arrival_cv: float
    tenants: bool = False
    """Assign `TENANTS` to the queries alternately."""
    calibration: str = DEFAULT_CALIBRATION
    """The cluster's latency calibration (what the engines run)."""
    planner_calibration: str | None = None
    """What the planner believes (None: `calibration`)."""
    planner_error: tuple[tuple[str, float, float], ...] = ()
    """(GPU type, prefill factor, decode factor) the planner misjudges."""
    learn_costs: bool = False
    output_lengths: str = "known"
    engine: str = DEFAULT_ENGINE_MODEL
    prefix_caching: bool = False
    goodput: tuple[float, float, float] = (0.95, 2.0, 0.005)
    """(target attainment, highest rate, resolution) of a goodput search."""


def saturation(goodput: Mapping[str, float]) -> tuple[str, float]:
    """A cluster's saturation rate for a workload: the highest goodput (q/s) among the
    `LOAD_AWARE` routers of `goodput` (each searched preset's goodput), the rate past which
    the routers people run stop keeping their SLOs, and the router that has it (on a tie,
    the first in `goodput`). Loads are stated as fractions of it, where a rate in q/s would
    mean another load on every cluster. ValueError if `goodput` has no load-aware router."""
    routers = [p for p in goodput if p in LOAD_AWARE]
    if not routers:
        raise ValueError(f"no load-aware router among {sorted(goodput)}")
    best = max(routers, key=goodput.__getitem__)
    return best, goodput[best]


def plan_tasks(plan: BenchPlan) -> list[Task]:
    """Every task of `plan`, the slow goodput searches first (better packing in the pool)."""
    x1 = plan.clusters[0][1]
    tasks: list[Task] = []

    def add(
        kind: str,
        key: tuple[Any, ...],
        *,
        preset: str,
        qps: float,
        num_queries: int | None,
        trace: str = plan.sweep_trace,
        cluster: str = x1,
        slo_scale: float = plan.slo_scale,
        tenants: bool = False,
        seed: int = plan.seed,
        calibration: str = plan.calibration,
        prefix_caching: bool = plan.prefix_caching,
    ) -> None:
        tasks.append(
            Task(
                kind,
                key,
                trace,
                cluster,
                preset,
                qps,
                num_queries,
                seed=seed,
                slo_scale=slo_scale,
                arrival_cv=plan.arrival_cv,
                tenants=tenants,
                goodput=(plan.goodput_target, plan.goodput_max_qps, plan.goodput_resolution),
                calibration=calibration,
                planner_calibration=plan.planner_calibration,
                planner_error=plan.planner_error,
                learn_costs=plan.learn_costs,
                output_lengths=plan.output_lengths,
                engine=plan.engine,
                prefix_caching=prefix_caching,
            )
        )

    for trace in plan.traces:
        for preset in plan.goodput_policies:
            add(
                "goodput",
                ("goodput", trace, preset),
                preset=preset,
                trace=trace,
                qps=plan.goodput_max_qps,
                num_queries=plan.goodput_queries,
            )
    for label, spec in plan.clusters:
        for trace in plan.traces:
            for qps in plan.qps:
                for preset in plan.presets:
                    add(
                        "run",
                        ("matrix", label, trace, qps, preset),
                        preset=preset,
                        trace=trace,
                        cluster=spec,
                        qps=qps,
                        num_queries=None,
                    )
    if plan.runs_band:
        band_presets = [p for p in BAND_PRESETS if p in plan.presets]
        for calibration, caching, seed, (label, spec), trace, qps, preset in itertools.product(
            plan.band_calibration_list,
            plan.band_caching_list,
            plan.band_seeds,
            plan.band_clusters,
            plan.traces,
            plan.qps,
            band_presets,
        ):
            add(
                "run",
                ("band", calibration, caching, seed, label, trace, qps, preset),
                preset=preset,
                trace=trace,
                cluster=spec,
                qps=qps,
                num_queries=None,
                seed=seed,
                calibration=calibration,
                prefix_caching=caching,
            )
    for preset in plan.presets:
        if "slo_sweep" in plan.parts:
            for scale in plan.slo_sweep_scales:
                add(
                    "run",
                    ("slo", preset, scale),
                    preset=preset,
                    qps=plan.slo_sweep_qps,
                    num_queries=plan.slo_sweep_queries,
                    slo_scale=scale,
                )
        if "load_sweep" in plan.parts:
            for qps in plan.load_sweep_qps:
                add(
                    "run",
                    ("load", preset, qps),
                    preset=preset,
                    qps=qps,
                    num_queries=plan.load_sweep_queries,
                )
        if "multi_tenant" in plan.parts:
            add(
                "run",
                ("tenant", preset),
                preset=preset,
                qps=plan.tenant_qps,
                num_queries=plan.tenant_queries,
                tenants=True,
            )
    return tasks
