"""Python's garbage collector, tuned for a service on the completion path.

A full (generation 2) collection walks every container object that survived two younger
collections. In the coordinator that was every module and class loaded at start-up (some
65,000 objects), and it stalled the event loop for 21-25 ms about every 40 s at 1,000
completions/s (measured: `benchmarks/coordinator_overhead.py`, and the pauses timed by
`GcPauses`). Two changes take that away:

- `freeze_startup`: after start-up, collect once and move every surviving object to the
  permanent generation (`gc.freeze`), which later collections never walk. What start-up
  built lives as long as the process, so nothing is lost.
- a larger first threshold (young collections every 2,000 net allocations instead of 700),
  so that fewer short-lived objects (protobuf messages, Redis replies, events of one
  completion) are promoted before they die.

Measured at 1,000 completions/s for 60 s: no full collection after start-up (Python's
defaults: two, of 21.4 and 24.7 ms), the longest pause 3.1 ms (a generation-1 collection).
It holds because nothing of a finished query stays behind: a service that kept every
query's objects (as the estimator's plan cache and the admission model once did with
admission off) would still fill the old generation.

`GcPauses` times every collection through `gc.callbacks`, so the effect is measured, not
assumed: the coordinator exports it as ``hexgen_flow_gc_pause_seconds{generation}``, and
`benchmarks/coordinator_overhead.py` prints from it the collections of each drive.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_THRESHOLDS", "GcPauses", "freeze_startup"]

DEFAULT_THRESHOLDS = (2_000, 10, 10)
"""gc.set_threshold for services (Python's own: 700, 10, 10)."""


def freeze_startup(thresholds: tuple[int, int, int] = DEFAULT_THRESHOLDS) -> int:
    """Collect, freeze what survives, set `thresholds`; return the objects frozen."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
    return gc.get_freeze_count()


@dataclass
class GcPauses:
    """Every collection's duration, by generation, while `install`ed."""

    observe: Callable[[int, float], None] | None = None
    """Called with (generation, seconds) after each collection (e.g. a histogram's)."""
    longest_s: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    count: list[int] = field(default_factory=lambda: [0, 0, 0])
    _started: float = 0.0

    def install(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        generation = int(info.get("generation", 0))
        self.count[generation] += 1
        self.longest_s[generation] = max(self.longest_s[generation], seconds)
        if self.observe is not None:
            self.observe(generation, seconds)
