"""The Redis the mesh tests share (HEXGEN_TEST_REDIS, default 127.0.0.1:6379), and a skip
mark for when none answers there."""

from __future__ import annotations

import os

import pytest
import redis

__all__ = ["REDIS_URL", "needs_redis", "redis_up"]

REDIS_URL = os.environ.get("HEXGEN_TEST_REDIS", "redis://127.0.0.1:6379/0")


def redis_up(url: str = REDIS_URL) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except redis.RedisError:
        return False


needs_redis = pytest.mark.skipif(not redis_up(), reason=f"no Redis at {REDIS_URL}")
