"""A local mesh in the foreground until Ctrl-C or SIGTERM (`up`, `up --shards`)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from hexgen_cli.options import PROG, info

__all__ = ["run_in_foreground"]


def run_in_foreground(
    *,
    start: Callable[[], None],
    poll: Callable[[], None],
    period_s: float,
    stop: Callable[[], None],
    stopped: Callable[[], str] | None = None,
) -> int:
    """`start`, then `poll` every `period_s` until Ctrl-C or SIGTERM (a container's or
    a supervisor's stop reads as Ctrl-C), then `stop` and print `stopped()`; returns the exit
    code (0). `stop` runs whatever ends the loop, an error included, and must be idempotent."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        start()
        while True:
            poll()
            time.sleep(period_s)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        info(f"{PROG}: stopping ...")
        stop()
        if stopped is not None:
            info(f"{PROG}: {stopped()}")
        return 0
    finally:
        stop()
        signal.signal(signal.SIGTERM, previous)
