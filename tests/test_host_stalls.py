"""`host_stalls.HostStalls`, the mesh tests' measure of how long the host stood still: a
monitor stopped for 0.5 s (SIGSTOP, then SIGCONT) reports one stall of that length where it
happened, and nothing while it ran freely."""

from __future__ import annotations

import os
import signal
import time

import pytest

from host_stalls import HostStalls


def test_a_stopped_monitor_reports_the_stall_and_nothing_else() -> None:
    with HostStalls() as stalls:
        time.sleep(0.3)
        before = time.time()
        os.kill(stalls.pid, signal.SIGSTOP)
        time.sleep(0.5)
        os.kill(stalls.pid, signal.SIGCONT)
        after = time.time()
        time.sleep(0.3)
    assert len(stalls.intervals) == 1, stalls.intervals
    start, seconds = stalls.intervals[0]
    assert 0.45 <= seconds <= 0.7
    assert before - 0.05 <= start <= before + 0.1
    assert stalls.lost_between(before - 1, after + 1) == pytest.approx(seconds)
    assert stalls.lost_between(before - 1, before - 0.5) == 0.0
    assert 0.1 < stalls.lost_between(start + 0.2, after + 1) < seconds
    assert stalls.total_s == seconds
    # On a cluster clock at time scale 10 that started 1 s before the stall: 10x the stall.
    epoch = before - 1
    whole = stalls.lost_on_cluster_clock(epoch, 10.0, 0.0, 10 * (after + 1 - epoch))
    assert whole == pytest.approx(10 * seconds)
    assert stalls.lost_on_cluster_clock(epoch, 10.0, 0.0, 5.0) == 0.0
