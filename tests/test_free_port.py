"""`hexgen_launch.processes.free_port`: the ports `up` and the tests give services that
bind after the pick come from below the kernel's ephemeral range, where no outgoing
connection can take them in between."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from hexgen_launch.processes import free_port

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not RANGE.exists(), reason="the ephemeral range is Linux's /proc file")
def test_picks_lie_below_the_ephemeral_range_and_are_bindable() -> None:
    low = int(RANGE.read_text().split()[0])
    picks = [free_port() for _ in range(20)]
    for port in picks:
        assert 10_000 <= port < low, (port, low)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # nobody took it
    assert len(set(picks)) > 1  # random, not one fixed port
