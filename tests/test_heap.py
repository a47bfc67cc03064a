"""`hexgen_service.heap.HeapTrimmer`'s decisions, on a model of a process's memory: what is
in use, and what was freed but still held by the allocator until a trim gives it back.
(tests/test_hostile_memory.py measures the real thing on a running coordinator.)"""

from __future__ import annotations

import ctypes.util
import platform
from dataclasses import dataclass

import pytest

from hexgen_service import heap
from hexgen_service.heap import HeapTrimmer, resident_bytes

MB = 1 << 20


@dataclass
class Memory:
    """Resident memory = in use (the process's own, and requests being read) + freed but
    held; a trim gives back what is held."""

    used: int = 100 * MB
    in_flight: int = 0
    held: int = 0
    trims: int = 0

    def rss(self) -> int:
        return self.used + self.in_flight + self.held

    def trim(self, _pad: int) -> int:
        self.trims += 1
        self.held = 0
        return 1

    def burst(self, size: int) -> None:
        """A request read and refused: freed, but held until a trim."""
        self.held += size

    def arriving(self, size: int) -> None:
        """The requests read a second ago are refused (freed, held); `size` more are read."""
        self.held += self.in_flight
        self.in_flight = size


def _trimmer(memory: Memory) -> HeapTrimmer:
    return HeapTrimmer(growth_bytes=32 * MB, rss=memory.rss, trim=memory.trim)


def _run(trimmer: HeapTrimmer, start_s: float, end_s: float, step: float = 1.0) -> None:
    t = start_s
    while t < end_s:
        trimmer.check(t)
        t += step


def test_below_the_growth_nothing_is_trimmed() -> None:
    memory = Memory()
    trimmer = _trimmer(memory)
    memory.burst(31 * MB)
    _run(trimmer, 0, 60)
    assert memory.trims == 0
    assert memory.rss() == 131 * MB


def test_a_short_burst_is_given_back_at_the_next_check() -> None:
    memory = Memory()
    trimmer = _trimmer(memory)
    memory.burst(200 * MB)
    assert trimmer.check(1.0)
    assert memory.rss() == 100 * MB
    assert trimmer.floor_bytes == 100 * MB


def test_memory_that_stays_after_the_retries_raises_the_floor() -> None:
    memory = Memory()
    trimmer = _trimmer(memory)
    memory.used += 200 * MB  # grown for real: a trim gives nothing back
    _run(trimmer, 0, 8)  # the first trim and its three retries, 2 s apart
    assert memory.trims == 4
    assert trimmer.floor_bytes == 300 * MB
    _run(trimmer, 8, 9.5)
    assert memory.trims == 4  # no more trims at every check


def test_a_burst_that_outlasts_the_retries_is_given_back_once_it_is_over() -> None:
    """A flood on a loaded machine: requests keep arriving through every retry, so what
    they hold is taken for memory in use; once they stop, the raised floor's recheck gives
    it back."""
    memory = Memory()
    trimmer = _trimmer(memory)
    t = 0.0
    while t < 8.0:  # each second 50 MB read, refused a second later
        memory.arriving(50 * MB)
        trimmer.check(t)
        t += 1.0
    # Trims at 0, 2, 4 and 6 s each left the 50 MB being read: taken for memory in use at
    # 6 s; the one at 7 s gave back what was refused since, down to that raised floor.
    assert memory.trims == 5
    assert trimmer.floor_bytes == 150 * MB
    memory.arriving(0)  # the flood ends at 8 s
    _run(trimmer, 8.0, 16.0)  # before the recheck, 10 s after the floor rose: nothing
    assert memory.rss() == 150 * MB
    assert trimmer.check(16.0)
    assert memory.rss() == 100 * MB
    assert trimmer.floor_bytes == 100 * MB


def test_a_raised_floor_that_stays_is_rechecked_ever_more_rarely() -> None:
    memory = Memory()
    trimmer = _trimmer(memory)
    memory.used += 200 * MB
    _run(trimmer, 0, 8)
    assert memory.trims == 4  # raised at t=6
    trims_at = []
    t = 8.0
    while t < 1000.0:
        if trimmer.check(t):
            trims_at.append(t)
        t += 1.0
    gaps = [b - a for a, b in zip([6.0, *trims_at], trims_at, strict=False)]
    assert gaps[:6] == [10, 20, 40, 80, 160, 320], gaps
    assert set(gaps[6:]) <= {320}, gaps


def test_memory_freed_for_real_later_lowers_the_floor_and_ends_the_rechecks() -> None:
    memory = Memory()
    trimmer = _trimmer(memory)
    memory.used += 200 * MB
    _run(trimmer, 0, 8)
    assert trimmer.floor_bytes == 300 * MB
    memory.used -= 200 * MB  # the queries that held it finished; their pages are held
    memory.held += 200 * MB
    _run(trimmer, 8, 40)
    assert memory.rss() == 100 * MB
    assert trimmer.floor_bytes == 100 * MB
    trims = memory.trims
    _run(trimmer, 40, 2000)
    assert memory.trims == trims


def test_without_malloc_trim_it_does_nothing() -> None:
    memory = Memory()
    trimmer = HeapTrimmer(rss=lambda: None, trim=memory.trim)
    assert not trimmer.works
    memory.burst(500 * MB)
    assert not trimmer.check(100.0)
    assert memory.trims == 0


def test_this_process_resident_memory_is_read() -> None:
    rss = resident_bytes()
    assert rss is not None and rss > MB


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_malloc_trim_is_found_without_ldconfig(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the C library cannot be named (no ``ldconfig``, no compiler on the path: what
    `ctypes.util.find_library` runs), the trimmer still finds ``malloc_trim`` among the
    symbols the interpreter has loaded, and trims."""
    monkeypatch.setattr(ctypes.util, "find_library", lambda _name: None)
    trim = heap._malloc_trim()
    assert trim is not None
    assert trim(0) in (0, 1)
    assert HeapTrimmer().works
