"""The coordinator: admits queries, keeps their state in Redis, dispatches their calls.

All scheduling decisions are the core's: each part hands the scheduling protocol
(`hexgen_flow.protocol.Scheduler`, the one the simulator drives) an event and carries out
the actions it returns. `Coordinator` is the one object the gRPC servicers, `__main__` and
the tests hold; it builds the parts a live system needs around the core and passes each
call on:

- `ledger`: the in-memory state, held by one owner per concern (running queries, calls in
  flight, worker slots, counters, the clock), each part given only those it uses; and the
  locking rule every part follows;
- `admission`: validating and storing a submitted query, releasing its roots;
- `dispatch`: released stages to tickets, tickets to their workers' streams;
- `completions`: what workers report about their calls, and cancellation;
- `sessions` (with `session_store`): workflows whose calls arrive one by one;
- `workers` (with `links`): slots, worker reconnects, lost workers, heartbeats;
- `worker_messages`: the worker protocol as these parts speak it, plain values that the
  gRPC servicer (`service`, through `worker_wire`) alone translates to and from protobuf;
- `client_messages`: the client API as they speak it (a submission, a session opened or
  given a call, a query's events and what clients read), which the servicer (through
  `client_wire`) translates; `client_wire` also encodes what Redis keeps of it;
- `recovery`: rebuilding running queries from Redis after a restart;
- `events`, `views`: a query's event log and watchers, what clients read;
- `write_behind`: persistence off the critical path; `store`: Redis itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple, TextIO

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from hexgen_coordinator import events
from hexgen_coordinator.admission import Admission, limits_of
from hexgen_coordinator.client_messages import (
    AlphaChange,
    AlphaHistory,
    CallSubmitted,
    ClusterStatus,
    OpenWorkflow,
    QueryDetail,
    QueryEvent,
    QueryInfo,
    QueryState,
    RunCall,
    Submission,
)
from hexgen_coordinator.completions import Completions
from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.dispatch import Dispatch
from hexgen_coordinator.ledger import ActiveQuery, Ledger
from hexgen_coordinator.links import SlotTakenError, WorkerLink
from hexgen_coordinator.metrics import CoordinatorMetrics
from hexgen_coordinator.pipelined_redis import PipelinedRedis
from hexgen_coordinator.recovery import Recovery
from hexgen_coordinator.redis_memory import RedisMemory
from hexgen_coordinator.session_store import SessionStore
from hexgen_coordinator.sessions import Sessions
from hexgen_coordinator.shards import ShardLease
from hexgen_coordinator.store import WorkflowStore
from hexgen_coordinator.views import QueryViews, UnknownQueryError
from hexgen_coordinator.worker_messages import Finished, Heartbeat, Hello, Started, Tokens, Welcome
from hexgen_coordinator.workers import WorkerSlots
from hexgen_coordinator.write_behind import WriteBehind
from hexgen_flow.alpha import alpha_problem
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.lengths import OutputLengthPredictor
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.protocol import AlphaChanged, InstanceLost, Scheduler
from hexgen_flow.runtime import CallTicket
from hexgen_flow.scheduler import GlobalScheduler
from hexgen_service.auth import KeyStore
from hexgen_service.clock import ClusterClock
from hexgen_service.errors import InvalidFieldError
from hexgen_service.loop_lag import watch_loop_lag
from hexgen_service.telemetry import setup_tracing

__all__ = ["Coordinator", "SlotTakenError", "UnknownQueryError", "WorkerLink"]

log = logging.getLogger(__name__)

LEARNED_SAVE_S = 5.0
"""Wall seconds between two writes of what was learned to Redis (`--learn-costs`,
`--output-lengths learned`)."""


class _Saved(NamedTuple):
    """What was last written of the cost learners' and the length belief's states."""

    costs: dict[str, str]
    lengths: dict[str, str]


def _changed(now: dict[str, str], saved: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in now.items() if saved.get(k) != v}


class Coordinator:
    def __init__(
        self,
        config: CoordinatorConfig,
        redis: aioredis.Redis[bytes],
        lease: ShardLease | None = None,
        *,
        pipelined: PipelinedRedis | None = None,
    ) -> None:
        """`pipelined`: the completion path's own Redis connection (`redis_retry.pipelined_client`);
        None: everything goes through `redis`."""
        self.config = config
        self.limits = limits_of(config)
        """The input limits a request is held to (`--max-calls`, `--max-prompt-bytes`, ...):
        what the servicer decodes a submission with (`client_wire.decode_submit`)."""
        self.lease = lease
        """The shard this coordinator holds (`hexgen_coordinator.shards`); None: not sharded,
        every workflow is its own."""
        self.cluster = parse_cluster(config.cluster, config.model, config.calibration)
        preset = resolve_policy(config.policy)
        self.scheduler = GlobalScheduler(
            self.cluster, preset, seed=config.seed, prefix_caching=config.prefix_caching
        )
        if config.learn_costs:
            self.scheduler.learn_costs()
        self._cost_journal: TextIO | None = None
        """``--cost-journal``: each call's cost appended, a line at a time."""
        if config.cost_journal:
            try:
                self._cost_journal = open(config.cost_journal, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (closed by `stop`)
            except OSError as exc:
                raise ConfigError(f"--cost-journal {config.cost_journal}: {exc.strerror}") from None
        self.core = Scheduler(
            self.scheduler,
            lengths=OutputLengthPredictor(within_declared=True)
            if config.output_lengths == "learned"
            else None,
        )
        """The scheduling protocol (`hexgen_flow.protocol`): every part hands it events and
        carries out the actions it returns; `scheduler` (its policies) is read, not
        changed, outside it."""
        self.store = WorkflowStore(
            redis,
            config.redis_prefix,
            retention_s=config.retention_s,
            stream_maxlen=config.stream_maxlen,
            pipelined=pipelined,
        )
        self.redis = redis
        self.slo_base_s = self.scheduler.slo_base_s
        self.tracer = setup_tracing("hexgen-coordinator")
        self.ledger = Ledger(len(self.cluster), ClusterClock.starting_now(config.time_scale))
        """The owners of the in-memory state; each part below takes the ones it uses."""
        ledger = self.ledger
        queries, calls, slots, tally, clock = (
            ledger.queries,
            ledger.calls,
            ledger.slots,
            ledger.tally,
            ledger.clock,
        )
        # The owners' own objects, under the names tests and benchmarks read.
        self.active: dict[str, ActiveQuery] = queries.active
        self.tickets: dict[str, CallTicket] = calls.tickets
        self.links: list[WorkerLink | None] = slots.links
        self._tasks: list[asyncio.Task[None]] = []
        cluster, scheduler, store = self.cluster, self.scheduler, self.store
        core = self.core
        self._writes = WriteBehind(store, queries.active)
        self._views = QueryViews(cluster, scheduler, store, queries, calls, slots, tally, clock)
        self._dispatch = Dispatch(
            cluster, core, self.tracer, queries, calls, slots, tally, clock, self._writes
        )
        self.keys = KeyStore(Path(config.api_keys_file)) if config.api_keys_file else None
        """The API keys (`hexgen_service.auth`); None: clients are not authenticated."""
        self._admission = Admission(
            config,
            core,
            store,
            self.tracer,
            queries,
            tally,
            clock,
            self._dispatch,
            self._writes,
            self._views,
            tenant_limits=self.keys.limits if self.keys is not None else None,
        )
        self._completions = Completions(
            cluster,
            core,
            store,
            queries,
            calls,
            slots,
            tally,
            clock,
            self._dispatch,
            self._writes,
            self._views,
            max_attempts=config.max_call_attempts,
            cost_journal=self._cost_journal,
        )
        self._sessions = Sessions(
            config,
            core,
            SessionStore(store),
            queries,
            calls,
            clock,
            self._admission,
            self._dispatch,
            self._completions,
            self._writes,
            self._views,
        )
        self._recovery = Recovery(
            config, core, store, redis, self.tracer, queries, calls, clock, self._dispatch
        )
        self._workers = WorkerSlots(
            config,
            cluster,
            core,
            calls,
            slots,
            clock,
            self._dispatch,
            self._writes,
            self._recovery,
            self._completions,
        )
        for i in range(len(self.cluster)):  # no worker holds a slot yet
            core.handle(InstanceLost(i, 0.0))
        tally.metrics.watch(queries, slots, scheduler, cluster)

    @property
    def clock(self) -> ClusterClock:
        return self.ledger.clock.current

    @property
    def metrics(self) -> CoordinatorMetrics:
        """The coordinator's Prometheus metrics (`hexgen_coordinator.metrics`)."""
        return self.ledger.tally.metrics

    @property
    def completions(self) -> int:
        """Calls completed since this coordinator started."""
        return self.ledger.tally.completions

    @property
    def queries_finished(self) -> int:
        """Queries that succeeded in this cluster (the `finished` stream's length)."""
        return self.ledger.tally.queries_finished

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        epoch, scale = await self.store.epoch(time.time(), self.config.time_scale)
        if scale != self.config.time_scale:
            log.warning(
                "cluster keeps its first time scale %s (asked: %s)", scale, self.config.time_scale
            )
        self.ledger.clock.set(ClusterClock(epoch, scale))
        stored_alpha = await self.store.alpha()
        alpha = self.config.alpha if self.config.alpha is not None else stored_alpha
        if alpha is not None and self.scheduler.alpha is not None:
            self.core.handle(AlphaChanged(alpha))
        await self._record_starting_alpha(stored_alpha)
        self.ledger.tally.carry_on(int(await self.redis.xlen(self.store.finished_key)))
        if self.scheduler.learner is not None:
            restored = self.scheduler.restore_costs(await self.store.learned())
            if restored:
                log.info(
                    "cost learning carries on for %s",
                    ", ".join(self.cluster.instances[i].name for i in restored),
                )
        lengths = self._length_learner()
        if lengths is not None:
            steps = lengths.restore(await self.store.lengths())
            if steps:
                log.info("output-length learning carries on for %s", ", ".join(sorted(steps)))
        if self.scheduler.learner is not None or lengths is not None:
            self._tasks.append(asyncio.create_task(self._keep_learned()))
        if not self.config.redis_cluster:  # a cluster's memory is per node
            memory = RedisMemory(self.redis, self.config.redis_memory_limit)
            await memory.start()
            if memory.max_bytes:
                self._admission.redis_memory = memory
                self._tasks.append(asyncio.create_task(memory.watch()))
        grace = await self._recovery.resume()
        if grace is not None:
            self._tasks.append(grace)
        await self._sessions.settle_resumed()
        self._tasks.append(asyncio.create_task(self._workers.watch_heartbeats()))
        lag = self.metrics.loop_lag
        self._tasks.append(asyncio.create_task(watch_loop_lag(lag.observe)))
        self._tasks.append(asyncio.create_task(self._sessions.close_idle()))

    async def _record_starting_alpha(self, stored: float | None) -> None:
        """Record the α this coordinator starts with in the α history when it is not the
        last one recorded (a first start, ``--alpha``, or a history lost), so that the one
        history (GetAlphaHistory; the tuner shows it) holds every α the dispatcher ran
        with."""
        alpha = self.scheduler.alpha
        if alpha is None:
            return
        last = await self.store.alpha_history(1)
        if last and last[-1].alpha == alpha:
            return
        if self.config.alpha is not None:
            reason = "--alpha at start"
        elif stored is not None:
            reason = "kept in Redis, at start"
        else:
            reason = f"the default of policy {self.config.policy}, at start"
        await self.store.record_alpha(alpha, self.clock.now(), reason)

    def _length_learner(self) -> OutputLengthPredictor | None:
        lengths = self.core.lengths
        return lengths if isinstance(lengths, OutputLengthPredictor) else None

    async def _keep_learned(self) -> None:
        """Write what the cost learners and the output-length belief learned to Redis
        every `LEARNED_SAVE_S` wall seconds when it changed (a crash loses at most that
        much learning; `stop` writes the rest)."""
        saved = _Saved({}, {})
        while True:
            await asyncio.sleep(LEARNED_SAVE_S)
            saved = await self._save_learned(saved)

    async def _save_learned(self, saved: _Saved) -> _Saved:
        learner, lengths = self.scheduler.learner, self._length_learner()
        costs = learner.states(self.cluster) if learner is not None else {}
        steps = lengths.state() if lengths is not None else {}
        try:
            await self.store.save_learned(_changed(costs, saved.costs))
            await self.store.save_lengths(_changed(steps, saved.lengths))
        except RedisError as exc:  # the next round tries again
            log.warning("could not keep what was learned in Redis: %s", exc)
            return saved
        return _Saved(costs, steps)

    async def stop(self) -> None:
        await self._admission.stop()
        await self.flush()
        await self._save_learned(_Saved({}, {}))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for link in self.links:
            if link is not None:
                link.close()
        if self._cost_journal is not None:
            self._cost_journal.close()

    async def flush(self) -> None:
        """Wait until every write behind has reached Redis."""
        await self._writes.flush()

    # ------------------------------------------------------------------ queries

    async def submit(self, submission: Submission) -> tuple[QueryInfo, bool]:
        """Admit a query (idempotent on its id); raises InvalidFieldError for bad input."""
        info, created = await self._admission.submit(submission)
        if not created and info.state == QueryState.RUNNING and info.query_id not in self.active:
            # Stored and running, yet not in memory: the submit script ran on an earlier
            # try whose reply was lost (Redis went away). Take it up as a restart would.
            await self._recovery.resume_one(info.query_id)
        return info, created

    async def open_workflow(self, opened: OpenWorkflow) -> tuple[QueryInfo, bool]:
        """Open a workflow session (idempotent on its id); raises InvalidFieldError."""
        info, created = await self._sessions.open(opened)
        if not created and info.state == QueryState.RUNNING and info.query_id not in self.active:
            await self._recovery.resume_one(info.query_id)  # as in `submit`
        return info, created

    def run_call(self, request: RunCall) -> AsyncIterator[CallSubmitted | QueryEvent]:
        """Give a call of an open session: its events until it finishes."""
        return self._sessions.run_call(request)

    async def close_workflow(self, workflow_id: str) -> QueryInfo:
        return await self._sessions.close(workflow_id)

    async def cancel(self, query_id: str) -> QueryInfo:
        return await self._completions.cancel(query_id)

    def watch(self, query_id: str) -> AsyncIterator[QueryEvent]:
        """The query's events so far, then live ones until it ends."""
        return events.watch(query_id, self.ledger.queries, self._views, self._writes)

    async def get_info(self, query_id: str) -> QueryInfo:
        return await self._views.get_info(query_id)

    async def get(self, query_id: str) -> QueryDetail:
        """The query's info, events and stages; raises UnknownQueryError."""
        return await self._views.get(query_id)

    def status(self) -> ClusterStatus:
        return self._views.status()

    async def set_alpha(self, alpha: float, reason: str) -> float:
        previous = self.scheduler.alpha
        if previous is None:
            raise InvalidFieldError("alpha", f"policy {self.config.policy!r} has no alpha")
        if (problem := alpha_problem(alpha)) is not None:
            raise InvalidFieldError("alpha", f"{problem}, got {alpha}")
        self.core.handle(AlphaChanged(alpha))
        await self.store.set_alpha(alpha, self.clock.now(), reason)
        return previous

    async def alpha_history(self, limit: int) -> AlphaHistory:
        """The α in force and the latest `limit` changes (0: all kept), oldest first, from
        this coordinator's ``alpha:history``; raises InvalidFieldError for a negative
        `limit`."""
        if limit < 0:
            raise InvalidFieldError("limit", f"must be >= 0, got {limit}")
        history = await self.store.alpha_history(limit)
        clock = self.clock
        return AlphaHistory(
            alpha=self.scheduler.alpha or 0.0,
            changes=tuple(
                AlphaChange(
                    time_s=c.time_s,
                    unix_s=clock.wall_time(c.time_s),
                    alpha=c.alpha,
                    reason=c.reason,
                )
                for c in history
            ),
        )

    # ------------------------------------------------------------------ workers

    def connect(self, hello: Hello, link: WorkerLink) -> Welcome:
        """Give a worker its slot; raises InvalidFieldError / SlotTakenError."""
        return self._workers.connect(hello, link)

    def disconnect(self, link: WorkerLink, reason: str) -> None:
        """The worker's stream ended: its calls go elsewhere."""
        self._workers.disconnect(link, reason)

    def on_heartbeat(self, link: WorkerLink, msg: Heartbeat) -> None:
        self._workers.on_heartbeat(link, msg)

    async def on_finished(self, link: WorkerLink, msg: Finished) -> None:
        await self._completions.on_finished(link, msg)

    def on_started(self, link: WorkerLink, msg: Started) -> None:
        self._completions.on_started(link, msg)

    def on_tokens(self, link: WorkerLink, msg: Tokens) -> None:
        self._completions.on_tokens(link, msg)
