"""The Redis ACL an auth directory writes (`hexgen_service.auth_dir.redis_acl_line`), on a
real ``redis-server --aclfile``: the coordinator's user runs everything the coordinator
does and nothing more, the tuner's user reads the ``admitted`` and ``finished`` streams
and keeps its own keys, and the default user is off. A sharded mesh's ACL is
test_redis_acl_shards.py's.

The server loads the file `AuthDir.init` writes plus one line for the test itself (an
admin user, to read ``ACL LOG`` and reset the database between tests); nothing else
(acl_redis_here.py).
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import redis

from acl_redis_here import (
    ADMIN,
    NO_RETRY,
    PREFIX,
    AclRedis,
    acl_server,
    check_every_command,
    emptied,
    text,
)
from hexgen_api.v1 import coordinator_pb2, tuner_pb2, tuner_pb2_grpc
from hexgen_client.client import CoordinatorClient
from hexgen_coordinator.check_state import check_state
from hexgen_coordinator.session_store import GIVE_APPLIED, SessionStore
from hexgen_coordinator.store import _SUBMIT, Placement, WorkflowStore
from hexgen_flow.errors import ConfigError
from hexgen_flow.runtime import CompletionEffect
from hexgen_flow.traces import load_trace, take_queries
from hexgen_flow.workload import LLMCall
from hexgen_launch.processes import ManagedProcess, free_port, stop_processes
from hexgen_service.auth_dir import (
    AuthDir,
    redis_acl_line,
)
from hexgen_tuner.store import TunerStore, TuningRunRecord
from hexgen_tuner.window import read_window

# What the core's rule (`QueryRun.completion_effect`) gives each completion below, which the
# store's script applies: the first stage of two releases the second; the last call ends
# the query.
FIRST = CompletionEffect(True, (1,), False)
LAST = CompletionEffect(True, (), True)
ALONE = CompletionEffect(True, (), False)
"""A session's only call: its stage finishes, the open session holds the query."""


pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server is not installed"
)


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    root = tmp_path_factory.mktemp("acl")
    auth = AuthDir(root / "auth")
    auth.init(["demo"])
    with acl_server(root, auth) as server:
        yield server


@pytest.fixture
def acl(acl_redis: AclRedis) -> AclRedis:
    """The ACL Redis, empty, its ACL log cleared."""
    return emptied(acl_redis)


# ------------------------------------------------------------------------------ the file


def test_the_file_has_one_line_per_service_and_the_default_user_off(acl: AclRedis) -> None:
    lines = acl.auth.redis_acl.read_text().splitlines()
    assert [line.split()[1] for line in lines] == ["coordinator", "tuner", "health", "default"]
    assert lines[-1] == "user default off"
    for line in lines[:-1]:
        assert " -@all " in line and "resetchannels" in line
        assert acl.password(line.split()[1]) not in line  # only its SHA-256
    listed = {text(line).split()[1]: text(line) for line in acl.admin.acl_list()}
    assert set(listed) == {"coordinator", "tuner", "health", "default", ADMIN}
    assert listed["default"].startswith("user default off ")  # no password, cannot log in
    assert "nopass" not in listed["default"]


def test_the_line_is_exact() -> None:
    line = redis_acl_line("tuner", "secret", "hf:")
    assert line == (
        "user tuner on resetpass "
        "#2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b "
        "resetkeys %R~hf:admitted %R~hf:finished ~hf:tuner:* resetchannels -@all +ping +multi "
        "+exec +discard +xrevrange +xrange +xlen +incr +lpush +ltrim +lrange "
        # a Redis Cluster's client (--redis-cluster) maps slots to nodes and reads the
        # commands' key positions; ASKING follows a slot that moves (tests/test_redis_cluster.py)
        "+cluster|slots +command +asking"
    )
    assert "~a\\*b:*" in redis_acl_line("coordinator", "x", "a*b:")  # a literal prefix
    for user, password, prefix in (("admin", "x", "hf:"), ("tuner", "", "hf:"), ("tuner", "x", "")):
        with pytest.raises(ConfigError):
            redis_acl_line(user, password, prefix)


def test_without_a_password_nobody_gets_in(acl: AclRedis) -> None:
    anonymous: redis.Redis[bytes] = redis.Redis(host="127.0.0.1", port=acl.port, retry=NO_RETRY)
    with pytest.raises(redis.AuthenticationError, match=r"NOAUTH|authenticated"):
        anonymous.ping()
    anonymous.close()
    for user, password in (("default", "x"), ("coordinator", "wrong"), ("tuner", "")):
        client = acl.client(user, password or "nope")
        with pytest.raises(redis.AuthenticationError, match=r"WRONGPASS|invalid"):
            client.ping()
        client.close()
    for user in ("coordinator", "tuner"):  # and each password only opens its own user
        other = "tuner" if user == "coordinator" else "coordinator"
        client = acl.client(user, acl.password(other))
        with pytest.raises(redis.AuthenticationError):
            client.ping()
        client.close()


# ----------------------------------------------------------------------- the coordinator


async def test_the_coordinator_user_runs_all_the_coordinator_does(acl: AclRedis) -> None:
    client = acl.aclient("coordinator")
    try:
        store = WorkflowStore(client, PREFIX, retention_s=60)
        sessions = SessionStore(store)
        assert await client.ping()
        await store.epoch(time.time(), 1.0)
        await store.set_alpha(0.4, 1.0, "test")
        assert await store.alpha() == 0.4
        # a query of two stages that succeeds
        assert await store.submit("q1", b"sub", "demo", 0.0, 10.0, [1, 1], [0, 1]) == (True, 0)
        await store.write(
            store.place_commands("q1", {"q1/0/0": Placement(0, 1, 1)}, {0: 5.0}, [b"e1", b"e2"])
        )
        first = await store.complete(
            "q1", "q1/0/0", 0, [1], FIRST, 1.0, {"call_id": "q1/0/0"}, slot=0
        )
        assert first.applied and first.released == (1,)
        assert (
            await store.complete("q1", "q1/0/0", 0, [1], FIRST, 1.0, {"call_id": "x"})
        ).status == 0
        last = await store.complete("q1", "q1/1/0", 1, [], LAST, 2.0, {"call_id": "q1/1/0"})
        assert last.applied and last.calls_left == 0
        # a write after the end
        await store.write(store.place_commands("q1", {}, {}, [b"e3"], ended=True))
        # a write after an end long gone (no query left), and a new query of that id on it
        await store.write(
            store.place_commands("q0", {"q0/0/0": Placement(0, 1, 1)}, {}, [b"x"], ended=True)
        )
        assert await store.load("q0") is None
        assert (await store.submit("q0", b"sub", "demo", 0.0, 10.0, [1], [0]))[0]
        assert await store.events("q0") == []
        assert await store.cancel("q0", 1.0)
        # a query whose call fails, then is cancelled
        await store.submit("q2", b"sub", "demo", 0.0, 10.0, [1], [0])
        failed = await store.fail_call(
            "q2", "q2/0/0", slot=0, attempt=1, max_attempts=3, now=1.0, reason="boom"
        )
        assert failed.retry
        assert await store.cancel("q2", 2.0)
        # a workflow session: a call given, completed, then the session closed
        await store.submit("q3", b"sub", "demo", 0.0, 10.0, [1], [0], session_idle_s=30.0)
        given = await sessions.give(
            "q3", "q3/0/0", 0, LLMCall("s", 1, 1), "replace", name="s", now=1.0, shape=None
        )
        assert given == GIVE_APPLIED
        await store.complete("q3", "q3/0/0", 0, [], ALONE, 2.0, {"call_id": "q3/0/0"})
        assert await sessions.close_stages("q3", [0], shape=None, close_session=True, now=3.0) == 2
        # what recovery, views and the ledger read
        assert await store.active_ids() == []
        loaded = await store.load("q1")
        assert loaded is not None and loaded.fields["state"] == "succeeded"
        assert await store.events("q1") == [b"e1", b"e2", b"e3"]
        assert await client.llen(store.evkey("q1")) == 3
        assert await client.xlen(store.finished_key) == 2
        async with client.pipeline(transaction=True) as pipe:  # MULTI/EXEC
            pipe.hget(f"{PREFIX}meta", "alpha")
            assert await pipe.execute() == [b"0.4"]
    finally:
        await client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose
    # `hexgen-flow check-state` with the coordinator's credentials
    sync = acl.client("coordinator")
    report = check_state(sync, PREFIX, None)
    sync.close()
    assert report.clean, report.problems
    assert report.queries == 4
    assert acl.denials() == []


DENIED_TO_COORDINATOR = [
    ("CONFIG", "SET", "appendonly", "no"),
    ("CONFIG", "GET", "dir"),
    ("FLUSHALL",),
    ("FLUSHDB",),
    ("DEBUG", "SLEEP", "0"),
    ("SHUTDOWN", "NOSAVE"),
    ("ACL", "LIST"),
    ("ACL", "SETUSER", "coordinator", "+@all"),
    ("KEYS", "*"),
    ("EVAL", "return redis.call('FLUSHALL')", "0"),
    ("SCRIPT", "FLUSH"),
    ("FUNCTION", "FLUSH"),
    ("MODULE", "LIST"),
    ("SAVE",),
    ("BGREWRITEAOF",),
    ("REPLICAOF", "NO", "ONE"),
    ("CLIENT", "LIST"),
    ("MIGRATE", "127.0.0.1", "1", "hf:active", "0", "100"),
    ("SELECT", "1"),
    ("PUBLISH", "hf:events", "x"),
    ("DEL", "hf:active"),
    ("SET", "other:key", "x"),
    ("HGET", "other:q:1", "state"),
    # a shard's lease: a mesh of one coordinator takes none (GET, SET, DEL: sharded only)
    ("SET", "hf:lease", "a:1", "NX", "PX", "1000"),
    ("GET", "hf:lease"),
]


@pytest.mark.parametrize("command", DENIED_TO_COORDINATOR, ids=" ".join)
def test_the_coordinator_user_cannot_administer_or_leave_its_prefix(
    acl: AclRedis, command: tuple[str, ...]
) -> None:
    client = acl.client("coordinator")
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.execute_command(*command)
    client.close()
    assert acl.admin.ping()  # still up (SHUTDOWN, DEBUG were refused)


def test_the_coordinator_scripts_cannot_reach_keys_outside_the_prefix(acl: AclRedis) -> None:
    client = acl.client("coordinator")
    sha = client.execute_command("SCRIPT", "LOAD", _SUBMIT)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.execute_command("EVALSHA", sha, 3, "other:q:1", "other:qseq", "other:active")
    client.close()


# ------------------------------------------------------------------------------ the tuner


async def test_the_tuner_user_reads_its_window_and_keeps_its_own_keys(acl: AclRedis) -> None:
    acl.admin.xadd(f"{PREFIX}admitted", {"query_id": "a", "tenant": "demo"})
    acl.admin.xadd(f"{PREFIX}finished", {"query_id": "q", "tenant": "demo"})
    client = acl.aclient("tuner")
    try:
        store = TunerStore(client, PREFIX, runs_kept=2)
        assert await client.ping()
        assert await store.next_run_id() == "tune-000001"
        run = TuningRunRecord("tune-000001", 1.0, 2.0, 0, 0.0, (), 0.5, 0.5, False, "test")
        for _ in range(3):
            await store.record_run(run)
        assert len(await store.runs(10)) == 2
        window = await read_window(client, PREFIX, 100)
        assert window.skipped == 2  # both streams read (and found unreadable: no shape)
        assert await client.xlen(f"{PREFIX}finished") == 1
    finally:
        await client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose
    assert acl.denials() == []


DENIED_TO_TUNER = [
    ("XADD", "hf:finished", "*", "query_id", "forged"),
    ("XADD", "hf:admitted", "*", "query_id", "forged"),
    ("XTRIM", "hf:admitted", "MAXLEN", "0"),
    ("XTRIM", "hf:finished", "MAXLEN", "0"),
    ("XDEL", "hf:finished", "0-1"),
    ("DEL", "hf:finished"),
    ("DEL", "hf:q:q1"),
    ("DEL", "hf:tuner:runs"),
    ("HGETALL", "hf:q:q1"),
    ("HSET", "hf:q:q1", "state", "succeeded"),
    ("SREM", "hf:active", "q1"),
    ("HSET", "hf:meta", "alpha", "0.9"),
    # the α history is the coordinator's (the tuner asks it with GetAlphaHistory)
    ("LRANGE", "hf:alpha:history", "0", "-1"),
    ("RPUSH", "hf:alpha:history", "{}"),
    # its own keys take only what its store does: no RPUSH, no LINDEX
    ("RPUSH", "hf:tuner:runs", "x"),
    ("LINDEX", "hf:tuner:runs", "0"),
    ("LRANGE", "hf:ev:q1", "0", "-1"),
    ("EVAL", "return 1", "0"),
    ("SCRIPT", "LOAD", "return 1"),
    ("CONFIG", "GET", "dir"),
    ("FLUSHALL",),
    ("KEYS", "*"),
    ("ACL", "WHOAMI"),
    ("SET", "other:key", "x"),
    # the clock of a shard: one coordinator's tuner reads no `meta` (nor may it, then)
    ("HMGET", "hf:meta", "epoch_unix_s", "time_scale"),
]


@pytest.mark.parametrize("command", DENIED_TO_TUNER, ids=" ".join)
def test_the_tuner_user_cannot_touch_query_state(acl: AclRedis, command: tuple[str, ...]) -> None:
    client = acl.client("tuner")
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.execute_command(*command)
    client.close()


def test_the_tuner_user_cannot_run_the_coordinators_scripts(acl: AclRedis) -> None:
    coordinator = acl.client("coordinator")
    sha = coordinator.execute_command("SCRIPT", "LOAD", _SUBMIT)
    coordinator.close()
    client = acl.client("tuner")
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.execute_command("EVALSHA", sha, 3, "hf:q:x", "hf:qseq", "hf:active")
    client.close()
    assert not acl.admin.exists("hf:q:x")


def test_every_allowed_command_is_allowed_to_its_user_only(acl: AclRedis) -> None:
    check_every_command(acl, sharded=False)


# ----------------------------------------------------- the real services, logged in


def test_the_real_coordinator_and_tuner_work_as_their_redis_users(
    acl: AclRedis, tmp_path: Path
) -> None:
    """The coordinator process, logged in as `coordinator` with --redis-password-file, runs
    a query on a simulated worker to its end; the tuner process, as `tuner`, replays it
    (Retune). Redis refuses nothing they ask."""
    host = "127.0.0.1"
    client_door = f"{host}:{free_port()}"
    worker_door = f"{host}:{free_port()}"
    tuner_door = f"{host}:{free_port()}"
    redis_at = f"{host}:{acl.port}"
    coordinator = ManagedProcess(
        "coordinator",
        [
            sys.executable, "-m", "hexgen_coordinator",
            "--listen", client_door,
            "--worker-listen", worker_door,
            "--redis-url", f"redis://coordinator@{redis_at}/0",
            "--redis-password-file", str(acl.auth.redis_password("coordinator")),
            "--cluster", "A100",
            "--time-scale", "50",
        ],
        tmp_path / "coordinator.log",
    )  # fmt: skip
    worker = ManagedProcess(
        "worker",
        [
            sys.executable, "-m", "hexgen_worker",
            "--coordinator", worker_door,
            "--worker-id", "w0", "--slot", "0", "--gpu", "A100", "--engine", "simulated",
        ],
        tmp_path / "worker.log",
    )  # fmt: skip
    tuner = ManagedProcess(
        "tuner",
        [
            sys.executable, "-m", "hexgen_tuner",
            "--listen", tuner_door,
            "--coordinator", client_door,
            "--redis-url", f"redis://tuner@{redis_at}/0",
            "--redis-password-file", str(acl.auth.redis_password("tuner")),
            "--period-s", "3600",
            "--min-queries", "1",
        ],
        tmp_path / "tuner.log",
    )  # fmt: skip
    processes = [coordinator, worker, tuner]
    query = replace(take_queries(load_trace("trace1"), 1)[0], query_id="acl/q0")

    async def drive() -> tuner_pb2.TuningRun:
        async with CoordinatorClient(client_door) as client:
            await client.wait_ready(timeout_s=30)
            worker.start()
            deadline = time.monotonic() + 30
            while not (await client.status()).instances[0].connected:
                assert time.monotonic() < deadline, worker.log_tail()
                await asyncio.sleep(0.1)
            events = [e async for e in client.run(query, slo_scale=50.0)]
            assert events, coordinator.log_tail()
            info = (await client.get(query.query_id)).query
            assert info.state == coordinator_pb2.QUERY_STATE_SUCCEEDED, coordinator.log_tail()
        tuner.start()
        async with grpc.aio.insecure_channel(tuner_door) as channel:
            stub = tuner_pb2_grpc.TunerServiceStub(channel)
            deadline = time.monotonic() + 30
            while True:
                try:
                    run = (await stub.Retune(tuner_pb2.RetuneRequest(), timeout=60)).run
                    break
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    assert time.monotonic() < deadline, tuner.log_tail()
                    await asyncio.sleep(0.2)
            listed = await stub.ListTuningRuns(tuner_pb2.ListTuningRunsRequest())
            assert [r.run_id for r in listed.runs] == [run.run_id]
            return run

    try:
        coordinator.start()
        run = asyncio.run(drive())
    finally:
        stop_processes(processes, 5.0)
    assert run.window_queries == 1, run.reason
    assert acl.admin.xlen(f"{PREFIX}finished") == 1
    assert acl.admin.llen(f"{PREFIX}tuner:runs") == 1
    assert acl.denials() == [], coordinator.log_tail() + tuner.log_tail()
