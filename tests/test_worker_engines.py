"""The worker's engines, driven directly: the simulated engine in real time on a fast
cluster clock, the capacity ledger and prompts of the real engines, and the request the
OpenAI engine builds (the real engines against real vLLM: tests/real_engine)."""

from __future__ import annotations

import asyncio
import importlib.util
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from hexgen_flow.cluster import parse_cluster
from hexgen_flow.estimate import Estimator
from hexgen_flow.policies.registration import QUEUES
from hexgen_flow.runtime import CallTicket, ClusterLoad, PolicyContext
from hexgen_flow.scheduler import InstanceScheduler
from hexgen_flow.sim.engine import BatchingEngineModel
from hexgen_flow.sim.vllm_v1 import VllmV1EngineModel
from hexgen_flow.workload import LLMCall
from hexgen_service.clock import ClusterClock
from hexgen_worker.cli import build_parser, config_from_args, main
from hexgen_worker.config import WorkerConfig
from hexgen_worker.engines import (
    Engine,
    EngineUnavailableError,
    OpenAIEngine,
    SimulatedEngine,
    VllmEngine,
    create_engine,
)
from hexgen_worker.engines.base import CapacityLedger, fit_to_context, synthetic_prompt
from hexgen_worker.engines.openai import api_base
from hexgen_worker.events import CallFinished, CallStarted, EngineEvent

T = TypeVar("T")
SCALE = 100.0  # cluster seconds per wall second


def ticket(seq: int, input_tokens: int = 1000, output_tokens: int = 100) -> CallTicket:
    return CallTicket.detached(
        seq=seq,
        call_id=f"c{seq}",
        query_id="q",
        query_seq=0,
        tenant="t",
        stage=0,
        call=LLMCall("revise", input_tokens, output_tokens),
        released_s=0.0,
        deadline_s=100.0 + seq,
        query_deadline_s=200.0,
        remaining_after_s=0.0,
    )


def policy_context(cluster: str) -> PolicyContext:
    parsed = parse_cluster(cluster)
    return PolicyContext(parsed, Estimator(parsed), ClusterLoad(parsed), random.Random(0))


def simulated(engine_model: str = "prefill-first", **overrides: Any) -> SimulatedEngine:
    spec = WorkerConfig(worker_id="w", gpu="A100", **overrides).instance_spec()
    engine = SimulatedEngine(spec, engine_model)
    engine.set_clock(ClusterClock.starting_now(SCALE))
    return engine


async def started(engine: Engine, body: Callable[[], Awaitable[T]]) -> T:
    await engine.start()
    try:
        return await body()
    finally:
        await engine.close()


async def next_finished(engine: Engine, timeout: float = 2.0) -> CallFinished:
    while True:
        event = await asyncio.wait_for(engine.next_event(), timeout)
        if isinstance(event, CallFinished):
            return event


# ---------------------------------------------------------------------- simulated engine


def test_simulated_call_takes_the_latency_models_time() -> None:
    engine = simulated()
    single = engine.spec.latency.single_s(1000, 100)

    async def body() -> tuple[EngineEvent, CallFinished, float]:
        t0 = time.monotonic()
        engine.admit(ticket(0), engine.clock.now())
        first = await engine.next_event()
        done = await next_finished(engine)
        return first, done, time.monotonic() - t0

    first, done, wall = asyncio.run(started(engine, body))
    assert isinstance(first, CallStarted) and first.call_id == "c0"
    assert done.finished_s - done.started_s == pytest.approx(single, abs=1e-9)
    assert single / SCALE <= wall < single / SCALE + 0.03  # ~39 ms, reported on time
    assert done.text == "[simulated A100] 100 tokens" and done.output_tokens == 100
    assert engine.load().running == 0 and engine.load().kv_used_tokens == 0


def test_simulated_call_reports_its_first_token_after_the_prefill() -> None:
    """The model's first output token (the end of the prompt's prefill), on the cluster
    clock as started_s and finished_s are: a call of many output tokens decodes after it."""
    engine = simulated()
    prefill = engine.spec.latency.prefill_s(1000, 100)

    async def body() -> CallFinished:
        engine.admit(ticket(0), engine.clock.now())
        return await next_finished(engine)

    done = asyncio.run(started(engine, body))
    assert done.started_s <= done.first_token_s < done.finished_s
    assert done.first_token_s - done.started_s == pytest.approx(prefill, abs=1e-9)


def test_simulated_calls_batch_like_the_simulator() -> None:
    engine = simulated()
    model = BatchingEngineModel(engine.spec)  # the simulator's model, driven offline
    a, b = ticket(0, 4000, 300), ticket(1, 1000, 100)
    a2, b2 = ticket(0, 4000, 300), ticket(1, 1000, 100)
    model.admit(a2, 0.0)
    model.admit(b2, 0.0)
    expected: dict[str, float] = {}
    while model.running:
        t = model.next_event_s()
        for done in model.advance(t):
            expected[done.call_id] = t

    async def body() -> dict[str, CallFinished]:
        now = engine.clock.now()
        engine.admit(a, now)
        engine.admit(b, now)
        assert engine.load().running == 2
        out = [await next_finished(engine), await next_finished(engine)]
        return {f.call_id: f for f in out}

    finished = asyncio.run(started(engine, body))
    for call_id, t in expected.items():
        assert finished[call_id].finished_s - finished[call_id].started_s == pytest.approx(
            t, abs=1e-9
        )
    # batching slows both calls down against running alone
    lat = engine.spec.latency
    assert expected["c1"] > lat.single_s(1000, 100)
    assert expected["c0"] > lat.single_s(4000, 300)


def test_simulated_engine_runs_the_vllm_v1_model_like_the_simulator() -> None:
    engine = simulated("vllm-v1")
    # the simulator's vllm-v1 model, driven offline, with the worker's (default) caching
    model = VllmV1EngineModel(engine.spec, enable_prefix_caching=engine.prefix_caching)
    sizes = [(300, 5), (1000, 100), (12000, 40)]
    for seq, (n_in, n_out) in enumerate(sizes):
        model.admit(ticket(seq, n_in, n_out), 0.0)
    expected: dict[str, float] = {}
    while model.running:
        t = model.next_event_s()
        for done in model.advance(t):
            expected[done.call_id] = t
    calls = [ticket(seq, n_in, n_out) for seq, (n_in, n_out) in enumerate(sizes)]

    async def body() -> dict[str, CallFinished]:
        now = engine.clock.now()
        for call in calls:
            engine.admit(call, now)
        out = [await next_finished(engine, timeout=5.0) for _ in calls]
        return {f.call_id: f for f in out}

    finished = asyncio.run(started(engine, body))
    assert len(expected) == 3
    for result in finished.values():  # every call of this model has a first token
        assert result.started_s <= result.first_token_s < result.finished_s
    for call_id, t in expected.items():
        assert finished[call_id].finished_s - finished[call_id].started_s == pytest.approx(
            t, abs=1e-9
        )
    # chunked prefill: the short call decodes while the 12,000-token prompt is prefilled
    assert expected["c0"] < engine.spec.latency.prefill_s(12000, 40)
    assert engine.load().running == 0 and engine.load().kv_used_tokens == 0


def test_the_engine_model_flag_reaches_the_simulated_engine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["--coordinator", "localhost:50051", "--worker-id", "w1", "--gpu", "A100"]
    config = config_from_args(build_parser().parse_args([*base, "--engine-model", "vllm-v1"]))
    assert (config.engine_model, config.prefix_caching) == ("vllm-v1", None)
    engine = create_engine(config)
    assert isinstance(engine, SimulatedEngine) and engine.engine_model == "vllm-v1"
    assert engine.prefix_caching  # vllm-v1's default, as vLLM V1 serves
    assert config_from_args(build_parser().parse_args(base)).engine_model == "vllm-v1"
    off = config_from_args(
        build_parser().parse_args([*base, "--engine-model", "vllm-v1", "--no-prefix-caching"])
    )
    off_engine = create_engine(off)
    assert isinstance(off_engine, SimulatedEngine) and not off_engine.prefix_caching
    first = config_from_args(build_parser().parse_args([*base, "--engine-model", "prefill-first"]))
    first_engine = create_engine(first)
    assert isinstance(first_engine, SimulatedEngine) and not first_engine.prefix_caching
    for bad, expected in (
        (["--engine-model", "vllm"], "invalid choice"),
        (["--engine-model", "prefill-first", "--prefix-caching"], "has no prefix cache"),
    ):
        assert main([*base, *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, err


def test_kv_limit_blocks_admission_until_a_call_finishes() -> None:
    engine = simulated(kv_cache_tokens=2500)
    queue = QUEUES.create("fcfs", policy_context("A100"), 0)
    scheduler = InstanceScheduler(queue, engine)

    async def body() -> None:
        for seq in range(3):
            queue.push(ticket(seq), engine.clock.now())  # 1100 tokens each
        admitted = scheduler.admit_ready(engine.clock.now())
        assert [t.call_id for t in admitted] == ["c0", "c1"]
        assert len(queue) == 1 and engine.load().kv_used_tokens == 2200
        await next_finished(engine)
        assert [t.call_id for t in scheduler.admit_ready(engine.clock.now())] == ["c2"]

    asyncio.run(started(engine, body))


def test_max_batch_blocks_admission() -> None:
    engine = simulated(max_batch=1)
    assert engine.fits(ticket(0))
    engine.set_clock(ClusterClock.starting_now(SCALE))

    async def body() -> None:
        engine.admit(ticket(0), engine.clock.now())
        assert not engine.fits(ticket(1))

    asyncio.run(started(engine, body))


def test_cancelled_simulated_call_reports_nothing() -> None:
    engine = simulated()

    async def body() -> list[EngineEvent]:
        now = engine.clock.now()
        engine.admit(ticket(0, 1000, 50), now)
        engine.admit(ticket(1, 1000, 100), now)
        assert engine.cancel("c0") and not engine.cancel("c0") and not engine.cancel("nope")
        events = [await engine.next_event() for _ in range(2)]  # the two starts
        events.append(await next_finished(engine))  # c1 ends after c0 would have
        await asyncio.sleep(0.01)
        while engine.pending_events():
            events.append(await engine.next_event())
        return events

    events = asyncio.run(started(engine, body))
    assert [e.call_id for e in events if isinstance(e, CallFinished)] == ["c1"]
    assert engine.load().running == 0


def test_clock_change_keeps_the_model_continuous() -> None:
    engine = simulated()
    single = engine.spec.latency.single_s(1000, 100)

    async def body() -> CallFinished:
        engine.admit(ticket(0), engine.clock.now())
        old = engine.clock
        engine.set_clock(ClusterClock(old.epoch_unix_s - 50.0, SCALE))  # now reads 5000 s on
        return await next_finished(engine)

    done = asyncio.run(started(engine, body))
    assert done.finished_s - done.started_s == pytest.approx(single, abs=1e-6)
    assert done.started_s > 4999
    assert done.started_s <= done.first_token_s < done.finished_s  # moved with them


# ---------------------------------------------------------------------- real-engine helpers


def test_capacity_ledger_limits_concurrency_and_tokens() -> None:
    ledger = CapacityLedger(max_concurrency=2, kv_cache_tokens=3000)
    small, big = LLMCall("x", 1000, 100), LLMCall("x", 2000, 500)
    assert ledger.fits(big)
    ledger.reserve(big)
    assert not ledger.fits(small)  # 2500 + 1100 > 3000
    ledger.release(big)
    ledger.reserve(small)
    ledger.reserve(small)
    assert not ledger.fits(LLMCall("x", 1, 1))  # two in flight
    assert ledger.load().running == 2 and ledger.load().kv_used_tokens == 2200
    assert CapacityLedger(1, 0).fits(LLMCall("x", 10**6, 10**6))  # 0: no KV check


def test_synthetic_prompt_has_one_word_per_token() -> None:
    assert len(synthetic_prompt(11748).split()) == 11748
    assert synthetic_prompt(3) == "the data table"
    assert synthetic_prompt(500) == synthetic_prompt(500)


def test_fit_to_context_keeps_output_first() -> None:
    assert fit_to_context(1000, 100, 0) == (1000, 100)
    assert fit_to_context(1000, 100, 2048) == (1000, 100)
    assert fit_to_context(11748, 678, 2048) == (1370, 678)
    assert fit_to_context(10, 5000, 2048) == (1, 2047)
    assert fit_to_context(11748, 678, 2048, reserve=48) == (1322, 678)


def test_vllm_engine_explains_a_missing_vllm() -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    engine = VllmEngine(model="/models/none")
    with pytest.raises(EngineUnavailableError, match=r"hexgen-flow\[vllm\]"):
        asyncio.run(engine.start())
    with pytest.raises(EngineUnavailableError, match="--vllm-model"):
        VllmEngine(model="")


# ---------------------------------------------------------------------- openai engine


def test_openai_base_url() -> None:
    assert api_base("http://h:8000") == "http://h:8000/v1"
    assert api_base("http://h:8000/v1/") == "http://h:8000/v1"


def test_openai_request_body_carries_the_call() -> None:
    """The streaming request the engine sends (the real server is the real-engine tier's:
    tests/real_engine, run by `make test-real-engines`)."""
    engine = OpenAIEngine(url="http://h:8000", model="m", send_priority=True)
    body = engine.request_body(ticket(0, 40, 5), None, priority=3)
    assert len(body["prompt"].split()) == 40  # synthesized: one word per input token
    assert body["max_tokens"] == 5 and body["stream"] and body["ignore_eos"]
    assert body["model"] == "m" and body["priority"] == 3
    assert body["stream_options"] == {"include_usage": True}
    chat = OpenAIEngine(url="http://h:8000", model="m", api="chat")
    chat_body = chat.request_body(ticket(1, 40, 5), "hello", priority=0)
    assert chat_body["messages"] == [{"role": "user", "content": "hello"}]
    assert "prompt" not in chat_body and "priority" not in chat_body
