"""Riding out a Redis that goes away: the client's own retries, and the coordinator's.

Two layers, because they protect different things:

- `redis_client` builds the connection pool every coordinator command goes through, with
  redis-py's retry on connection errors (a reconnect replaces a pooled connection that died
  with a restarted Redis, instead of failing every command that draws it) and a health
  check of idle connections. A command still failing after these retries (Redis away for
  longer) raises, and a client's request is answered UNAVAILABLE, which clients retry.
- `until_stored` wraps the writes that must not be dropped (a completion a worker reported,
  a failed attempt, a cancel): it retries them with backoff for as long as Redis is away,
  holding only that query's lock, so that the mesh resumes where it stopped once Redis is
  back. Every such write is a script that checks the state it changes, so running it again
  after a reply was lost applies it at most once (`hexgen_coordinator.store`).

On a Redis Cluster (``--redis-cluster``) `redis_client` builds redis-py's cluster client
with the same retries and timeouts; every key of the coordinator carries the hash tag of its
prefix (`cluster_prefix`), so each script, pipeline and transaction touches one slot. Behind
Sentinel (a ``redis+sentinel://`` URL, `hexgen_service.redis_sentinel`) it builds a client of
the master that asks the Sentinels again when a connection fails, so the same retries ride
out a failover.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, ClusterDownError, ConnectionError, TimeoutError
from redis.retry import Retry

from hexgen_coordinator.pipelined_redis import PipelinedRedis
from hexgen_service.redis_keys import CLUSTER_PREFIX, cluster_prefix
from hexgen_service.redis_sentinel import async_master, parse_sentinel_url

__all__ = [
    "CLUSTER_PREFIX",
    "REDIS_UNAVAILABLE",
    "cluster_prefix",
    "pipelined_client",
    "redis_client",
    "until_stored",
]

log = logging.getLogger("hexgen_coordinator.coordinator")  # the coordinator's one logger

REDIS_UNAVAILABLE: tuple[type[Exception], ...] = (
    ConnectionError,
    TimeoutError,
    BusyLoadingError,
    ClusterDownError,  # a Redis Cluster without a master for a slot (a failover under way)
)
"""The errors that mean "Redis is away for now" (retryable), not "the request is wrong"."""

T = TypeVar("T")


def redis_client(
    url: str, max_connections: int = 64, *, password: str | None = None, cluster: bool = False
) -> aioredis.Redis[bytes]:
    """The coordinator's Redis client: a blocking pool (bursts wait for a connection rather
    than fail), retries with backoff over about 3 s, idle connections checked before use;
    `password` for the ACL user the URL names (kept out of the URL: command lines are
    world-readable); `cluster`: `url` is a node of a Redis Cluster; a ``redis+sentinel://``
    URL: the master the Sentinels name (its pool does not block: no cap on connections)."""
    if cluster:
        return _cluster_client(url, max_connections, password)
    sentinel = parse_sentinel_url(url)
    if sentinel is not None:
        return async_master(
            sentinel,
            password=password,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=6),
            retry_on_error=list(REDIS_UNAVAILABLE),
            health_check_interval=5,
            socket_connect_timeout=2,
        )
    pool: aioredis.BlockingConnectionPool[aioredis.Connection] = (
        aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=30,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=6),
            retry_on_error=list(REDIS_UNAVAILABLE),
            health_check_interval=5,
            socket_connect_timeout=2,
            **({"password": password} if password else {}),
        )
    )
    return aioredis.Redis(connection_pool=pool)


def pipelined_client(
    url: str, *, password: str | None = None, cluster: bool = False
) -> PipelinedRedis | None:
    """The completion path's pipelined connection (`hexgen_coordinator.pipelined_redis`) to
    the single Redis `url` names; None for a Redis Cluster or Sentinel, whose redis-py
    clients follow slots and failovers, which the pipelined one does not."""
    if cluster or parse_sentinel_url(url) is not None:
        return None
    return PipelinedRedis(url, password=password)


if TYPE_CHECKING:  # generic in types-redis, not at run time
    _Cluster = RedisCluster[bytes]
else:
    _Cluster = RedisCluster


class _WaitingCluster(_Cluster):
    """redis-py's cluster client, with a command waiting (up to `wait_s`) for one of
    `turns` rather than failing at once when every connection to a node is busy
    (MaxConnectionsError), as the single-Redis client's blocking pool waits."""

    turns: asyncio.Semaphore | None = None
    wait_s: float = 30.0

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self.turns is None:
            return await super().execute_command(*args, **kwargs)
        try:
            async with asyncio.timeout(self.wait_s):
                await self.turns.acquire()
        except builtins.TimeoutError:  # asyncio's, not redis-py's
            raise ConnectionError(f"no Redis connection free in {self.wait_s:g} s") from None
        try:
            return await super().execute_command(*args, **kwargs)
        finally:
            self.turns.release()


def _cluster_client(url: str, max_connections: int, password: str | None) -> aioredis.Redis[bytes]:
    """The coordinator's client of a Redis Cluster (`url`: any one of its nodes; the others
    are discovered), with the retries and timeouts of the single-Redis one. Typed as a plain
    client: it takes the same commands, scripts and pipelines (transactions of one slot)."""
    client = _WaitingCluster.from_url(
        url,
        # per node; headroom over the commands' turns for pipelines, which draw their own
        max_connections=max_connections + 8,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=6),
        health_check_interval=5,
        socket_connect_timeout=2,
        password=password,  # a password in the URL wins
    )
    assert isinstance(client, _WaitingCluster)
    client.turns = asyncio.Semaphore(max_connections)
    return cast("aioredis.Redis[bytes]", client)


async def until_stored(what: str, write: Callable[[], Awaitable[T]], cap_s: float = 2.0) -> T:
    """Run `write` until Redis takes it, waiting with backoff (up to `cap_s`) while Redis
    is unreachable; any other error propagates."""
    delay = 0.1
    failures = 0
    while True:
        try:
            result = await write()
        except REDIS_UNAVAILABLE as exc:
            failures += 1
            if failures == 1:
                log.warning("redis unavailable while %s (%s); retrying until it is back", what, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, cap_s)
            continue
        if failures:
            log.info("redis back after %d retries while %s", failures, what)
        return result
