"""Admission: validate a submitted query, decide whether the cluster can still serve it in
time, store it once, release its root stages.

In order, a submission is

1. **validated** against the coordinator's input limits (`--max-calls`, `--max-prompt-bytes`,
   `--max-slo-s`, ...) as the servicer decodes it (`client_wire.decode_submit`, which
   makes the `Submission` admitted here), then against what the deployment serves (a
   call's output tokens, the KV caches, the SLO): `InvalidFieldError` naming the field
   (INVALID_ARGUMENT);
2. **matched** against a query of the same id: the same content returns the existing query
   (``created: false``, idempotent), different content is `AlreadyExistsError`;
3. **limited**: more than `--max-running-queries` running, or `--max-tenant-queries` of its
   tenant, is `OverloadedError` (RESOURCE_EXHAUSTED);
4. **given room**: Redis above ``--redis-memory-limit`` of its maxmemory, a tenant whose
   kept prompts would pass its byte quota (``--max-tenant-prompt-bytes``, or the keys
   file's ``max_prompt_bytes``), or whose work in flight would pass its ``max_work_s``:
   `OverloadedError` with a hint;
5. **predicted** (`hexgen_flow.admission.decide`): a query that cannot meet its SLO even
   alone on the whole cluster is refused for good (INVALID_ARGUMENT on ``slo_s``: no wait
   can help); one that would not finish within `--admission-slack` x its SLO under the
   load it shares instances with, or would push an admitted query past its deadline, is
   refused with a retry-after hint (``--admission reject``), admitted at the lowest
   urgency (``best-effort``, both kinds; see below) or admitted anyway (``off``). The
   load it is judged by is local and fair: only what the admitted queries can do within
   its window, and another tenant's at most its weighted share (the keys file's
   ``weight``);
6. **stored** by Redis's submit script, which creates the query only if its id is new (a
   submission racing the first returns the stored query), its prompts apart, each kept
   until its call completes.

Every retry hint is at least a second and spread by up to half again at random, so that
clients refused together do not come back together.

A best-effort query (``QueryInfo.best_effort``) is stored and running at once, but its
root stages wait here, first come first served, until it would be admitted (it is
predicted to finish within its SLO from then on, pushing no admitted query late): the
engines batch whatever they are given, so a call of the lowest urgency still slows every
call it runs beside. Its deadline is pushed far out, so every deadline-ordered queue
serves it last; its SLO stays for reporting, and its work is not counted against
queries admitted at normal urgency. (A restarted coordinator releases them at once, still
after every query held to its SLO: Redis keeps that it is best-effort.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from opentelemetry import trace

from hexgen_coordinator.client_messages import EventKind, QueryInfo, Submission
from hexgen_coordinator.client_wire import prompt_to_bytes
from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.dispatch import Dispatch
from hexgen_coordinator.events import record_event
from hexgen_coordinator.ledger import (
    ActiveQuery,
    Clock,
    Queries,
    SessionState,
    Tally,
    call_id_of,
)
from hexgen_coordinator.redis_memory import RedisMemory
from hexgen_coordinator.session_store import stored_submission
from hexgen_coordinator.store import WorkflowStore, prompts_digest
from hexgen_coordinator.views import QueryViews
from hexgen_coordinator.write_behind import WriteBehind
from hexgen_flow.admission import (
    AdmissionMode,
    AdmissionModel,
    Prediction,
    Verdict,
    decide,
    is_best_effort,
)
from hexgen_flow.cluster import Cluster
from hexgen_flow.latency import resolve_model
from hexgen_flow.protocol import Action, Admitted, Scheduler, Start, Submit
from hexgen_flow.runtime import QueryRun
from hexgen_flow.workload import LLMCall, Query
from hexgen_service.auth import TenantLimits
from hexgen_service.convert import MAX_TOKENS_PER_CALL, SubmitLimits, check_declared_tokens
from hexgen_service.errors import AlreadyExistsError, InvalidFieldError, OverloadedError
from hexgen_service.telemetry import traceparent_of

__all__ = ["Admission", "context_tokens", "limits_of"]


log = logging.getLogger(__name__)

_MIN_RETRY_S = 1.0
"""The least retry hint (wall seconds): clients refused in a burst and told to come back at
once would come back as a burst, many times a second."""
_RETRY_JITTER = 0.5
"""A hint is its value times a random factor in [1, 1 + jitter): clients refused together
come back spread out."""
_MAX_RETRY_S = 600.0
_RELEASE_PERIOD_S = 0.05
"""Wall seconds between looks at the waiting best-effort queries."""


def context_tokens(cluster: Cluster) -> int:
    """The longest context of the cluster's models (the default ``--max-output-tokens``);
    `MAX_TOKENS_PER_CALL` when no model's is known."""
    known = [
        tokens
        for name in {inst.model for inst in cluster.instances}
        if (tokens := resolve_model(name).context_tokens) is not None
    ]
    return max(known, default=MAX_TOKENS_PER_CALL)


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
        core: Scheduler,
        store: WorkflowStore,
        tracer: trace.Tracer,
        queries: Queries,
        tally: Tally,
        clock: Clock,
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
        self.core = core
        self.scheduler = core.policy
        """Read only here (its cluster, estimator, load and SLO base)."""
        scheduler = core.policy
        self.store = store
        self.tracer = tracer
        self.queries = queries
        self.tally = tally
        self.clock = clock
        self.dispatch = dispatch
        self.writes = writes
        self.views = views
        self.mode = AdmissionMode.parse(config.admission)
        self.max_output_tokens = config.max_output_tokens or context_tokens(scheduler.cluster)
        """Most output tokens a call may ask for (``--max-output-tokens``)."""
        self.model = AdmissionModel(scheduler.cluster, scheduler.estimator, weight_of=self._weight)
        """The backlog of the running queries (best-effort ones apart)."""
        self.redis_memory: RedisMemory | None = None
        """How full Redis is (set by the coordinator when it watches); None: not watched."""
        self._rng = random.Random(config.seed)
        """Jitters the retry hints (`hint_s`)."""
        self._best_effort: set[str] = set()
        self._pending: set[str] = set()
        """Ids between the admission decision and the store's answer."""
        self._waiting: deque[ActiveQuery] = deque()
        """Best-effort queries whose root stages are not released yet, in arrival order."""
        self._releaser: asyncio.Task[None] | None = None

    async def submit(
        self,
        submission: Submission,
        *,
        session_idle_s: float | None = None,
        names: Sequence[str] = (),
    ) -> tuple[QueryInfo, bool]:
        """Admit a query (idempotent on its id); raises InvalidFieldError for bad input,
        AlreadyExistsError for a known id with other content, OverloadedError when refused.
        `submission` is within the input limits (`client_wire.decode_submit` checked them).

        With `session_idle_s` the query is a workflow session (`hexgen_coordinator.sessions`)
        whose workflow is what it expects, its stages named `names`: its calls wait until
        given, and it is closed after that many wall seconds without a call."""
        t0 = submission.received
        query, prompts = submission.query, submission.prompts
        sizes = [[len(p.encode("utf-8")) for p in texts] for texts in prompts]
        self.check_fits(query, sizes)
        slo_s = self.scheduler.slo_of(query, self.config.slo_scale)
        if not (math.isfinite(slo_s) and 0 < slo_s <= self.config.max_slo_s):
            raise InvalidFieldError(
                "slo_s" if query.slo_s is not None else "slo_scale",
                f"the SLO must be at most {self.config.max_slo_s:g} s, got {slo_s:g} s",
            )
        digest = prompts_digest(prompts)
        active = self.queries.active
        existing = active.get(query.query_id)
        if existing is not None:
            if existing.session is not None:
                self._check_session(query, existing.session.opened, session_idle_s)
            else:
                declared = self.core.declared(existing.run)
                self._check_same(query, digest, declared, existing.digest)
            return self._info(existing.run), False
        now = self.clock.now()
        query_id = query.query_id
        best_effort = False
        provisional: QueryRun | None = None
        if query_id not in self._pending:
            try:
                best_effort = self._decide(query, now, slo_s, sum(map(sum, sizes)))
            except (OverloadedError, InvalidFieldError) as exc:
                # A resubmission of a stored query is answered, never refused.
                known = await self._known(query, digest)
                if known is not None:
                    return known, False
                self.tally.rejected(query.tenant, exc.reason)
                raise
            if not best_effort and self._tracks(query.tenant):
                # Counted in the backlog at once: submissions racing this one see it.
                provisional = QueryRun(query, -1, now, slo_s)
                self.model.track(provisional, self.config.admission_slack)
        kept = {
            call_id_of(query_id, k, i): prompt_to_bytes(text)
            for k, texts in enumerate(prompts)
            for i, text in enumerate(texts)
            if text
        }
        # The workflow's root span, started before the query is stored so that its
        # traceparent is stored with it: a restarted coordinator's spans of the query, and a
        # gateway's spans of its later requests, are parented into its trace. Never ended
        # (so never exported) when the id turns out to be known.
        span = self.tracer.start_span(
            "query",
            attributes={
                "query.id": query_id,
                "query.tenant": query.tenant,
                "query.slo_s": slo_s,
                "query.calls": query.workflow.num_calls,
                "query.best_effort": best_effort,
                "gen_ai.conversation.id": query_id,
            },
        )
        root = traceparent_of(span)
        self._pending.add(query_id)
        try:
            stages = query.workflow.stages
            shape = submission.shape()
            created, index = await self.store.submit(
                query_id,
                shape,
                query.tenant,
                now,
                slo_s,
                [len(s.calls) for s in stages],
                [len(s.after) for s in stages],
                shape=shape,
                session_idle_s=session_idle_s,
                prompts=kept,
                digest=digest,
                trace=root,
                best_effort=best_effort,
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
            known = await self._known(query, digest)
            if known is not None:
                return known, False
            return await self.views.get_info(query_id), False
        # The core admits the query (a best-effort one waits, WAITING) and releases its
        # root stages: carried out once its entry exists.
        actions = self.core.handle(
            Submit(
                query,
                index,
                now,
                slo_s,
                best_effort=best_effort,
                session=session_idle_s is not None,
            )
        )
        admitted = actions[0]
        assert isinstance(admitted, Admitted)
        run = admitted.run
        self.tally.metrics.admitted(query.tenant, (s.step for s in stages))
        session: SessionState | None = None
        if session_idle_s is not None:
            session = SessionState(
                names=list(names),
                idle_timeout_s=session_idle_s,
                last_call_wall=time.monotonic(),
                opened=query,
                last_done_s=now,
            )
        if best_effort:
            self._best_effort.add(query_id)
        elif self._tracks(query.tenant):
            self.model.track(run, self.config.admission_slack)
        entry = ActiveQuery(
            run,
            prompts,
            span,
            first_dispatch_pending=None if best_effort or session else t0,
            session=session,
            digest=digest,
            trace=root,
        )
        queries = self.queries
        queries.add(entry)
        for k, texts in enumerate(sizes):
            for i, nbytes in enumerate(texts):
                queries.hold_prompt(entry, call_id_of(query_id, k, i), nbytes)
        record_event(entry, EventKind.SUBMITTED, now)
        if best_effort:
            self._waiting.append(entry)
            self.writes.persist(entry, [])
            self.release_waiting()
        else:
            self._carry_out(entry, actions[1:], now)
        return self._info(run), True

    def _carry_out(self, entry: ActiveQuery, actions: Sequence[Action], now: float) -> None:
        """The root stages the core released: sent (`Dispatch.carry_out`), persisted."""
        for rest in self.dispatch.carry_out(actions, now):
            raise AssertionError(f"unexpected action at admission: {rest!r}")
        self.writes.persist(entry, [])

    # ------------------------------------------------------------------ best effort

    def release_waiting(self) -> int:
        """Release the waiting best-effort queries that would now be admitted, in arrival
        order (the first that would not stops the rest); keep looking while any wait.
        Returns how many were released."""
        waiting, active = self._waiting, self.queries.active
        released = 0
        while waiting:
            entry = waiting[0]
            run = entry.run
            if active.get(run.query.query_id) is not entry:  # cancelled meanwhile
                waiting.popleft()
                continue
            now = self.clock.now()
            prediction = self.predict(self.core.declared(run), now, run.slo_s, best_effort=True)
            if not prediction.meets(run.slo_s, self.config.admission_slack):
                break
            waiting.popleft()
            self.model.track(run, best_effort=True)
            self._carry_out(entry, self.core.handle(Start(run, now)), now)
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

    def check_fits(self, query: Query, prompt_bytes: list[list[int]]) -> None:
        """InvalidFieldError naming the first call the deployment cannot serve as asked
        (`check_call`); `prompt_bytes`: each call's prompt size, per stage."""
        for k, stage in enumerate(query.workflow.stages):
            for c, call in enumerate(stage.calls):
                self.check_call(f"workflow.stages[{k}].calls[{c}]", call, prompt_bytes[k][c])

    def check_call(self, field: str, call: LLMCall, prompt_bytes: int) -> None:
        """InvalidFieldError on `field` (or its ``.output_tokens``, ``.input_tokens``) for a
        call that asks for more output tokens than ``--max-output-tokens``, fits no
        instance's KV cache, or declares fewer input tokens than its prompt of
        `prompt_bytes` can hold (`check_declared_tokens`)."""
        if call.output_tokens > self.max_output_tokens:
            raise InvalidFieldError(
                f"{field}.output_tokens",
                f"must be at most {self.max_output_tokens} (the deployment's "
                f"--max-output-tokens), got {call.output_tokens}",
            )
        largest = max(self.scheduler.load.kv_tokens)
        if call.input_tokens + call.output_tokens > largest:
            raise InvalidFieldError(
                field,
                f"{call.input_tokens}+{call.output_tokens} tokens fit no instance's KV cache "
                f"(largest: {largest} tokens)",
            )
        check_declared_tokens(f"{field}.input_tokens", call.input_tokens, prompt_bytes)

    def check_room(self, tenant: str, prompt_bytes: int) -> None:
        """OverloadedError when new work of `tenant` with `prompt_bytes` of prompts would not
        fit: Redis above ``--redis-memory-limit``, or the tenant's kept prompts past its
        quota."""
        if self.redis_memory is not None:
            try:
                self.redis_memory.check()
            except OverloadedError as exc:
                raise OverloadedError(
                    str(exc), self.hint_s(exc.retry_after_s, 1.0), reason="redis_memory"
                ) from None
        limits = self._limits(tenant)
        quota = limits.max_prompt_bytes or self.config.max_tenant_prompt_bytes
        kept = self.queries.kept_bytes(tenant)
        if prompt_bytes > quota:
            whose = "its own" if limits.max_prompt_bytes else "--max-tenant-prompt-bytes"
            raise InvalidFieldError(
                "prompt",
                f"{prompt_bytes} bytes of prompts are more than tenant {tenant!r} may keep "
                f"at once ({quota} bytes, {whose})",
                reason="too_large",
            )
        if kept + prompt_bytes > quota:
            now = self.clock.now()
            raise OverloadedError(
                f"tenant {tenant!r} keeps {kept} bytes of prompts in running calls; "
                f"{prompt_bytes} more would pass its quota of {quota} bytes: retry when its "
                "calls have finished",
                self.hint_s(self._soonest_finish_s(now, tenant)),
                reason="quota",
            )

    # ------------------------------------------------------------------ the decision

    def predict(
        self, query: Query, now: float, slo_s: float | None = None, *, best_effort: bool = False
    ) -> Prediction:
        """What admitting `query` at `now` is predicted to do (within its window when its
        SLO `slo_s` is given). While no instance is available (workers starting), the
        whole cluster is assumed: calls wait parked."""
        self._sync()
        query = self.core.believe(query)  # with the output lengths dispatch will plan
        available = self.scheduler.load.available
        if not any(available):
            available = [True] * len(available)
        window = math.inf if slo_s is None else self.config.admission_slack * slo_s
        return self.model.predict(
            query.workflow,
            now,
            available,
            self._alive,
            tenant=query.tenant,
            window_s=window,
            best_effort=best_effort,
        )

    def _decide(self, query: Query, now: float, slo_s: float, prompt_bytes: int) -> bool:
        """Whether to admit `query` best-effort; raises OverloadedError to refuse it for
        now, InvalidFieldError to refuse it for good."""
        config = self.config
        active = self.queries.active
        if len(active) >= config.max_running_queries:
            raise OverloadedError(
                f"{len(active)} queries are running (the coordinator's limit: "
                f"{config.max_running_queries})",
                self.hint_s(self._soonest_finish_s(now)),
                reason="running_limit",
            )
        own = self._limits(query.tenant)
        cap = own.max_running or config.max_tenant_queries
        if cap > 0:
            running = Counter(e.run.query.tenant for e in active.values())[query.tenant]
            if running >= cap:
                raise OverloadedError(
                    f"tenant {query.tenant!r} has {running} queries running (limit: "
                    f"{cap}{'' if own.max_running else ' per tenant'})",
                    self.hint_s(self._soonest_finish_s(now, query.tenant)),
                    reason="tenant_limit",
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
                    f"({own.rate_qps:g} queries/s, burst {bucket.burst})",
                    self.hint_s(wait, 1.0),
                    reason="rate_limit",
                )
        self.check_room(query.tenant, prompt_bytes)
        if own.max_work_s > 0:
            self._check_work(query, own.max_work_s)
        if self.mode is AdmissionMode.OFF:
            return False
        prediction = self.predict(query, now, slo_s)
        slack = config.admission_slack
        decision = decide(prediction, slo_s, mode=self.mode, slack=slack)
        if decision.verdict is Verdict.ADMIT:
            return False
        if decision.verdict is Verdict.BEST_EFFORT:
            return True
        if decision.verdict is Verdict.INFEASIBLE:
            raise InvalidFieldError(
                "slo_s" if query.slo_s is not None or query.slo_scale is None else "slo_scale",
                f"the query needs about {prediction.least_s:.0f} s even alone on the whole "
                f"cluster, more than its SLO of {slo_s:.0f} s: no wait can help; ask for an "
                f"SLO of at least {math.ceil(prediction.least_s)} s, or make it smaller",
                reason="infeasible",
            )
        wait = self.hint_s(decision.retry_after_s)
        raise OverloadedError(
            f"the cluster is overloaded: the query is predicted to take "
            f"{prediction.finish_s:.0f} s against an SLO of {slo_s:.0f} s"
            + ("" if prediction.delay_s <= prediction.headroom_s else " (or to delay others)")
            + f"; retry in {wait:.1f} s",
            wait,
        )

    def _check_work(self, query: Query, quota_s: float) -> None:
        """The tenant's work in flight with `query` admitted stays within `quota_s`."""
        tenant = query.tenant
        work = sum(self.model.stage_work_s(query.workflow))
        if work > quota_s:
            raise InvalidFieldError(
                "workflow",
                f"the query is about {work:.0f} s of work, more than tenant {tenant!r} may "
                f"have in flight at once ({quota_s:g} s, the API keys file's max_work_s)",
                reason="too_large",
            )
        self._sync()
        flying = self.model.tenant_work_s(tenant, self._alive)
        if flying + work > quota_s:
            capacity = self.model.full_capacity
            raise OverloadedError(
                f"tenant {tenant!r} has about {flying:.0f} s of work in flight; the query's "
                f"{work:.0f} s more would pass its quota of {quota_s:g} s (max_work_s)",
                self.hint_s((flying + work - quota_s) / max(capacity, 1e-9)),
                reason="quota",
            )

    def hint_s(self, cluster_s: float, time_scale: float | None = None) -> float:
        """A retry hint in wall seconds for a wait of `cluster_s` (on the cluster clock,
        or in wall seconds with `time_scale` 1): at least a second, spread over up to half
        again at random, at most ten minutes."""
        scale = self.clock.time_scale if time_scale is None else time_scale
        if not math.isfinite(cluster_s):
            return _MAX_RETRY_S
        wall = max(cluster_s / scale, _MIN_RETRY_S) * (1.0 + _RETRY_JITTER * self._rng.random())
        return min(wall, _MAX_RETRY_S)

    def _tracks(self, tenant: str) -> bool:
        """Whether the model tracks `tenant`'s queries. The model forgets an ended query
        when it next predicts (or counts the tenant's work); with admission off it never
        predicts, so it tracks only the queries of tenants with a `max_work_s` quota, which
        their own next submission counts (tracking all would hold every query ever run)."""
        return self.mode is not AdmissionMode.OFF or self._limits(tenant).max_work_s > 0

    def _limits(self, tenant: str) -> TenantLimits:
        return self.tenant_limits(tenant) if self.tenant_limits else TenantLimits()

    def _weight(self, tenant: str) -> float:
        return self._limits(tenant).weight or 1.0

    def _soonest_finish_s(self, now: float, tenant: str | None = None) -> float:
        """Cluster seconds until a running query (of `tenant`) is due: a retry hint."""
        due = [
            e.run.deadline_s - now
            for e in self.queries.active.values()
            if tenant is None or e.run.query.tenant == tenant
        ]
        return max(min(due, default=1.0), 0.0)

    def _alive(self, run: QueryRun) -> bool:
        entry = self.queries.active.get(run.query.query_id)
        return (entry is not None and entry.run is run) or run.index < 0

    def _sync(self) -> None:
        """Track running queries the model does not know yet (resumed after a restart)."""
        if self.mode is AdmissionMode.OFF:
            return
        active = self.queries.active
        if len(self.model) >= len(active) - len(self._waiting):
            return
        tracked = {run.query.query_id for run in self.model.tracked()}
        waiting = {e.run.query.query_id for e in self._waiting}
        for query_id, entry in active.items():
            if query_id in tracked or query_id in waiting:
                continue
            if is_best_effort(entry.run):
                self._best_effort.add(query_id)
                self.model.track(entry.run, best_effort=True)
            else:
                self.model.track(entry.run, self.config.admission_slack)
        if len(self._best_effort) > 2 * len(active) + 64:
            self._best_effort.intersection_update(active)

    # ------------------------------------------------------------------ idempotency

    def _info(self, run: QueryRun) -> QueryInfo:
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
    def _check_same(query: Query, digest: str, known: Query, known_digest: str) -> None:
        """AlreadyExistsError unless `query` with prompts of `digest` is the known one."""
        if query != known or digest != known_digest:
            raise AlreadyExistsError(
                "query_id",
                f"a query {query.query_id!r} with other content exists (resubmit the same "
                "content, or use a new id)",
            )

    async def _known(self, query: Query, digest: str) -> QueryInfo | None:
        """The stored query of the same id (its info), None when there is none; raises
        AlreadyExistsError when its content differs (its prompts by their digest: they are
        gone once its calls finished)."""
        entry = self.queries.active.get(query.query_id)
        if entry is not None:
            self._check_same(query, digest, self.core.declared(entry.run), entry.digest)
            return self._info(entry.run)
        stored = await self.store.load(query.query_id)
        if stored is None:
            return None
        try:
            known, known_prompts = stored_submission(stored)
        except Exception:  # an unreadable stored submission cannot be matched
            known, known_prompts = None, []
        if known is None:
            raise AlreadyExistsError("query_id", f"a query {query.query_id!r} exists")
        # Stored before prompts were kept apart: the submission held them, and no digest.
        known_digest = stored.fields.get("digest") or prompts_digest(known_prompts)
        self._check_same(query, digest, known, known_digest)
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
