"""Giving a burst's memory back to the system.

A large request a service reads and refuses (or serves) is freed, but glibc's allocator
keeps the pages in its arenas: measured on the coordinator, sixteen 7.5 MB submissions
refused by a field check (three rounds) took its resident memory from 84 to 435 MB, and
there it stayed; ``malloc_trim(0)`` brought it back to 118 MB. The same holds for what gRPC
buffered of a request it refused at the door, which no Python code ever sees.

`HeapTrimmer.watch` reads the process's resident memory every second (``/proc/self/statm``,
a few microseconds) and, once it has grown by `growth_bytes` over its floor, collects
the young generations (a refused request can sit in a reference cycle, an exception and the
handler frame holding the request, until the collector runs, which the coordinator's GC
tuning makes rare) and trims the heap: a few milliseconds, in the event loop. A trim in the
middle of a burst is tried again when it is over; memory still in use after a few tries
raises the floor, so a service that grows for real trims a few times per `growth_bytes` of
growth. A raised floor is checked again later (a trim after 10 s, then 20, 40, ... up to
320 s, while it stays above the lowest memory seen): a burst that outlasted the retries, as
a flood on a loaded machine does, is given back once it is over instead of being taken for
memory in use for good. On a system without glibc or /proc it does nothing. It logs whether
it is on when it starts, and each trim with what it gave back (INFO when that is a quarter
of `growth_bytes` or more): what a trim cannot give back (requests still held, or pages
the allocator's arenas keep in use) shows there.

(The door's own receive limit, `hexgen_service.server.GrpcServer`, keeps requests beyond it
from being parsed at all; this gives back what was read.)
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["HeapTrimmer", "resident_bytes", "watch_heap"]

log = logging.getLogger(__name__)

_STATM = Path("/proc/self/statm")


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``: looked up among the symbols the process has loaded (an
    interpreter linked with glibc has it, whatever the environment), then in the C library
    `ctypes.util.find_library` names (which runs ``ldconfig`` or a compiler to find it);
    None where neither has it (musl, macOS)."""
    return _symbol(None) or _symbol(ctypes.util.find_library("c"))


def _symbol(library: str | None) -> Callable[[int], int] | None:
    """``malloc_trim`` in `library` (None: the process's own symbols), or None."""
    try:
        trim = ctypes.CDLL(library).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def resident_bytes() -> int | None:
    """The process's resident memory, None where /proc does not tell."""
    try:
        return int(_STATM.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class HeapTrimmer:
    """Trim the heap when resident memory grew by `growth_bytes` over its floor (see the
    module). A trim that leaves it that high is tried again `retry_s` later, up to
    `retries` times (the burst may still be arriving); then what is left counts as in use,
    and the floor moves up to it. A floor so raised is tried again `recheck_s[0]` later,
    the wait doubling up to `recheck_s[1]` while the trims give nothing back; it comes down
    to what a trim leaves.

    `rss` and `trim` are the process's resident memory and glibc's ``malloc_trim`` unless
    given (tests give their own)."""

    def __init__(
        self,
        growth_bytes: int = 32 << 20,
        period_s: float = 1.0,
        retry_s: float = 2.0,
        retries: int = 3,
        recheck_s: tuple[float, float] = (10.0, 320.0),
        *,
        rss: Callable[[], int | None] = resident_bytes,
        trim: Callable[[int], int] | None = None,
    ) -> None:
        self.growth_bytes = growth_bytes
        self.period_s = period_s
        self.retry_s = retry_s
        self.retries = retries
        self.recheck_s = recheck_s
        self.trims = 0
        """Trims done (for tests and figures)."""
        self._rss = rss
        self._trim = trim if trim is not None else _malloc_trim()
        self._floor = rss()
        self._lowest = self._floor
        """The least resident memory seen: where a raised floor may come back to."""
        self._tried = 0
        """Trims since the last that brought memory down to its floor."""
        self._next_s = 0.0
        self._recheck_wait_s = recheck_s[0]
        self._recheck_at_s = float("inf")
        """When a raised floor is tried again (never while it is not raised)."""

    @property
    def works(self) -> bool:
        return self._trim is not None and self._floor is not None

    @property
    def floor_bytes(self) -> int | None:
        """The memory counted as in use: a trim is tried `growth_bytes` above it."""
        return self._floor

    def check(self, now_s: float) -> bool:
        """Trim if resident memory is `growth_bytes` above its floor (and a retry is due),
        or if a raised floor is due to be tried again; whether it did. `now_s`: a monotonic
        clock."""
        rss = self._rss()
        if self._trim is None or rss is None or self._floor is None or self._lowest is None:
            return False
        self._floor = min(self._floor, rss)
        self._lowest = min(self._lowest, rss)
        if rss - self._floor >= self.growth_bytes and now_s >= self._next_s:
            after = self._trim_now(rss)
            if after - self._floor < self.growth_bytes:
                self._tried = 0
            elif self._tried < self.retries:
                self._tried += 1
                self._next_s = now_s + self.retry_s
            else:  # it stays: memory in use, not a burst's leftovers (for now: see recheck)
                self._floor, self._tried = after, 0
                self._recheck_wait_s = self.recheck_s[0]
                self._recheck_at_s = now_s + self._recheck_wait_s
            return True
        if now_s >= self._recheck_at_s:
            after = self._trim_now(rss)
            gave_back = after <= self._floor - self.growth_bytes
            self._floor = min(self._floor, after)
            if self._floor - self._lowest < self.growth_bytes:
                self._recheck_at_s = float("inf")
            else:
                self._recheck_wait_s = (
                    self.recheck_s[0]
                    if gave_back
                    else min(2 * self._recheck_wait_s, self.recheck_s[1])
                )
                self._recheck_at_s = now_s + self._recheck_wait_s
            return True
        return False

    def _trim_now(self, rss: int) -> int:
        """Collect the young generations and trim; resident memory after (logged, at INFO
        when the trim gave back a quarter of `growth_bytes` or more)."""
        assert self._trim is not None
        gc.collect(1)
        self._trim(0)
        self.trims += 1
        after = self._rss() or rss
        log.log(
            logging.INFO if rss - after >= self.growth_bytes // 4 else logging.DEBUG,
            "heap trimmed: %.0f MB -> %.0f MB resident (floor %.0f MB)",
            rss / 2**20,
            after / 2**20,
            (self._floor or 0) / 2**20,
        )
        return after

    async def watch(self) -> None:
        """`check` every `period_s` (until cancelled)."""
        if not self.works:
            return
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.period_s)
            self.check(loop.time())


_watching: set[asyncio.AbstractEventLoop] = set()


def watch_heap() -> asyncio.Task[None] | None:
    """Start the process's one `HeapTrimmer` in the running loop (a second call, from a
    second server of the same process, starts none); the task, or None."""
    loop = asyncio.get_running_loop()
    if loop in _watching:
        return None
    _watching.add(loop)
    trimmer = HeapTrimmer()
    if trimmer.works:
        log.info("heap trimmer on: trims at +%d MB resident", trimmer.growth_bytes >> 20)
    else:
        log.warning("heap trimmer off: no glibc malloc_trim or no /proc here")
    task = loop.create_task(trimmer.watch())
    task.add_done_callback(lambda _: _watching.discard(loop))
    return task
