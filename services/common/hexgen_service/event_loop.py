"""Which asyncio event loop a service runs on.

The coordinator's completion path is mostly event-loop work: every completion is a gRPC
message read, a Redis round trip or two, and a message written, each a handful of
callbacks, timers and socket writes. uvloop (libuv under asyncio's API) does that work in C;
on this machine it cut the coordinator's CPU per completion (figures in docs/scaling.md,
"Wire to wire"). grpc.aio runs on it unchanged.

`EVENT_LOOPS`: ``auto`` (uvloop where it is installed, asyncio's own loop otherwise),
``uvloop`` (refused with a clear error where it is not installed) and ``asyncio``.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from hexgen_flow.errors import ConfigError

__all__ = ["EVENT_LOOPS", "loop_factory", "resolve_event_loop", "run"]

T = TypeVar("T")

EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def resolve_event_loop(name: str) -> str:
    """``uvloop`` or ``asyncio``: what `name` (one of `EVENT_LOOPS`) runs on here."""
    if name not in EVENT_LOOPS:
        raise ConfigError(f"--event-loop: {name!r} is not one of {', '.join(EVENT_LOOPS)}")
    have_uvloop = importlib.util.find_spec("uvloop") is not None
    if name == "uvloop" and not have_uvloop:
        raise ConfigError(
            "--event-loop: uvloop is not installed here (pip install uvloop; it has no "
            "Windows build), or give --event-loop asyncio"
        )
    if name == "auto":
        return "uvloop" if have_uvloop else "asyncio"
    return name


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The new-loop function for `name` (None: asyncio's default)."""
    if resolve_event_loop(name) == "asyncio":
        return None
    import uvloop  # noqa: PLC0415 - optional, imported only when chosen

    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], event_loop: str = "auto") -> T:
    """``asyncio.run(main)`` on the loop `event_loop` names."""
    try:
        factory = loop_factory(event_loop)
    except ConfigError:
        main.close()  # never awaited: say nothing of it
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
