"""Admission: validate a submitted query, decide whether the cluster can still serve it in
time, store it once, release its root stages.

In order, a submission is

1. **validated** against the coordinator's input limits (`--max-calls`, `--max-prompt-bytes`,
   `--max-slo-s`, ...): `InvalidFieldError` naming the field (INVALID_ARGUMENT);
2. **matched** against a query of the same id: the same content returns the existing query
   (``created: false``, idempotent), different content is `AlreadyExistsError`;
3. **limited**: more than `--max-running-queries` running, or `--max-tenant-queries` of its
   tenant, is `OverloadedError` (RESOURCE_EXHAUSTED);
4. **predicted** (`hexgen_flow.admission`): a query that would not finish within
   `--admission-slack` x its SLO under the current load, or would push an admitted query
   past its deadline, is refused with a retry-after hint (``--admission reject``), admitted
   at the lowest urgency (``best-effort``, see below) or admitted anyway (``off``);
5. **stored** by Redis's submit script, which creates the query only if its id is new (a
   submission racing the first returns the stored query).

A best-effort query (``QueryInfo.best_effort``) is stored and running at once, but its
root stages wait here, first come first served, until it would be admitted (it is
predicted to finish within its SLO from then on, pushing no admitted query late): the
engines batch whatever they are given, so a call of the lowest urgency still slows every
call it runs beside. Its deadline is pushed far out, so every deadline-ordered queue
serves it last; its SLO stays for reporting. (A restarted coordinator releases them at
once.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import trace

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.dispatch import Dispatch
from hexgen_coordinator.events import record_event
from hexgen_coordinator.ledger import ActiveQuery, Ledger, SessionState
from hexgen_coordinator.store import WorkflowStore
from hexgen_coordinator.views import QueryViews
from hexgen_coordinator.write_behind import WriteBehind
from hexgen_flow.admission import (
    BEST_EFFORT_DELAY_S,
    AdmissionModel,
    Prediction,
    is_best_effort,
)
from hexgen_flow.runtime import CallTicket, QueryRun
from hexgen_flow.scheduler import GlobalScheduler
from hexgen_flow.workload import Query
from hexgen_service.auth import TenantLimits
from hexgen_service.convert import SubmitLimits, parse_submit, stage_names, without_prompts
from hexgen_service.errors import AlreadyExistsError, InvalidFieldError, OverloadedError

__all__ = ["Admission", "limits_of"]

K = cpb.QueryEventKind

log = logging.getLogger(__name__)

_MIN_RETRY_S = 0.05
_MAX_RETRY_S = 600.0
_RELEASE_PERIOD_S = 0.05
"""Wall seconds between looks at the waiting best-effort queries."""


def limits_of(config: CoordinatorConfig) -> SubmitLimits:
    """The input limits a coordinator with `config` enforces."""
    return SubmitLimits(
        max_calls=config.max_calls,
        max_stages=config.max_stages,
        max_prompt_bytes=config.max_prompt_bytes,
        max_id_bytes=config.max_id_bytes,
        max_tenant_bytes=config.max_tenant_bytes,
        max_slo_s=config.max_slo_s,
        allow_control_characters=False,
    )


class Admission:
    def __init__(
        self,
        config: CoordinatorConfig,
        scheduler: GlobalScheduler,
        store: WorkflowStore,
        tracer: trace.Tracer,
        ledger: Ledger,
        dispatch: Dispatch,
        writes: WriteBehind,
        views: QueryViews,
        *,
        tenant_limits: Callable[[str], TenantLimits] | None = None,
    ) -> None:
        self.config = config
        self.tenant_limits = tenant_limits
        """A tenant's own limits (the API keys file's ``tenants``); None: only the global
        ``--max-tenant-queries``."""
        self._rates: dict[str, TokenBucket] = {}
        self.scheduler = scheduler
        self.store = store
        self.tracer = tracer
        self.ledger = ledger
        self.dispatch = dispatch
        self.writes = writes
        self.views = views
        self.limits = limits_of(config)
        self.model = AdmissionModel(scheduler.cluster, scheduler.estimator)
        """The backlog of the running queries admitted at normal urgency."""
        self._best_effort: set[str] = set()
        self._pending: set[str] = set()
        """Ids between the admission decision and the store's answer."""
        self._waiting: deque[ActiveQuery] = deque()
        """Best-effort queries whose root stages are not released yet, in arrival order."""
        self._releaser: asyncio.Task[None] | None = None

    async def submit(
        self, request: cpb.SubmitQueryRequest, *, session_idle_s: float | None = None
    ) -> tuple[cpb.QueryInfo, bool]:
        """Admit a query (idempotent on its id); raises InvalidFieldError for bad input,
        AlreadyExistsError for a known id with other content, OverloadedError when refused.

        With `session_idle_s` the query is a workflow session (`hexgen_coordinator.sessions`)
        whose workflow is what it expects: its calls wait until given, and it is closed
        after that many wall seconds without a call."""
        t0 = time.perf_counter()
        query, prompts = parse_submit(request, self.limits)
        self.check_fits(query)
        slo_s = self.scheduler.slo_of(query, self.config.slo_scale)
        if not (math.isfinite(slo_s) and 0 < slo_s <= self.config.max_slo_s):
            raise InvalidFieldError(
                "slo_s" if query.slo_s is not None else "slo_scale",
                f"the SLO must be at most {self.config.max_slo_s:g} s, got {slo_s:g} s",
            )
        active = self.ledger.active
        existing = active.get(query.query_id)
        if existing is not None:
            if existing.session is not None:
                self._check_session(query, existing.session.opened, session_idle_s)
            else:
                self._check_same(query, prompts, existing.run.query, existing.prompts)
            return self._info(existing.run), False
        now = self.ledger.clock.now()
        query_id = query.query_id
        best_effort = False
        provisional: QueryRun | None = None
        if query_id not in self._pending:
            try:
                best_effort = self._decide(query, now, slo_s)
            except OverloadedError:
                # A resubmission of a stored query is answered, never refused.
                known = await self._known(query, prompts)
                if known is not None:
                    return known, False
                self.ledger.queries_rejected += 1
                self.ledger.metrics.queries_rejected.labels(query.tenant).inc()
                raise
            if not best_effort and self.config.admission != "off":
                # Counted in the backlog at once: submissions racing this one see it.
                provisional = QueryRun(query, -1, now, slo_s)
                self.model.track(provisional, self.config.admission_slack)
        self._pending.add(query_id)
        try:
            stages = query.workflow.stages
            created, index = await self.store.submit(
                query_id,
                request.SerializeToString(),
                query.tenant,
                now,
                slo_s,
                [len(s.calls) for s in stages],
                [len(s.after) for s in stages],
                shape=without_prompts(request),
                session_idle_s=session_idle_s,
            )
        except BaseException:
            if provisional is not None:
                self.model.forget(query_id)
            raise
        finally:
            self._pending.discard(query_id)
        if not created or query_id in active:
            if provisional is not None:
                self.model.forget(query_id)
            known = await self._known(query, prompts)
            if known is not None:
                return known, False
            return await self.views.get_info(query_id), False
        run = self.scheduler.admit(query, index, now, slo_s)
        session: SessionState | None = None
        if session_idle_s is not None:
            run.start_session()
            session = SessionState(
                names=stage_names(request.workflow),
                idle_timeout_s=session_idle_s,
                last_call_wall=time.monotonic(),
                opened=query,
                last_done_s=now,
            )
        if best_effort:
            run.deadline_s += BEST_EFFORT_DELAY_S
            self._best_effort.add(query_id)
        elif self.config.admission != "off":
            # The model forgets an ended query when it next predicts; with admission off it
            # never predicts, so it tracks nothing (it would hold every query ever run).
            self.model.track(run, self.config.admission_slack)
        span = self.tracer.start_span(
            "query",
            attributes={
                "query.id": query_id,
                "query.tenant": query.tenant,
                "query.slo_s": slo_s,
                "query.calls": query.workflow.num_calls,
                "query.best_effort": best_effort,
            },
        )
        entry = ActiveQuery(
            run,
            prompts,
            span,
            first_dispatch_pending=None if best_effort or session else t0,
            session=session,
        )
        active[query_id] = entry
        record_event(entry, K.QUERY_EVENT_KIND_SUBMITTED, now)
        if best_effort:
            self._waiting.append(entry)
            self.writes.persist(entry, [])
            self.release_waiting()
        else:
            self._release_roots(entry, now)
        return self._info(run), True

    def _release_roots(self, entry: ActiveQuery, now: float) -> None:
        released: list[CallTicket] = []
        for k in entry.run.query.workflow.roots:
            released.extend(self.dispatch.release_stage(entry, k, now))
        self.dispatch.send(released)
        self.dispatch.note_first_dispatch(entry, released)
        self.writes.persist(entry, released)

    # ------------------------------------------------------------------ best effort

    def release_waiting(self) -> int:
        """Release the waiting best-effort queries that would now be admitted, in arrival
        order (the first that would not stops the rest); keep looking while any wait.
        Returns how many were released."""
        waiting, active = self._waiting, self.ledger.active
        released = 0
        while waiting:
            entry = waiting[0]
            run = entry.run
            if active.get(run.query.query_id) is not entry:  # cancelled meanwhile
                waiting.popleft()
                continue
            now = self.ledger.clock.now()
            if not self.predict(run.query, now).meets(run.slo_s, self.config.admission_slack):
                break
            waiting.popleft()
            self.model.track(run, protect=False)
            self._release_roots(entry, now)
            released += 1
        if waiting and (self._releaser is None or self._releaser.done()):
            self._releaser = asyncio.ensure_future(self._keep_releasing())
        return released

    async def _keep_releasing(self) -> None:
        while self._waiting:
            await asyncio.sleep(_RELEASE_PERIOD_S)
            try:
                self.release_waiting()
            except Exception:  # keep looking; a bug here must not strand the queries
                log.exception("releasing best-effort queries failed")

    async def stop(self) -> None:
        """Stop looking at the waiting best-effort queries."""
        if self._releaser is not None:
            self._releaser.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._releaser

    def check_fits(self, query: Query) -> None:
        oversized = self.scheduler.oversized_call(query)
        if oversized is not None:
            k, c, call = oversized
            raise InvalidFieldError(
                f"workflow.stages[{k}].calls[{c}]",
                f"{call.input_tokens}+{call.output_tokens} tokens fit no instance's KV cache "
                f"(largest: {max(self.scheduler.load.kv_tokens)} tokens)",
            )

    # ------------------------------------------------------------------ the decision

    def predict(self, query: Query, now: float) -> Prediction:
        """What admitting `query` at `now` is predicted to do. While no instance is
        available (workers starting), the whole cluster is assumed: calls wait parked."""
        self._sync()
        available = self.scheduler.load.available
        if not any(available):
            available = [True] * len(available)
        return self.model.predict(query.workflow, now, available, self._alive)

    def _decide(self, query: Query, now: float, slo_s: float) -> bool:
        """Whether to admit `query` best-effort; raises OverloadedError to refuse it."""
        config = self.config
        active = self.ledger.active
        scale = self.ledger.clock.time_scale
        if len(active) >= config.max_running_queries:
            raise OverloadedError(
                f"{len(active)} queries are running (the coordinator's limit: "
                f"{config.max_running_queries})",
                self._wall(self._soonest_finish_s(now), scale),
            )
        own = self.tenant_limits(query.tenant) if self.tenant_limits else TenantLimits()
        cap = own.max_running or config.max_tenant_queries
        if cap > 0:
            running = Counter(e.run.query.tenant for e in active.values())[query.tenant]
            if running >= cap:
                raise OverloadedError(
                    f"tenant {query.tenant!r} has {running} queries running (limit: "
                    f"{cap}{'' if own.max_running else ' per tenant'})",
                    self._wall(self._soonest_finish_s(now, query.tenant), scale),
                )
        if own.rate_qps > 0:
            bucket = self._rates.get(query.tenant)
            if bucket is None or bucket.rate != own.rate_qps:
                bucket = TokenBucket(own.rate_qps, own.burst or max(1, math.ceil(own.rate_qps)))
                self._rates[query.tenant] = bucket
            wait = bucket.take(time.monotonic())
            if wait > 0:
                raise OverloadedError(
                    f"tenant {query.tenant!r} submits faster than its rate "
                    f"({own.rate_qps:g} queries/s, burst {bucket.burst}); retry in {wait:.2f} s",
                    wait,
                )
        if config.admission == "off":
            return False
        prediction = self.predict(query, now)
        slack = config.admission_slack
        if prediction.meets(slo_s, slack):
            return False
        if config.admission == "best-effort":
            return True
        wait = prediction.retry_after_s(slo_s, slack)
        raise OverloadedError(
            f"the cluster is overloaded: the query is predicted to take "
            f"{prediction.finish_s:.0f} s against an SLO of {slo_s:.0f} s"
            + ("" if prediction.delay_s <= prediction.headroom_s else " (or to delay others)")
            + f"; retry in {self._wall(wait, scale):.1f} s",
            self._wall(wait, scale),
        )

    def _soonest_finish_s(self, now: float, tenant: str | None = None) -> float:
        """Cluster seconds until a running query (of `tenant`) is due: a retry hint."""
        due = [
            e.run.deadline_s - now
            for e in self.ledger.active.values()
            if tenant is None or e.run.query.tenant == tenant
        ]
        return max(min(due, default=1.0), 0.0)

    @staticmethod
    def _wall(cluster_s: float, time_scale: float) -> float:
        if not math.isfinite(cluster_s):
            return _MAX_RETRY_S
        return min(max(cluster_s / time_scale, _MIN_RETRY_S), _MAX_RETRY_S)

    def _alive(self, run: QueryRun) -> bool:
        entry = self.ledger.active.get(run.query.query_id)
        return (entry is not None and entry.run is run) or run.index < 0

    def _sync(self) -> None:
        """Track running queries the model does not know yet (resumed after a restart)."""
        if self.config.admission == "off":
            return
        active = self.ledger.active
        best_effort = self._best_effort
        if len(best_effort) > 2 * len(active) + 64:
            best_effort.intersection_update(active)
        if len(self.model) + len(best_effort) >= len(active):
            return
        tracked = {run.query.query_id for run in self.model.tracked()}
        for query_id, entry in active.items():
            if query_id in tracked or query_id in best_effort:
                continue
            if is_best_effort(entry.run):
                best_effort.add(query_id)
            else:
                self.model.track(entry.run, self.config.admission_slack)

    # ------------------------------------------------------------------ idempotency

    def _info(self, run: QueryRun) -> cpb.QueryInfo:
        return self.views.info_of_run(run)

    @staticmethod
    def _check_session(query: Query, opened: Query, session_idle_s: float | None) -> None:
        if session_idle_s is None:
            raise AlreadyExistsError(
                "query_id", f"{query.query_id!r} is a workflow session (use RunCall)"
            )
        if query != opened:
            raise AlreadyExistsError(
                "workflow_id",
                f"a workflow {query.query_id!r} with other content is open (open it with "
                "the same content, or use a new id)",
            )

    @staticmethod
    def _check_same(
        query: Query,
        prompts: list[tuple[str, ...]],
        known: Query,
        known_prompts: list[tuple[str, ...]],
    ) -> None:
        if query != known or prompts != known_prompts:
            raise AlreadyExistsError(
                "query_id",
                f"a query {query.query_id!r} with other content exists (resubmit the same "
                "content, or use a new id)",
            )

    async def _known(self, query: Query, prompts: list[tuple[str, ...]]) -> cpb.QueryInfo | None:
        """The stored query of the same id (its info), None when there is none; raises
        AlreadyExistsError when its content differs."""
        entry = self.ledger.active.get(query.query_id)
        if entry is not None:
            self._check_same(query, prompts, entry.run.query, entry.prompts)
            return self._info(entry.run)
        stored = await self.store.load(query.query_id)
        if stored is None:
            return None
        try:
            known, known_prompts = parse_submit(cpb.SubmitQueryRequest.FromString(stored.submit))
        except Exception:  # an unreadable stored submission cannot be matched
            known, known_prompts = None, []
        if known is None:
            raise AlreadyExistsError("query_id", f"a query {query.query_id!r} exists")
        self._check_same(query, prompts, known, known_prompts)
        return self.views.info_of_stored(stored)


@dataclass
class TokenBucket:
    """`rate` tokens a second, at most `burst` saved up; a submission takes one."""

    rate: float
    burst: int
    tokens: float = -1.0
    at: float = 0.0

    def take(self, now: float) -> float:
        """Take a token at `now` (wall seconds): 0 when one was there, else the seconds
        until one will be (nothing taken)."""
        if self.tokens < 0:
            self.tokens, self.at = float(self.burst), now
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate
