"""How full Redis is: new work is refused before Redis refuses writes.

Redis runs with ``maxmemory`` and ``maxmemory-policy noeviction`` (`hexgen-flow up`'s private
Redis, compose, the Kubernetes manifests): nothing the mesh stores may be evicted, so a
full Redis answers every write with an OOM error, the completions of admitted queries
included. The coordinator reads ``INFO memory`` every second and, above `limit` of
``maxmemory`` (``--redis-memory-limit``, 0.9), refuses new work (a submission, a session, a
call given to one) with RESOURCE_EXHAUSTED and a retry hint, keeping the rest for what is
already admitted: its completions, events and placements. Prompts leave Redis as their
calls complete (`hexgen_coordinator.store`), so the room comes back as the work drains.

A Redis without ``maxmemory`` is not watched (a warning at start says so); neither is a
Redis Cluster, whose memory is per node.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from hexgen_service.errors import OverloadedError

__all__ = ["RedisMemory"]

log = logging.getLogger(__name__)

_PERIOD_S = 1.0
"""Wall seconds between reads of INFO memory."""
_RETRY_S = 5.0
"""The hint of a refusal: about how long a busy mesh takes to free a few per cent."""


class RedisMemory:
    """Redis's memory as last read (`read`, `watch`); `check` refuses new work above the
    limit."""

    def __init__(self, redis: Any, limit: float) -> None:
        self.redis = redis
        self.limit = limit
        """Share of ``maxmemory`` above which new work is refused."""
        self.used_bytes = 0
        self.max_bytes = 0
        """``maxmemory`` (0: none, not watched)."""

    async def read(self) -> None:
        info = await self.redis.info("memory")
        self.used_bytes = int(info.get("used_memory", 0))
        self.max_bytes = int(info.get("maxmemory", 0))

    async def start(self) -> None:
        """The first read, and the warning when nothing bounds Redis's memory."""
        try:
            await self.read()
        except Exception as exc:  # an ACL without INFO, a proxy: admission goes on without
            log.warning("cannot read Redis's memory (INFO memory: %s); not watching it", exc)
            return
        if self.max_bytes == 0:
            log.warning(
                "Redis has no maxmemory: nothing bounds what it holds; run it with "
                "maxmemory and maxmemory-policy noeviction (docs/mesh.md, 'Keys and retention')"
            )

    async def watch(self) -> None:
        """Read INFO memory every second (until cancelled)."""
        while True:
            await asyncio.sleep(_PERIOD_S)
            try:
                await self.read()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: the requests themselves will say so
                log.debug("reading Redis's memory failed: %s", exc)

    @property
    def share(self) -> float:
        """``used_memory / maxmemory`` as last read (0 without maxmemory)."""
        return self.used_bytes / self.max_bytes if self.max_bytes else 0.0

    def check(self) -> None:
        """OverloadedError when Redis is above the limit."""
        if self.max_bytes and self.share >= self.limit and math.isfinite(self.share):
            raise OverloadedError(
                f"redis holds {self.used_bytes / 2**20:.0f} MiB of its maxmemory "
                f"{self.max_bytes / 2**20:.0f} MiB ({self.share:.0%}, above the coordinator's "
                f"--redis-memory-limit {self.limit:.0%}): new work waits until admitted work "
                "frees room",
                _RETRY_S,
            )
