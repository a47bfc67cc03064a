"""The discrete-event simulator end to end: determinism, completion, DAG dependencies and
parallelism checked against latencies computed by hand on idle clusters, arrivals."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from typing import Any

import pytest

from hexgen_flow.cluster import Cluster, parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.latency import latency_model
from hexgen_flow.metrics import RunMetrics
from hexgen_flow.policies.presets import PRESETS, Preset
from hexgen_flow.sim.arrivals import gamma_arrivals
from hexgen_flow.sim.simulator import SimConfig, Simulation, simulate
from hexgen_flow.traces import load_trace
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow

MODEL = "llama-3.1-70b"
TRACE1 = load_trace("trace1")
DEFAULT = parse_cluster("A100,A100,A6000,L40S")
VLLM = PRESETS["vllm"]
EXACT = "prefill-first"
"""The engine model these hand-computed latencies hold for exactly: a call alone takes its
single-request latency (vllm-v1's steps come within a few per cent of it, which
tests/test_vllm_v1_engine.py checks)."""

BIG = LLMCall("generate_candidate", 11748, 678)
REVISE = LLMCall("revise", 5963, 79)
SMALL = LLMCall("information_retriever", 308, 5)
EVAL = LLMCall("evaluate", 961, 22)
KEYS = LLMCall("extract_keywords", 667, 45)


def _single(call: LLMCall, gpu: str = "A100") -> float:
    return latency_model(MODEL, gpu).single_s(call.input_tokens, call.output_tokens)


def _latencies(metrics: RunMetrics) -> dict[str, float]:
    return {o.query_id: o.latency_s for o in metrics.outcomes}


def _one(query: Query, cluster: Cluster, preset: Preset = VLLM) -> float:
    metrics = simulate([query], cluster, preset, SimConfig(engine=EXACT, qps=1.0))
    assert metrics.completed == 1
    return metrics.outcomes[0].latency_s


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("name", ["hexgen-flow-paper", "hexgen-flow", "ray-serve"])
def test_same_seed_same_run_byte_for_byte(name: str) -> None:
    queries = TRACE1[:20]
    runs = [
        simulate(queries, DEFAULT, PRESETS[name], SimConfig(engine=EXACT, qps=1.0, seed=s))
        for s in (3, 3, 4)
    ]
    assert _latencies(runs[0]) == _latencies(runs[1])
    assert json.dumps(runs[0].to_json()) == json.dumps(runs[1].to_json())
    assert _latencies(runs[0]) != _latencies(runs[2])
    assert json.dumps(runs[0].to_json()) != json.dumps(runs[2].to_json())


# --------------------------------------------------------------------------- completion


def _critical_path_floor(query: Query, cluster: Cluster) -> float:
    """A lower bound on a query's latency: along the workflow's longest path, every call
    takes at least its single-request latency on the fastest instance that can hold it
    (batching only slows decode down, queueing only adds)."""
    stages = query.workflow.stages
    finish: list[float] = []
    for stage in stages:
        own = max(
            min(
                inst.latency.single_s(c.input_tokens, c.output_tokens)
                for inst in cluster.instances
                if c.input_tokens + c.output_tokens <= inst.kv_cache_tokens
            )
            for c in stage.calls
        )
        finish.append(own + max((finish[j] for j in stage.after), default=0.0))
    return max(finish)


CLUSTERS = {
    "default": DEFAULT,
    # a small-KV baseline: candidates must go elsewhere, short calls may not
    "small-kv": Cluster.build(
        [{"gpu": "A100", "kv_cache_tokens": 6000}, {"gpu": "A6000"}, {"gpu": "L40S"}],
        "small-kv",
    ),
}


@pytest.mark.parametrize("cluster_name", sorted(CLUSTERS))
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_query_completes_no_faster_than_its_critical_path(
    name: str, cluster_name: str
) -> None:
    cluster = CLUSTERS[cluster_name]
    queries = TRACE1[:15]
    metrics = simulate(queries, cluster, PRESETS[name], SimConfig(engine=EXACT, qps=1.0, seed=2))
    assert metrics.completed == metrics.num_queries == len(queries)
    assert sorted(o.query_id for o in metrics.outcomes) == sorted(q.query_id for q in queries)
    by_id = {q.query_id: q for q in queries}
    for o in metrics.outcomes:
        floor = _critical_path_floor(by_id[o.query_id], cluster)
        assert o.latency_s >= floor * (1 - 1e-9), o.query_id
    assert all(math.isfinite(x) for x in metrics.latencies)


# --------------------------------------------------------------------------- by hand


def test_chain_on_one_instance_takes_the_sum_of_single_latencies() -> None:
    # If stage 2 started before stage 1 finished the two would share the GPU and the
    # query would finish sooner than the sum.
    query = Query("chain", Workflow.chain([(REVISE,), (BIG,)]), arrival_s=0.0)
    got = _one(query, parse_cluster("A100"))
    assert got == pytest.approx(_single(REVISE) + _single(BIG), rel=1e-9)


@pytest.mark.parametrize("name", ["vllm", "hexgen-flow-paper", "hexgen-flow", "llf", "qlm"])
def test_chain_latency_does_not_depend_on_the_policy_when_alone(name: str) -> None:
    query = Query("chain", Workflow.chain([(SMALL,), (KEYS,), (REVISE,), (EVAL,)]))
    expected = sum(_single(c) for c in (SMALL, KEYS, REVISE, EVAL))
    assert _one(query, parse_cluster("A100"), PRESETS[name]) == pytest.approx(expected, rel=1e-9)


def test_fan_out_on_two_instances_runs_in_parallel() -> None:
    query = Query("fan", Workflow.chain([(BIG, BIG), (EVAL,)]))
    got = _one(query, parse_cluster("A100,A100"))
    assert got == pytest.approx(_single(BIG) + _single(EVAL), rel=1e-9)


def test_fan_out_on_one_instance_is_batched() -> None:
    # Both prefills run back to back, then both calls decode together at slowdown(2).
    query = Query("fan", Workflow.chain([(BIG, BIG)]))
    lat = latency_model(MODEL, "A100")
    prefill, decode = lat.split(BIG.input_tokens, BIG.output_tokens)
    got = _one(query, parse_cluster("A100"))
    assert got == pytest.approx(2 * prefill + decode * lat.slowdown(2), rel=1e-9)
    assert _single(BIG) < got < 2 * _single(BIG)


def test_diamond_join_waits_for_the_slower_branch() -> None:
    query = Query(
        "diamond",
        Workflow(
            (
                Stage("information_retriever", (SMALL,)),
                Stage("generate_candidate", (BIG,), (0,)),
                Stage("revise", (REVISE,), (0,)),
                Stage("evaluate", (EVAL,), (1, 2)),
            )
        ),
    )
    expected = _single(SMALL) + max(_single(BIG), _single(REVISE)) + _single(EVAL)
    assert _one(query, parse_cluster("A100x4")) == pytest.approx(expected, rel=1e-9)


def test_explicit_arrivals_are_honoured() -> None:
    chain = Workflow.chain([(SMALL,)])
    queries = [
        Query("a", chain, arrival_s=3.5),
        Query("b", chain),
        Query("c", chain, arrival_s=100.0),
        Query("d", chain),
    ]
    config = SimConfig(engine=EXACT, qps=2.0, seed=9)
    process = gamma_arrivals(4, 2.0, 1.0, random.Random(9))
    metrics = simulate(queries, parse_cluster("A100x4"), VLLM, config)
    arrivals = {o.query_id: o.arrival_s for o in metrics.outcomes}
    assert arrivals == {"a": 3.5, "b": process[1], "c": 100.0, "d": process[3]}
    # Idle cluster: each query takes exactly its call's latency, whenever it arrives.
    for o in metrics.outcomes:
        assert o.latency_s == pytest.approx(_single(SMALL), rel=1e-9)
    assert [o.query_id for o in metrics.outcomes] == sorted(arrivals, key=arrivals.__getitem__)


def test_query_slo_overrides_are_honoured() -> None:
    chain = Workflow.chain([(SMALL,)])
    queries = [
        Query("own", chain, slo_s=0.01),
        Query("scaled", chain, slo_scale=2.0),
        Query("run", chain),
    ]
    sim = Simulation(queries, DEFAULT, VLLM, SimConfig(engine=EXACT, qps=1.0, slo_scale=3.0))
    metrics = sim.run()
    slos = {o.query_id: o.slo_s for o in metrics.outcomes}
    assert slos["own"] == 0.01
    assert slos["scaled"] == pytest.approx(2.0 * sim.slo_base_s)
    assert slos["run"] == pytest.approx(3.0 * sim.slo_base_s) == metrics.slo_s
    met = {o.query_id: o.met_slo for o in metrics.outcomes}
    assert met == {"own": False, "scaled": True, "run": True}
    assert metrics.slo_attainment == pytest.approx(2 / 3)


# --------------------------------------------------------------------------- rejections


def test_call_too_large_for_every_kv_cache_is_rejected_at_construction() -> None:
    cluster = Cluster.build(
        [{"gpu": "A100", "kv_cache_tokens": 10_000}, {"gpu": "L40S", "kv_cache_tokens": 12_000}],
        "tiny",
    )
    query = Query("big", Workflow.chain([(SMALL,), (BIG,)]))
    with pytest.raises(ConfigError, match="fits no instance"):
        Simulation([query], cluster, VLLM, SimConfig(engine=EXACT, qps=1.0))
    # 12,426 tokens: one more slot on the larger instance and it fits.
    roomy = Cluster.build(
        [{"gpu": "A100", "kv_cache_tokens": 10_000}, {"gpu": "L40S", "kv_cache_tokens": 12_426}],
        "roomy",
    )
    assert simulate([query], roomy, VLLM, SimConfig(engine=EXACT, qps=1.0)).completed == 1


def test_no_queries_is_rejected() -> None:
    with pytest.raises(ConfigError):
        Simulation([], DEFAULT, VLLM, SimConfig(engine=EXACT, qps=1.0))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"qps": 0.0},
        {"qps": -1.0},
        {"qps": math.nan},
        {"qps": 1.0, "slo_scale": 0.0},
        {"qps": 1.0, "arrival_cv": 0.0},
        {"qps": 1.0, "arrival_cv": -2.0},
    ],
)
def test_sim_config_rejects_non_positive_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        SimConfig(**kwargs)


# --------------------------------------------------------------------------- arrivals


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0])
def test_gamma_arrivals_have_the_requested_rate_and_cv(cv: float) -> None:
    qps = 2.0
    times = gamma_arrivals(20_001, qps, cv, random.Random(0))
    assert len(times) == 20_001
    assert times[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 0.0
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / qps, rel=0.05)
    assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.06)


def test_gamma_arrivals_reject_bad_settings() -> None:
    with pytest.raises(ConfigError):
        gamma_arrivals(5, 0.0, 1.0, random.Random(0))
    with pytest.raises(ConfigError):
        gamma_arrivals(5, 1.0, 0.0, random.Random(0))
