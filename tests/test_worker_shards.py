"""A worker's state serving two coordinator shards at once, without a network: calls of
both links in one queue ordered together by deadline, the same call id on both links kept
apart, cancels, deadline updates and acks applied to their own link only, reports sent on
the link that dispatched the call with times on its clock, each link told the other's load,
and welcomes that disagree refused; a lost link's calls handed over to the link whose welcome
names its shard (`hexgen_worker.handover`); and what a coordinator's load ledger makes of
the other shards' load that a shared worker reports."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pytest

from dispatch_driver import Driver, context
from hexgen_coordinator.worker_messages import Run
from hexgen_coordinator.worker_wire import encode_command
from hexgen_flow.cluster import DEFAULT_MODEL, parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.policies.dispatch import LeastRequestsDispatcher, LeastWorkDispatcher
from hexgen_flow.runtime import CallTicket
from hexgen_flow.workload import LLMCall
from hexgen_service.clock import ClusterClock
from hexgen_service.convert import dispatch_to_ticket
from hexgen_service.eos_script import EosScript
from hexgen_worker import DispatchOutcome, WelcomeSettings, WorkerConfig, WorkerState
from hexgen_worker.convert import heartbeat_request, hello_request
from hexgen_worker.engines import SimulatedEngine
from hexgen_worker.events import CallFinished, CallReport, CallStarted
from hexgen_worker.handover import hand_over_shard, lost_holders
from worker_welcome import welcome_settings

T = TypeVar("T")
SCALE = 1000.0
SHARDS = ("10.0.0.1:50052", "10.0.0.2:50052")


def ticket(
    call_id: str,
    seq: int,
    *,
    deadline_s: float = 100.0,
    out: int = 50,
    released_s: float = 0.0,
    asked: int | None = None,
) -> CallTicket:
    """`out`: the output tokens the queue plans with; `asked`: what the engine is asked for
    (the declared cap; default `out`)."""
    return CallTicket.detached(
        seq=seq,
        call_id=call_id,
        query_id=call_id.partition("/")[0],
        query_seq=seq,
        tenant="t",
        stage=0,
        call=LLMCall("revise", 1000, out),
        released_s=released_s,
        deadline_s=deadline_s,
        query_deadline_s=500.0,
        remaining_after_s=0.0,
        output_tokens=asked,
    )


def welcome(clock: ClusterClock, **overrides: Any) -> WelcomeSettings:
    overrides.setdefault("cluster", "A100,A6000,A100")
    return welcome_settings(clock, **overrides)


class TwoShards:
    """A WorkerState with two links on a simulated engine, recording what each link sends."""

    def __init__(
        self,
        coordinators: Sequence[str] = SHARDS,
        eos_script: EosScript | None = None,
        **config: Any,
    ) -> None:
        cfg = WorkerConfig(worker_id="w", gpu="A100", **config).resolved()
        self.config = cfg
        self.engine = SimulatedEngine(cfg.instance_spec(), "vllm-v1")
        self.sent: list[tuple[int, CallReport]] = []
        self.state = WorkerState(
            self.engine,
            gpu=cfg.gpu,
            model=cfg.model,
            kv_cache_tokens=cfg.kv_cache_tokens or 0,
            send=lambda link, report: self.sent.append((link, report)),
            coordinators=coordinators,
            eos_script=eos_script,
        )

    def finished(self, link: int | None = None) -> list[CallFinished]:
        return [
            r for at, r in self.sent if isinstance(r, CallFinished) and (link is None or at == link)
        ]

    def started(self) -> list[tuple[int, str]]:
        return [(at, r.call_id) for at, r in self.sent if isinstance(r, CallStarted)]

    async def until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        end = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < end, "timed out"
            await asyncio.sleep(0.002)


def run(shards: TwoShards, body: Callable[[], Awaitable[T]], *welcomes: WelcomeSettings) -> T:
    async def main() -> T:
        await shards.engine.start()
        events = asyncio.create_task(shards.state.run_engine_events())
        try:
            for link, settings in enumerate(welcomes):
                shards.state.configure(settings, link)
            return await body()
        finally:
            events.cancel()
            await shards.engine.close()

    return asyncio.run(main())


def same_clock() -> tuple[WelcomeSettings, WelcomeSettings]:
    clock = ClusterClock(time.time(), SCALE)
    return welcome(clock), welcome(clock, slot=2, instance="A100#2")


def test_calls_of_both_shards_are_ordered_together_by_deadline() -> None:
    w = TwoShards(max_batch=1)

    async def body() -> None:
        w.state.dispatch(ticket("a/0.0", 1, deadline_s=900.0, out=300), link=0)  # runs at once
        w.state.dispatch(ticket("b/0.0", 1, deadline_s=400.0), link=1)
        w.state.dispatch(ticket("a/0.1", 2, deadline_s=50.0), link=0)
        w.state.dispatch(ticket("b/0.1", 2, deadline_s=200.0), link=1)
        assert w.state.queued() == 3
        await w.until(lambda: len(w.finished()) == 4)

    run(w, body, *same_clock())
    # one queue: the most urgent first, whichever coordinator sent it
    assert w.started() == [(0, "a/0.0"), (0, "a/0.1"), (1, "b/0.1"), (1, "b/0.0")]


def test_the_same_call_id_on_two_shards_is_two_calls() -> None:
    w = TwoShards()

    # Outputs long enough that neither call ends between the two dispatches even on a
    # loaded machine (at time scale 1000 a 20-token call took well under a millisecond, and
    # the engine had finished it by the time it was asked how many calls it runs).
    async def body() -> None:
        assert w.state.dispatch(ticket("q/0.0", 7, out=2000), link=0) is DispatchOutcome.QUEUED
        assert w.state.dispatch(ticket("q/0.0", 7, out=6000), link=1) is DispatchOutcome.QUEUED
        assert w.engine.load().running == 2
        assert w.state.resident_call_ids(0) == ["q/0.0"] == w.state.resident_call_ids(1)
        await w.until(lambda: len(w.finished()) == 2)
        # each result goes to its own coordinator, with its own call's tokens
        assert [(f.call_id, f.output_tokens) for f in w.finished(0)] == [("q/0.0", 2000)]
        assert [(f.call_id, f.output_tokens) for f in w.finished(1)] == [("q/0.0", 6000)]
        assert [f.output_tokens for f in w.state.unacked(0)] == [2000]
        w.state.ack(["q/0.0"], link=1)
        assert w.state.unacked(1) == [] and len(w.state.unacked(0)) == 1
        # a dispatch again on link 0 resends link 0's result only
        assert w.state.dispatch(ticket("q/0.0", 7), link=0) is DispatchOutcome.RESENT
        assert w.sent[-1][0] == 0

    run(w, body, *same_clock())


def test_each_shards_engine_is_asked_for_the_cap_not_the_belief_the_queue_plans_with() -> None:
    # Under learned output lengths a coordinator plans a call with less than its cap; the
    # shared queue plans with that belief, but the engine must still be asked for the cap.
    w = TwoShards()

    async def body() -> None:
        w.state.dispatch(ticket("a/0.0", 1, out=20, asked=60), link=0)
        w.state.dispatch(ticket("b/0.0", 1, out=20, asked=70), link=1)
        await w.until(lambda: len(w.finished()) == 2)

    run(w, body, *same_clock())
    assert [(f.call_id, f.output_tokens) for f in w.finished(0)] == [("a/0.0", 60)]
    assert [(f.call_id, f.output_tokens) for f in w.finished(1)] == [("b/0.0", 70)]


def test_an_eos_script_stops_each_shards_calls_where_it_says_never_past_the_cap() -> None:
    w = TwoShards(eos_script=EosScript({"a/0.0": 7, "b/0.0": 90}))

    async def body() -> None:
        w.state.dispatch(ticket("a/0.0", 1, out=20, asked=60), link=0)
        w.state.dispatch(ticket("b/0.0", 1, out=20, asked=60), link=1)
        w.state.dispatch(ticket("c/0.0", 2, out=20, asked=60), link=1)  # not in the script
        await w.until(lambda: len(w.finished()) == 3)

    run(w, body, *same_clock())
    assert [(f.call_id, f.output_tokens) for f in w.finished(0)] == [("a/0.0", 7)]
    assert sorted((f.call_id, f.output_tokens) for f in w.finished(1)) == [
        ("b/0.0", 60),
        ("c/0.0", 60),
    ]


def test_cancel_and_deadline_update_touch_their_own_shard_only() -> None:
    w = TwoShards(max_batch=1)

    async def body() -> None:
        w.state.dispatch(ticket("busy/0.0", 1, out=400), link=0)  # holds the engine
        w.state.dispatch(ticket("q/0.0", 2, deadline_s=300.0), link=0)
        w.state.dispatch(ticket("q/0.0", 2, deadline_s=200.0), link=1)
        w.state.dispatch(ticket("q/0.1", 3, deadline_s=250.0), link=1)
        assert w.state.update_deadline("q/0.0", 10.0, link=0)
        mine, theirs = w.state.ticket("q/0.0", 0), w.state.ticket("q/0.0", 1)
        assert mine is not None and theirs is not None
        assert (mine.deadline_s, theirs.deadline_s) == (10.0, 200.0)
        assert w.state.cancel("q/0.1", link=1)
        assert not w.state.cancel("q/0.1", link=0)  # link 0 has no such call
        assert w.state.cancel("busy/0.0", link=0)
        await w.until(lambda: len(w.finished()) == 2)

    run(w, body, *same_clock())
    # (busy's start was never reported: it was cancelled first)
    assert w.started() == [(0, "q/0.0"), (1, "q/0.0")]


def test_each_shards_times_are_on_its_own_clock() -> None:
    """Each shard fixes its epoch when it first starts: link 1's clock reads 50,000 cluster
    seconds more than link 0's. The queue compares deadlines on one clock, and each link
    hears its results on its own."""
    w = TwoShards(max_batch=1)
    now = time.time()
    early, late = ClusterClock(now, SCALE), ClusterClock(now - 50.0, SCALE)
    shift = 50.0 * SCALE

    async def body() -> None:
        w.state.dispatch(ticket("hold/0.0", 1, deadline_s=900.0, out=300), link=0)
        # link 1's deadline 50,050 is 50 on link 0's clock: before link 0's 100
        w.state.dispatch(ticket("b/0.0", 1, deadline_s=shift + 50.0), link=1)
        w.state.dispatch(ticket("a/0.0", 2, deadline_s=100.0), link=0)
        held = w.state.ticket("b/0.0", 1)
        assert held is not None and held.deadline_s == pytest.approx(50.0)
        await w.until(lambda: len(w.finished()) == 3)
        for link, clock in ((0, early), (1, late)):
            for done in w.finished(link):
                assert done.started_s <= done.finished_s <= clock.now()
                assert done.finished_s > clock.now() - 100.0  # just now, on that clock
                assert done.started_s <= done.first_token_s < done.finished_s
        assert w.state.unacked(1)[0].finished_s == w.finished(1)[0].finished_s

    run(w, body, welcome(early), welcome(late, slot=2, instance="A100#2"))
    assert w.started() == [(0, "hold/0.0"), (1, "b/0.0"), (0, "a/0.0")]


def test_a_first_token_not_given_stays_zero_on_another_shards_clock() -> None:
    """A result without a first token (a call that failed before it) is translated to the
    link's clock but for its first token: 0.0 means "not given" on every clock."""
    w = TwoShards(kv_cache_tokens=500)
    now = time.time()
    early, late = ClusterClock(now, SCALE), ClusterClock(now - 50.0, SCALE)

    async def body() -> None:
        assert w.state.dispatch(ticket("big/0.0", 1), link=1) is DispatchOutcome.REJECTED

    run(w, body, welcome(early), welcome(late, slot=2, instance="A100#2"))
    [failed] = w.finished(1)
    assert "never fit" in failed.error
    assert failed.started_s > 50.0 * SCALE - 100.0  # on link 1's clock
    assert failed.first_token_s == 0.0
    assert w.state.unacked(1)[0].first_token_s == 0.0


def test_each_shard_hears_the_load_of_the_others() -> None:
    """Three alike calls, one from shard a and two from shard b, each with the tail weight
    its coordinator charged, sent as the coordinator sends it (a DispatchCall); each shard
    hears the others' number, work, tokens and weights, and the wire carries them."""
    w = TwoShards()

    def wired(t: CallTicket, weight: float) -> CallTicket:
        t.weight = weight
        return dispatch_to_ticket(encode_command(Run.of(t)).dispatch)

    async def body() -> None:
        w.state.dispatch(wired(ticket("a/0.0", 1, out=5_000), 0.25), link=0)
        w.state.dispatch(wired(ticket("b/0.0", 1, out=5_000), 2.0), link=1)
        w.state.dispatch(wired(ticket("b/0.1", 2, out=5_000), 3.0), link=1)
        to_a, to_b = w.state.heartbeat(0), w.state.heartbeat(1)
        assert to_a.running == to_b.running == 3  # the whole engine, to both
        assert (to_a.others_in_flight, to_b.others_in_flight) == (2, 1)
        assert (to_a.others_tokens, to_b.others_tokens) == (12_000, 6_000)
        assert to_a.others_outstanding_s == pytest.approx(2 * to_b.others_outstanding_s)
        work = to_b.others_outstanding_s  # one call's
        assert work > 0
        assert (to_a.others_weight, to_b.others_weight) == (5.0, 0.25)
        assert to_a.others_weighted_outstanding_s == pytest.approx(5.0 * work)
        assert to_b.others_weighted_outstanding_s == pytest.approx(0.25 * work)
        sent = heartbeat_request(to_a).heartbeat
        assert (sent.others_weight, sent.others_weighted_outstanding_s) == (
            to_a.others_weight,
            to_a.others_weighted_outstanding_s,
        )

    run(w, body, *same_clock())


def test_a_dispatch_without_a_weight_weighs_one() -> None:
    """A coordinator older than `DispatchCall.weight` sends none (0): the call weighs 1."""
    sent = encode_command(Run.of(ticket("a/0.0", 1))).dispatch
    sent.ClearField("weight")
    assert dispatch_to_ticket(sent).weight == 1.0


@pytest.mark.parametrize(
    ("overrides", "field", "values"),
    [
        ({"cluster": "A100,A6000"}, "cluster", ("'A100,A6000'", "'A100,A6000,A100'")),
        ({"queue_policy": "fcfs", "queue_params": {}}, "queue_policy", ("'fcfs'", "'urgency'")),
        (
            {"queue_params": {"estimate": "step"}},
            "queue_params_json",
            ('{"estimate": "step"}', '{"estimate": "call"}'),
        ),
        ({"time_scale": 20.0}, "time_scale", ("20.0", "1000.0")),
    ],
)
def test_welcomes_that_disagree_are_refused_naming_the_field_and_both_values(
    overrides: dict[str, Any], field: str, values: tuple[str, str]
) -> None:
    w = TwoShards()
    clock = ClusterClock(time.time(), SCALE)
    w.state.configure(welcome(clock), 0)
    scale = overrides.pop("time_scale", SCALE)
    other = welcome(ClusterClock(clock.epoch_unix_s - 5.0, scale), **overrides)
    with pytest.raises(ConfigError) as refused:
        w.state.configure(other, 1)
    message = str(refused.value)
    assert message.startswith(f"welcome.{field}: coordinator {SHARDS[1]} says {values[0]}")
    assert f"coordinator {SHARDS[0]} says {values[1]}" in message
    assert w.state.shards.settings[1] is None  # nothing of it adopted


def test_slots_and_epochs_may_differ_but_not_the_gpu() -> None:
    w = TwoShards()
    clock = ClusterClock(time.time(), SCALE)
    w.state.configure(welcome(clock), 0)
    w.state.configure(welcome(ClusterClock(clock.epoch_unix_s - 3.0, SCALE), slot=2), 1)
    assert w.state.clock == clock  # the first welcome's clock stays the local one
    with pytest.raises(ConfigError, match="A6000"):
        w.state.configure(welcome(clock, slot=1), 1)


# ------------------------------------------------------- the coordinator's view: ClusterLoad


def test_load_reported_by_a_shared_worker_counts_in_the_dispatchers_view() -> None:
    cluster = parse_cluster("A100,A100", DEFAULT_MODEL)
    ctx = context(cluster)
    load, driver = ctx.load, Driver(ctx)
    least_requests = LeastRequestsDispatcher(ctx)
    least_work = LeastWorkDispatcher(ctx)
    mine = driver.ticket(LLMCall("revise", 1000, 50))
    mine.instance, mine.work_s = 1, 2.0
    load.on_dispatch(mine)
    assert least_requests.select(driver.ticket(LLMCall("revise", 10, 5)), 0.0) == 0
    # instance 0's worker says the other shards have 3 calls (30 s, 9,000 tokens) there
    load.report_others(0, 3, 30.0, 9_000)
    assert (load.in_flight, load.others_in_flight) == ([3, 1], [3, 0])
    assert load.outstanding_s == [30.0, 2.0] and load.tokens_in_flight == [9_000, 1_050]
    assert least_requests.select(driver.ticket(LLMCall("revise", 10, 5)), 0.0) == 1
    assert least_work.select(driver.ticket(LLMCall("revise", 10, 5)), 0.0) == 1
    # a report replaces the previous one; nonsense is read as nothing
    load.report_others(0, 1, float("nan"), -5)
    assert (load.in_flight[0], load.outstanding_s[0], load.tokens_in_flight[0]) == (1, 0.0, 0)
    # our own calls come and go around the others'
    ours = driver.ticket(LLMCall("revise", 100, 10))
    ours.instance, ours.work_s = 0, 0.1
    load.report_others(0, 2, 5.0, 600)
    load.on_dispatch(ours)
    load.on_complete(ours)
    assert (load.in_flight[0], load.outstanding_s[0], load.tokens_in_flight[0]) == (2, 5.0, 600)
    load.report_others(0, 0, 0.0, 0)
    assert (load.in_flight[0], load.outstanding_s[0], load.tokens_in_flight[0]) == (0, 0.0, 0)


def test_a_cluster_file_neither_shard_has_here_serves_both_slots() -> None:
    w = TwoShards()
    clock = ClusterClock(time.time(), SCALE)
    cluster = "/nowhere/cluster.yaml"
    w.state.configure(welcome(clock, cluster=cluster, slot=0), 0)
    w.state.configure(welcome(clock, cluster=cluster, slot=3, instance="A100#3"), 1)
    assert w.state.shards.settings[1] is not None


# ------------------------------------------------------- a dead shard's calls, handed over

S0, S1 = "hf:{s0}:", "hf:{s1}:"
Y, Z, X = "10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"
"""Shard 0's first coordinator (dies), shard 1's, and the spare that takes shard 0 over."""


def _hello_ids(w: TwoShards, link: int) -> tuple[list[str], list[str]]:
    """What link `link`'s next hello lists (as `CoordinatorLink` builds it)."""
    hello = hello_request(
        w.config,
        slot=0,
        resident_call_ids=w.state.resident_call_ids(link),
        unacked_call_ids=[f.call_id for f in w.state.unacked(link)],
    ).hello
    return list(hello.resident_call_ids), list(hello.unacked_call_ids)


def test_a_lost_links_calls_are_handed_over_to_the_new_holder_of_its_shard() -> None:
    w = TwoShards((Y, Z, X), max_batch=2)
    clock = ClusterClock(time.time(), SCALE)
    up = w.state.shards.up

    async def body() -> None:
        w.state.dispatch(ticket("a/0.0", 1, out=10), link=0)  # finishes: an unacked result
        w.state.dispatch(ticket("a/0.1", 2, out=3_000), link=0)  # runs through the hand-over
        w.state.dispatch(ticket("b/0.0", 1, out=3_000), link=1)  # shard 1's: fills the engine
        w.state.dispatch(ticket("a/0.2", 3, deadline_s=300.0), link=0)  # waits in the queue
        await w.until(lambda: len(w.finished(0)) == 1)
        up[0] = False  # Y died; X took shard 0 over and welcomes us
        w.state.configure(welcome(clock, shard=S0), 2)
        assert lost_holders(w.state.shards, 2) == [0]
        assert hand_over_shard(w.state, 2) == 3
        assert _hello_ids(w, 2) == (["a/0.1", "a/0.2"], ["a/0.0"])
        assert _hello_ids(w, 0) == ([], [])
        assert w.state.resident_call_ids(1) == ["b/0.0"]  # shard 1's stay its own
        # untouched in the engine: still running, not restarted
        assert w.engine.load().running == 2 and w.state.queued() == 1
        assert [c for _, c in w.started()] == ["a/0.0", "a/0.1", "b/0.0"]
        # the new holder drives them by their own ids: a deadline, an ack
        assert w.state.update_deadline("a/0.2", 50.0, link=2)
        assert not w.state.update_deadline("a/0.2", 50.0, link=0)
        w.state.ack(["a/0.0"], link=2)
        assert w.state.unacked(2) == []
        # a call of the same id on the old link later is another call, under another id
        assert w.state.dispatch(ticket("a/0.2", 9, out=5), link=0) is DispatchOutcome.QUEUED
        assert w.state.cancel("a/0.2", link=0)
        assert w.state.ticket("a/0.2", 2) is not None
        await w.until(lambda: len(w.finished(2)) == 2)

    run(w, body, welcome(clock, shard=S0), welcome(clock, slot=2, instance="A100#2", shard=S1))
    # each call ran once; the moved calls' results went to the new holder, by their ids
    assert sorted(f.call_id for f in w.finished(2)) == ["a/0.1", "a/0.2"]
    assert [f.call_id for f in w.finished(0)] == ["a/0.0"]
    assert [c for _, c in w.started()].count("a/0.1") == 1
    assert all(not f.error for f in w.finished())


def test_nothing_is_handed_over_from_a_live_link_another_shard_or_unsharded_ones() -> None:
    w = TwoShards((Y, Z, X))
    clock = ClusterClock(time.time(), SCALE)

    async def body() -> None:
        w.state.dispatch(ticket("a/0.0", 1, out=3_000), link=0)
        w.state.dispatch(ticket("b/0.0", 1, out=3_000), link=1)
        w.state.shards.up[:2] = [True, False]
        w.state.configure(welcome(clock, shard=S0), 2)
        assert hand_over_shard(w.state, 2) == 0  # Y is up: it still holds shard 0
        w.state.configure(welcome(clock, shard="hf:{s2}:"), 2)
        assert hand_over_shard(w.state, 2) == 0  # shard 1's lost link serves another shard
        w.state.shards.up[0] = False
        w.state.configure(welcome(clock), 2)
        assert lost_holders(w.state.shards, 2) == []  # an unsharded coordinator names none
        assert w.state.resident_call_ids(0) == ["a/0.0"]
        assert w.state.resident_call_ids(1) == ["b/0.0"]

    run(w, body, welcome(clock, shard=S0), welcome(clock, slot=2, instance="A100#2", shard=S1))


def test_a_call_the_new_holder_dispatched_again_stays_its_own_and_links_may_hand_back() -> None:
    w = TwoShards((Y, X), max_batch=4)
    clock = ClusterClock(time.time(), SCALE)

    async def body() -> None:
        w.state.dispatch(ticket("a/0.0", 1, out=3_000), link=0)
        w.state.dispatch(ticket("a/0.1", 2, out=3_000), link=0)
        w.state.configure(welcome(clock, shard=S0), 1)
        # X resumed shard 0 and dispatched a/0.1 again before the hand-over: its attempt wins
        w.state.dispatch(ticket("a/0.1", 2, out=3_000), link=1)
        assert w.engine.load().running == 3
        assert hand_over_shard(w.state, 1) == 1
        assert sorted(w.state.resident_call_ids(1)) == ["a/0.0", "a/0.1"]
        kept = w.state.ticket("a/0.1", 1)
        assert kept is not None and kept.call_id == "1/a/0.1"  # X's own copy
        assert w.engine.load().running == 2  # Y's copy of a/0.1 was aborted
        # X dies in turn and a coordinator at Y's address takes shard 0: the calls go back
        w.state.configure(welcome(clock, shard=S0), 0)
        assert hand_over_shard(w.state, 0) == 2
        assert sorted(w.state.resident_call_ids(0)) == ["a/0.0", "a/0.1"]
        assert w.state.cancel("a/0.1", link=0) and w.state.cancel("a/0.0", link=0)
        assert w.engine.load().running == 0

    run(w, body, welcome(clock, shard=S0))
    assert w.finished() == []
