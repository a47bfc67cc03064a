"""A real ``redis-server`` loading the ACL file an auth directory holds, plus one admin
user for the test itself (to read ``ACL LOG`` and reset the data between tests): what
test_redis_acl.py (a mesh of one coordinator) and test_redis_acl_shards.py (a sharded
mesh) log in to."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from hexgen_launch.processes import ManagedProcess, free_port, stop_processes
from hexgen_service.auth_dir import (
    REDIS_COMMANDS,
    REDIS_SHARD_COMMANDS,
    AuthDir,
    redis_commands,
)

__all__ = [
    "ADMIN",
    "NO_RETRY",
    "PREFIX",
    "SHARDS",
    "AclRedis",
    "acl_server",
    "check_every_command",
    "dry_run",
    "emptied",
    "text",
]

PREFIX = "hf:"
SHARDS = ("hf:{s0}:", "hf:{s1}:")
"""The shards of the sharded ACL, as `hexgen-flow up --shards 2` names them."""
ADMIN, ADMIN_PASSWORD = "hf-test-admin", "test-admin-password"
NO_RETRY = Retry(NoBackoff(), 0)
"""For clients whose errors the tests expect: raised at once."""


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
            # a refused login is an AuthenticationError, a ConnectionError to redis-py,
            # which it would retry with back-off (seconds per refusal) before raising it
            retry=NO_RETRY,
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
            f"{text(e['username'])}: {text(e['object'])}"
            for e in entries
            if text(e["object"]) != "client|setinfo"
        ]
        return seen


def text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@contextmanager
def acl_server(root: Path, auth: AuthDir) -> Iterator[AclRedis]:
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


def emptied(server: AclRedis) -> AclRedis:
    """`server`, its data, scripts and ACL log cleared."""
    server.admin.flushall()
    server.admin.script_flush()  # so that every script is loaded again (SCRIPT LOAD)
    server.admin.acl_log_reset()
    return server


def dry_run(acl: AclRedis, user: str, command: str, key: str) -> str:
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
        return text(reply)
    raise AssertionError(f"no arity fits {command}")


def check_every_command(server: AclRedis, *, sharded: bool) -> None:
    """Every command of every user (`redis_commands`), tried by ACL DRYRUN as each user:
    allowed to its own users only. (A command the server did not know would have failed
    the whole ACL file at start.)"""
    mesh_key = f"{SHARDS[1] if sharded else PREFIX}x"
    keys = {"coordinator": mesh_key, "tuner": "hf:tuner:x", "health": mesh_key}
    # a shard-only command is tried on the one key of a shard it is confined to
    shard_keys = {"coordinator": f"{SHARDS[1]}lease", "tuner": f"{SHARDS[1]}meta"}
    allowed = {user: redis_commands(user, sharded=sharded) for user in REDIS_COMMANDS}
    every = {command for user in REDIS_COMMANDS for command in redis_commands(user, sharded=True)}
    for command in sorted(every):
        for user, commands in allowed.items():
            key = shard_keys[user] if command in REDIS_SHARD_COMMANDS[user] else keys[user]
            verdict = dry_run(server, user, command, key)
            assert (verdict == "OK") == (command in commands), (user, command, verdict)
