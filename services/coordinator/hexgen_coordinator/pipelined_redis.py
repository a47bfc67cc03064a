"""One pipelined connection to one Redis: the completion path's lean client.

A completion costs the coordinator a script call and, behind it, a pipeline of writes. Through
redis-py's asyncio client each of those pays for its pool (a connection drawn and returned
under a lock), a timeout context per read and per write, a health check, argument encoding
in Python and a chain of coroutines: about a third of all the coordinator spent on a
completion (a py-spy profile at 800 completions/s). None of it is needed where the callers
are few and batch their own work (`GroupCommit` sends one script call at a time,
`WriteBehind` one pipeline, and the submit, fail and cancel scripts come a few at a time):
`PipelinedRedis` keeps one connection, packs commands in C (hiredis), writes them without
waiting for earlier replies and hands each reply, parsed by hiredis, to the future waiting
for it, in order. Not for blocking commands (BLPOP, XREAD BLOCK): a reply slower than
`timeout_s` closes the connection.

What it keeps of redis-py's contract is what the coordinator's retries rely on: a connection
that fails or a Redis that does not answer within `timeout_s` raises redis-py's
`ConnectionError` / `TimeoutError` to every caller waiting on it (`until_stored` and the
write-behind retry those, as before), and the next call connects again; error replies raise
redis-py's exception for them (`NoScriptError`, `BusyLoadingError`, ...). A timed-out
connection is closed, so no late reply can be taken for the answer to a later command.

It serves a single Redis (``redis://`` or ``unix://`` URL, with the ACL user and database the
URL names). A Redis Cluster or Sentinel keeps redis-py's client, which follows slots and
failovers (`hexgen_coordinator.redis_retry.hot_path`).
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, cast

import hiredis
from redis._parsers.base import BaseParser
from redis.asyncio.connection import parse_url
from redis.exceptions import (
    ConnectionError,
    DataError,
    NoScriptError,
    RedisError,
    ResponseError,
    TimeoutError,
)

__all__ = ["PipelinedRedis", "PipelinedScript"]

Command = Sequence[bytes | str | int | float]
"""One Redis command and its arguments, as redis-py's ``execute_command`` takes them."""


class _Waiter:
    """Replies expected for one write of commands, and the future that gets them."""

    __slots__ = ("expected", "future", "replies", "sent_at")

    def __init__(self, future: asyncio.Future[list[Any]], expected: int, sent_at: float) -> None:
        self.future = future
        self.expected = expected
        self.replies: list[Any] = []
        self.sent_at = sent_at


class _Connection(asyncio.Protocol):
    """One open connection: replies go to the waiters in the order the commands went out."""

    def __init__(self, where: str, timeout_s: float) -> None:
        self.where = where
        self.timeout_s = timeout_s
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._reader = hiredis.Reader(replyError=ResponseError)
        self._waiters: deque[_Waiter] = deque()
        self._loop = asyncio.get_running_loop()
        self._watchdog: asyncio.TimerHandle | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's: no subclass
        self._watchdog = self._loop.call_later(self.timeout_s / 2, self._check_overdue)

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        waiters = self._waiters
        while (reply := reader.gets()) is not False:
            if not waiters:  # a reply nobody asked for: the stream is out of step
                self._fail(ConnectionError(f"unexpected reply from Redis at {self.where}"))
                return
            waiter = waiters[0]
            waiter.replies.append(reply)
            if len(waiter.replies) == waiter.expected:
                waiters.popleft()
                if not waiter.future.done():
                    waiter.future.set_result(waiter.replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"connection to Redis at {self.where} lost: {exc or 'closed'}"))

    # ours
    def send(self, commands: Iterable[Command], count: int) -> asyncio.Future[list[Any]]:
        """Write `count` commands at once; the future gets their `count` replies."""
        if self.closed or self.transport is None:
            raise ConnectionError(f"connection to Redis at {self.where} is closed")
        # Packed before the waiter is queued: an argument hiredis refuses (None, say)
        # raises here, as redis-py's DataError, and leaves the connection in step.
        try:
            # hiredis's stub types a command as a 1-tuple; any tuple of arguments is packed
            packed = b"".join([hiredis.pack_command(tuple(c)) for c in commands])  # type: ignore[arg-type]
        except TypeError as exc:
            raise DataError(f"a command for Redis at {self.where}: {exc}") from exc
        future: asyncio.Future[list[Any]] = self._loop.create_future()
        self._waiters.append(_Waiter(future, count, self._loop.time()))
        self.transport.write(packed)
        return future

    def _check_overdue(self) -> None:
        if self.closed:
            return
        if self._waiters and self._loop.time() - self._waiters[0].sent_at > self.timeout_s:
            late = f"Redis at {self.where} did not answer in {self.timeout_s:g} s"
            self._fail(TimeoutError(late))
            return
        self._watchdog = self._loop.call_later(self.timeout_s / 2, self._check_overdue)

    def _fail(self, exc: RedisError) -> None:
        """Close for good: every waiter gets `exc` (a later reply must not answer a later
        command)."""
        self.closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.transport is not None:
            self.transport.abort()
        waiters, self._waiters = self._waiters, deque()
        for waiter in waiters:
            if not waiter.future.done():
                waiter.future.set_exception(exc)


class PipelinedRedis:
    """See the module docstring. ``await execute(...)``, ``await execute_many([...])``,
    ``register_script(text)`` (as redis-py's), ``await aclose()``."""

    def __init__(
        self,
        url: str,
        *,
        password: str | None = None,
        timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
    ) -> None:
        options = parse_url(url)
        if "connection_class" in options and "path" not in options:
            raise ValueError(f"{url!r}: only redis:// and unix:// URLs are served here")
        self._path: str | None = options.get("path")
        self._host: str = options.get("host", "localhost")
        self._port: int = int(options.get("port", 6379))
        self._db = int(options.get("db", 0) or 0)
        self._username: str | None = options.get("username")
        self._password = options.get("password") or password
        self.where = self._path or f"{self._host}:{self._port}"
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._conn: _Connection | None = None
        self._connecting: asyncio.Lock | None = None

    async def execute(self, *command: bytes | str | int | float) -> Any:
        """One command's reply; an error reply raises its redis-py exception."""
        (reply,) = await self._send((command,), 1)
        if isinstance(reply, ResponseError):
            raise _typed(reply)
        return reply

    async def execute_many(self, commands: Sequence[Command]) -> list[Any]:
        """Several commands in one write (a pipeline, not a transaction); the first error
        reply raises, as redis-py's pipeline does."""
        if not commands:
            return []
        replies = await self._send(commands, len(commands))
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise _typed(reply)
        return replies

    def register_script(self, script: str) -> PipelinedScript:
        return PipelinedScript(self, script)

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            conn._fail(ConnectionError(f"client of Redis at {self.where} closed"))

    async def _send(self, commands: Sequence[Command], count: int) -> list[Any]:
        conn = self._conn
        if conn is None or conn.closed:
            conn = await self._connect()
        return await conn.send(commands, count)

    async def _connect(self) -> _Connection:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # one caller connects; the others use its connection
            conn = self._conn
            if conn is not None and not conn.closed:
                return conn
            loop = asyncio.get_running_loop()
            conn = _Connection(self.where, self.timeout_s)
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    if self._path is not None:
                        await loop.create_unix_connection(lambda: conn, self._path)
                    else:
                        await loop.create_connection(lambda: conn, self._host, self._port)
                    hello: list[Command] = []
                    if self._password:
                        user = [self._username] if self._username else []
                        hello.append(("AUTH", *user, self._password))
                    if self._db:
                        hello.append(("SELECT", self._db))
                    for reply in await conn.send(hello, len(hello)) if hello else []:
                        if isinstance(reply, ResponseError):
                            raise _typed(reply)
            except (OSError, builtins.TimeoutError) as exc:
                conn._fail(ConnectionError(f"cannot reach Redis at {self.where}"))
                raise ConnectionError(f"Error connecting to Redis at {self.where}: {exc}") from exc
            except BaseException:
                conn._fail(ConnectionError(f"cannot log in to Redis at {self.where}"))
                raise
            self._conn = conn
            return conn


class PipelinedScript:
    """A Lua script run by its SHA1 (EVALSHA), loaded when Redis lacks it (NOSCRIPT),
    called as redis-py's registered scripts are: ``await script(keys=[...], args=[...])``."""

    def __init__(self, client: PipelinedRedis, script: str) -> None:
        self.client = client
        self.script = script
        self.sha = hashlib.sha1(script.encode()).hexdigest()

    async def __call__(
        self, keys: Sequence[bytes | str] | None = None, args: Iterable[Any] | None = None
    ) -> Any:
        keys = list(keys or ())
        argv = list(args or ())
        try:
            return await self.client.execute("EVALSHA", self.sha, len(keys), *keys, *argv)
        except NoScriptError:  # a new, restarted or flushed Redis: load it, as redis-py does
            # (SCRIPT LOAD, not EVAL: the coordinator's ACL user may run EVALSHA only)
            await self.client.execute("SCRIPT", "LOAD", self.script)
            return await self.client.execute("EVALSHA", self.sha, len(keys), *keys, *argv)


def _typed(reply: ResponseError) -> Exception:
    """redis-py's exception for an error reply (NOSCRIPT: NoScriptError, LOADING:
    BusyLoadingError, which is retryable, ...)."""
    error: Exception = BaseParser.parse_error(str(reply))  # type: ignore[no-untyped-call]
    return error
