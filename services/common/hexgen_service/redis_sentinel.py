"""Redis behind Sentinel: a ``redis+sentinel://`` URL and the clients that follow its master.

A coordinator, tuner or ``check-state`` given

    redis+sentinel://[USER@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]

asks those Sentinels where the master of SERVICE is, connects to it, and asks again when a
connection fails: after a failover its retries land on the promoted replica, with no restart
and no new flag. (redis-py has the clients, not the URL form; the form is the common one of
other Redis clients.) The password of USER stays out of the URL, as everywhere in the mesh
(``--redis-password-file``); the Sentinels themselves are asked without one.

Redis replicates asynchronously: a failover that Sentinel starts because the master died can
lose the master's last writes that no replica had yet, and the coordinator's state with them;
so can ``SENTINEL FAILOVER`` alone, which promotes at once. A planned failover pauses the
master's writes (``CLIENT PAUSE ... WRITE``) until the replica has them all, asks Sentinel,
and lets the writes go only once Sentinel has made the old master a replica: the held
writes then meet a replica, redis-py reports that as a lost connection, and the
coordinator's retries send them to the new master. Nothing is lost
(tests/test_redis_sentinel.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel

from hexgen_flow.errors import ConfigError

__all__ = [
    "REDIS_URL_HELP",
    "SENTINEL_SCHEME",
    "SentinelUrl",
    "async_master",
    "check_redis_url",
    "parse_sentinel_url",
    "sync_master",
]

SENTINEL_SCHEME = "redis+sentinel"
REDIS_URL_HELP = (
    "redis://[USER@]HOST:PORT/DB, or Redis behind Sentinel: "
    "redis+sentinel://[USER@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]"
)
"""What ``--redis-url`` takes, for the services' and the CLI's help."""


@dataclass(frozen=True, slots=True)
class SentinelUrl:
    """What a ``redis+sentinel://`` URL says."""

    sentinels: tuple[tuple[str, int], ...]
    """The Sentinels to ask, (host, port)."""
    service: str
    """The name the Sentinels monitor the master under."""
    db: int = 0
    username: str | None = None
    """The Redis ACL user to log in as (its password comes from a file, never the URL)."""


def parse_sentinel_url(url: str, option: str = "--redis-url") -> SentinelUrl | None:
    """`url` as a Sentinel URL; None when it is not one (another scheme); `ConfigError`
    naming `option` when it is one but malformed."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme != SENTINEL_SCHEME:
        return None
    form = f"{SENTINEL_SCHEME}://[USER@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]"
    where, _, path = rest.partition("/")
    user, at, hosts = where.rpartition("@")
    if at and ":" in user:
        raise ConfigError(
            f"{option}: no password in the URL; give the user's password with --redis-password-file"
        )
    sentinels = []
    for item in hosts.split(","):
        host, colon, port = item.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{option}: {item!r} is not HOST:PORT; write {form}")
        sentinels.append((host.strip("[]"), int(port)))
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ConfigError(f"{option}: name the master's service (and a db number): {form}")
    return SentinelUrl(
        tuple(sentinels),
        unquote(parts[0]),
        int(parts[1]) if len(parts) == 2 else 0,
        unquote(user) if at else None,
    )


def check_redis_url(url: str, *, cluster: bool = False, option: str = "--redis-url") -> None:
    """`ConfigError` naming `option` for a malformed Sentinel URL, or one given with
    ``--redis-cluster`` (a Redis Cluster fails over by itself, without Sentinel)."""
    if parse_sentinel_url(url, option) is not None and cluster:
        raise ConfigError(
            f"{option}: a {SENTINEL_SCHEME}:// URL names Redis behind Sentinel; "
            "--redis-cluster wants a node of a Redis Cluster: give one or the other"
        )


def _login(url: SentinelUrl, password: str | None) -> dict[str, Any]:
    login: dict[str, Any] = {"db": url.db}
    if url.username:
        login["username"] = url.username
    if password:
        login["password"] = password
    return login


def async_master(
    url: SentinelUrl, *, password: str | None = None, **connection: Any
) -> aioredis.Redis[bytes]:
    """An asyncio client of `url`'s master that asks the Sentinels again whenever a
    connection fails; `connection`: redis-py connection options (retry, timeouts)."""
    sentinels = aiosentinel.Sentinel(
        list(url.sentinels), sentinel_kwargs={"socket_connect_timeout": 2}
    )
    client: aioredis.Redis[bytes] = sentinels.master_for(
        url.service, **_login(url, password), **connection
    )
    return client


def sync_master(
    url: SentinelUrl, *, password: str | None = None, **connection: Any
) -> redis.Redis[bytes]:
    """`async_master`, blocking (``check-state``)."""
    sentinels = redis.sentinel.Sentinel(
        list(url.sentinels), sentinel_kwargs={"socket_connect_timeout": 2}
    )
    client: redis.Redis[bytes] = sentinels.master_for(
        url.service, **_login(url, password), **connection
    )
    return client
