"""Coordinator shards: which shard owns a workflow, and which coordinator holds each shard.

A sharded mesh is N shards, each a Redis key prefix with its own hash tag (``hf:{s0}:``,
``hf:{s1}:``, ...: on a Redis Cluster each shard's keys share one slot), listed in the same
order to every coordinator (``--shards``). A workflow belongs to shard
``crc32(UTF-8 id) mod N``, a rule any client can compute, though none needs to: every
coordinator redirects what is not its own.

A coordinator serves one shard at a time and holds it by a lease, the key ``P lease`` of
that shard's prefix: its client address, set only if absent (``SET NX PX``), renewed every
third of the lease's time by a script that extends it only while it still names the holder.
At start a coordinator takes its own `--redis-prefix` if that is a shard whose lease is free,
else the first free shard; with none free it waits, a spare, and takes the first lease that
expires: a coordinator killed mid-run is replaced within about one lease time. The
replacement resumes the shard from Redis as a restarted coordinator does
(`hexgen_coordinator.recovery`).

A holder that cannot renew (its lease expired, or was taken while it was paused, or Redis
stayed unreachable for a whole lease time) stops at once (`LeaseLostError`), so that no two
coordinators serve one shard for longer than the pause that cost the lease; and every
change that decides what runs is a Lua script that applies exactly once whoever sends it
(`hexgen_coordinator.store`).
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from dataclasses import dataclass

import redis.asyncio as aioredis

from hexgen_flow.errors import ConfigError
from hexgen_service import redis_schema as schema
from hexgen_service.errors import SHARD_OWNER_KEY

__all__ = ["OWNER_METADATA", "LeaseLostError", "ShardLease", "ShardMap", "lease_key"]

OWNER_METADATA = SHARD_OWNER_KEY
"""Trailing metadata of a redirect: the owning coordinator's client address, HOST:PORT (the
clients read the same key)."""

log = logging.getLogger(__name__)

_RENEW = """
-- KEYS: lease ; ARGV: holder, ttl_ms ; 1 renewed, 0 not ours any more
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

_RELEASE = """
-- KEYS: lease ; ARGV: holder ; delete it only while it names the holder
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def _ttl_ms(ttl_s: float) -> int:
    return max(1, round(ttl_s * 1000))


class LeaseLostError(RuntimeError):
    """This coordinator no longer holds its shard's lease: it must stop serving."""


def lease_key(prefix: str) -> str:
    return schema.key(prefix, schema.LEASE)


@dataclass(frozen=True, slots=True)
class ShardMap:
    """The shards' prefixes, in the order every coordinator lists them."""

    prefixes: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.prefixes:
            raise ConfigError("--shards: name at least one shard prefix")
        if len(set(self.prefixes)) != len(self.prefixes):
            raise ConfigError(f"--shards: a prefix appears twice in {list(self.prefixes)}")
        for prefix in self.prefixes:
            if not prefix or any(c.isspace() for c in prefix):
                raise ConfigError(f"--shards: {prefix!r} is not a key prefix")

    @classmethod
    def parse(cls, text: str) -> ShardMap:
        """``P0,P1,...`` (the flag's form)."""
        return cls(tuple(p.strip() for p in text.split(",") if p.strip()))

    def __len__(self) -> int:
        return len(self.prefixes)

    def shard_of(self, query_id: str) -> int:
        """The shard that owns the workflow `query_id`."""
        return zlib.crc32(query_id.encode()) % len(self.prefixes)

    def index(self, prefix: str) -> int | None:
        return self.prefixes.index(prefix) if prefix in self.prefixes else None


class ShardLease:
    """This coordinator's hold on one shard (`acquire` finds it one)."""

    def __init__(
        self, redis: aioredis.Redis[bytes], shards: ShardMap, shard: int, holder: str, ttl_s: float
    ) -> None:
        self.redis = redis
        self.shards = shards
        self.shard = shard
        self.holder = holder
        self.ttl_ms = _ttl_ms(ttl_s)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    @property
    def prefix(self) -> str:
        return self.shards.prefixes[self.shard]

    @classmethod
    async def acquire(
        cls,
        redis: aioredis.Redis[bytes],
        shards: ShardMap,
        holder: str,
        ttl_s: float,
        *,
        preferred: int | None = None,
        poll_s: float | None = None,
    ) -> ShardLease:
        """The lease of `preferred` if it is free, else of the first free shard; with none
        free, wait (a spare) and poll every `poll_s` (default a third of `ttl_s`)."""
        order = list(range(len(shards)))
        if preferred is not None:
            order.remove(preferred)
            order.insert(0, preferred)
        ttl_ms = _ttl_ms(ttl_s)
        pause = poll_s if poll_s is not None else ttl_s / 3
        waiting = False
        while True:
            for k in order:
                if await redis.set(lease_key(shards.prefixes[k]), holder, nx=True, px=ttl_ms):
                    if waiting:
                        log.warning("took over shard %d (%s)", k, shards.prefixes[k])
                    return cls(redis, shards, k, holder, ttl_s)
            if not waiting:
                log.info("every shard has a coordinator: waiting as a spare")
                waiting = True
            await asyncio.sleep(pause)

    async def renew(self) -> None:
        """Extend the lease; `LeaseLostError` if it no longer names this holder."""
        renewed = await self._renew(keys=[lease_key(self.prefix)], args=[self.holder, self.ttl_ms])
        if not renewed:
            raise LeaseLostError(f"lost the lease of shard {self.shard} ({self.prefix})")

    async def keep(self) -> None:
        """Renew every third of the lease time until cancelled. `LeaseLostError` when it is
        lost, or when Redis did not answer for the whole lease time."""
        loop = asyncio.get_running_loop()
        interval = self.ttl_ms / 3000
        last = loop.time()
        while True:
            await asyncio.sleep(interval)
            try:
                await self.renew()
                last = loop.time()
            except LeaseLostError:
                raise
            except Exception as exc:  # Redis away: the lease may still run; keep trying
                if loop.time() - last >= self.ttl_ms / 1000:
                    raise LeaseLostError(
                        f"could not renew the lease of shard {self.shard} ({self.prefix}) "
                        f"for {self.ttl_ms / 1000:g} s: {exc}"
                    ) from exc
                log.warning("lease renewal failed (retrying): %s", exc)

    async def owner(self, shard: int) -> str | None:
        """The client address of the coordinator holding `shard`; None while none does."""
        value = await self.redis.get(lease_key(self.shards.prefixes[shard]))
        return value.decode() if value is not None else None

    async def release(self) -> None:
        """Give the shard up at a clean stop, so that a spare takes it at once."""
        await self._release(keys=[lease_key(self.prefix)], args=[self.holder])
