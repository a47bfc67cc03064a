"""Shard leases (`hexgen_coordinator.shards`) on the real Redis at HEXGEN_TEST_REDIS (default
127.0.0.1:6379), each test under prefixes of its own: which shard owns a workflow, who takes
which shard, a spare taking an expired one, renewal, a lost lease, a clean release."""

from __future__ import annotations

import asyncio
import os
import uuid
import zlib
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from hexgen_coordinator.shards import LeaseLostError, ShardLease, ShardMap, lease_key
from hexgen_flow.errors import ConfigError

REDIS_URL = os.environ.get("HEXGEN_TEST_REDIS", "redis://127.0.0.1:6379/0")
TTL_S = 0.6


@pytest.fixture
async def client() -> AsyncIterator[aioredis.Redis[bytes]]:
    redis: aioredis.Redis[bytes] = aioredis.Redis.from_url(REDIS_URL)
    yield redis
    await redis.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


@pytest.fixture
async def shards(client: aioredis.Redis[bytes]) -> AsyncIterator[ShardMap]:
    tag = uuid.uuid4().hex[:8]
    shard_map = ShardMap(tuple(f"hf-test-lease-{tag}:{{s{k}}}:" for k in range(3)))
    yield shard_map
    await client.delete(*(lease_key(p) for p in shard_map.prefixes))


def test_a_workflow_belongs_to_crc32_of_its_id_mod_the_shards() -> None:
    shard_map = ShardMap.parse("hf:{s0}:, hf:{s1}:,hf:{s2}:")
    assert shard_map.prefixes == ("hf:{s0}:", "hf:{s1}:", "hf:{s2}:")
    ids = [f"q-{i}" for i in range(300)]
    assert [shard_map.shard_of(i) for i in ids] == [zlib.crc32(i.encode()) % 3 for i in ids]
    assert {shard_map.shard_of(i) for i in ids} == {0, 1, 2}
    assert shard_map.index("hf:{s1}:") == 1 and shard_map.index("hf:") is None
    for bad in ("", "hf:{s0}:,hf:{s0}:", "hf:{s0}:,a b:"):
        with pytest.raises(ConfigError, match="--shards"):
            ShardMap.parse(bad)


async def test_coordinators_take_their_own_shard_then_the_first_free_one(
    client: aioredis.Redis[bytes], shards: ShardMap
) -> None:
    b = await ShardLease.acquire(client, shards, "b:1", TTL_S, preferred=1)
    a = await ShardLease.acquire(client, shards, "a:1", TTL_S, preferred=1)  # taken: first free
    c = await ShardLease.acquire(client, shards, "c:1", TTL_S)
    assert (b.shard, a.shard, c.shard) == (1, 0, 2)
    assert [await a.owner(k) for k in range(3)] == ["a:1", "b:1", "c:1"]
    assert a.prefix == shards.prefixes[0]


async def test_a_spare_waits_and_takes_the_shard_whose_lease_expires(
    client: aioredis.Redis[bytes], shards: ShardMap
) -> None:
    held = [await ShardLease.acquire(client, shards, f"h{k}:1", TTL_S) for k in range(3)]
    spare = asyncio.create_task(ShardLease.acquire(client, shards, "spare:1", TTL_S, poll_s=0.05))
    keepers = [asyncio.create_task(lease.keep()) for lease in held]
    await asyncio.sleep(3 * TTL_S)
    assert not spare.done()  # renewed leases never expire
    keepers[2].cancel()  # shard 2's coordinator dies: nobody renews
    taken = await asyncio.wait_for(spare, timeout=5 * TTL_S)
    assert (taken.shard, await taken.owner(2)) == (2, "spare:1")
    # The dead holder's renewal, were it to come back, finds the lease gone: it must stop.
    with pytest.raises(LeaseLostError, match="lost the lease of shard 2"):
        await held[2].renew()
    for keeper in keepers[:2]:
        keeper.cancel()


async def test_a_released_shard_is_free_at_once_and_only_its_holder_releases_it(
    client: aioredis.Redis[bytes], shards: ShardMap
) -> None:
    lease = await ShardLease.acquire(client, shards, "a:1", 60.0, preferred=0)
    impostor = ShardLease(client, shards, 0, "b:1", 60.0)
    await impostor.release()
    assert await lease.owner(0) == "a:1"
    await lease.release()
    assert await lease.owner(0) is None
    again = await ShardLease.acquire(client, shards, "b:1", 60.0, preferred=0)
    assert again.shard == 0
