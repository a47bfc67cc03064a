"""How late the event loop runs: the longest any one piece of work held it.

A service's asyncio loop runs one callback at a time; a callback that takes long (parsing a
huge request, a full garbage collection) delays everything else: heartbeats, completions,
every other client. `watch_loop_lag` sleeps `period_s` again and again and reports how much
later than asked each wake-up came (`observe`): a lag of L seconds means some piece of work
held the loop for about L. The coordinator exports it as the histogram
``hexgen_flow_event_loop_lag_seconds``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["watch_loop_lag"]


async def watch_loop_lag(observe: Callable[[float], None], period_s: float = 0.05) -> None:
    """Report each wake-up's lateness to `observe` (wall seconds), until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time() + period_s
        await asyncio.sleep(period_s)
        observe(max(loop.time() - asked, 0.0))
