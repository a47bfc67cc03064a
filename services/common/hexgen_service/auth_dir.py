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
overwritten: files that exist are kept, so running init again adds missing tenants.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hexgen_flow.errors import ConfigError
from hexgen_service.auth import KeyStore, Role
from hexgen_service.certs import DEFAULT_SERVER_NAMES, CertificateAuthority, write_private
from hexgen_service.worker_token import write_token

__all__ = ["REDIS_COMMANDS", "REDIS_USERS", "AuthDir", "redis_acl_line", "redis_keys"]

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
        # its own runs, alpha history and run counter (`hexgen_tuner.store`)
        "incr", "lpush", "rpush", "ltrim", "lrange", "lindex",
        *_CLUSTER_COMMANDS,
    ),
    # answers PONG once the data is loaded (LOADING before): no key, nothing else
    "health": ("ping",),
}  # fmt: skip
"""Every command each Redis user may run; anything else (administration, DEL, FLUSHALL,
CONFIG, DEBUG, KEYS, EVAL, Pub/Sub, ...) is refused (NOPERM). docs/security-deploy.md says
why each is there."""


def _key_pattern(text: str) -> str:
    """`text` as a literal Redis glob pattern (its ``*?[]\\`` escaped)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def redis_keys(user: str, prefix: str = "hf:") -> tuple[str, ...]:
    """The key patterns of `user`: ``~P*`` the coordinator (every key of the mesh); the
    tuner ``%R~P admitted`` and ``%R~P finished`` (read only) and ``~P tuner:*`` (its own
    keys); the health
    probe none."""
    if not prefix or any(c.isspace() for c in prefix):
        raise ConfigError(f"redis prefix: {prefix!r} must be non-empty, without spaces")
    p = _key_pattern(prefix)
    if user == "coordinator":
        return (f"~{p}*",)
    if user == "tuner":
        return (f"%R~{p}admitted", f"%R~{p}finished", f"~{p}tuner:*")
    if user == "health":
        return ()
    raise ConfigError(f"redis user: no ACL for {user!r} (known: {', '.join(REDIS_USERS)})")


def redis_acl_line(user: str, password: str, prefix: str = "hf:") -> str:
    """One line of a Redis ACL file: `user`, its password as a SHA-256 (Redis stores no
    plain password), its keys under `prefix` only, no Pub/Sub channel, and only the
    commands of `REDIS_COMMANDS` (everything else, administration included, is refused).

    The coordinator runs the mesh's Lua scripts and reads and writes every key of the mesh.
    The tuner reads the `finished` stream and keeps its own runs and alpha history: it can
    neither run the coordinator's scripts nor change or delete a query's state."""
    keys = redis_keys(user, prefix)
    if not password:
        raise ConfigError(f"redis user {user}: empty password")
    digest = hashlib.sha256(password.encode()).hexdigest()
    commands = " ".join(f"+{c}" for c in REDIS_COMMANDS[user])
    words = ["user", user, "on", "resetpass", f"#{digest}", "resetkeys", *keys]
    return " ".join([*words, "resetchannels", "-@all", commands])


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
        redis_prefix: str = "hf:",
    ) -> list[Path]:
        """Create what is missing; return the files written (existing ones are kept)."""
        for tenant in tenants:
            if not tenant or "/" in tenant or tenant.startswith(".") or len(tenant) > 64:
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
            acl_lines.append(redis_acl_line(user, password, redis_prefix))
        acl_lines.append("user default off")
        write_private(self.redis_acl, ("\n".join(acl_lines) + "\n").encode())
        written.append(self.redis_acl)
        return written
