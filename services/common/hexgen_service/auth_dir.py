"""The auth directory: every secret a secured mesh needs, in one place, made by one call.

`hexgen-flow auth init DIR` and `hexgen-flow up --secure --auth-dir DIR` write::

    DIR/ca.pem, ca.key            the local CA (ca.key: keep it; it signs new certificates)
    DIR/server.pem, server.key    every service's listening side (coordinator, tuner, gateway)
    DIR/worker.pem, worker.key    the workers' client certificate (the workers' door)
    DIR/keys.json                 API keys, hashed: the coordinator's and tuner's --api-keys-file
    DIR/admin.key                 an admin API key
    DIR/tuner.key                 the tuner's operator key (it calls SetAlpha)
    DIR/tenants/NAME.key          one tenant key per --tenants name
    DIR/worker-token              the workers' token (for links whose TLS ends elsewhere)
    DIR/redis/users.acl           Redis ACL users with hashed passwords (redis-server --aclfile)
    DIR/redis/NAME.password       each service's Redis password

Private files are mode 0600 and DIR itself 0700. An existing DIR is completed, never
overwritten: files that exist are kept, so running init again adds missing tenants. The
ACL file alone is written anew each time, from the passwords kept, so that init with other
``--shards`` (or ``--redis-prefix``) changes the users' keys and nothing else.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hexgen_flow.errors import ConfigError
from hexgen_service import redis_schema as schema
from hexgen_service.auth import KeyStore, Role, check_tenant
from hexgen_service.certs import DEFAULT_SERVER_NAMES, CertificateAuthority, write_private
from hexgen_service.redis_schema import DEFAULT_PREFIX
from hexgen_service.worker_token import write_token

__all__ = [
    "REDIS_COMMANDS",
    "REDIS_SHARD_COMMANDS",
    "REDIS_USERS",
    "AuthDir",
    "redis_acl_line",
    "redis_commands",
    "redis_keys",
    "shard_prefixes",
]

REDIS_USERS = ("coordinator", "tuner", "health")
"""Who logs in to Redis, each as its own ACL user: the coordinator, the tuner, and the
health probe of a Redis container (``redis-cli --user health ping``: PING only)."""

_CLUSTER_COMMANDS = ("cluster|slots", "command", "asking")
"""What a client of a Redis Cluster (``--redis-cluster``) sends besides its own commands:
redis-py's cluster client maps slots to nodes (CLUSTER SLOTS) and reads where each command
has its keys (COMMAND); ASKING follows a slot while it moves to another node. Harmless on a
single Redis (read-only introspection), so one ACL file serves both."""

REDIS_COMMANDS: dict[str, tuple[str, ...]] = {
    "coordinator": (
        # connection and transactions: health checks, pipelines (MULTI/EXEC)
        "ping", "multi", "exec", "discard",
        # the Lua scripts (`hexgen_coordinator.store`, `.session_store`): redis-py runs a
        # script by EVALSHA and loads it on NOSCRIPT (SCRIPT EXISTS: a pipeline's scripts)
        "evalsha", "script|load", "script|exists",
        # what the scripts call: they run with the coordinator's own permissions
        "exists", "incr", "hget", "hmget", "hset", "hsetnx", "hincrby", "hexists", "hgetall",
        "sadd", "srem", "smembers", "xadd", "xlen", "xrange", "pexpire",
        # a call's prompt is dropped when it completes, every prompt when its query ends
        "hdel", "hkeys",
        # how full Redis is (`hexgen_coordinator.redis_memory`): new work waits above a limit
        "info",
        # the write-behind, the event logs, recovery and views
        "rpush", "lrange", "llen", "ltrim",
        # `hexgen-flow check-state` (run with the coordinator's credentials)
        "scan", "type", "pttl",
        *_CLUSTER_COMMANDS,
    ),
    "tuner": (
        "ping", "multi", "exec", "discard",
        # the `admitted` and `finished` streams (read only, by their key patterns)
        "xrevrange", "xrange", "xlen",
        # its own runs and run counter (`hexgen_tuner.store`; the α history is the
        # coordinator's, read with its GetAlphaHistory RPC)
        "incr", "lpush", "ltrim", "lrange",
        *_CLUSTER_COMMANDS,
    ),
    # answers PONG once the data is loaded (LOADING before): no key, nothing else
    "health": ("ping",),
}  # fmt: skip
"""Every command each Redis user may run; anything else (administration, DEL, FLUSHALL,
CONFIG, DEBUG, KEYS, EVAL, Pub/Sub, ...) is refused (NOPERM). docs/security-deploy.md says
why each is there."""

REDIS_SHARD_COMMANDS: dict[str, tuple[str, ...]] = {
    # the shard lease (`hexgen_coordinator.shards`): SET NX PX takes a shard, GET names its
    # holder (a redirect's target); the lease's scripts renew it (GET, PEXPIRE) and give it
    # up at a clean stop (GET, DEL), so that a spare takes the shard at once
    "coordinator": ("set", "get", "del"),
    # each shard's clock, its `meta` hash's epoch and time scale (`read_sharded_window`)
    "tuner": ("hmget",),
    "health": (),
}
"""What each user runs besides `REDIS_COMMANDS` in a sharded mesh (``--shards``) only, and
on one key of each shard only (`_SHARD_COMMAND_KEYS`): a mesh of one coordinator takes no
lease and has one clock, so its users are not given them."""

_SHARD_COMMAND_KEYS = {"coordinator": "~{}" + schema.LEASE, "tuner": "%R~{}" + schema.META}
"""The one key of each shard (its prefix in the braces) that a user's `REDIS_SHARD_COMMANDS`
may touch, in a Redis 7 selector of its own: the coordinator's SET, GET and DEL reach the
leases (`hexgen_coordinator.shards.lease_key`), never a query's state, nor can code a thief
loads with SCRIPT LOAD use them on it; the tuner's HMGET reads the clocks."""


def _key_pattern(text: str) -> str:
    """`text` as a literal Redis glob pattern (its ``*?[]\\`` escaped)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def shard_prefixes(shards: Sequence[str]) -> tuple[str, ...]:
    """The shards' key prefixes, checked as the coordinator's ``--shards`` checks them
    (`hexgen_coordinator.shards.ShardMap`): each non-empty, without spaces, none twice;
    empty: no shards. ConfigError naming --shards otherwise."""
    prefixes = tuple(shards)
    for prefix in prefixes:
        if not prefix or any(c.isspace() for c in prefix):
            raise ConfigError(f"--shards: {prefix!r} is not a key prefix")
    if len(set(prefixes)) != len(prefixes):
        raise ConfigError(f"--shards: a prefix appears twice in {list(prefixes)}")
    return prefixes


def redis_commands(user: str, *, sharded: bool = False) -> tuple[str, ...]:
    """Every command `user` may run: `REDIS_COMMANDS`, and `sharded` the shard lease's and
    clocks' too (`REDIS_SHARD_COMMANDS`, on one key of each shard only)."""
    if user not in REDIS_COMMANDS:
        raise ConfigError(f"redis user: no ACL for {user!r} (known: {', '.join(REDIS_USERS)})")
    return REDIS_COMMANDS[user] + (REDIS_SHARD_COMMANDS[user] if sharded else ())


def redis_keys(
    user: str, prefix: str = DEFAULT_PREFIX, *, shards: Sequence[str] = ()
) -> tuple[str, ...]:
    """The key patterns of `user`. One coordinator (no `shards`): ``~P*`` the coordinator
    (every key of the mesh); the tuner ``%R~P admitted`` and ``%R~P finished`` (read only)
    and ``~P tuner:*`` (its own keys). With `shards` the coordinator gets ``~S*`` of every
    shard S, since a spare takes over whichever shard's lease expires, and no key outside
    them; the tuner reads every shard's ``admitted`` and ``finished`` (and, by its selector,
    `_SHARD_COMMAND_KEYS`, the ``meta`` clock) and keeps its own keys under `prefix` (its
    ``--redis-prefix``: ``P tuner:*``, outside the shards unless P is one). The health probe
    gets no key."""
    if not prefix or any(c.isspace() for c in prefix):
        raise ConfigError(f"--redis-prefix: {prefix!r} must be non-empty, without spaces")
    # the prefixes of the mesh's state: every shard's, or the one coordinator's
    state = [_key_pattern(s) for s in shard_prefixes(shards) or (prefix,)]
    if user == "coordinator":
        return tuple(f"~{s}*" for s in state)
    if user == "tuner":
        window = [f"%R~{s}{key}" for s in state for key in _WINDOW]
        return (*window, f"~{_key_pattern(prefix)}{schema.TUNER_NS}*")
    if user == "health":
        return ()
    raise ConfigError(f"redis user: no ACL for {user!r} (known: {', '.join(REDIS_USERS)})")


_WINDOW = (schema.ADMITTED, schema.FINISHED)
"""The streams the tuner reads its window from, of the mesh or of each shard
(`hexgen_tuner.window`)."""


def redis_acl_line(
    user: str, password: str, prefix: str = DEFAULT_PREFIX, *, shards: Sequence[str] = ()
) -> str:
    """One line of a Redis ACL file: `user`, its password as a SHA-256 (Redis stores no
    plain password), its keys (`redis_keys`: under `prefix`, or the `shards`' prefixes),
    no Pub/Sub channel, and only its commands (`redis_commands`; everything else,
    administration included, is refused).

    The coordinator runs the mesh's Lua scripts and reads and writes every key of the mesh.
    The tuner reads the `admitted` and `finished` streams and keeps its own runs (the α
    history is the coordinator's, asked for over gRPC): it can neither run the
    coordinator's scripts nor change or delete a query's state. With `shards` each user's
    `REDIS_SHARD_COMMANDS` come last, in a selector (``(KEYS +CMD...)``) that confines them
    to one key of each shard."""
    keys = redis_keys(user, prefix, shards=shards)
    if not password:
        raise ConfigError(f"redis user {user}: empty password")
    digest = hashlib.sha256(password.encode()).hexdigest()
    words = ["user", user, "on", "resetpass", f"#{digest}", "resetkeys", *keys]
    words += ["resetchannels", "-@all", *(f"+{c}" for c in REDIS_COMMANDS[user])]
    confined = REDIS_SHARD_COMMANDS[user] if shards else ()
    if confined:
        where = [_SHARD_COMMAND_KEYS[user].format(_key_pattern(s)) for s in shards]
        words.append("(" + " ".join([*where, *(f"+{c}" for c in confined)]) + ")")
    return " ".join(words)


@dataclass(frozen=True)
class AuthDir:
    path: Path

    # ------------------------------------------------------------------ the layout
    @property
    def ca(self) -> Path:
        return self.path / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.path / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.path / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.path / "server.key"

    @property
    def worker_cert(self) -> Path:
        return self.path / "worker.pem"

    @property
    def worker_key(self) -> Path:
        return self.path / "worker.key"

    @property
    def keys(self) -> Path:
        return self.path / "keys.json"

    @property
    def admin_key(self) -> Path:
        return self.path / "admin.key"

    @property
    def tuner_key(self) -> Path:
        return self.path / "tuner.key"

    @property
    def worker_token(self) -> Path:
        return self.path / "worker-token"

    @property
    def redis_acl(self) -> Path:
        return self.path / "redis" / "users.acl"

    def tenant_key(self, tenant: str) -> Path:
        return self.path / "tenants" / f"{tenant}.key"

    def redis_password(self, user: str) -> Path:
        return self.path / "redis" / f"{user}.password"

    # ------------------------------------------------------------------ making it

    def init(
        self,
        tenants: Sequence[str] = (),
        *,
        server_names: Sequence[str] = (),
        redis_prefix: str = DEFAULT_PREFIX,
        shards: Sequence[str] = (),
    ) -> list[Path]:
        """Create what is missing; return the files written (existing ones are kept).
        The Redis ACL is for the mesh of one coordinator with keys under `redis_prefix`, or,
        given `shards` (every shard's prefix, as the coordinators' ``--shards``), for a
        sharded one: `redis_keys` says who gets which keys."""
        redis_keys("tuner", redis_prefix, shards=shards)  # bad prefixes: nothing written
        for tenant in tenants:  # all checked before anything is written
            check_tenant(tenant, "--tenants")
            if "/" in tenant or tenant.startswith("."):  # it names a key file
                raise ConfigError(f"--tenants: {tenant!r} is not a usable tenant name")
        written: list[Path] = []
        self.path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        (self.path / "tenants").mkdir(exist_ok=True)
        (self.path / "redis").mkdir(exist_ok=True)
        if self.ca.exists() and self.ca_key.exists():
            ca = CertificateAuthority.load(self.ca, self.ca_key)
        else:
            ca = CertificateAuthority.create()
            ca.save(self.ca, self.ca_key)
            written += [self.ca, self.ca_key]
        if not self.server_cert.exists():
            names = list(dict.fromkeys([*DEFAULT_SERVER_NAMES, *server_names]))
            ca.write_issued(self.server_cert, self.server_key, "hexgen-flow", server_names=names)
            written += [self.server_cert, self.server_key]
        if not self.worker_cert.exists():
            ca.write_issued(self.worker_cert, self.worker_key, "hexgen-flow worker", client=True)
            written += [self.worker_cert, self.worker_key]
        if not self.worker_token.exists():
            write_token(self.worker_token)
            written.append(self.worker_token)
        store = KeyStore(self.keys) if self.keys.exists() else KeyStore.create(self.keys)
        for path, tenant, role in (
            (self.admin_key, "admin", Role.ADMIN),
            (self.tuner_key, "tuner", Role.OPERATOR),
            *((self.tenant_key(t), t, Role.TENANT) for t in tenants),
        ):
            if not path.exists():
                key, _ = store.add(tenant, role, note=path.name)
                write_private(path, (key + "\n").encode())
                written.append(path)
        acl_lines = []
        for user in REDIS_USERS:
            password_file = self.redis_password(user)
            if not password_file.exists():
                write_private(password_file, (secrets.token_urlsafe(24) + "\n").encode())
                written.append(password_file)
            password = password_file.read_text().strip()
            acl_lines.append(redis_acl_line(user, password, redis_prefix, shards=shards))
        acl_lines.append("user default off")
        write_private(self.redis_acl, ("\n".join(acl_lines) + "\n").encode())
        written.append(self.redis_acl)
        return written
