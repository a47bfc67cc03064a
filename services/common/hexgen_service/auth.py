"""Who may call what: API keys that name a tenant and a role, checked on every RPC.

An API key is ``hfk_<key id>_<secret>``: the id finds its record, the secret proves it. The
keys file (``--api-keys-file``; `hexgen-flow auth init` writes one) holds, per key, its id,
tenant, role, expiry, whether it is revoked and the SHA-256 of the whole key, never the key
itself. A plain hash is enough because the secret is 256 random bits, not a password that
could be guessed; a slow hash would cost every RPC without making a random key harder to
find. The file is re-read when it changes (checked at most once a second), so revoking a
key takes effect within a second without a restart.

Roles are ordered: ``tenant`` < ``operator`` < ``admin``. A tenant's key sees, watches and
cancels only its tenant's queries; ``operator`` adds cluster mutation (``SetAlpha``,
``Retune``); ``admin`` may do everything. `AuthInterceptor` authenticates each RPC from its
``authorization: Bearer <key>`` metadata, checks the method's role from a table, writes one
audit line for every refusal, and hands the `Principal` to the handler through
`current_principal`.
"""

from __future__ import annotations

import contextvars
import enum
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeAlias

import grpc

from hexgen_flow.errors import ConfigError
from hexgen_wire.metadata import API_KEY_ENV, AUTH_METADATA  # the wire contract: one definition

__all__ = [
    "API_KEY_ENV",
    "AUTH_METADATA",
    "PUBLIC_METHODS",
    "AuthError",
    "AuthInterceptor",
    "KeyRecord",
    "KeyStore",
    "Principal",
    "Role",
    "TenantLimits",
    "bearer_key",
    "check_tenant",
    "current_principal",
    "new_key",
    "read_secret",
]

audit = logging.getLogger("hexgen.audit")


_KEY_RE = re.compile(r"^hfk_([0-9a-f]{12})_([A-Za-z0-9_-]{20,})$")
_REFRESH_S = 1.0
_MAX_TENANT_CHARS = 64


def check_tenant(tenant: object, where: str) -> None:
    """ConfigError naming `where` unless `tenant` is a usable tenant name: 1-64 printable
    characters (no control, bidi or zero-width characters, no line separators), without
    leading or trailing whitespace ('default ' would be a tenant of its own)."""
    if (
        not isinstance(tenant, str)
        or not 0 < len(tenant) <= _MAX_TENANT_CHARS
        or not tenant.isprintable()
        or tenant != tenant.strip()
    ):
        raise ConfigError(
            f"{where}: {tenant!a} must be 1-{_MAX_TENANT_CHARS} printable characters "
            "without leading or trailing whitespace"
        )


class Role(enum.IntEnum):
    """What a key may do; a higher role may do what a lower one may."""

    TENANT = 1
    OPERATOR = 2
    ADMIN = 3

    @classmethod
    def parse(cls, text: str) -> Role:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            names = ", ".join(r.name.lower() for r in cls)
            raise ConfigError(f"role: {text!r} is not one of {names}") from None

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Principal:
    """Who an authenticated RPC comes from."""

    key_id: str
    tenant: str
    role: Role

    def may(self, role: Role) -> bool:
        return self.role >= role

    def sees(self, tenant: str) -> bool:
        """Whether this caller may see a query of `tenant` (its own, or any as operator)."""
        return self.role >= Role.OPERATOR or tenant == self.tenant


current_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "hexgen_principal", default=None
)
"""The caller of the RPC being handled; None when the server checks no keys."""


class AuthError(Exception):
    """A refused RPC: `code` is UNAUTHENTICATED or PERMISSION_DENIED."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One key as the keys file stores it (the key itself is not stored)."""

    key_id: str
    tenant: str
    role: str
    sha256: str
    created_s: float
    expires_s: float = 0.0
    """Unix time after which the key is refused; 0: never."""
    revoked: bool = False
    note: str = ""


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """Per-tenant admission limits from the keys file; 0: none."""

    max_running: int = 0
    """Queries the tenant may have running at once."""
    rate_qps: float = 0.0
    """Queries per second the tenant may submit, sustained."""
    burst: int = 0
    """Queries the tenant may submit at once above the rate (0: max(1, rate_qps))."""
    max_work_s: float = 0.0
    """Work the tenant may have in flight at once: the unfinished calls of its running
    queries, in seconds of saturated work on the cluster (the scheduler's estimates)."""
    max_prompt_bytes: int = 0
    """Prompt bytes the tenant may have stored at once (calls not finished yet); 0: the
    coordinator's ``--max-tenant-prompt-bytes``."""
    weight: float = 0.0
    """The tenant's weight in fair admission (0: 1): its share of the cluster, when
    tenants compete, is its weight over the sum of theirs."""

    def check(self) -> None:
        """ConfigError naming a limit that is negative or not a number."""
        for name in (
            "max_running",
            "rate_qps",
            "burst",
            "max_work_s",
            "max_prompt_bytes",
            "weight",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{name}: must be a number, got {value!r}")
            if not (value >= 0 and value != float("inf")):
                raise ConfigError(f"{name}: must be >= 0 and finite, got {value!r}")


def read_secret(path: str | Path, flag: str) -> str:
    """The one-line secret in `path` (a key, a token, a password); ConfigError naming `flag`
    when it cannot be read or is empty. Surrounding whitespace is ignored."""
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    if not text:
        raise ConfigError(f"{flag}: {path} is empty")
    return text


def new_key() -> tuple[str, str]:
    """A fresh key and its id."""
    key_id = secrets.token_hex(6)
    return f"hfk_{key_id}_{secrets.token_urlsafe(32)}", key_id


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class KeyStore:
    """The keys file, read when it changes; `authenticate` turns a key into a Principal."""

    path: Path
    clock: Callable[[], float] = time.time
    _records: dict[str, KeyRecord] = field(default_factory=dict)
    _limits: dict[str, TenantLimits] = field(default_factory=dict)
    _stamp: tuple[int, int] | None = None
    _checked: float = float("-inf")

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self._load()

    # ------------------------------------------------------------------ reading

    def _load(self) -> None:
        try:
            stat = self.path.stat()
            data = json.loads(self.path.read_text())
        except OSError as exc:
            raise ConfigError(f"--api-keys-file: cannot read {self.path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--api-keys-file: {self.path} is not JSON: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
            raise ConfigError(f"--api-keys-file: {self.path} has no 'keys' list")
        records: dict[str, KeyRecord] = {}
        for i, raw in enumerate(data["keys"]):
            try:
                record = KeyRecord(**raw)
                Role.parse(record.role)
                check_tenant(record.tenant, "tenant")
            except (TypeError, ConfigError) as exc:
                raise ConfigError(f"--api-keys-file: {self.path}: keys[{i}]: {exc}") from None
            records[record.key_id] = record
        limits: dict[str, TenantLimits] = {}
        for tenant, raw in (data.get("tenants") or {}).items():
            try:
                check_tenant(tenant, "name")
                limits[tenant] = TenantLimits(**raw)
                limits[tenant].check()
            except (TypeError, ConfigError) as exc:
                raise ConfigError(
                    f"--api-keys-file: {self.path}: tenants.{tenant}: {exc}"
                ) from None
        self._records, self._limits = records, limits
        self._stamp = (stat.st_mtime_ns, stat.st_size)

    def refresh(self) -> None:
        """Re-read the file if it changed (checked at most once a second). A file that
        became unreadable keeps the keys last read, and says so in the log."""
        now = time.monotonic()
        if now - self._checked < _REFRESH_S:
            return
        self._checked = now
        try:
            stat = self.path.stat()
        except OSError:
            return
        if (stat.st_mtime_ns, stat.st_size) == self._stamp:
            return
        try:
            self._load()
        except ConfigError as exc:
            logging.getLogger(__name__).error("keeping the keys read before: %s", exc)

    def records(self) -> list[KeyRecord]:
        self.refresh()
        return list(self._records.values())

    def limits(self, tenant: str) -> TenantLimits:
        self.refresh()
        return self._limits.get(tenant, TenantLimits())

    def authenticate(self, key: str | None) -> Principal:
        """The principal `key` stands for; AuthError(UNAUTHENTICATED) naming why not."""
        unauthenticated = grpc.StatusCode.UNAUTHENTICATED
        if not key:
            raise AuthError(
                unauthenticated,
                "unauthenticated: no API key (send 'authorization: "
                f"Bearer <key>', or set {API_KEY_ENV})",
            )
        match = _KEY_RE.match(key)
        if match is None:
            raise AuthError(unauthenticated, "unauthenticated: malformed API key")
        self.refresh()
        record = self._records.get(match.group(1))
        if record is None or not hmac.compare_digest(record.sha256, _digest(key)):
            raise AuthError(unauthenticated, "unauthenticated: unknown API key")
        if record.revoked:
            raise AuthError(unauthenticated, f"unauthenticated: API key {record.key_id} is revoked")
        if record.expires_s and self.clock() >= record.expires_s:
            raise AuthError(unauthenticated, f"unauthenticated: API key {record.key_id} expired")
        return Principal(record.key_id, record.tenant, Role.parse(record.role))

    # ------------------------------------------------------------------ writing

    @staticmethod
    def create(path: Path, tenants: Mapping[str, TenantLimits] | None = None) -> KeyStore:
        """Write an empty keys file at `path` (mode 0600) and open it."""
        _write(
            path,
            {
                "version": 1,
                "keys": [],
                "tenants": {t: asdict(limits) for t, limits in (tenants or {}).items()},
            },
        )
        return KeyStore(path)

    def add(
        self, tenant: str, role: Role, *, expires_s: float = 0.0, note: str = ""
    ) -> tuple[str, KeyRecord]:
        """Mint a key for `tenant` with `role`; store its hash; return the key (shown once)."""
        check_tenant(tenant, "tenant")
        key, key_id = new_key()
        record = KeyRecord(
            key_id, tenant, role.label, _digest(key), self.clock(), expires_s, False, note
        )
        self._records[key_id] = record
        self._save()
        return key, record

    def set_limits(self, tenant: str, limits: TenantLimits) -> None:
        """Give `tenant` its own admission limits (all 0: none)."""
        check_tenant(tenant, "tenant")
        try:
            limits.check()
        except ConfigError as exc:
            raise ConfigError(f"tenant {tenant!r}: {exc}") from None
        self._load()
        self._limits[tenant] = limits
        self._save()

    def revoke(self, key_id: str) -> KeyRecord:
        self._load()
        record = self._records.get(key_id)
        if record is None:
            raise ConfigError(f"key id: no key {key_id!r} in {self.path}")
        self._records[key_id] = replace(record, revoked=True)
        self._save()
        return self._records[key_id]

    def _save(self) -> None:
        _write(
            self.path,
            {
                "version": 1,
                "keys": [asdict(r) for r in self._records.values()],
                "tenants": {t: asdict(limits) for t, limits in self._limits.items()},
            },
        )
        self._stamp = None


def _write(path: Path, data: dict[str, Any]) -> None:
    """Write `path` (mode 0600), in place when it exists.

    In place, not by renaming a new file over it: a file bind-mounted into a container (a
    compose secret) stays the old inode after a rename, and the service there would never
    see a revocation. A reader that catches the file half-written keeps the keys it read
    before and tries again at the next change (`KeyStore.refresh`); the full new content is
    first written beside it, and stays there if this process dies mid-write."""
    path = Path(path)
    text = json.dumps(data, indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    if not path.exists():
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        return
    with path.open("r+") as target:
        target.write(text)
        target.truncate()
        target.flush()
        os.fsync(target.fileno())
    os.chmod(path, 0o600)
    Path(tmp).unlink()


# ---------------------------------------------------------------------- the interceptor

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # generic in the stubs only


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``authorization: Bearer <key>`` value; None without one (or with
    another scheme)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == AUTH_METADATA and isinstance(value, str):
            return bearer_key(value)
    return None


PUBLIC_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""What needs no key: health checking (probes) and reflection (the API's shape is public)."""


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticate and authorize every RPC of a server.

    `rules` maps a full method name (``/pkg.Service/Method``) or a service prefix
    (``/pkg.Service/``) to the least role it needs; `public` lists methods or prefixes that
    need no key (health checking, reflection). A method in neither is refused to all but
    admins, so a method added later is closed until someone decides who may call it.
    """

    def __init__(
        self,
        keys: KeyStore,
        rules: Mapping[str, Role],
        public: tuple[str, ...] = PUBLIC_METHODS,
    ) -> None:
        self.keys = keys
        self.rules = dict(rules)
        self.public = public

    def _role_for(self, method: str) -> Role:
        if method in self.rules:
            return self.rules[method]
        service = method.rsplit("/", 1)[0] + "/"
        return self.rules.get(service, Role.ADMIN)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(self.public):
            return handler
        try:
            principal = self.keys.authenticate(_bearer(handler_call_details.invocation_metadata))
            needed = self._role_for(method)
            if not principal.may(needed):
                raise AuthError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"permission denied: {method.rsplit('/', 1)[-1]} needs the "
                    f"{needed.label} role; key {principal.key_id} of tenant "
                    f"{principal.tenant!r} is {principal.role.label}",
                )
        except AuthError as exc:
            audit.warning("denied %s: %s", method, exc)
            return _refusal(handler, exc)
        return _with_principal(handler, principal)


def _refusal(handler: Handler, error: AuthError) -> Handler:
    """A handler that aborts with `error` without reading the request: a streaming-request
    handler (whatever the method's shape; on the wire a unary request is one message of a
    stream) that never asks for a message, so a refused caller's body is never parsed, and
    never received beyond gRPC's flow-control window."""

    async def abort(context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(error.code, str(error))

    if handler.response_streaming:

        async def ss(requests: Any, context: Any) -> Any:
            await abort(context)
            yield  # pragma: no cover - a generator that aborts first

        return grpc.stream_stream_rpc_method_handler(ss, None, handler.response_serializer)

    async def su(requests: Any, context: Any) -> Any:
        await abort(context)

    return grpc.stream_unary_rpc_method_handler(su, None, handler.response_serializer)


def _with_principal(handler: Handler, principal: Principal) -> Handler:
    """The same handler, run with `current_principal` set to `principal`."""
    if handler.unary_unary is not None:
        inner_uu: Any = handler.unary_unary

        async def uu(request: Any, context: Any) -> Any:
            current_principal.set(principal)
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(
            uu, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream is not None:
        inner_us: Any = handler.unary_stream

        async def us(request: Any, context: Any) -> Any:
            current_principal.set(principal)
            async for response in inner_us(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(
            us, handler.request_deserializer, handler.response_serializer
        )
    if handler.stream_unary is not None:
        inner_su: Any = handler.stream_unary

        async def su(requests: Any, context: Any) -> Any:
            current_principal.set(principal)
            return await inner_su(requests, context)

        return grpc.stream_unary_rpc_method_handler(
            su, handler.request_deserializer, handler.response_serializer
        )
    inner_ss: Any = handler.stream_stream

    async def ss(requests: Any, context: Any) -> Any:
        current_principal.set(principal)
        async for response in inner_ss(requests, context):
            yield response

    return grpc.stream_stream_rpc_method_handler(
        ss, handler.request_deserializer, handler.response_serializer
    )
