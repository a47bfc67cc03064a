"""Group commit (`hexgen_coordinator.group_commit`) on a real Redis: calls that queue while
one is in flight go as one script call, each caller gets its own call's result, and an
error reaches every caller of the batch. Each test runs through both clients a coordinator
gives it: redis-py's (a Redis Cluster, Sentinel, ``--no-pipelined-redis``) and
`PipelinedRedis` (a single Redis, the default). The completion script itself runs through it
in every mesh test; `test_redis_cluster.py` runs a batch on a Redis Cluster."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from hexgen_coordinator.group_commit import GroupCommit
from hexgen_coordinator.pipelined_redis import PipelinedRedis
from redis_here import REDIS_URL, needs_redis

pytestmark = needs_redis

# Adds ARGV[1] to KEYS[1]; returns the new value and this call's tag (ARGV[2]), so that a
# caller can see that the result it got is its own call's. ARGV[1] = 'refuse' returns an
# error reply; 'boom' raises (INCRBY of a non-number); 'nothing' returns nil (a bug).
ADD = """
local function apply(KEYS, ARGV)
  if ARGV[1] == 'refuse' then return redis.error_reply('refused') end
  if ARGV[1] == 'nothing' then return nil end
  return {redis.call('INCRBY', KEYS[1], ARGV[1]), ARGV[2]}
end
"""


@pytest.fixture
async def redis() -> AsyncIterator[aioredis.Redis[bytes]]:
    client: aioredis.Redis[bytes] = aioredis.Redis.from_url(REDIS_URL)
    yield client
    await client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


@pytest.fixture(params=["redis-py", "pipelined"])
async def scripts(
    request: pytest.FixtureRequest, redis: aioredis.Redis[bytes]
) -> AsyncIterator[aioredis.Redis[bytes] | PipelinedRedis]:
    """The client the group commit sends its scripts through."""
    if request.param == "redis-py":
        yield redis
        return
    client = PipelinedRedis(REDIS_URL)
    yield client
    await client.aclose()


def _key() -> str:
    return f"test:group-commit:{uuid.uuid4().hex}"


async def test_calls_made_while_one_is_in_flight_go_as_one_batch(
    redis: aioredis.Redis[bytes],
    scripts: aioredis.Redis[bytes] | PipelinedRedis,
) -> None:
    commit = GroupCommit(scripts, ADD)
    keys = [_key() for _ in range(3)]
    calls = [(keys[i % 3], i + 1, f"call-{i}") for i in range(20)]
    results = await asyncio.gather(*(commit(keys=[key], args=[n, tag]) for key, n, tag in calls))
    # each caller got its own call's result
    assert [r[1].decode() for r in results] == [tag for _, _, tag in calls]
    # the first went alone, the 19 that queued behind it as one batch
    assert (commit.calls, commit.round_trips) == (20, 2)
    for i, key in enumerate(keys):
        expected = sum(n for k, n, _ in calls if k == key)
        assert int(await redis.get(key) or 0) == expected, i
        # the last result of a key is its final value: calls applied in order
        assert (
            max(int(r[0]) for (k, _, _), r in zip(calls, results, strict=True) if k == key)
            == expected
        )
    await redis.delete(*keys)


async def test_a_batch_is_cut_at_max_batch(
    redis: aioredis.Redis[bytes], scripts: aioredis.Redis[bytes] | PipelinedRedis
) -> None:
    commit = GroupCommit(scripts, ADD, max_batch=4)
    key = _key()
    await asyncio.gather(*(commit(keys=[key], args=[1, str(i)]) for i in range(10)))
    assert int(await redis.get(key) or 0) == 10
    assert commit.round_trips == 1 + 3  # one alone, then 9 queued in batches of 4, 4, 1
    await redis.delete(key)


async def test_one_call_at_a_time_is_never_delayed_into_a_batch(
    redis: aioredis.Redis[bytes],
    scripts: aioredis.Redis[bytes] | PipelinedRedis,
) -> None:
    commit = GroupCommit(scripts, ADD)
    key = _key()
    for i in range(5):
        value, _ = await commit(keys=[key], args=[2, str(i)])
        assert int(value) == 2 * (i + 1)
    assert commit.round_trips == 5
    await redis.delete(key)


async def _batch_behind_one(
    commit: GroupCommit, key: str, args: list[list[object]]
) -> list[object]:
    """Run `args` as one batch (queued behind a first call of 1); their outcomes."""
    first = asyncio.ensure_future(commit(keys=[key], args=[1, "first"]))
    await asyncio.sleep(0)  # in flight: the next ones queue behind it
    batch = [asyncio.ensure_future(commit(keys=[key], args=a)) for a in args]
    assert (await first)[1] == b"first"
    outcomes = await asyncio.gather(*batch, return_exceptions=True)
    assert commit.round_trips == 2
    return outcomes


async def test_an_error_reply_fails_its_own_caller_only(
    redis: aioredis.Redis[bytes], scripts: aioredis.Redis[bytes] | PipelinedRedis
) -> None:
    commit = GroupCommit(scripts, ADD)
    key = _key()
    refused, after = await _batch_behind_one(commit, key, [["refuse", "a"], [1, "b"]])
    assert isinstance(refused, ResponseError) and "refused" in str(refused)
    assert isinstance(after, list) and after[1] == b"b"
    assert int(await redis.get(key) or 0) == 2
    await redis.delete(key)


async def test_a_script_error_fails_every_caller_of_its_batch(
    redis: aioredis.Redis[bytes],
    scripts: aioredis.Redis[bytes] | PipelinedRedis,
) -> None:
    commit = GroupCommit(scripts, ADD)
    key = _key()
    outcomes = await _batch_behind_one(commit, key, [[1, "a"], ["boom", "b"], [1, "c"]])
    assert all(isinstance(o, ResponseError) for o in outcomes), outcomes
    # the script stopped at the error: the call before it ran, the one after it did not
    assert int(await redis.get(key) or 0) == 2
    value, _ = await commit(keys=[key], args=[5, "after"])  # and the commit goes on
    assert int(value) == 7
    await redis.delete(key)


async def test_a_batch_cut_short_by_a_nil_fails_its_callers_instead_of_hanging(
    redis: aioredis.Redis[bytes],
    scripts: aioredis.Redis[bytes] | PipelinedRedis,
) -> None:
    commit = GroupCommit(scripts, ADD)
    key = _key()
    outcomes = await asyncio.wait_for(
        _batch_behind_one(commit, key, [[1, "a"], ["nothing", "b"], [1, "c"]]), timeout=10
    )
    assert all(
        isinstance(o, ResponseError) and "answered 1 results for 3 calls" in str(o)
        for o in outcomes
    ), outcomes
    value, _ = await commit(keys=[key], args=[1, "after"])  # and the commit goes on
    assert int(value) == 4  # first, a, c and this one: the batch itself ran
    await redis.delete(key)


async def test_a_call_cancelled_while_queued_is_not_sent(
    redis: aioredis.Redis[bytes], scripts: aioredis.Redis[bytes] | PipelinedRedis
) -> None:
    commit = GroupCommit(scripts, ADD)
    key = _key()
    first = asyncio.ensure_future(commit(keys=[key], args=[1, "first"]))
    await asyncio.sleep(0)
    dropped = asyncio.ensure_future(commit(keys=[key], args=[100, "dropped"]))
    kept = asyncio.ensure_future(commit(keys=[key], args=[10, "kept"]))
    await asyncio.sleep(0)
    dropped.cancel()
    await first
    assert (await kept)[1] == b"kept"
    assert int(await redis.get(key) or 0) == 11
    await redis.delete(key)


def test_max_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        GroupCommit(aioredis.Redis.from_url(REDIS_URL), ADD, max_batch=0)
