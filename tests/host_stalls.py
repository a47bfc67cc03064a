"""How long the host stood still: a separate process that sleeps 10 ms at a time and reports
every wake-up later than it asked for by more than `threshold_s` on the Unix clock, the
mesh's cluster clock (the whole machine paused, or was starved of CPU so that nothing ran,
or its clock was stepped forward), as wall-clock intervals.

For the mesh tests that grade latency on a scaled cluster clock: a mesh at time scale k
multiplies each second the host stands still by k, for every query in flight, and a stall
of 3 s at time scale 10 puts 30 cluster seconds on each of them. Such a test can subtract
the stalls it saw (`lost_between`) and still fail on a scheduler that runs late by itself;
what it subtracted is printed beside the verdict. (Subtracting is not exact: work that
piled up behind a stall can delay a query by more than the stall.)
"""

from __future__ import annotations

import subprocess
import sys
import time
from types import TracebackType

__all__ = ["HostStalls"]

_SLEEPER = """
import sys, time
step, threshold = float(sys.argv[1]), float(sys.argv[2])
print("ready", flush=True)
last = time.time()
while True:
    time.sleep(step)
    now = time.time()
    late = now - last - step
    if late > threshold:
        print(f"{now - late:.6f} {late:.6f}", flush=True)
    last = now
"""


class HostStalls:
    """``with HostStalls() as stalls: ...``; afterwards ``stalls.intervals`` holds each stall
    as (unix start, seconds) and ``stalls.lost_between(a, b)`` the stalled seconds within
    [a, b] (unix times)."""

    def __init__(self, step_s: float = 0.01, threshold_s: float = 0.05) -> None:
        self.step_s = step_s
        self.threshold_s = threshold_s
        self.intervals: list[tuple[float, float]] = []
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> HostStalls:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SLEEPER, repr(self.step_s), repr(self.threshold_s)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        if self._proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the stall monitor did not start")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        proc = self._proc
        assert proc is not None
        time.sleep(2 * self.step_s)  # a stall ending now is reported by the next wake-up
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
        self.intervals = [
            (float(start), float(seconds))
            for start, seconds in (line.split() for line in out.splitlines() if line.strip())
        ]

    @property
    def pid(self) -> int:
        """The monitor's process (its own test stops it to make a stall)."""
        assert self._proc is not None
        return self._proc.pid

    @property
    def total_s(self) -> float:
        return sum(seconds for _, seconds in self.intervals)

    def lost_between(self, start_unix: float, end_unix: float) -> float:
        """Seconds the host stood still within [start_unix, end_unix]."""
        return sum(max(0.0, min(end_unix, s + d) - max(start_unix, s)) for s, d in self.intervals)

    def lost_on_cluster_clock(
        self, epoch_unix_s: float, time_scale: float, start_s: float, end_s: float
    ) -> float:
        """Cluster seconds the host stood still within [start_s, end_s] of a cluster clock
        (`epoch_unix_s`, `time_scale`): each wall second of a stall counts `time_scale`."""
        wall = (epoch_unix_s + start_s / time_scale, epoch_unix_s + end_s / time_scale)
        return time_scale * self.lost_between(*wall)
