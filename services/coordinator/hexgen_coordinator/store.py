"""Workflow state in Redis: the coordinator's memory that survives it.

Key layout (every key starts with the configured prefix P, default ``hf:``)::

    P meta                 hash   epoch_unix_s, time_scale, alpha
    P qseq                 string arrival counter of queries (query_seq)
    P active               set    ids of running queries (what a restarted coordinator resumes)
    P q:{id}               hash   the query: submit (SubmitQueryRequest bytes), tenant,
                                  index, arrival_s, slo_s, deadline_s, state, finished_s,
                                  calls_total, calls_left, stages_total, stages_done;
                                  per stage k: s{k}:left, s{k}:deps, s{k}:rel, s{k}:fin, s{k}:dl;
                                  per call: c:{call_id} = "slot:seq" while dispatched, "done"
    P q:{id}:ev            list   the query's events (QueryEvent bytes), in order
    P completions          stream one entry per finished call (what the tuner reads)
    P finished             stream one entry per finished query, with its submit bytes
    P alpha:history        list   JSON of every alpha change

Everything that decides what runs next happens in one Lua script per call completion
(`complete`): it marks the call done (exactly once: a second completion of the same call
is rejected), closes the stage when it was its last call, releases every stage whose
dependencies are all done, counts the query down, finishes it, and appends the completion
records. A coordinator that dies at any point either did or did not apply a completion;
there is no half-applied one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

__all__ = ["CompletionResult", "StoredQuery", "WorkflowStore"]

_SUBMIT = """
-- KEYS: q, qseq, active ; ARGV: submit, tenant, arrival_s, slo_s, deadline_s,
--        calls_total, stages_total, then per stage: left, deps ; returns {created, index}
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, tonumber(redis.call('HGET', KEYS[1], 'index'))}
end
local index = redis.call('INCR', KEYS[2]) - 1
redis.call('HSET', KEYS[1], 'submit', ARGV[1], 'tenant', ARGV[2], 'index', index,
  'arrival_s', ARGV[3], 'slo_s', ARGV[4], 'deadline_s', ARGV[5], 'state', 'running',
  'finished_s', 0, 'calls_total', ARGV[6], 'calls_left', ARGV[6],
  'stages_total', ARGV[7], 'stages_done', 0)
local n = tonumber(ARGV[7])
for k = 0, n - 1 do
  redis.call('HSET', KEYS[1], 's' .. k .. ':left', ARGV[8 + 2 * k],
    's' .. k .. ':deps', ARGV[9 + 2 * k])
  if tonumber(ARGV[9 + 2 * k]) == 0 then
    redis.call('HSET', KEYS[1], 's' .. k .. ':rel', ARGV[3])
  end
end
redis.call('SADD', KEYS[3], ARGV[8 + 2 * n])
return {1, index}
"""

_COMPLETE = """
-- KEYS: q, active, completions, finished
-- ARGV: query_id, call_id, stage, now, n_dependents, dependents..., then the completion
--       record as field/value pairs
-- returns {status, calls_left, released stages...}; status 1 applied, 0 duplicate,
-- -1 unknown or not running
if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return {-1, -1} end
local ckey = 'c:' .. ARGV[2]
if redis.call('HGET', KEYS[1], ckey) == 'done' then return {0, -1} end
redis.call('HSET', KEYS[1], ckey, 'done')
local k = ARGV[3]
local now = ARGV[4]
local released = {}
if redis.call('HINCRBY', KEYS[1], 's' .. k .. ':left', -1) == 0 then
  redis.call('HSET', KEYS[1], 's' .. k .. ':fin', now)
  redis.call('HINCRBY', KEYS[1], 'stages_done', 1)
  local ndep = tonumber(ARGV[5])
  for i = 1, ndep do
    local j = ARGV[5 + i]
    if redis.call('HINCRBY', KEYS[1], 's' .. j .. ':deps', -1) == 0 then
      redis.call('HSET', KEYS[1], 's' .. j .. ':rel', now)
      table.insert(released, tonumber(j))
    end
  end
end
local record = {}
local ndep = tonumber(ARGV[5])
for i = 6 + ndep, #ARGV do table.insert(record, ARGV[i]) end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', 100000, '*', unpack(record))
local left = redis.call('HINCRBY', KEYS[1], 'calls_left', -1)
if left == 0 then
  redis.call('HSET', KEYS[1], 'state', 'succeeded', 'finished_s', now)
  redis.call('SREM', KEYS[2], ARGV[1])
  local q = redis.call('HMGET', KEYS[1], 'tenant', 'arrival_s', 'slo_s', 'submit')
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', 100000, '*', 'query_id', ARGV[1],
    'tenant', q[1], 'arrival_s', q[2], 'finished_s', now, 'slo_s', q[3], 'submit', q[4])
end
local out = {1, left}
for _, j in ipairs(released) do table.insert(out, j) end
return out
"""

_CANCEL = """
-- KEYS: q, active ; ARGV: query_id, now ; returns 1 if cancelled now, 0 if not running
if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finished_s', ARGV[2])
redis.call('SREM', KEYS[2], ARGV[1])
return 1
"""


@dataclass(frozen=True, slots=True)
class CompletionResult:
    status: int
    """1: applied; 0: the call was already complete; -1: the query is not running."""
    calls_left: int
    released: tuple[int, ...]

    @property
    def applied(self) -> bool:
        return self.status == 1


@dataclass(frozen=True, slots=True)
class StoredQuery:
    """A query as Redis holds it (what a restarted coordinator resumes from)."""

    query_id: str
    fields: Mapping[str, str]
    submit: bytes

    def num(self, name: str) -> float:
        return float(self.fields[name])

    def stage(self, k: int, name: str) -> str | None:
        return self.fields.get(f"s{k}:{name}")

    def call(self, call_id: str) -> str | None:
        return self.fields.get(f"c:{call_id}")


class WorkflowStore:
    def __init__(self, redis: aioredis.Redis[bytes], prefix: str = "hf:") -> None:
        self.redis = redis
        self.prefix = prefix
        self._submit = redis.register_script(_SUBMIT)
        self._complete = redis.register_script(_COMPLETE)
        self._cancel = redis.register_script(_CANCEL)

    # ------------------------------------------------------------------ keys

    def qkey(self, query_id: str) -> str:
        return f"{self.prefix}q:{query_id}"

    def evkey(self, query_id: str) -> str:
        return f"{self.prefix}q:{query_id}:ev"

    @property
    def completions_key(self) -> str:
        return f"{self.prefix}completions"

    @property
    def finished_key(self) -> str:
        return f"{self.prefix}finished"

    # ------------------------------------------------------------------ cluster meta

    async def epoch(self, now_unix: float, time_scale: float) -> tuple[float, float]:
        """The cluster clock: kept from the first coordinator, so times survive restarts."""
        key = f"{self.prefix}meta"
        await self.redis.hsetnx(key, "epoch_unix_s", repr(now_unix))
        await self.redis.hsetnx(key, "time_scale", repr(time_scale))
        epoch, scale = await self.redis.hmget(key, ["epoch_unix_s", "time_scale"])
        assert epoch is not None and scale is not None  # set just above
        return float(epoch), float(scale)

    async def alpha(self) -> float | None:
        value = await self.redis.hget(f"{self.prefix}meta", "alpha")
        return float(value) if value is not None else None

    async def set_alpha(self, alpha: float, now: float, reason: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(f"{self.prefix}meta", "alpha", repr(alpha))
            pipe.rpush(
                f"{self.prefix}alpha:history",
                json.dumps({"time_s": now, "alpha": alpha, "reason": reason}),
            )
            await pipe.execute()

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
    ) -> tuple[bool, int]:
        """Record a new query (root stages released); (created, query index).

        Idempotent: an id already stored is left untouched and reported as not created.
        """
        args: list[Any] = [
            submit,
            tenant,
            repr(arrival_s),
            repr(slo_s),
            repr(arrival_s + slo_s),
            sum(stage_calls),
            len(stage_calls),
        ]
        for calls, deps in zip(stage_calls, stage_deps, strict=True):
            args += [calls, deps]
        args.append(query_id)
        keys = [self.qkey(query_id), f"{self.prefix}qseq", f"{self.prefix}active"]
        created, index = await self._submit(keys=keys, args=args)
        return bool(created), int(index)

    async def complete(
        self,
        query_id: str,
        call_id: str,
        stage: int,
        dependents: Sequence[int],
        now: float,
        record: Mapping[str, str | int | float],
    ) -> CompletionResult:
        args: list[Any] = [query_id, call_id, stage, repr(now), len(dependents), *dependents]
        for k, v in record.items():
            args += [k, v]
        keys = [
            self.qkey(query_id),
            f"{self.prefix}active",
            self.completions_key,
            self.finished_key,
        ]
        out = await self._complete(keys=keys, args=args)
        return CompletionResult(int(out[0]), int(out[1]), tuple(int(j) for j in out[2:]))

    async def cancel(self, query_id: str, now: float) -> bool:
        keys = [self.qkey(query_id), f"{self.prefix}active"]
        return bool(await self._cancel(keys=keys, args=[query_id, repr(now)]))

    async def active_ids(self) -> list[str]:
        members = await self.redis.smembers(f"{self.prefix}active")
        return sorted(m.decode() if isinstance(m, bytes) else m for m in members)

    async def load(self, query_id: str) -> StoredQuery | None:
        raw = await self.redis.hgetall(self.qkey(query_id))
        if not raw:
            return None
        fields = {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}
        submit = fields.pop("submit")
        text = {k: (v.decode() if isinstance(v, bytes) else str(v)) for k, v in fields.items()}
        return StoredQuery(query_id, text, submit if isinstance(submit, bytes) else submit.encode())

    async def events(self, query_id: str) -> list[bytes]:
        return list(await self.redis.lrange(self.evkey(query_id), 0, -1))
