"""The worker's coordinator link, end to end against the real coordinator.

Every coordinator here is a real ``python -m hexgen_coordinator`` process on a free port of
127.0.0.1, keeping its state in the test Redis (``HEXGEN_TEST_REDIS``, default
127.0.0.1:6379, which ``make test`` starts) under a key prefix of its own that is deleted
afterwards. It serves the cluster ``A100,A6000`` at time scale 100 with short heartbeat
settings. Workers run in the test's own event loop (``Worker(config).run()``, as
services/worker/README.md shows) where the test watches ``worker.state``, and as
``python -m hexgen_worker`` processes where the exit status or a signal is what is tested.

What is checked:

- a coordinator SIGKILLed mid-call and restarted: the worker reconnects, the result that
  finished while the coordinator was down is sent again and recorded exactly once (one
  ``completions`` entry per call id), a call still running is reclaimed, not run again, and
  the query completes (``crash`` below); and the same crash when the worker comes back
  only after the coordinator's resume grace (``late``): the coordinator drops the running
  call and dispatches both calls again, the worker answers the finished one with its stored
  result and runs the other afresh, and every call is still completed once;
- hellos the coordinator rejects (a GPU type the cluster lacks, a slot of another GPU type
  or model, no such slot, a slot a live worker holds) end the worker with exit code 2 and
  an error naming the field;
- a worker process started before its coordinator retries until it is up, then serves,
  and exits with code 0 on SIGTERM; in-process workers end ``run()`` with 0 on ``stop()``
  after serving through the crashes and while holding a contested slot.

Duplicate dispatches of a call that is still queued or running, which the real coordinator
never sends (it drops such a call in the welcome first, as ``late`` shows), are covered on
the worker's state without a network in tests/test_worker_state.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_client.client import CoordinatorClient
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow
from hexgen_launch.processes import ManagedProcess, free_port, stop_processes
from hexgen_service.healthcheck import check
from hexgen_worker import Worker, WorkerConfig
from hexgen_worker.events import CallFinished
from hexgen_worker.state import CallStatus

REDIS_URL = os.environ.get("HEXGEN_TEST_REDIS", "redis://127.0.0.1:6379/0")
CLUSTER = "A100,A6000"
TIME_SCALE = 100.0
TIMEOUT_S = 20.0
"""Upper bound of every wait (a failing test, not a slow machine, should hit it)."""

K = cpb.QueryEventKind


# ----------------------------------------------------------------------------- processes


class CoordinatorProcess:
    """``python -m hexgen_coordinator`` on a free port with a Redis key prefix of its own.

    `kill` then `start` is a crash and a restart on the same address and state."""

    def __init__(self, log_dir: Path) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.prefix = f"hf-link-test-{uuid.uuid4().hex[:8]}:"
        self.log_path = log_dir / f"coordinator-{self.prefix[:-1]}.log"
        self.process: ManagedProcess | None = None

    def argv(self, resume_grace_s: float) -> list[str]:
        return [
            sys.executable, "-m", "hexgen_coordinator",
            "--listen", self.address,
            "--redis-url", REDIS_URL,
            "--redis-prefix", self.prefix,
            "--cluster", CLUSTER,
            "--time-scale", repr(TIME_SCALE),
            "--heartbeat-interval-s", "0.1",
            "--heartbeat-timeout-s", "1.0",
            "--resume-grace-s", repr(resume_grace_s),
        ]  # fmt: skip

    def start(self, resume_grace_s: float = 30.0) -> None:
        """Start it and wait until it reports SERVING (blocking: call it in a thread while
        an in-process worker runs)."""
        self.process = ManagedProcess("coordinator", self.argv(resume_grace_s), self.log_path)
        self.process.start()
        deadline = time.monotonic() + TIMEOUT_S
        while (problem := check(self.address, timeout_s=1.0)) is not None:
            if not self.process.running:
                raise self.process.failure(f"exited with code {self.process.returncode}")
            if time.monotonic() > deadline:
                raise self.process.failure(f"is not SERVING after {TIMEOUT_S:g} s ({problem})")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL, and wait until it is gone (its state stays in Redis)."""
        if self.process is not None:
            self.process.kill()

    def stop(self) -> None:
        if self.process is not None:
            stop_processes([self.process], grace_s=5.0)

    def completions(self) -> list[dict[str, str]]:
        """The ``completions`` stream: one record per completed call."""
        with redis.Redis.from_url(REDIS_URL, decode_responses=True) as client:
            entries = client.xrange(f"{self.prefix}completions")
        return [dict(fields) for _, fields in entries]

    def dispatched_to(self, call_id: str) -> str | None:
        """Where Redis says a call went (``slot:seq:attempt``), as a restarted coordinator
        reads it."""
        query_id = call_id.rpartition("/")[0]
        with redis.Redis.from_url(REDIS_URL, decode_responses=True) as client:
            value: str | None = client.hget(f"{self.prefix}q:{query_id}", f"p:{call_id}")
        return value

    def delete_state(self) -> None:
        with redis.Redis.from_url(REDIS_URL) as client:
            keys = list(client.scan_iter(match=f"{self.prefix}*"))
            if keys:
                client.delete(*keys)


@contextlib.contextmanager
def coordinator_process(log_dir: Path) -> Iterator[CoordinatorProcess]:
    """A coordinator, not started yet; stopped and its Redis state deleted afterwards."""
    coordinator = CoordinatorProcess(log_dir)
    try:
        yield coordinator
    finally:
        coordinator.stop()
        coordinator.delete_state()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    """One running coordinator for the tests that leave it as they found it."""
    with coordinator_process(tmp_path_factory.mktemp("coordinator")) as coordinator:
        coordinator.start()
        yield coordinator


def worker_config(
    coordinator: CoordinatorProcess, worker_id: str, **fields: object
) -> WorkerConfig:
    settings: dict[str, object] = {
        "coordinator": coordinator.address,
        "worker_id": worker_id,
        "gpu": "A100",
        "backoff_initial_s": 0.02,
        "backoff_max_s": 0.1,
        "jitter_seed": 0,
        "shutdown_grace_s": 0.5,
    }
    settings.update(fields)
    return WorkerConfig(**settings)  # type: ignore[arg-type]


def worker_process(
    coordinator: CoordinatorProcess, worker_id: str, log_path: Path, *args: str
) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [
                sys.executable, "-m", "hexgen_worker",
                "--coordinator", coordinator.address,
                "--worker-id", worker_id,
                "--gpu", "A100",
                *args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip


# ------------------------------------------------------------------------------- helpers


@contextlib.asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[asyncio.Task[int]]:
    """`worker.run()` as a task of this loop; stopped and awaited on the way out."""
    task = asyncio.create_task(worker.run())
    try:
        yield task
    finally:
        worker.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, TIMEOUT_S)


async def until(condition: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.005)


def query(query_id: str, *stages: tuple[int, ...]) -> Query:
    """A chain of stages, each a fan-out of calls with these output tokens (500 input), with
    an SLO of an hour (a call of LONG_TOKENS needs more than the default's 255 s even alone,
    which admission refuses for good)."""
    return Query(
        query_id,
        Workflow(
            tuple(
                Stage("revise", tuple(LLMCall("revise", 500, out) for out in outputs),
                      after=(k - 1,) if k else ())
                for k, outputs in enumerate(stages)
            )
        ),
        slo_s=3600.0,
    )  # fmt: skip


async def finish(client: CoordinatorClient, query_id: str) -> cpb.GetQueryResponse:
    """Wait until the query ends; its state and event log."""

    async def watch() -> None:
        async for _ in client.watch(query_id):
            pass

    try:
        await asyncio.wait_for(watch(), TIMEOUT_S)
    except TimeoutError:
        got = await client.get(query_id)
        raise AssertionError(f"{query_id} did not end within {TIMEOUT_S:g} s: {got}") from None
    return await client.get(query_id)


def count(events: list[cpb.QueryEvent], kind: int) -> Counter[str]:
    """How many events of `kind` each call id has."""
    return Counter(e.call_id for e in events if e.kind == kind)


async def status(coordinator: CoordinatorProcess) -> cpb.ClusterStatusResponse:
    async with CoordinatorClient(coordinator.address) as client:
        return await client.wait_ready(TIMEOUT_S)


class LogLines(logging.Handler):
    """The worker's log messages, as it writes them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def worker_log() -> Iterator[LogLines]:
    logger = logging.getLogger("hexgen_worker")
    handler, level = LogLines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# ------------------------------------------------------------- a coordinator crash mid-call

SHORT, LONG = "short", "long"
SHORT_FIRST, SHORT_NEXT, LONG_CALL = "short/0.0", "short/1.0", "long/0.0"
SHORT_TOKENS = 600  # about 0.2 s of wall time: it finishes while the coordinator is down
LONG_TOKENS = 20_000  # about 7 s: still running whenever the worker reconnects; cancelled


@dataclass(frozen=True, slots=True)
class CrashRun:
    """What a worker and its coordinator did around a coordinator SIGKILLed mid-call.

    Query SHORT is two calls in a chain; query LONG is one call that outlasts the test and
    is cancelled at the end. The coordinator is killed while SHORT_FIRST and LONG_CALL run,
    and restarted once SHORT_FIRST has finished."""

    outbox_while_down: tuple[CallFinished, ...]
    """The worker's unacknowledged results just before the restart."""
    resident_at_restart: tuple[str, ...]
    """The calls the worker held just before the restart (what its hello names)."""
    restart_s: float
    """Cluster time of the restart."""
    long_ticket_kept: bool
    """After the reconnect the worker still runs the very call it ran before the crash."""
    short: cpb.GetQueryResponse
    """SHORT once it ended."""
    long_events: tuple[cpb.QueryEvent, ...]
    """LONG's event log before it was cancelled."""
    completions: tuple[dict[str, str], ...]
    """The `completions` stream at the end."""
    status_after: cpb.ClusterStatusResponse
    """ClusterStatus once SHORT succeeded and LONG was cancelled (nothing in flight)."""
    outbox_after: tuple[CallFinished, ...]
    resident_after: tuple[str, ...]
    welcomes: int
    exit_code: int
    log: tuple[str, ...]
    """The worker's log messages."""


async def crash_mid_call(coordinator: CoordinatorProcess, resume_grace_s: float) -> CrashRun:
    await asyncio.to_thread(coordinator.start)
    worker = Worker(worker_config(coordinator, "crash-worker"))
    with worker_log() as log:
        async with running(worker) as run:
            await asyncio.wait_for(worker.welcomed.wait(), TIMEOUT_S)
            state = worker.state
            assert state is not None
            async with CoordinatorClient(coordinator.address) as client:
                await client.submit(query(LONG, (LONG_TOKENS,)))
                await client.submit(query(SHORT, (SHORT_TOKENS,), (20,)))
            await until(
                lambda: state.status(SHORT_FIRST) == state.status(LONG_CALL) == CallStatus.RUNNING,
                "both calls run on the worker",
            )
            long_ticket = state.ticket(LONG_CALL)
            # (a dispatch is recorded in Redis just after it is sent: kill after that)
            await until(
                lambda: all(coordinator.dispatched_to(c) for c in (SHORT_FIRST, LONG_CALL)),
                "both dispatches are recorded",
            )
            await asyncio.to_thread(coordinator.kill)
            await until(lambda: not worker.welcomed.is_set(), "the worker sees the link drop")
            await until(lambda: bool(state.unacked()), f"{SHORT_FIRST} finishes")
            outbox_while_down = tuple(state.unacked())
            resident_at_restart = tuple(state.resident_call_ids())
            assert state.clock is not None
            restart_s = state.clock.now()

            await asyncio.to_thread(coordinator.start, resume_grace_s)
            await until(lambda: worker.welcomes == 2, "the worker reconnects")
            async with CoordinatorClient(coordinator.address) as client:
                await client.wait_ready(TIMEOUT_S)
                short = await finish(client, SHORT)
                await until(
                    lambda: state.ticket(LONG_CALL) is not None, f"{LONG_CALL} is on the worker"
                )
                long_ticket_kept = state.ticket(LONG_CALL) is long_ticket
                long_events = tuple((await client.get(LONG)).events)
                await client.cancel(LONG)
                await until(
                    lambda: not state.resident_call_ids() and not state.unacked(),
                    "the worker holds nothing",
                )
                status_after = await client.status()
            outbox_after = tuple(state.unacked())
            resident_after = tuple(state.resident_call_ids())
            worker.stop()
            exit_code = await asyncio.wait_for(run, TIMEOUT_S)
    return CrashRun(
        outbox_while_down=outbox_while_down,
        resident_at_restart=resident_at_restart,
        restart_s=restart_s,
        long_ticket_kept=long_ticket_kept,
        short=short,
        long_events=long_events,
        completions=tuple(coordinator.completions()),
        status_after=status_after,
        outbox_after=outbox_after,
        resident_after=resident_after,
        welcomes=worker.welcomes,
        exit_code=exit_code,
        log=tuple(log.lines),
    )


@pytest.fixture(scope="module")
def crash(tmp_path_factory: pytest.TempPathFactory) -> CrashRun:
    """The worker comes back within the coordinator's resume grace (30 s)."""
    with coordinator_process(tmp_path_factory.mktemp("crash")) as coordinator:
        return asyncio.run(crash_mid_call(coordinator, resume_grace_s=30.0))


@pytest.fixture(scope="module")
def late(tmp_path_factory: pytest.TempPathFactory) -> CrashRun:
    """The worker comes back after the coordinator's resume grace (0 s)."""
    with coordinator_process(tmp_path_factory.mktemp("late")) as coordinator:
        return asyncio.run(crash_mid_call(coordinator, resume_grace_s=0.0))


def _check_short_completed_once(run: CrashRun) -> None:
    assert [f.call_id for f in run.outbox_while_down] == [SHORT_FIRST]
    assert run.resident_at_restart == (LONG_CALL,)
    assert run.short.query.state == cpb.QUERY_STATE_SUCCEEDED
    assert run.short.query.calls_done == 2
    # Recorded exactly once per call, whatever was sent twice.
    assert Counter(r["call_id"] for r in run.completions) == {SHORT_FIRST: 1, SHORT_NEXT: 1}
    assert count(list(run.short.events), K.QUERY_EVENT_KIND_CALL_FINISHED) == {
        SHORT_FIRST: 1,
        SHORT_NEXT: 1,
    }
    # The record of the call that finished during the outage is the worker's own result.
    done = run.outbox_while_down[0]
    record = next(r for r in run.completions if r["call_id"] == SHORT_FIRST)
    assert float(record["finished_s"]) == done.finished_s < run.restart_s
    assert float(record["started_s"]) == done.started_s
    assert int(record["output_tokens"]) == done.output_tokens == SHORT_TOKENS
    # The worker was acknowledged and holds nothing; it stopped cleanly.
    assert run.outbox_after == () and run.resident_after == ()
    assert run.welcomes == 2 and run.exit_code == 0


def test_a_result_finished_while_the_coordinator_was_down_is_recorded_once(
    crash: CrashRun,
) -> None:
    _check_short_completed_once(crash)
    # Sent once: the coordinator did not dispatch anything again.
    assert count(list(crash.short.events), K.QUERY_EVENT_KIND_CALL_DISPATCHED) == {
        SHORT_FIRST: 1,
        SHORT_NEXT: 1,
    }
    assert not any("resending its result" in line for line in crash.log)


def test_a_call_still_running_across_the_restart_is_reclaimed_not_run_again(
    crash: CrashRun,
) -> None:
    assert crash.long_ticket_kept
    assert count(list(crash.long_events), K.QUERY_EVENT_KIND_CALL_DISPATCHED) == {LONG_CALL: 1}
    assert not any("dropped call" in line for line in crash.log)


def test_the_load_ledger_is_clean_after_the_restart(crash: CrashRun) -> None:
    # The result resent after the restart completes a call that is on no instance's ledger
    # (it was never reclaimed): nothing may be taken off an instance for it.
    assert [i.in_flight for i in crash.status_after.instances] == [0, 0]
    assert [i.outstanding_s for i in crash.status_after.instances] == [0.0, 0.0]


def test_a_result_resent_after_the_restart_names_the_instance_that_ran_it(
    crash: CrashRun,
) -> None:
    record = next(r for r in crash.completions if r["call_id"] == SHORT_FIRST)
    assert (record["instance"], record["gpu"]) == ("A100#0", "A100")
    finished = next(
        e
        for e in crash.short.events
        if e.kind == K.QUERY_EVENT_KIND_CALL_FINISHED and e.call_id == SHORT_FIRST
    )
    assert finished.instance == "A100#0"


def test_after_the_resume_grace_calls_are_dispatched_again_and_still_completed_once(
    late: CrashRun,
) -> None:
    _check_short_completed_once(late)
    # Both calls the worker had were dispatched again: the finished one was answered with
    # the stored result (not run again), the running one was dropped and run afresh.
    assert count(list(late.short.events), K.QUERY_EVENT_KIND_CALL_DISPATCHED) == {
        SHORT_FIRST: 2,
        SHORT_NEXT: 1,
    }
    assert any(f"call {SHORT_FIRST} dispatched again after it finished" in line
               for line in late.log)  # fmt: skip
    assert count(list(late.long_events), K.QUERY_EVENT_KIND_CALL_DISPATCHED) == {LONG_CALL: 2}
    assert any(f"dropped call {LONG_CALL}" in line for line in late.log)
    assert not late.long_ticket_kept
    assert [i.in_flight for i in late.status_after.instances] == [0, 0]


# --------------------------------------------------------------------------- rejections


@pytest.mark.parametrize(
    ("fields", "field", "detail"),
    [
        pytest.param({"gpu": "H100"}, "hello.gpu", "no 'H100' slot", id="gpu-not-in-cluster"),
        pytest.param({"slot": 1}, "hello.gpu", "slot 1 is a A6000", id="slot-of-another-gpu"),
        pytest.param({"slot": 2}, "hello.slot", "not a slot of this cluster", id="no-such-slot"),
        pytest.param(
            {"model": "qwen3-30b-a3b"}, "hello.model", "serves llama-3.1-70b", id="other-model"
        ),
    ],
)
async def test_a_rejected_hello_ends_the_worker_with_exit_code_2(
    shared: CoordinatorProcess,
    fields: dict[str, object],
    field: str,
    detail: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = Worker(worker_config(shared, f"rejected-{uuid.uuid4().hex[:6]}", **fields))
    assert await asyncio.wait_for(worker.run(), TIMEOUT_S) == 2
    assert worker.welcomes == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(
        f"INVALID_ARGUMENT: {field}: " in message and detail in message for message in errors
    ), errors
    assert worker.config.worker_id not in {i.worker_id for i in (await status(shared)).instances}


async def test_a_slot_held_by_a_live_worker_is_refused(
    shared: CoordinatorProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    holder = Worker(worker_config(shared, "holder", slot=0))
    async with running(holder) as run:
        await asyncio.wait_for(holder.welcomed.wait(), TIMEOUT_S)

        # The same slot, from another worker process.
        log_path = tmp_path / "intruder.log"
        intruder = worker_process(shared, "intruder", log_path, "--slot", "0")
        assert await asyncio.to_thread(intruder.wait, TIMEOUT_S) == 2
        log = log_path.read_text()
        assert "FAILED_PRECONDITION: hello.slot: slot 0 is held by worker holder" in log, log

        # Any slot of its GPU type, from a worker in this process.
        anyone = Worker(worker_config(shared, "anyone"))
        assert await asyncio.wait_for(anyone.run(), TIMEOUT_S) == 2
        assert any(
            "FAILED_PRECONDITION: hello.slot: every A100 slot is held" in r.getMessage()
            for r in caplog.records
        )

        # The holder kept its slot and its stream.
        slot0 = (await status(shared)).instances[0]
        assert (slot0.worker_id, slot0.connected) == ("holder", True)
        assert holder.welcomes == 1 and holder.welcomed.is_set() and not run.done()
        async with CoordinatorClient(shared.address) as client:
            qid = f"held-{uuid.uuid4().hex[:6]}"
            await client.submit(query(qid, (20,)))
            assert (await finish(client, qid)).query.state == cpb.QUERY_STATE_SUCCEEDED
    assert run.result() == 0


# ------------------------------------------------------ a worker started before its coordinator


async def test_a_worker_process_started_first_serves_and_exits_0_on_sigterm(
    tmp_path: Path,
) -> None:
    with coordinator_process(tmp_path) as coordinator:
        log_path = tmp_path / "worker.log"
        proc = worker_process(coordinator, "early-process", log_path, "--slot", "0")
        try:
            await until(
                lambda: "link to coordinator" in log_path.read_text(),
                "a failed attempt",
            )
            assert proc.poll() is None
            await asyncio.to_thread(coordinator.start)
            async with CoordinatorClient(coordinator.address) as client:

                async def connected() -> bool:
                    slot0 = (await client.status()).instances[0]
                    return slot0.connected and slot0.worker_id == "early-process"

                deadline = time.monotonic() + TIMEOUT_S
                while not await connected():
                    assert time.monotonic() < deadline, log_path.read_text()
                    await asyncio.sleep(0.02)
                await client.submit(query("sigterm", (20,)))
                assert (await finish(client, "sigterm")).query.state == cpb.QUERY_STATE_SUCCEEDED
                proc.send_signal(signal.SIGTERM)
                assert await asyncio.to_thread(proc.wait, TIMEOUT_S) == 0
                log = log_path.read_text()
                assert "Traceback" not in log and "worker early-process stopped" in log, log
                deadline = time.monotonic() + TIMEOUT_S
                while (await client.status()).instances[0].connected:
                    assert time.monotonic() < deadline, "the coordinator still sees the worker"
                    await asyncio.sleep(0.02)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
