"""The Redis ACL of a sharded mesh (``hexgen-flow auth init DIR --shards ...``), on a real
``redis-server --aclfile`` (acl_redis_here.py): the coordinator's user reads and writes
every shard's keys, leases included, and none outside them; the tuner's reads every shard's
window and clock and writes none of them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import redis

from acl_redis_here import (
    PREFIX,
    SHARDS,
    AclRedis,
    acl_server,
    check_every_command,
    emptied,
)
from hexgen_coordinator.shards import ShardLease, ShardMap
from hexgen_coordinator.store import _SUBMIT, WorkflowStore
from hexgen_flow.errors import ConfigError
from hexgen_flow.runtime import CompletionEffect
from hexgen_service.auth_dir import (
    AuthDir,
    redis_acl_line,
)
from hexgen_tuner.store import TunerStore, TuningRunRecord
from hexgen_tuner.window import read_sharded_window

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server is not installed"
)


@pytest.fixture(scope="module")
def shard_acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    """The ACL of a sharded mesh, as ``hexgen-flow auth init DIR --shards hf:{s0}:,hf:{s1}:``
    writes it (the command itself, as a user runs it)."""
    root = tmp_path_factory.mktemp("shard-acl")
    auth = AuthDir(root / "auth")
    done = subprocess.run(
        [sys.executable, "-m", "hexgen_cli", "auth", "init", str(auth.path),
         "--shards", ",".join(SHARDS)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with acl_server(root, auth) as server:
        yield server


@pytest.fixture
def shard_acl(shard_acl_redis: AclRedis) -> AclRedis:
    """The sharded ACL Redis, empty, its ACL log cleared."""
    return emptied(shard_acl_redis)


def test_every_allowed_command_is_allowed_to_its_user_only(shard_acl: AclRedis) -> None:
    check_every_command(shard_acl, sharded=True)


# ------------------------------------------------------------------- a sharded mesh


def test_the_sharded_lines_are_exact() -> None:
    tuner = redis_acl_line("tuner", "secret", shards=SHARDS)
    assert tuner == (
        "user tuner on resetpass "
        "#2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b "
        "resetkeys %R~hf:{s0}:admitted %R~hf:{s0}:finished %R~hf:{s1}:admitted "
        "%R~hf:{s1}:finished ~hf:tuner:* resetchannels -@all +ping +multi +exec +discard "
        "+xrevrange +xrange +xlen +incr +lpush +ltrim +lrange +cluster|slots "
        "+command +asking "
        # a selector: HMGET on the shards' clocks only
        "(%R~hf:{s0}:meta %R~hf:{s1}:meta +hmget)"
    )
    coordinator = redis_acl_line("coordinator", "secret", shards=SHARDS)
    assert " resetkeys ~hf:{s0}:* ~hf:{s1}:* resetchannels " in coordinator
    # SET, GET and DEL on the leases alone
    assert coordinator.endswith(" +asking (~hf:{s0}:lease ~hf:{s1}:lease +set +get +del)")
    # the tuner's own keys follow its --redis-prefix (on a Redis Cluster, hf:{0}:)
    assert " ~hf:{0}:tuner:* " in redis_acl_line("tuner", "x", "hf:{0}:", shards=SHARDS)
    for shards, problem in (
        (("hf:{s0}:", "hf:{s0}:"), "appears twice"),
        (("hf:{s0}:", ""), "is not a key prefix"),
        (("hf:{s0}:", "a b:"), "is not a key prefix"),
    ):
        with pytest.raises(ConfigError, match=f"^--shards: .*{problem}"):
            redis_acl_line("coordinator", "x", shards=shards)
    with pytest.raises(ConfigError, match=r"^--redis-prefix: '' must be non-empty"):
        redis_acl_line("tuner", "x", "", shards=SHARDS)


async def test_the_sharded_tuner_reads_every_shards_window_and_clock(shard_acl: AclRedis) -> None:
    for k, prefix in enumerate(SHARDS):  # what each shard's coordinator writes
        shard_acl.admin.hset(
            f"{prefix}meta", mapping={"epoch_unix_s": f"{1000 + k}", "time_scale": "10"}
        )
        shard_acl.admin.xadd(f"{prefix}admitted", {"query_id": f"a{k}", "tenant": "demo"})
        shard_acl.admin.xadd(f"{prefix}finished", {"query_id": f"q{k}", "tenant": "demo"})
    client = shard_acl.aclient("tuner")
    try:
        window = await read_sharded_window(client, SHARDS, 100)
        assert window.skipped == 4  # both shards' streams read (and found unreadable: no shape)
        clock = await client.hmget(f"{SHARDS[1]}meta", ["epoch_unix_s", "time_scale"])
        assert clock == [b"1001", b"10"]
        assert [f[b"query_id"] for _, f in await client.xrange(f"{SHARDS[1]}admitted")] == [b"a1"]
        assert await client.xlen(f"{SHARDS[1]}finished") == 1
        store = TunerStore(client, PREFIX, runs_kept=2)  # its own keys
        assert await store.next_run_id() == "tune-000001"
        await store.record_run(TuningRunRecord("tune-000001", 1.0, 2.0, 0, 0.0, (), 0.3, 0.3,
                                               False, "test"))  # fmt: skip
        assert [r.best_alpha for r in await store.runs(10)] == [0.3]
    finally:
        await client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose
    assert shard_acl.denials() == []


DENIED_TO_SHARD_TUNER = [
    ("XADD", "hf:{s1}:admitted", "*", "query_id", "forged"),
    ("XADD", "hf:{s1}:finished", "*", "query_id", "forged"),
    ("XTRIM", "hf:{s1}:finished", "MAXLEN", "0"),
    ("XDEL", "hf:{s1}:admitted", "0-1"),
    ("HSET", "hf:{s1}:meta", "epoch_unix_s", "0"),
    ("HSET", "hf:{s1}:meta", "alpha", "0.9"),
    ("DEL", "hf:{s1}:meta"),
    ("HMGET", "hf:{s1}:q:q1", "state"),  # HMGET reads the clocks, nothing else
    ("HMGET", "hf:tuner:runs", "x"),
    ("SET", "hf:{s1}:lease", "tuner:1"),
    ("LPUSH", "hf:{s1}:tuner:runs", "x"),  # its own keys are under its prefix, in no shard
    ("XADD", "hf:{s0}:admitted", "*", "query_id", "forged"),
    ("HMGET", "hf:meta", "epoch_unix_s"),  # no shard's
    ("FLUSHALL",),
]


@pytest.mark.parametrize("command", DENIED_TO_SHARD_TUNER, ids=" ".join)
def test_the_sharded_tuner_cannot_write_a_shard(
    shard_acl: AclRedis, command: tuple[str, ...]
) -> None:
    shard_acl.admin.xadd("hf:{s1}:admitted", {"query_id": "a"}, id="0-1")
    shard_acl.admin.hset("hf:{s1}:meta", "epoch_unix_s", "1000")
    before = _dump(shard_acl)
    client = shard_acl.client("tuner")
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.execute_command(*command)
    client.close()
    assert _dump(shard_acl) == before


def _dump(server: AclRedis) -> dict[bytes, bytes | None]:
    """Every key and its serialized value (DUMP), as the admin reads them."""
    return {key: server.admin.dump(key) for key in server.admin.scan_iter()}


async def test_the_sharded_coordinator_serves_and_leases_every_shard(shard_acl: AclRedis) -> None:
    """Any coordinator may come to serve any shard (a spare takes over whichever expires):
    its user runs a query to its end on each, and takes, names, renews, gives up and takes
    over leases."""
    client = shard_acl.aclient("coordinator")
    shards = ShardMap(SHARDS)
    try:
        for k, prefix in enumerate(SHARDS):
            store = WorkflowStore(client, prefix, retention_s=60)
            await store.epoch(time.time(), 1.0)
            assert await store.submit(f"q{k}", b"sub", "demo", 0.0, 10.0, [1], [0]) == (True, 0)
            only = CompletionEffect(True, (), True)  # the core's: the only call ends the query
            done = await store.complete(f"q{k}", f"q{k}/0/0", 0, [], only, 1.0, {"call_id": "c"})
            assert done.applied and done.calls_left == 0
        a = await ShardLease.acquire(client, shards, "a:1", 5.0, preferred=0)
        b = await ShardLease.acquire(client, shards, "b:1", 5.0)
        assert (a.shard, b.shard, await a.owner(1)) == (0, 1, "b:1")  # a redirect's target
        await a.renew()
        await a.release()  # a clean stop
        spare = await ShardLease.acquire(client, shards, "spare:1", 5.0)
        assert (spare.shard, await spare.owner(0)) == (0, "spare:1")
    finally:
        await client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose
    assert [shard_acl.admin.xlen(f"{p}finished") for p in SHARDS] == [1, 1]
    assert shard_acl.denials() == []


DENIED_TO_SHARD_COORDINATOR = [
    # SET, GET and DEL reach the leases, not a query's state
    ("GET", "hf:{s0}:qseq"),
    ("SET", "hf:{s0}:qseq", "0"),
    ("DEL", "hf:{s0}:active"),
    ("DEL", "hf:{s1}:q:q1"),
    ("HSET", "hf:q:q1", "state", "succeeded"),  # the prefix of one coordinator: no shard's
    ("SET", "hf:lease", "a:1", "NX", "PX", "1000"),
    ("SET", "hf:{s2}:lease", "a:1", "NX", "PX", "1000"),  # a shard it was not given
    ("GET", "hf:{s2}:lease"),
    ("XADD", "hf:{spare}:finished", "*", "query_id", "x"),  # a spare's own prefix
    ("DEL", "hf:tuner:runs"),  # the tuner's keys
    ("GET", "other:key"),
    ("EVAL", "return redis.call('DEL', KEYS[1])", "1", "hf:{s0}:lease"),
    ("FLUSHALL",),
    ("KEYS", "*"),
    ("CONFIG", "GET", "dir"),
    ("ACL", "LIST"),
]


@pytest.mark.parametrize("command", DENIED_TO_SHARD_COORDINATOR, ids=" ".join)
def test_the_sharded_coordinator_cannot_leave_the_shards(
    shard_acl: AclRedis, command: tuple[str, ...]
) -> None:
    client = shard_acl.client("coordinator")
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.execute_command(*command)
    client.close()
    assert list(shard_acl.admin.scan_iter()) == []


def test_the_sharded_coordinators_scripts_cannot_leave_the_shards(shard_acl: AclRedis) -> None:
    shard_acl.admin.sadd("hf:{s0}:active", "q1")
    client = shard_acl.client("coordinator")
    sha = client.execute_command("SCRIPT", "LOAD", _SUBMIT)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.execute_command("EVALSHA", sha, 3, "hf:q:1", "hf:qseq", "hf:active")
    # code of a thief's own, loaded as the coordinator: the leases' DEL is not for it
    wipe = client.execute_command("SCRIPT", "LOAD", "return redis.call('DEL', KEYS[1])")
    with pytest.raises(redis.ResponseError, match="can't access at least one of the keys"):
        client.execute_command("EVALSHA", wipe, 1, "hf:{s0}:active")  # refused inside it
    client.close()
    assert [k.decode() for k in shard_acl.admin.scan_iter()] == ["hf:{s0}:active"]
