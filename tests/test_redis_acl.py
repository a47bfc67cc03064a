"""The Redis ACL an auth directory writes (`hexgen_service.auth_dir.redis_acl_line`), on a
real ``redis-server --aclfile``: the coordinator's user runs everything the coordinator
does and nothing more, the tuner's user reads the ``admitted`` and ``finished`` streams
and keeps its own keys, and the default user is off. For a sharded mesh (``auth init
--shards``, on a server of its own) the coordinator's user reads and writes every shard's
keys, leases included, and none outside them; the tuner's reads every shard's window and
clock and writes none of them.

Each server loads the file `AuthDir.init` writes plus one line for the test itself (an
admin user, to read ``ACL LOG`` and reset the database between tests); nothing else.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import redis.asyncio as aioredis

from hexgen_api.v1 import coordinator_pb2, tuner_pb2, tuner_pb2_grpc
from hexgen_client.client import CoordinatorClient
from hexgen_client.processes import ManagedProcess, free_port, stop_processes
from hexgen_coordinator.check_state import check_state
from hexgen_coordinator.session_store import GIVE_APPLIED, SessionStore
from hexgen_coordinator.shards import ShardLease, ShardMap
from hexgen_coordinator.store import _SUBMIT, Placement, WorkflowStore
from hexgen_flow.errors import ConfigError
from hexgen_flow.traces import load_trace, take_queries
from hexgen_service.auth_dir import (
    REDIS_COMMANDS,
    REDIS_SHARD_COMMANDS,
    AuthDir,
    redis_acl_line,
    redis_commands,
)
from hexgen_tuner.store import AlphaChange, TunerStore, TuningRunRecord
from hexgen_tuner.window import read_sharded_window, read_window

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server is not installed"
)

PREFIX = "hf:"
SHARDS = ("hf:{s0}:", "hf:{s1}:")
"""The shards of the sharded ACL, as `hexgen-flow up --shards 2` names them."""
ADMIN, ADMIN_PASSWORD = "hf-test-admin", "test-admin-password"


@dataclass
class AclRedis:
    port: int
    auth: AuthDir
    admin: redis.Redis[bytes]

    def password(self, user: str) -> str:
        return self.auth.redis_password(user).read_text().strip()

    def client(self, user: str, password: str | None = None) -> redis.Redis[bytes]:
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            username=user,
            password=password if password is not None else self.password(user),
            socket_timeout=5,
        )

    def aclient(self, user: str) -> aioredis.Redis[bytes]:
        return aioredis.Redis(
            host="127.0.0.1",
            port=self.port,
            username=user,
            password=self.password(user),
            socket_timeout=5,
        )

    def denials(self) -> list[str]:
        """What ACL LOG recorded as refused, as "user: command or key" (CLIENT SETINFO
        aside: redis-py sends it on connecting, ignores a refusal, and Redis before 7.2 has
        no such command to allow)."""
        entries: list[dict[str, Any]] = self.admin.acl_log()
        seen = [
            f"{_text(e['username'])}: {_text(e['object'])}"
            for e in entries
            if _text(e["object"]) != "client|setinfo"
        ]
        return seen


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@contextmanager
def _acl_server(root: Path, auth: AuthDir) -> Iterator[AclRedis]:
    """A redis-server loading `auth`'s ACL file and the test's admin user, until the end."""
    aclfile = root / "users.acl"
    aclfile.write_text(
        auth.redis_acl.read_text() + f"user {ADMIN} on >{ADMIN_PASSWORD} ~* &* +@all\n"
    )
    port = free_port()
    argv = [
        "redis-server",
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "no",
        "--dir", str(root),
        "--aclfile", str(aclfile),
        "--enable-debug-command", "yes",  # so that only the ACL refuses DEBUG
    ]  # fmt: skip
    process = ManagedProcess("redis-server", argv, root / "redis.log")
    process.start()
    admin: redis.Redis[bytes] = redis.Redis(
        host="127.0.0.1", port=port, username=ADMIN, password=ADMIN_PASSWORD, socket_timeout=2
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or not process.running:
                    raise process.failure("redis-server did not start") from None
                time.sleep(0.05)
        yield AclRedis(port, auth, admin)
    finally:
        admin.close()
        stop_processes([process], 5.0)


def _emptied(server: AclRedis) -> AclRedis:
    """`server`, its data, scripts and ACL log cleared."""
    server.admin.flushall()
    server.admin.script_flush()  # so that every script is loaded again (SCRIPT LOAD)
    server.admin.acl_log_reset()
    return server


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    root = tmp_path_factory.mktemp("acl")
    auth = AuthDir(root / "auth")
    auth.init(["demo"])
    with _acl_server(root, auth) as server:
        yield server


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
    with _acl_server(root, auth) as server:
        yield server


@pytest.fixture
def shard_acl(shard_acl_redis: AclRedis) -> AclRedis:
    """The sharded ACL Redis, empty, its ACL log cleared."""
    return _emptied(shard_acl_redis)


@pytest.fixture
def acl(acl_redis: AclRedis) -> AclRedis:
    """The ACL Redis, empty, its ACL log cleared."""
    return _emptied(acl_redis)


# ------------------------------------------------------------------------------ the file


def test_the_file_has_one_line_per_service_and_the_default_user_off(acl: AclRedis) -> None:
    lines = acl.auth.redis_acl.read_text().splitlines()
    assert [line.split()[1] for line in lines] == ["coordinator", "tuner", "health", "default"]
    assert lines[-1] == "user default off"
    for line in lines[:-1]:
        assert " -@all " in line and "resetchannels" in line
        assert acl.password(line.split()[1]) not in line  # only its SHA-256
    listed = {_text(line).split()[1]: _text(line) for line in acl.admin.acl_list()}
    assert set(listed) == {"coordinator", "tuner", "health", "default", ADMIN}
    assert listed["default"].startswith("user default off ")  # no password, cannot log in
    assert "nopass" not in listed["default"]


def test_the_line_is_exact() -> None:
    line = redis_acl_line("tuner", "secret", "hf:")
    assert line == (
        "user tuner on resetpass "
        "#2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b "
        "resetkeys %R~hf:admitted %R~hf:finished ~hf:tuner:* resetchannels -@all +ping +multi "
        "+exec +discard +xrevrange +xrange +xlen +incr +lpush +rpush +ltrim +lrange +lindex "
        # a Redis Cluster's client (--redis-cluster) maps slots to nodes and reads the
        # commands' key positions; ASKING follows a slot that moves (tests/test_redis_cluster.py)
        "+cluster|slots +command +asking"
    )
    assert "~a\\*b:*" in redis_acl_line("coordinator", "x", "a*b:")  # a literal prefix
    for user, password, prefix in (("admin", "x", "hf:"), ("tuner", "", "hf:"), ("tuner", "x", "")):
        with pytest.raises(ConfigError):
            redis_acl_line(user, password, prefix)


def test_without_a_password_nobody_gets_in(acl: AclRedis) -> None:
    anonymous: redis.Redis[bytes] = redis.Redis(host="127.0.0.1", port=acl.port)
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
        async with client.pipeline(transaction=False) as pipe:
            store.place(pipe, "q1", {"q1/0/0": Placement(0, 1, 1)}, {0: 5.0}, [b"e1", b"e2"])
            await pipe.execute()
        first = await store.complete("q1", "q1/0/0", 0, [1], 1.0, {"call_id": "q1/0/0"}, slot=0)
        assert first.applied and first.released == (1,)
        assert (await store.complete("q1", "q1/0/0", 0, [1], 1.0, {"call_id": "x"})).status == 0
        last = await store.complete("q1", "q1/1/0", 1, [], 2.0, {"call_id": "q1/1/0"})
        assert last.applied and last.calls_left == 0
        async with client.pipeline(transaction=False) as pipe:  # a write after the end
            store.place(pipe, "q1", {}, {}, [b"e3"], ended=True)
            await pipe.execute()
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
            "q3", "q3/0/0", 0, b"call", "replace", name="s", now=1.0, shape=b""
        )
        assert given == GIVE_APPLIED
        await store.complete("q3", "q3/0/0", 0, [], 2.0, {"call_id": "q3/0/0"})
        assert await sessions.close_stages("q3", [0], shape=b"", close_session=True, now=3.0) == 2
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
    assert report.queries == 3
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
        store = TunerStore(client, PREFIX, runs_kept=2, history_kept=2)
        assert await client.ping()
        assert await store.next_run_id() == "tune-000001"
        run = TuningRunRecord("tune-000001", 1.0, 2.0, 0, 0.0, (), 0.5, 0.5, False, "test")
        for _ in range(3):
            await store.record_run(run)
        assert len(await store.runs(10)) == 2
        for alpha in (0.1, 0.2, 0.3):
            await store.record_alpha(AlphaChange(1.0, alpha, "test"))
        assert [c.alpha for c in await store.alpha_history()] == [0.2, 0.3]
        last = await store.last_alpha()
        assert last is not None and last.alpha == 0.3
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


@pytest.mark.parametrize("sharded", [False, True], ids=["one coordinator", "sharded"])
def test_every_allowed_command_is_allowed_to_its_user_only(
    sharded: bool, request: pytest.FixtureRequest
) -> None:
    # A command the server did not know would have failed the whole file at start.
    server: AclRedis = request.getfixturevalue("shard_acl" if sharded else "acl")
    mesh_key = f"{SHARDS[1] if sharded else PREFIX}x"
    keys = {"coordinator": mesh_key, "tuner": "hf:tuner:x", "health": mesh_key}
    # a shard-only command is tried on the one key of a shard it is confined to
    shard_keys = {"coordinator": f"{SHARDS[1]}lease", "tuner": f"{SHARDS[1]}meta"}
    allowed = {user: redis_commands(user, sharded=sharded) for user in REDIS_COMMANDS}
    every = {command for user in REDIS_COMMANDS for command in redis_commands(user, sharded=True)}
    for command in sorted(every):
        for user, commands in allowed.items():
            key = shard_keys[user] if command in REDIS_SHARD_COMMANDS[user] else keys[user]
            verdict = _dry_run(server, user, command, key)
            assert (verdict == "OK") == (command in commands), (user, command, verdict)


def _dry_run(acl: AclRedis, user: str, command: str, key: str) -> str:
    """ACL DRYRUN of `command` as `user`, with as many `key` arguments as its arity needs."""
    for n in range(6):
        try:
            reply = acl.admin.execute_command(
                "ACL", "DRYRUN", user, *command.split("|"), *[key] * n
            )
        except redis.ResponseError as exc:
            if "wrong number of arguments" in str(exc) or "numkeys" in str(exc):
                continue
            raise
        return _text(reply)
    raise AssertionError(f"no arity fits {command}")


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


# ------------------------------------------------------------------- a sharded mesh


def test_the_sharded_lines_are_exact() -> None:
    tuner = redis_acl_line("tuner", "secret", shards=SHARDS)
    assert tuner == (
        "user tuner on resetpass "
        "#2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b "
        "resetkeys %R~hf:{s0}:admitted %R~hf:{s0}:finished %R~hf:{s1}:admitted "
        "%R~hf:{s1}:finished ~hf:tuner:* resetchannels -@all +ping +multi +exec +discard "
        "+xrevrange +xrange +xlen +incr +lpush +rpush +ltrim +lrange +lindex +cluster|slots "
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
        store = TunerStore(client, PREFIX, runs_kept=2, history_kept=2)  # its own keys
        assert await store.next_run_id() == "tune-000001"
        await store.record_alpha(AlphaChange(1.0, 0.3, "test"))
        assert [c.alpha for c in await store.alpha_history()] == [0.3]
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
            done = await store.complete(f"q{k}", f"q{k}/0/0", 0, [], 1.0, {"call_id": "c"})
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
