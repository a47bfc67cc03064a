"""Group commit: calls of one Lua script that queue up while one is in flight go to Redis
together, as one script call.

A completion costs the coordinator one Redis round trip before it may release anything
(the completion script; exactly-once needs Redis to say "applied" first). On this machine
the client side of a round trip is 150-250 µs of CPU through redis-py's asyncio client
(pool, timeouts, encoding, parsing), a fifth of all the coordinator spends on a completion,
and less, not nothing, through `PipelinedRedis`. Under
load, completions of different workflows arrive while a script call is in flight; sending
each on its own would pay that price per completion. `GroupCommit` sends the first alone,
at once (an idle coordinator adds no delay), and everything that arrived meanwhile as one
batch when it returns: the batch grows with the load, so the cost per completion falls
just where the coordinator nears saturation.

The batched script applies each call in turn, exactly as the single one would, and returns
each call's result; a call that returns an error reply fails its own caller only, while a
script that raises stops the batch where it raised and fails every caller of it (their
retries find the calls applied before it done, as after any lost reply).

A batch spans workflows. All of a coordinator's keys share its prefix's hash tag (a
sharded or cluster prefix must have one), so a batch touches one Redis Cluster slot, as
every script does.

A script for `GroupCommit` is Lua that defines ``local function apply(KEYS, ARGV)``,
returning that call's result, never nil (a nil would cut the batch's reply short, and
every caller of that batch would get an error); `GroupCommit` adds the entry points.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from hexgen_coordinator.pipelined_redis import PipelinedRedis

__all__ = ["GroupCommit"]

_ONE = """
return apply(KEYS, ARGV)
"""

_MANY = """
-- ARGV: n, then each call's key count and argument count, then every call's arguments in
-- order; KEYS: every call's keys in order. Returns each call's result.
local n = tonumber(ARGV[1])
local out = {}
local k, a = 0, 1 + 2 * n
for i = 1, n do
  local nk, na = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  local keys, argv = {}, {}
  for j = 1, nk do keys[j] = KEYS[k + j] end
  for j = 1, na do argv[j] = ARGV[a + j] end
  k, a = k + nk, a + na
  out[i] = apply(keys, argv)
end
return out
"""


@dataclass(slots=True)
class _Queued:
    keys: Sequence[str]
    args: Sequence[Any]
    future: asyncio.Future[Any]


class GroupCommit:
    """Run a script (see the module docstring): ``await commit(keys=..., args=...)``."""

    def __init__(
        self, redis: aioredis.Redis[bytes] | PipelinedRedis, script: str, max_batch: int = 32
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self._one = redis.register_script(script + _ONE)
        self._many = redis.register_script(script + _MANY)
        self.max_batch = max_batch
        """The most calls in one batch: a script blocks Redis while it runs."""
        self._queue: list[_Queued] = []
        self._busy = False
        self._sender: asyncio.Future[None] | None = None
        self.calls = 0
        """Calls made (for figures: calls / round_trips is the mean batch)."""
        self.round_trips = 0

    async def __call__(self, *, keys: Sequence[str], args: Sequence[Any]) -> Any:
        self.calls += 1
        if not self._busy:  # nothing in flight: this one goes now, alone
            self._busy = True
            try:
                self.round_trips += 1
                return await self._one(keys=keys, args=args)
            finally:
                self._next()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append(_Queued(keys, args, future))
        return await future

    def _next(self) -> None:
        """The call in flight has returned: send what queued meanwhile, or go idle."""
        if self._queue:
            self._sender = asyncio.ensure_future(self._send_queued())
        else:
            self._busy = False

    async def _send_queued(self) -> None:
        batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
        batch = [q for q in batch if not q.future.done()]  # a caller cancelled: not sent
        try:
            if not batch:
                return
            self.round_trips += 1
            if len(batch) == 1:
                results = [await self._one(keys=batch[0].keys, args=batch[0].args)]
            else:
                results = await self._many(keys=_keys(batch), args=_args(batch))
            if not isinstance(results, list) or len(results) != len(batch):
                # a call that returned nothing (Lua nil) ends the reply's array early
                raise ResponseError(
                    f"the batched script answered {_count(results)} results for "
                    f"{len(batch)} calls (does every apply return a value?)"
                )
        except asyncio.CancelledError:
            for q in batch:
                q.future.cancel()
            raise
        except Exception as exc:  # Redis away, a script error: each caller sees it
            for q in batch:
                if not q.future.done():
                    q.future.set_exception(exc)
        else:
            for q, result in zip(batch, results, strict=True):
                if q.future.done():
                    continue
                if isinstance(result, Exception):  # its call returned an error reply
                    q.future.set_exception(result)
                else:
                    q.future.set_result(result)
        finally:
            self._next()


def _count(results: object) -> int:
    return len(results) if isinstance(results, list) else 1


def _keys(batch: Sequence[_Queued]) -> list[str]:
    return [key for q in batch for key in q.keys]


def _args(batch: Sequence[_Queued]) -> list[Any]:
    counts = [count for q in batch for count in (len(q.keys), len(q.args))]
    return [len(batch), *counts, *(arg for q in batch for arg in q.args)]
