"""Workflow state in Redis: the coordinator's memory that survives it.

The key layout, every field name and format, and the streams' entries are
`hexgen_service.redis_schema`'s (one table, there): this module writes and reads them
through its names.

Prompts are the bulk of what a query stores, so they are kept apart and only as long as a
call may need its prompt again (a redispatch after a crash): nothing a client sent
outlives its query's end, and a finished query's retention window keeps its shape and
log, not its text. (Queries stored before this layout kept their prompts in ``submit``;
they are read as before and expire with it.)

Every change that decides what runs next is one Lua script that checks the state it
changes, so it applies exactly once whatever order or number of times it arrives:

- `submit` creates a query only if its id is new (and, for a workflow declared whole,
  appends it to the ``admitted`` stream);
- `place_commands` (plain commands, written behind by `write`) records where calls went
  in fields of their own (``p:``), which no completion reads as done; a write after the
  query ended sets the retention window on its keys again, so nothing it writes outlives
  the query;
- `complete` accepts a completion only for a call not yet done, from the slot and attempt
  it was last placed on; it closes the stage, releases every stage whose dependencies are
  done, counts the query down and finishes it;
- `fail_call` counts a failed attempt from the slot and attempt it was placed on and, at the
  limit, ends the query FAILED;
- `cancel` ends a running query.

A finished query (succeeded, cancelled or failed) expires after the retention window; the three
streams are trimmed to about `stream_maxlen` entries.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from hexgen_coordinator.group_commit import GroupCommit
from hexgen_coordinator.pipelined_redis import Command, PipelinedRedis
from hexgen_flow.runtime import CompletionEffect
from hexgen_service import redis_schema as schema
from hexgen_service.redis_schema import DEFAULT_PREFIX, F, M, Placement, parse_placement

__all__ = [
    "COMPLETE_APPLIED",
    "COMPLETE_DUPLICATE",
    "COMPLETE_NOT_RUNNING",
    "COMPLETE_STALE",
    "LUA_HELPERS",
    "CompletionResult",
    "FailureResult",
    "Placement",
    "StoredQuery",
    "WorkflowStore",
    "parse_placement",
    "prompts_digest",
]

log = logging.getLogger(__name__)

COMPLETE_APPLIED = 1
COMPLETE_DUPLICATE = 0
COMPLETE_NOT_RUNNING = -1
COMPLETE_STALE = -2

ALPHA_HISTORY_MAX = 1000
"""alpha:history keeps this many latest changes (the mesh's one α history: the tuner reads
it through the coordinator's GetAlphaHistory)."""

_SUBMIT = """
-- KEYS: q, qseq, active, admitted, pr, ev ; ARGV: submit, shape, tenant, arrival_s, slo_s,
--        deadline_s, calls_total, stages_total, then per stage: left, deps, then query_id,
--        session ('' for a static query, else 'open'), idle timeout of a session, maxlen,
--        digest, trace (the root span's traceparent), best effort ('1' or ''), then
--        call_id, prompt pairs
-- returns {created, index}
if redis.call('HEXISTS', KEYS[1], 'submit') == 1 then
  return {0, tonumber(redis.call('HGET', KEYS[1], 'index'))}
end
-- What a write-behind left after an earlier query of this id expired is not a query:
-- emptied (field by field, and the log trimmed: the coordinator's ACL user has no DEL).
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HDEL', KEYS[1], unpack(redis.call('HKEYS', KEYS[1])))
end
redis.call('LTRIM', KEYS[6], 1, 0)
local index = redis.call('INCR', KEYS[2]) - 1
redis.call('HSET', KEYS[1], 'submit', ARGV[1], 'shape', ARGV[2], 'tenant', ARGV[3],
  'index', index, 'arrival_s', ARGV[4], 'slo_s', ARGV[5], 'deadline_s', ARGV[6],
  'state', 'running', 'finished_s', 0, 'calls_total', ARGV[7], 'calls_left', ARGV[7],
  'stages_total', ARGV[8], 'stages_done', 0)
local n = tonumber(ARGV[8])
for k = 0, n - 1 do
  redis.call('HSET', KEYS[1], 's' .. k .. ':left', ARGV[9 + 2 * k],
    's' .. k .. ':deps', ARGV[10 + 2 * k])
  if tonumber(ARGV[10 + 2 * k]) == 0 then
    redis.call('HSET', KEYS[1], 's' .. k .. ':rel', ARGV[4])
  end
end
redis.call('SADD', KEYS[3], ARGV[9 + 2 * n])
redis.call('HSET', KEYS[1], 'digest', ARGV[13 + 2 * n], 'trace', ARGV[14 + 2 * n])
if ARGV[15 + 2 * n] == '1' then
  redis.call('HSET', KEYS[1], 'best_effort', '1')
end
for i = 16 + 2 * n, #ARGV, 2 do
  redis.call('HSET', KEYS[5], ARGV[i], ARGV[i + 1])
end
if ARGV[10 + 2 * n] ~= '' then
  redis.call('HSET', KEYS[1], 'session', ARGV[10 + 2 * n], 'idle_s', ARGV[11 + 2 * n])
else
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[12 + 2 * n], '*', 'query_id',
    ARGV[9 + 2 * n], 'tenant', ARGV[3], 'arrival_s', ARGV[4], 'slo_s', ARGV[5],
    'submit', ARGV[2])
end
return {1, index}
"""

# Shared by the scripts below and the session's (`hexgen_coordinator.session_store`): is
# `placed` (a p:{id} value) the dispatch (slot, attempt) names? A call not placed yet (its
# placement still behind) matches any; attempt 0 is a worker that does not count attempts
# and matches any attempt on its slot. `succeed` ends a query whose last call is done.
_MATCHES = """
local function matches(placed, slot, attempt)
  if not placed then return true end
  local s, _, a = string.match(placed, '^(-?%d+):(-?%d+):?(%d*)$')
  if s == nil then return false end
  if tonumber(slot) >= 0 and tonumber(s) ~= tonumber(slot) then return false end
  if tonumber(attempt) > 0 and a ~= '' and tonumber(a) ~= tonumber(attempt) then
    return false
  end
  return true
end
-- the query ended: its keys expire after the retention window, its prompts go now
local function expire(q, ev, ms, pr)
  redis.call('PEXPIRE', q, ms)
  if redis.call('EXISTS', ev) == 1 then redis.call('PEXPIRE', ev, ms) end
  local calls = redis.call('HKEYS', pr)
  for i = 1, #calls, 256 do
    redis.call('HDEL', pr, unpack(calls, i, math.min(i + 255, #calls)))
  end
end
-- the query's last call is done: it succeeded (q, active, finished, ev, pr are keys)
local function succeed(q, active, finished, ev, query_id, now, retention_ms, maxlen, pr)
  redis.call('HSET', q, 'state', 'succeeded', 'finished_s', now)
  redis.call('SREM', active, query_id)
  local f = redis.call('HMGET', q, 'tenant', 'arrival_s', 'slo_s', 'shape')
  redis.call('XADD', finished, 'MAXLEN', '~', maxlen, '*', 'query_id', query_id,
    'tenant', f[1], 'arrival_s', f[2], 'finished_s', now, 'slo_s', f[3], 'submit', f[4])
  expire(q, ev, retention_ms, pr)
end
"""

LUA_HELPERS = _MATCHES

_COMPLETE = (
    _MATCHES
    + """
-- KEYS: q, active, completions, finished, ev, pr
-- ARGV: query_id, call_id, stage, now, slot, attempt, retention_ms, maxlen,
--       finishes_stage (0/1), finishes_query (0/1), n_dependents, dependents...,
--       n_released, released..., then the completion record as field/value pairs
-- The workflow's release rule is the core's (`QueryRun.completion_effect`): this script
-- applies the effect it is handed (which stage finishes, which stages that releases,
-- whether the query succeeds) and decides none of it; the counters it keeps are what a
-- restarted coordinator rebuilds the query from.
-- returns {status, calls_left, released stages...}: status 1 applied, 0 already done,
-- -1 unknown or not running, -2 not from the slot and attempt the call was placed on
local function apply(KEYS, ARGV)
  if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return {-1, -1} end
  local ckey = 'c:' .. ARGV[2]
  local was = redis.call('HGET', KEYS[1], ckey)
  if was == 'done' or was == 'skipped' then return {0, -1} end
  local placed = redis.call('HGET', KEYS[1], 'p:' .. ARGV[2])
  if not matches(placed, ARGV[5], ARGV[6]) then return {-2, -1} end
  redis.call('HSET', KEYS[1], ckey, 'done')
  redis.call('HDEL', KEYS[6], ARGV[2])  -- its prompt is not needed again
  local k = ARGV[3]
  local now = ARGV[4]
  local ndep = tonumber(ARGV[11])
  local nrel = tonumber(ARGV[12 + ndep])
  local released = {}
  redis.call('HINCRBY', KEYS[1], 's' .. k .. ':left', -1)
  if ARGV[9] == '1' then
    redis.call('HSET', KEYS[1], 's' .. k .. ':fin', now)
    redis.call('HINCRBY', KEYS[1], 'stages_done', 1)
    for i = 1, ndep do
      redis.call('HINCRBY', KEYS[1], 's' .. ARGV[11 + i] .. ':deps', -1)
    end
  end
  for i = 1, nrel do
    local j = ARGV[12 + ndep + i]
    redis.call('HSET', KEYS[1], 's' .. j .. ':rel', now)
    table.insert(released, tonumber(j))
  end
  local record = {}
  for i = 13 + ndep + nrel, #ARGV do table.insert(record, ARGV[i]) end
  if #record > 0 then  -- a session's skipped call has no record: nothing ran
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[8], '*', unpack(record))
  else
    redis.call('HSET', KEYS[1], ckey, 'skipped')
  end
  local left = redis.call('HINCRBY', KEYS[1], 'calls_left', -1)
  if ARGV[10] == '1' then
    succeed(KEYS[1], KEYS[2], KEYS[4], KEYS[5], ARGV[1], now, ARGV[7], ARGV[8], KEYS[6])
  end
  local out = {1, left}
  for _, j in ipairs(released) do table.insert(out, j) end
  return out
end
"""
)

_FAIL_CALL = (
    _MATCHES
    + """
-- KEYS: q, active, ev, pr ; ARGV: query_id, call_id, slot, attempt, max_attempts, now,
--       reason, retention_ms
-- returns {status, failures}: status 1 counted (retry), 2 counted and the query failed,
-- 0 already done, -1 not running, -2 not from where the call was placed
if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return {-1, 0} end
local was = redis.call('HGET', KEYS[1], 'c:' .. ARGV[2])
if was == 'done' or was == 'skipped' then return {0, 0} end
local placed = redis.call('HGET', KEYS[1], 'p:' .. ARGV[2])
if not matches(placed, ARGV[3], ARGV[4]) then return {-2, 0} end
-- the attempt is over: on no slot until placed again, so that a late completion of it is
-- not taken for the next attempt
redis.call('HSET', KEYS[1], 'p:' .. ARGV[2], '-1:0:' .. ARGV[4])
local failures = redis.call('HINCRBY', KEYS[1], 'f:' .. ARGV[2], 1)
if failures < tonumber(ARGV[5]) then return {1, failures} end
redis.call('HSET', KEYS[1], 'state', 'failed', 'finished_s', ARGV[6], 'reason', ARGV[7])
redis.call('SREM', KEYS[2], ARGV[1])
expire(KEYS[1], KEYS[3], ARGV[8], KEYS[4])
return {2, failures}
"""
)

_CANCEL = (
    _MATCHES
    + """
-- KEYS: q, active, ev, pr ; ARGV: query_id, now, retention_ms, reason
-- returns 1 if cancelled now, 0 if not running
if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finished_s', ARGV[2])
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'reason', ARGV[4]) end
redis.call('SREM', KEYS[2], ARGV[1])
expire(KEYS[1], KEYS[3], ARGV[3], KEYS[4])
return 1
"""
)


@dataclass(frozen=True, slots=True)
class CompletionResult:
    status: int
    """COMPLETE_APPLIED, COMPLETE_DUPLICATE, COMPLETE_NOT_RUNNING or COMPLETE_STALE."""
    calls_left: int
    released: tuple[int, ...]

    @property
    def applied(self) -> bool:
        return self.status == COMPLETE_APPLIED


@dataclass(frozen=True, slots=True)
class FailureResult:
    status: int
    """1: counted, retry the call; 2: counted, the query failed; 0: the call is done; -1: the
    query is not running; -2: not from where the call was placed (a stale attempt)."""
    failures: int

    @property
    def retry(self) -> bool:
        return self.status == 1

    @property
    def query_failed(self) -> bool:
        return self.status == 2


def prompts_digest(prompts: Sequence[Sequence[str]]) -> str:
    """SHA-256 of a query's prompts (per stage, per call): what tells a resubmission of the
    same id with the same content from one with other content, once the prompts
    themselves are gone."""
    return hashlib.sha256(json.dumps([list(p) for p in prompts]).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class StoredQuery:
    """A query as Redis holds it (what a restarted coordinator resumes from)."""

    query_id: str
    fields: Mapping[str, str]
    submit: bytes
    prompts: Mapping[str, bytes] = field(default_factory=dict)
    """The prompts still kept (``pr:{id}``): call_id -> LLMCall bytes (prompt, messages)."""

    def num(self, name: str) -> float:
        return float(self.fields[name])

    def stage(self, k: int, name: str) -> str | None:
        """Stage k's field `name` (one of `redis_schema.STAGE_FIELDS`)."""
        return self.fields.get(schema.stage_field(k, name))

    def done(self, call_id: str) -> bool:
        """Finished, or skipped by its workflow session."""
        return schema.is_done(self.fields.get(schema.call_field(schema.DONE, call_id)))

    def skipped(self) -> set[str]:
        """The calls its workflow session skipped (never given)."""
        return {
            call_id
            for name, value in self.fields.items()
            if (call_id := schema.parse_call_field(name, schema.DONE)) is not None
            and value == schema.CALL_SKIPPED
        }

    def placement(self, call_id: str) -> Placement | None:
        """Where the call was last dispatched (None: never, as far as Redis knows)."""
        value = self.fields.get(schema.call_field(schema.PLACED, call_id))
        return parse_placement(value) if value is not None else None

    def failures(self, call_id: str) -> int:
        return int(self.fields.get(schema.call_field(schema.FAILURES, call_id), 0))


class WorkflowStore:
    def __init__(
        self,
        redis: aioredis.Redis[bytes],
        prefix: str = DEFAULT_PREFIX,
        *,
        retention_s: float = 3600.0,
        stream_maxlen: int = 10_000,
        pipelined: PipelinedRedis | None = None,
    ) -> None:
        self.redis = redis
        self.pipelined = pipelined
        """The completion path's own connection (`hexgen_coordinator.pipelined_redis`): the
        scripts (submit, complete, fail, cancel) and the write-behind go through it; None:
        through `redis`, which serves everything else (reads, recovery, sessions)."""
        self.prefix = prefix
        self.retention_ms = max(1, int(retention_s * 1000))
        """How long a finished query's keys stay (wall milliseconds)."""
        self.stream_maxlen = stream_maxlen
        scripts = pipelined or redis
        self._submit = scripts.register_script(_SUBMIT)
        self._complete = GroupCommit(scripts, _COMPLETE)
        """Completions go to Redis in batches under load (`hexgen_coordinator.group_commit`)."""
        self._fail_call = scripts.register_script(_FAIL_CALL)
        self._cancel = scripts.register_script(_CANCEL)

    # ------------------------------------------------------------------ keys

    def qkey(self, query_id: str) -> str:
        return schema.query_key(self.prefix, query_id)

    def evkey(self, query_id: str) -> str:
        return schema.events_key(self.prefix, query_id)

    def prkey(self, query_id: str) -> str:
        return schema.prompts_key(self.prefix, query_id)

    def key(self, name: str) -> str:
        """A fixed key (`redis_schema.COORDINATOR_KEYS`)."""
        return schema.key(self.prefix, name)

    @property
    def active_key(self) -> str:
        return self.key(schema.ACTIVE)

    @property
    def completions_key(self) -> str:
        return self.key(schema.COMPLETIONS)

    @property
    def admitted_key(self) -> str:
        return self.key(schema.ADMITTED)

    @property
    def finished_key(self) -> str:
        return self.key(schema.FINISHED)

    # ------------------------------------------------------------------ cluster meta

    async def epoch(self, now_unix: float, time_scale: float) -> tuple[float, float]:
        """The cluster clock: kept from the first coordinator, so times survive restarts."""
        key = self.key(schema.META)
        await self.redis.hsetnx(key, M.EPOCH_UNIX_S, repr(now_unix))
        await self.redis.hsetnx(key, M.TIME_SCALE, repr(time_scale))
        epoch, scale = await self.redis.hmget(key, [M.EPOCH_UNIX_S, M.TIME_SCALE])
        assert epoch is not None and scale is not None  # set just above
        return float(epoch), float(scale)

    async def alpha(self) -> float | None:
        value = await self.redis.hget(self.key(schema.META), M.ALPHA)
        return float(value) if value is not None else None

    async def set_alpha(self, alpha: float, now: float, reason: str) -> None:
        """Keep `alpha` (what a restarted coordinator takes) and record the change."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.key(schema.META), M.ALPHA, repr(alpha))
            self._record_alpha(pipe, alpha, now, reason)
            await pipe.execute()

    async def record_alpha(self, alpha: float, now: float, reason: str) -> None:
        """Record a change of α in the history alone (the α a coordinator started with:
        the kept one, ``meta``'s, stays what SetAlpha last set)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            self._record_alpha(pipe, alpha, now, reason)
            await pipe.execute()

    def _record_alpha(
        self, pipe: aioredis.client.Pipeline[bytes], alpha: float, now: float, reason: str
    ) -> None:
        history = self.key(schema.ALPHA_HISTORY)
        pipe.rpush(history, schema.encode_alpha_change(now, alpha, reason))
        pipe.ltrim(history, -ALPHA_HISTORY_MAX, -1)

    async def alpha_history(self, limit: int = 0) -> list[schema.AlphaChange]:
        """The latest `limit` α changes (0: every one kept), oldest first, `time_s` on the
        cluster clock; an unreadable entry is skipped (logged)."""
        raw = await self.redis.lrange(self.key(schema.ALPHA_HISTORY), -limit if limit else 0, -1)
        history = []
        for text in raw:
            try:
                history.append(schema.decode_alpha_change(text))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("unreadable alpha change skipped: %s", exc)
        return history

    async def learned(self) -> dict[str, str]:
        """The cost learners' states kept by `save_learned`, by instance name."""
        return await self._strings(schema.LEARNED)

    async def save_learned(self, states: Mapping[str, str]) -> None:
        await self._set_strings(schema.LEARNED, states)

    async def lengths(self) -> dict[str, str]:
        """The output-length belief's state kept by `save_lengths`, by step type."""
        return await self._strings(schema.LENGTHS)

    async def save_lengths(self, states: Mapping[str, str]) -> None:
        await self._set_strings(schema.LENGTHS, states)

    async def _strings(self, name: str) -> dict[str, str]:
        """The fixed hash `name`, decoded."""
        raw = await self.redis.hgetall(self.key(name))
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def _set_strings(self, name: str, values: Mapping[str, str]) -> None:
        """Set `values`' fields of the fixed hash `name` (nothing when empty)."""
        if values:
            fields: dict[str | bytes, bytes | float | int | str] = dict(values.items())
            await self.redis.hset(self.key(name), mapping=fields)

    # ------------------------------------------------------------------ queries

    async def submit(
        self,
        query_id: str,
        submit: bytes,
        tenant: str,
        arrival_s: float,
        slo_s: float,
        stage_calls: Sequence[int],
        stage_deps: Sequence[int],
        shape: bytes = b"",
        *,
        session_idle_s: float | None = None,
        prompts: Mapping[str, bytes] | None = None,
        digest: str = "",
        trace: str = "",
        best_effort: bool = False,
    ) -> tuple[bool, int]:
        """Record a new query (root stages released); (created, query index).

        Idempotent: an id already stored is left untouched and reported as not created.
        `submit` is the submission without its prompts, `shape` what the `admitted` and
        `finished` streams keep (a session is added to `admitted` never, to `finished` when
        it ends); `prompts` (call_id -> LLMCall bytes) are kept apart, each until its call
        completes; `digest` is `prompts_digest` of them. `trace` is the W3C traceparent of
        the query's root span, kept with it (``trace``) so that a restarted coordinator's
        spans of the query join its trace. `best_effort`: admitted best-effort, which a
        restarted coordinator keeps.
        """
        args: list[Any] = [
            submit,
            shape or submit,
            tenant,
            repr(arrival_s),
            repr(slo_s),
            repr(arrival_s + slo_s),
            # an open session holds one more call: it cannot finish until closed
            sum(stage_calls) + (session_idle_s is not None),
            len(stage_calls),
        ]
        for calls, deps in zip(stage_calls, stage_deps, strict=True):
            args += [calls, deps]
        args += [
            query_id,
            "" if session_idle_s is None else schema.S.OPEN,
            repr(session_idle_s or 0.0),
            self.stream_maxlen,
            digest,
            trace,
            schema.BEST_EFFORT_YES if best_effort else "",
        ]
        for call_id, blob in (prompts or {}).items():
            args += [call_id, blob]
        keys = [
            self.qkey(query_id),
            self.key(schema.QSEQ),
            self.active_key,
            self.admitted_key,
            self.prkey(query_id),
            self.evkey(query_id),
        ]
        created, index = await self._submit(keys=keys, args=args)
        return bool(created), int(index)

    def place_commands(
        self,
        query_id: str,
        placements: Mapping[str, Placement],
        stage_deadlines: Mapping[int, float],
        events: Sequence[bytes] = (),
        *,
        ended: bool = False,
    ) -> list[Command]:
        """The commands that record where calls went, stage deadlines and new events of a
        query; `ended`: the query has ended, so its keys get the retention window again (a
        write that lands after the end never leaves a key that does not expire)."""
        qkey, evkey = self.qkey(query_id), self.evkey(query_id)
        commands: list[Command] = []
        fields: list[str] = []
        for call_id, p in placements.items():
            fields += [schema.call_field(schema.PLACED, call_id), schema.format_placement(p)]
        for k, d in stage_deadlines.items():
            fields += [schema.stage_field(k, schema.STAGE_DL), repr(d)]
        if fields:
            commands.append(("HSET", qkey, *fields))
        if events:
            commands.append(("RPUSH", evkey, *events))
        if ended:
            commands.append(("PEXPIRE", qkey, self.retention_ms))
            commands.append(("PEXPIRE", evkey, self.retention_ms))
        return commands

    async def write(self, commands: Sequence[Command]) -> None:
        """Send `commands` (`place_commands`) as one pipeline, not a transaction."""
        if not commands:
            return
        if self.pipelined is not None:
            await self.pipelined.execute_many(commands)
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            await pipe.execute()

    async def complete(
        self,
        query_id: str,
        call_id: str,
        stage: int,
        dependents: Sequence[int],
        effect: CompletionEffect,
        now: float,
        record: Mapping[str, str | int | float],
        *,
        slot: int = -1,
        attempt: int = 0,
    ) -> CompletionResult:
        """Apply a call's completion reported by the worker on `slot` for `attempt` (-1 / 0:
        any): its `effect` on the query (`QueryRun.completion_effect`, the core's rule,
        which the script applies and does not recompute; `dependents` are the stage's
        dependents, whose counters it keeps); see `COMPLETE_*` for the outcomes."""
        args: list[Any] = [
            query_id,
            call_id,
            stage,
            repr(now),
            slot,
            attempt,
            self.retention_ms,
            self.stream_maxlen,
            int(effect.finishes_stage),
            int(effect.finishes_query),
            len(dependents),
            *dependents,
            len(effect.released),
            *effect.released,
        ]
        for k, v in record.items():
            args += [k, v]
        keys = [
            self.qkey(query_id),
            self.active_key,
            self.completions_key,
            self.finished_key,
            self.evkey(query_id),
            self.prkey(query_id),
        ]
        out = await self._complete(keys=keys, args=args)
        return CompletionResult(int(out[0]), int(out[1]), tuple(int(j) for j in out[2:]))

    async def fail_call(
        self,
        query_id: str,
        call_id: str,
        *,
        slot: int,
        attempt: int,
        max_attempts: int,
        now: float,
        reason: str,
    ) -> FailureResult:
        """Count a failed attempt of a call; the query fails at `max_attempts` failures."""
        keys = [self.qkey(query_id), self.active_key, self.evkey(query_id), self.prkey(query_id)]
        args: list[Any] = [
            query_id,
            call_id,
            slot,
            attempt,
            max_attempts,
            repr(now),
            reason,
            self.retention_ms,
        ]
        status, failures = await self._fail_call(keys=keys, args=args)
        return FailureResult(int(status), int(failures))

    async def cancel(self, query_id: str, now: float, reason: str = "") -> bool:
        """End a running query CANCELLED (`reason` kept for GetQuery); False if it was not
        running."""
        keys = [self.qkey(query_id), self.active_key, self.evkey(query_id), self.prkey(query_id)]
        args: list[Any] = [query_id, repr(now), self.retention_ms, reason]
        return bool(await self._cancel(keys=keys, args=args))

    async def active_ids(self) -> list[str]:
        members = await self.redis.smembers(self.active_key)
        return sorted(m.decode() if isinstance(m, bytes) else m for m in members)

    async def load(self, query_id: str) -> StoredQuery | None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.qkey(query_id))
            pipe.hgetall(self.prkey(query_id))
            raw, raw_prompts = await pipe.execute()
        if not raw:
            return None
        fields = {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}
        submit = fields.pop(F.SUBMIT, None)
        if submit is None:
            # Only a write-behind that landed after the query expired (`place_commands`,
            # which gives it the retention window again): no query is stored here.
            return None
        fields.pop(F.SHAPE, None)
        text = {k: (v.decode() if isinstance(v, bytes) else str(v)) for k, v in fields.items()}
        prompts = {
            (k.decode() if isinstance(k, bytes) else k): (v if isinstance(v, bytes) else v.encode())
            for k, v in raw_prompts.items()
        }
        return StoredQuery(
            query_id, text, submit if isinstance(submit, bytes) else submit.encode(), prompts
        )

    async def events(self, query_id: str) -> list[bytes]:
        return list(await self.redis.lrange(self.evkey(query_id), 0, -1))
