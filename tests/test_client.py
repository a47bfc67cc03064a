"""The Python client's conversions (submissions, the arrival schedule, metrics from the
coordinator's answers, the coordinator's cluster for the simulator), its renderings, and
its errors against a real address where nothing listens."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_client.client import CoordinatorClient
from hexgen_client.convert import submit_request
from hexgen_client.errors import CoordinatorUnavailableError
from hexgen_client.report import event_line, status_json, status_lines
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError, WorkloadError
from hexgen_flow.metrics import QueryOutcome
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.traces import load_trace, take_queries
from hexgen_launch.measure import (
    arrival_schedule,
    default_slo_s,
    outcome_from_info,
    policy_alpha,
    run_metrics,
)
from hexgen_launch.processes import free_port
from hexgen_launch.replay import replay
from hexgen_service.convert import query_from_submit
from hexgen_service.status import cluster_from_status, preset_from_status

TRACE = load_trace("trace1")


# ------------------------------------------------------------------------- submissions


def test_submission_round_trips_to_the_same_query() -> None:
    query = replace(TRACE[5], tenant="acme")
    back = query_from_submit(submit_request(query))
    assert back == query
    assert submit_request(query).slo_scale == 0.0  # the coordinator's default scale


def test_slo_scale_applies_only_to_queries_without_an_slo() -> None:
    assert submit_request(TRACE[0], 2.5).slo_scale == 2.5
    own_slo = submit_request(replace(TRACE[0], slo_s=90.0), 2.5)
    assert (own_slo.slo_s, own_slo.slo_scale) == (90.0, 0.0)
    own_scale = submit_request(replace(TRACE[0], slo_scale=4.0), 2.5)
    assert own_scale.slo_scale == 4.0


def test_prompts_go_to_their_calls_and_must_fit_the_workflow() -> None:
    query = TRACE[0]
    shape = [len(stage.calls) for stage in query.workflow.stages]
    prompts = [[f"stage {k} call {c}" for c in range(n)] for k, n in enumerate(shape)]
    request = submit_request(query, prompts=prompts)
    sent = [[call.prompt for call in stage.calls] for stage in request.workflow.stages]
    assert sent == prompts
    assert query_from_submit(request) == query  # prompts change nothing else
    assert all(not c.prompt for s in submit_request(query).workflow.stages for c in s.calls)
    with pytest.raises(WorkloadError, match="one per call of each stage"):
        submit_request(query, prompts=[*prompts, ["one too many"]])


def test_arrival_schedule_is_the_simulators_for_the_same_seed() -> None:
    queries = take_queries(TRACE, 120)  # cycles: ids trace1-N#1 for the second round
    schedule = arrival_schedule(queries, qps=0.8, arrival_cv=2.0, seed=7)
    sim = Simulation(
        queries,
        parse_cluster("A100,A100,A6000,L40S"),
        resolve_policy("vllm"),
        SimConfig(qps=0.8, seed=7, arrival_cv=2.0),
    )
    metrics = sim.run()
    assert [(o.arrival_s, o.query_id) for o in metrics.outcomes] == [
        (t, queries[i].query_id) for t, i in schedule
    ]
    assert schedule[0][0] == 0.0
    # Explicit arrival times are kept, as the simulator keeps them.
    timed = [replace(q, arrival_s=5.0 * n) for n, q in enumerate(TRACE[:3])]
    assert arrival_schedule(timed, qps=100.0) == [(0.0, 0), (5.0, 1), (10.0, 2)]


# ------------------------------------------------------------------------------ metrics


def _info(query_id: str, state: int, arrival: float, finished: float) -> cpb.QueryInfo:
    return cpb.QueryInfo(
        query_id=query_id,
        tenant="",
        state=state,  # type: ignore[arg-type]  # test data
        arrival_s=arrival,
        finished_s=finished,
        slo_s=100.0,
    )


def test_metrics_come_from_the_coordinators_times() -> None:
    infos = [
        _info("b", cpb.QUERY_STATE_SUCCEEDED, 10.0, 60.0),
        _info("a", cpb.QUERY_STATE_SUCCEEDED, 10.0, 150.0),
        _info("c", cpb.QUERY_STATE_CANCELLED, 12.0, 13.0),
        _info("d", cpb.QUERY_STATE_SUCCEEDED, 0.0, 90.0),
    ]
    assert outcome_from_info(infos[0]) == QueryOutcome("b", "default", 10.0, 60.0, 100.0)
    assert outcome_from_info(infos[2]) is None
    metrics = run_metrics(
        infos, policy="hexgen-flow", alpha=0.5, qps=1.0, num_queries=4, slo_s=100.0
    )
    assert [o.query_id for o in metrics.outcomes] == ["d", "a", "b"]  # simulator's order
    assert metrics.completed == 3 and metrics.num_queries == 4
    assert metrics.slo_attainment == pytest.approx(2 / 4)  # a missed, c never finished
    assert metrics.makespan_s == 150.0
    assert metrics.latency_summary()["p50"] == 90.0
    assert metrics.to_json()["alpha"] == 0.5


def test_run_slo_is_the_one_given_to_queries_without_their_own() -> None:
    queries = [replace(TRACE[0], slo_s=30.0), TRACE[1]]
    infos = [
        cpb.QueryInfo(query_id=TRACE[0].query_id, slo_s=30.0),
        cpb.QueryInfo(query_id=TRACE[1].query_id, slo_s=176.7),
    ]
    assert default_slo_s(queries, infos) == 176.7
    assert math.isnan(default_slo_s(queries[:1], infos[:1]))


def test_policy_alpha_is_reported_as_simulate_reports_it() -> None:
    assert policy_alpha("hexgen-flow", 0.4) == 0.4
    assert policy_alpha("vllm", 0.4) is None
    assert policy_alpha("some-future-policy", 0.4) == 0.4


# ----------------------------------------------------------------- the coordinator's cluster


def _status() -> cpb.ClusterStatusResponse:
    return cpb.ClusterStatusResponse(
        instances=[
            cpb.InstanceStatus(
                index=1,
                name="L40S#1",
                gpu="L40S",
                model="llama-3.1-70b",
                connected=False,
                engine="ENGINE_KIND_SIMULATED",
            ),
            cpb.InstanceStatus(
                index=0,
                name="A100#0",
                gpu="A100",
                model="llama-3.1-70b",
                worker_id="w0",
                connected=True,
                engine="ENGINE_KIND_SIMULATED",
                in_flight=3,
                kv_used_tokens=25_000,
                kv_capacity_tokens=100_000,
                outstanding_s=12.5,
            ),
        ],
        policy="hexgen-flow",
        alpha=0.3,
        time_scale=20.0,
        now_s=1234.5,
        slo_base_s=58.9,
        queries_running=2,
        queries_finished=7,
    )


def test_cluster_and_preset_from_status() -> None:
    cluster = cluster_from_status(_status())
    assert cluster.gpus == ("A100", "L40S")
    assert cluster.instances[0].kv_cache_tokens == 100_000  # as the coordinator reports it
    default = parse_cluster("L40S").instances[0].kv_cache_tokens
    assert cluster.instances[1].kv_cache_tokens == default
    preset = preset_from_status(_status())
    assert preset.name == "hexgen-flow" and preset.alpha == 0.3


def test_status_renderings() -> None:
    lines = status_lines(_status(), "127.0.0.1:50051")
    assert lines[1] == "policy       hexgen-flow (alpha 0.3)"
    table = lines[lines.index("") + 1 :]
    assert table[0].split() == [
        "slot",
        "instance",
        "model",
        "engine",
        "worker",
        "in-flight",
        "running",
        "queued",
        "KV",
        "used",
        "outstanding",
    ]
    assert table[1].split()[:5] == ["0", "A100#0", "llama-3.1-70b", "simulated", "w0"]
    assert table[1].endswith("25 %       12.5 s")
    assert "(not connected)" in table[2]
    doc = status_json(_status())
    assert doc["queries_finished"] == 7 and doc["instances"][1]["kv_used_tokens"] == 25_000


def test_event_line() -> None:
    event = cpb.QueryEvent(
        query_id="q",
        kind=cpb.QUERY_EVENT_KIND_CALL_FINISHED,
        time_s=12.345,
        stage=3,
        call_id="q/3.0",
        instance="A100#0",
        text="SELECT  name\nFROM t " + "x" * 100,
    )
    line = event_line(event)
    assert line.startswith(
        "     12.35 s  CALL_FINISHED       stage 3    q/3.0  on A100#0  'SELECT name"
    )
    assert line.endswith("…'")
    submitted = cpb.QueryEvent(kind=cpb.QUERY_EVENT_KIND_SUBMITTED, time_s=1.0, stage=-1)
    assert event_line(submitted) == "      1.00 s  SUBMITTED"


# ------------------------------------------------------------------------------- errors


async def test_an_unreachable_coordinator_is_one_clear_error() -> None:
    address = f"127.0.0.1:{free_port()}"
    async with CoordinatorClient(address, timeout_s=2.0) as client:
        with pytest.raises(CoordinatorUnavailableError) as err:
            await client.status()
        assert str(err.value) == (
            f"cannot reach the coordinator at {address}: is `hexgen-flow up` running?"
        )
        with pytest.raises(CoordinatorUnavailableError):
            await client.wait_ready(timeout_s=0.3)
        with pytest.raises(CoordinatorUnavailableError):
            async for _ in client.watch("q"):
                pass


async def test_replay_rejects_duplicate_query_ids_before_submitting() -> None:
    client = CoordinatorClient(f"127.0.0.1:{free_port()}")
    with pytest.raises(ConfigError, match="query id 'trace1-0' appears twice"):
        await replay(client, [TRACE[0], TRACE[1], TRACE[0]], qps=1.0)
    with pytest.raises(ConfigError, match="no queries"):
        await replay(client, [], qps=1.0)
    await client.close()
