"""A workflow session's state in Redis, beside its query's (`hexgen_coordinator.store`).

A session is a query whose calls arrive one by one (OpenWorkflow, RunCall, CloseWorkflow).
Its hash ``P q:{id}`` holds, besides a query's fields::

    submit                the expected workflow as opened (SubmitQueryRequest bytes, no
                          prompts): what an OpenWorkflow of the same id is matched against
    session               "open" while it takes calls, then "closed"
    shape                 (as a query's) the workflow as it runs: its given calls, and those
                          of stages still open (rewritten by `give` and `close_stages`)
    idle_s                wall seconds without a call after which the coordinator closes it
    g:{call_id}           a given call (LLMCall bytes in base64: its step and token
                          counts; its prompt and messages wait in ``pr:{id}`` until the
                          call completes, as a query's do)
    x:{k}                 the name of stage k, added because a call named a stage the
                          workflow did not expect (it waits for nothing)
    z:{k}                 "1": stage k takes no more calls (a later stage was given a call,
                          or its calls all finished before another of its name came, or the
                          session closed); its calls never given are skipped when it is
                          released (`complete` with no record marks them "skipped")

`give` is the one script that changes what a session runs: it records a given call, and
grows the stage (a call beyond the expected ones) or the workflow (a new stage) in the
same step, only while the session is open and the query running. A retried `give` of a
call already given changes nothing. A restarted coordinator rebuilds the session from
these fields (`hexgen_coordinator.recovery`).

The client API's messages among these (the submission, the shape, the given calls and the
prompts kept apart) are encoded and read back by `hexgen_coordinator.client_wire`, as the
coordinator has always written them.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from hexgen_coordinator.client_messages import GivenCall
from hexgen_coordinator.client_wire import (
    call_from_bytes,
    call_to_bytes,
    prompt_to_bytes,
    shape_to_bytes,
    submission_from_bytes,
)
from hexgen_coordinator.ledger import call_id_of
from hexgen_coordinator.store import LUA_HELPERS, StoredQuery, WorkflowStore
from hexgen_coordinator.worker_messages import Chat
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow, canonical_step
from hexgen_service import redis_schema as schema
from hexgen_service.redis_schema import F, S

__all__ = [
    "GIVE_APPLIED",
    "GIVE_CLOSED",
    "GIVE_DUPLICATE",
    "GIVE_NOT_RUNNING",
    "GiveMode",
    "SessionStore",
    "StoredWorkflow",
    "stored_submission",
    "stored_workflow",
]

GIVE_APPLIED = 1
GIVE_DUPLICATE = 0
GIVE_NOT_RUNNING = -1
GIVE_CLOSED = -2
GIVE_CONFLICT = -3

GiveMode = Literal["replace", "join", "new"]

_GIVE = """
-- KEYS: q, pr ; ARGV: call_id, stage, call bytes, mode (replace|join|new), stage name, now,
--       shape, prompt (LLMCall bytes: prompt and messages; '' for none)
-- returns 1 given, 0 already given, -1 not running, -2 session closed, -3 a conflict with
-- the stored workflow (another coordinator grew it)
if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return -1 end
if redis.call('HGET', KEYS[1], 'session') ~= 'open' then return -2 end
local g = 'g:' .. ARGV[1]
if redis.call('HEXISTS', KEYS[1], g) == 1 then return 0 end
local k = ARGV[2]
if ARGV[4] == 'new' then
  if tonumber(redis.call('HGET', KEYS[1], 'stages_total')) ~= tonumber(k) then return -3 end
  redis.call('HSET', KEYS[1], 'x:' .. k, ARGV[5], 's' .. k .. ':left', 1,
    's' .. k .. ':deps', 0, 's' .. k .. ':rel', ARGV[6])
  redis.call('HINCRBY', KEYS[1], 'stages_total', 1)
elseif ARGV[4] == 'join' then
  if redis.call('HEXISTS', KEYS[1], 's' .. k .. ':fin') == 1 then return -3 end
  redis.call('HINCRBY', KEYS[1], 's' .. k .. ':left', 1)
end
if ARGV[4] ~= 'replace' then
  redis.call('HINCRBY', KEYS[1], 'calls_total', 1)
  redis.call('HINCRBY', KEYS[1], 'calls_left', 1)
end
redis.call('HSET', KEYS[1], g, ARGV[3], 'shape', ARGV[7])
if ARGV[8] ~= '' then redis.call('HSET', KEYS[2], ARGV[1], ARGV[8]) end
return 1
"""

_CLOSE_STAGES = (
    LUA_HELPERS
    + """
-- KEYS: q, active, finished, ev, pr ; ARGV: query_id, close_session ('1' or '0'), now,
--       retention_ms, maxlen, shape, stages...
-- returns 1 done, 2 done and the query succeeded (closing it let its last call go),
-- -1 not running
if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return -1 end
redis.call('HSET', KEYS[1], 'shape', ARGV[6])
for i = 7, #ARGV do redis.call('HSET', KEYS[1], 'z:' .. ARGV[i], '1') end
if ARGV[2] == '1' and redis.call('HGET', KEYS[1], 'session') == 'open' then
  redis.call('HSET', KEYS[1], 'session', 'closed', 'c:' .. ARGV[1] .. '/session', 'skipped')
  if redis.call('HINCRBY', KEYS[1], 'calls_left', -1) == 0 then
    succeed(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], ARGV[3], ARGV[4], ARGV[5], KEYS[5])
    return 2
  end
end
return 1
"""
)


class SessionStore:
    def __init__(self, store: WorkflowStore) -> None:
        self.store = store
        self._give = store.redis.register_script(_GIVE)
        self._close_stages = store.redis.register_script(_CLOSE_STAGES)

    async def give(
        self,
        query_id: str,
        call_id: str,
        stage: int,
        call: LLMCall,
        mode: GiveMode,
        *,
        name: str,
        now: float,
        shape: Query | None,
        prompt: str = "",
        chat: Chat | None = None,
    ) -> int:
        """Record a given call (see the module docstring); one of the GIVE_* outcomes.
        `call` is what ``g:{call_id}`` keeps of it (its step and token counts); `prompt` and
        `chat` are what ``pr:{id}`` keeps until the call completes (neither: nothing);
        `shape` is the workflow as it runs now (None: nothing given, kept empty)."""
        blob = base64.b64encode(call_to_bytes(call))
        kept = prompt_to_bytes(prompt, chat) if prompt or chat is not None else b""
        args: list[Any] = [
            call_id,
            stage,
            blob,
            mode,
            name,
            repr(now),
            _shape_bytes(shape),
            kept,
        ]
        keys = [self.store.qkey(query_id), self.store.prkey(query_id)]
        return int(await self._give(keys=keys, args=args))

    async def close_stages(
        self,
        query_id: str,
        stages: Iterable[int],
        *,
        shape: Query | None,
        close_session: bool = False,
        now: float = 0.0,
    ) -> int:
        """Mark stages as taking no more calls and, with `close_session`, close the
        session (the query succeeds at `now` if no call is left); `shape` is what the
        workflow runs now (what the `finished` stream keeps; None: nothing given, kept
        empty). 1 done, 2 done and the query succeeded, -1 the query is not running."""
        store = self.store
        keys = [
            store.qkey(query_id),
            store.active_key,
            store.finished_key,
            store.evkey(query_id),
            store.prkey(query_id),
        ]
        args: list[Any] = [
            query_id,
            schema.STAGE_CLOSED_YES if close_session else "0",
            repr(now),
            store.retention_ms,
            store.stream_maxlen,
            _shape_bytes(shape),
            *stages,
        ]
        return int(await self._close_stages(keys=keys, args=args))


@dataclass(frozen=True, slots=True)
class StoredWorkflow:
    """A query rebuilt from Redis: as submitted, or a session as its calls made it."""

    query: Query
    prompts: list[tuple[str, ...]]
    names: list[str]
    given: list[int] | None
    """A session's given calls per stage; None for a query submitted whole."""
    closed_stages: set[int]
    session_open: bool
    idle_s: float
    chats: dict[str, Chat]
    """Calls' chat messages and options (`client_wire.chat_part`) by call id."""


def _shape_bytes(shape: Query | None) -> bytes:
    """A session's ``shape`` as Redis keeps it; empty when nothing was given (there is
    nothing to replay)."""
    return shape_to_bytes(shape) if shape is not None else b""


def _kept_apart(given: GivenCall, held: GivenCall) -> tuple[str, Chat | None]:
    """A given call's prompt and chat part when they were kept apart (``pr:{id}``): those
    kept, with the given call's options when the kept ones have none (the layout before
    kept them all in ``g:{call_id}``)."""
    messages = held.chat.messages if held.chat is not None else ()
    options = held.chat.options if held.chat is not None else None
    if options is None and given.chat is not None:
        options = given.chat.options
    if not messages and options is None:
        return held.prompt, None
    return held.prompt, Chat(messages, options)


def stored_submission(stored: StoredQuery) -> tuple[Query, list[tuple[str, ...]]]:
    """The query as it was submitted (or opened, for a session) and the prompts its stored
    submission holds (none since prompts are kept apart: `stored_workflow` has those)."""
    query, prompts, _ = submission_from_bytes(stored.submit)
    return query, prompts


def stored_workflow(stored: StoredQuery) -> StoredWorkflow:
    """The query's workflow as it stands in Redis (what recovery and views read), with the
    prompts still kept (a call done has none left)."""
    opened, prompts, names = submission_from_bytes(stored.submit)
    f = stored.fields
    session = f.get(F.SESSION)
    kept = {c: call_from_bytes(blob) for c, blob in stored.prompts.items()}
    if session is None:
        for k, stage_prompts in enumerate(prompts):
            texts = list(stage_prompts)
            for i in range(len(texts)):
                held = kept.get(call_id_of(opened.query_id, k, i))
                if held is not None:
                    texts[i] = held.prompt
            prompts[k] = tuple(texts)
        return StoredWorkflow(opened, prompts, names, None, set(), False, 0.0, {})
    stages = list(opened.workflow.stages)
    total = int(f.get(F.STAGES_TOTAL, len(stages)))
    for k in range(len(stages), total):  # stages added by a call that named a new one
        name = f.get(schema.call_field(schema.STAGE_NAME, k), f"stage{k}")
        stages.append(Stage(step=canonical_step(name), calls=(LLMCall("x", 1, 1),)))
        names.append(name)
        prompts.append(("",))
    given: list[int] = []
    chats: dict[str, Chat] = {}
    for k, stage in enumerate(stages):
        calls, texts = list(stage.calls), list(prompts[k])
        n = 0
        while True:
            call_id = call_id_of(opened.query_id, k, n)
            raw = f.get(schema.call_field(schema.GIVEN, call_id))
            if raw is None:
                break
            sizes = call_from_bytes(base64.b64decode(raw))
            held = kept.get(call_id)
            prompt, chat = (  # the prompt kept apart (the layout before: in g:{call_id})
                (sizes.prompt, sizes.chat) if held is None else _kept_apart(sizes, held)
            )
            if chat is not None:
                chats[call_id] = chat
            call = LLMCall(sizes.step or stage.step, sizes.input_tokens, sizes.output_tokens)
            if n < len(calls):
                calls[n], texts[n] = call, prompt
            else:
                calls.append(call)
                texts.append(prompt)
            n += 1
        given.append(n)
        stages[k] = Stage(step=stage.step, calls=tuple(calls), after=stage.after)
        prompts[k] = tuple(texts)
    query = Query(
        query_id=opened.query_id,
        workflow=Workflow(tuple(stages)),
        tenant=opened.tenant,
        slo_s=opened.slo_s,
        slo_scale=opened.slo_scale,
    )
    closed = {
        k
        for k in range(len(stages))
        if f.get(schema.call_field(schema.STAGE_CLOSED, k)) == schema.STAGE_CLOSED_YES
    }
    return StoredWorkflow(
        query,
        prompts,
        names,
        given,
        closed,
        session == S.OPEN,
        float(f.get(F.IDLE_S, 0.0)),
        chats,
    )
