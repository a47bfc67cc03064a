"""`PipelinedRedis` (the completion path's own connection) against real redis-servers: replies
reach their callers in order, error replies raise redis-py's exceptions, a script Redis lost
is loaded again, and the failures the coordinator's retries rely on (Redis gone, Redis not
answering, a wrong login) raise redis-py's retryable errors, after which the next call
connects again. The group commit through it: `test_group_commit.py`; the whole completion
path through it: every mesh test (it is the coordinator's default on a single Redis)."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.exceptions import (
    AuthenticationError,
    ConnectionError,
    DataError,
    NoScriptError,
    ResponseError,
    TimeoutError,
)

from hexgen_coordinator.pipelined_redis import PipelinedRedis
from hexgen_coordinator.redis_retry import pipelined_client
from hexgen_launch.processes import RedisServer, free_port
from redis_here import REDIS_URL, needs_redis

pytestmark = needs_redis


@pytest.fixture
async def client() -> AsyncIterator[PipelinedRedis]:
    pipelined = PipelinedRedis(REDIS_URL)
    yield pipelined
    await pipelined.aclose()


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    server = RedisServer(appendfsync=None)
    server.start()
    yield server
    server.stop()


def _key() -> str:
    return f"test:pipelined:{uuid.uuid4().hex}"


async def test_concurrent_commands_each_get_their_own_reply(client: PipelinedRedis) -> None:
    key = _key()
    await client.execute("SET", key, 0)
    replies = await asyncio.gather(*(client.execute("INCRBY", key, n) for n in range(1, 51)))
    # pipelined in order on one connection: the running sums, in the order they were sent
    assert replies == [n * (n + 1) // 2 for n in range(1, 51)]
    await client.execute("DEL", key)


async def test_execute_many_is_one_pipeline_with_every_reply(client: PipelinedRedis) -> None:
    key = _key()
    replies = await client.execute_many(
        [("HSET", key, "a", 1, "b", 2.5), ("HINCRBY", key, "a", 2), ("HGETALL", key)]
    )
    assert replies == [2, 3, [b"a", b"3", b"b", b"2.5"]]
    assert await client.execute_many([]) == []
    await client.execute("DEL", key)


async def test_an_error_reply_raises_redis_pys_exception(client: PipelinedRedis) -> None:
    key = _key()
    await client.execute("SET", key, "text")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await client.execute("HGET", key, "a")
    # in a pipeline the commands before and after the error still ran, and the error raises
    other = _key()
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await client.execute_many([("SET", other, 1), ("HGET", key, "a"), ("INCR", other)])
    assert await client.execute("GET", other) == b"2"
    with pytest.raises(NoScriptError):
        await client.execute("EVALSHA", "0" * 40, 0)
    await client.execute("DEL", key, other)


async def test_an_argument_redis_cannot_take_raises_and_leaves_the_connection_in_step(
    client: PipelinedRedis,
) -> None:
    key = _key()
    with pytest.raises(DataError, match="must be str, int, float or bytes"):
        await client.execute("SET", key, None)  # type: ignore[arg-type]  # what is refused
    with pytest.raises(DataError):
        await client.execute_many([("SET", key, 1), ("SET", key, object())])  # type: ignore[list-item]
    # nothing of either went out, and the next reply is the next command's own
    assert await client.execute("EXISTS", key) == 0
    assert await client.execute("SET", key, 0.1 + 0.2) == b"OK"
    assert await client.execute("GET", key) == repr(0.1 + 0.2).encode()  # as redis-py writes it
    await client.execute("DEL", key)


async def test_a_script_redis_lost_is_loaded_again(client: PipelinedRedis) -> None:
    script = client.register_script("return {KEYS[1], ARGV[1], #ARGV}")
    await client.execute("SCRIPT", "FLUSH")
    assert await script(keys=["k"], args=[1, "two"]) == [b"k", b"1", 2]
    assert await client.execute("SCRIPT", "EXISTS", script.sha) == [1]
    assert await script(keys=["k"], args=[3]) == [b"k", b"3", 1]


async def test_a_user_and_database_from_the_url(private_redis: RedisServer) -> None:
    admin = PipelinedRedis(private_redis.url)
    await admin.execute("ACL", "SETUSER", "coord", "on", ">s3cret", "~*", "&*", "+@all")
    url = f"redis://coord@127.0.0.1:{private_redis.port}/2"
    good = PipelinedRedis(url, password="s3cret")
    await good.execute("SET", "k", "in db 2")
    assert await good.execute("ACL", "WHOAMI") == b"coord"
    await admin.execute("SELECT", 2)
    assert await admin.execute("GET", "k") == b"in db 2"  # the database the URL names
    bad = PipelinedRedis(url, password="wrong")
    with pytest.raises(AuthenticationError):
        await bad.execute("PING")
    for client in (admin, good, bad):
        await client.aclose()


async def test_redis_gone_raises_connection_error_then_the_next_call_reconnects(
    private_redis: RedisServer,
) -> None:
    client, killer = PipelinedRedis(private_redis.url), PipelinedRedis(private_redis.url)
    assert await client.execute("SET", "k", 1) == b"OK"
    own_id = await client.execute("CLIENT", "ID")
    waiting = asyncio.ensure_future(client.execute("BLPOP", "nothing", 10))  # in flight
    await asyncio.sleep(0.1)
    assert await killer.execute("CLIENT", "KILL", "ID", own_id) == 1
    with pytest.raises(ConnectionError, match="lost"):
        await asyncio.wait_for(waiting, timeout=5)
    assert await client.execute("GET", "k") == b"1"  # a new connection
    assert await client.execute("CLIENT", "ID") != own_id
    for pipelined in (client, killer):
        await pipelined.aclose()
    nowhere = PipelinedRedis(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(ConnectionError, match="Error connecting"):
        await nowhere.execute("PING")


async def test_a_redis_that_does_not_answer_times_out_and_is_dropped(
    private_redis: RedisServer,
) -> None:
    client = PipelinedRedis(private_redis.url, timeout_s=0.5)
    assert await client.execute("PING") == b"PONG"
    process = private_redis.process
    assert process is not None and process.pid is not None
    os.kill(process.pid, signal.SIGSTOP)
    try:
        waiting = [asyncio.ensure_future(client.execute("INCR", "n")) for _ in range(3)]
        outcomes = await asyncio.wait_for(
            asyncio.gather(*waiting, return_exceptions=True), timeout=5
        )
        assert all(isinstance(o, TimeoutError) for o in outcomes), outcomes
    finally:
        os.kill(process.pid, signal.SIGCONT)
    # the next call connects again; no late reply of the stopped ones is taken for its own
    assert await client.execute("PING") == b"PONG"
    assert await client.execute("GET", "n") in (None, b"3")  # the three ran or did not, whole
    await client.aclose()


def test_only_a_single_redis_gets_the_pipelined_connection() -> None:
    assert isinstance(pipelined_client("redis://127.0.0.1:6379/0"), PipelinedRedis)
    assert pipelined_client("redis://127.0.0.1:6379/0", cluster=True) is None
    assert pipelined_client("redis+sentinel://127.0.0.1:26379/mymaster/0") is None
    with pytest.raises(ValueError, match="redis:// and unix://"):
        PipelinedRedis("rediss://127.0.0.1:6379/0")
