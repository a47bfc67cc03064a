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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError
from redis.retry import Retry

__all__ = ["REDIS_UNAVAILABLE", "redis_client", "until_stored"]

log = logging.getLogger("hexgen_coordinator.coordinator")  # the coordinator's one logger

REDIS_UNAVAILABLE: tuple[type[Exception], ...] = (ConnectionError, TimeoutError, BusyLoadingError)
"""The errors that mean "Redis is away for now" (retryable), not "the request is wrong"."""

T = TypeVar("T")


def redis_client(
    url: str, max_connections: int = 64, *, password: str | None = None
) -> aioredis.Redis[bytes]:
    """The coordinator's Redis client: a blocking pool (bursts wait for a connection rather
    than fail), retries with backoff over about 3 s, idle connections checked before use;
    `password` for the ACL user the URL names (kept out of the URL: command lines are
    world-readable)."""
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
