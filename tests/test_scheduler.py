"""GlobalScheduler and InstanceScheduler: the decisions every driver shares."""

from __future__ import annotations

import pytest

from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.latency import latency_model
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.scheduler import GlobalScheduler, InstanceScheduler
from hexgen_flow.sim.engine import BatchingEngineModel
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow

GPUS = ("A100", "A100", "A6000", "L40S")
CLUSTER = parse_cluster(",".join(GPUS))
SMALL = LLMCall("information_retriever", 308, 5)
BIG = LLMCall("generate_candidate", 11748, 678)
REVISE = LLMCall("revise", 5963, 79)
EVAL = LLMCall("evaluate", 961, 22)


def _mean(call: LLMCall) -> float:
    return sum(
        latency_model("llama-3.1-70b", g).single_s(call.input_tokens, call.output_tokens)
        for g in GPUS
    ) / len(GPUS)


def _diamond() -> Query:
    return Query(
        "d",
        Workflow(
            (
                Stage("information_retriever", (SMALL,)),
                Stage("generate_candidate", (BIG, REVISE), (0,)),
                Stage("revise", (REVISE,), (0,)),
                Stage("evaluate", (EVAL,), (1, 2)),
            )
        ),
    )


def test_release_dispatches_every_call_and_sets_the_remaining_longest_path() -> None:
    sched = GlobalScheduler(CLUSTER, PRESETS["hexgen-flow"])
    run = sched.admit(_diamond(), 0, 0.0, 200.0)
    (root,) = sched.release(run, 0, 0.0)
    # After stage 0: the longer branch (the fan-out's slowest call) then the evaluation.
    expected = max(_mean(BIG), _mean(REVISE)) + _mean(EVAL)
    assert root.remaining_after_s == pytest.approx(expected, rel=1e-12)
    assert root.instance >= 0
    assert sched.load.in_flight[root.instance] == 1
    assert root.query_deadline_s == 200.0


def test_complete_releases_a_stage_only_when_all_its_dependencies_finished() -> None:
    sched = GlobalScheduler(CLUSTER, PRESETS["vllm"])
    run = sched.admit(_diamond(), 0, 0.0, 200.0)
    (root,) = sched.release(run, 0, 0.0)
    after_root = sched.complete(root, 1.0)
    assert sorted(t.stage for t in after_root) == [1, 1, 2]
    by_stage = {t.stage: t for t in after_root}
    fan = [t for t in after_root if t.stage == 1]
    assert sched.complete(by_stage[2], 2.0) == []  # stage 1 still runs
    assert sched.complete(fan[0], 3.0) == []  # stage 1 has one call left
    (last,) = sched.complete(fan[1], 4.0)
    assert last.stage == 3
    assert run.finished_s is None
    assert sched.complete(last, 5.0) == []
    assert run.finished_s == 5.0
    assert sum(sched.load.in_flight) == 0
    assert sched.next_seq == 5  # one sequence number per released call


def test_unavailable_instances_are_skipped_and_none_available_leaves_the_ticket_parked() -> None:
    sched = GlobalScheduler(CLUSTER, PRESETS["vllm"])
    for i in (0, 1, 2):
        sched.load.set_available(i, False)
    run = sched.admit(Query("q", Workflow.chain([(SMALL, SMALL)])), 0, 0.0, 100.0)
    tickets = sched.release(run, 0, 0.0)
    assert [t.instance for t in tickets] == [3, 3]
    sched.load.set_available(3, False)
    run2 = sched.admit(Query("q2", Workflow.chain([(SMALL,)])), 1, 0.0, 100.0)
    (parked,) = sched.release(run2, 0, 0.0)
    assert parked.instance == -1
    sched.load.set_available(2, True)
    assert sched.dispatch(parked, 1.0) == 2


def test_withdraw_takes_a_ticket_off_its_instance_ledger() -> None:
    sched = GlobalScheduler(CLUSTER, PRESETS["hexgen-flow"])
    run = sched.admit(Query("q", Workflow.chain([(BIG,)])), 0, 0.0, 100.0)
    (ticket,) = sched.release(run, 0, 0.0)
    i = ticket.instance
    assert sched.load.outstanding_s[i] > 0
    sched.withdraw(ticket)
    assert ticket.instance == -1
    assert sched.load.in_flight[i] == 0 and sched.load.outstanding_s[i] == 0.0


def test_set_alpha_changes_the_dispatcher_and_rejects_bad_values() -> None:
    sched = GlobalScheduler(CLUSTER, PRESETS["hexgen-flow"].with_alpha(0.2))
    assert sched.alpha == 0.2
    sched.set_alpha(0.7)
    assert sched.alpha == 0.7
    with pytest.raises(ConfigError, match="alpha"):
        sched.set_alpha(1.5)
    with pytest.raises(ConfigError, match="no alpha"):
        GlobalScheduler(CLUSTER, PRESETS["vllm"]).set_alpha(0.5)


def test_instance_scheduler_admits_in_queue_order_until_the_engine_is_full() -> None:
    sched = GlobalScheduler(CLUSTER, PRESETS["vllm"])
    spec = CLUSTER.instances[2]
    engine = BatchingEngineModel(spec)
    instance = InstanceScheduler(sched.make_queue(2), engine)
    run = sched.admit(Query("q", Workflow.chain([(BIG,) * 20])), 0, 0.0, 100.0)
    tickets = sched.release(run, 0, 0.0)
    for t in tickets:
        instance.queue.push(t, 0.0)
    admitted = instance.admit_ready(0.0)
    per_call = BIG.input_tokens + BIG.output_tokens
    assert len(admitted) == spec.kv_cache_tokens // per_call
    assert [t.seq for t in admitted] == sorted(t.seq for t in admitted)
    assert len(instance.queue) == 20 - len(admitted)
    assert instance.admit_ready(0.0) == []  # still full


def test_completing_a_ticket_on_no_ledger_leaves_every_instance_alone() -> None:
    sched = GlobalScheduler(CLUSTER, PRESETS["vllm"])
    run = sched.admit(Query("q", Workflow.chain([(SMALL,), (SMALL,)])), 0, 0.0, 100.0)
    (ticket,) = sched.release(run, 0, 0.0)
    sched.withdraw(ticket)  # e.g. resumed after a restart, not yet claimed by a worker
    (nxt,) = sched.complete(ticket, 1.0)
    assert nxt.stage == 1
    assert sched.load.in_flight == [1 if i == nxt.instance else 0 for i in range(len(GPUS))]
