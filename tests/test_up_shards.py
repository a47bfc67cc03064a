"""``hexgen-flow up --shards 2`` as a user runs it (a subprocess; its banner gives the
addresses): ``replay`` given the banner's comma list of coordinators completes its queries
on both shards; after shard 0's coordinator is SIGKILLed, `up` reports it (no restart:
the spare takes the shard over) and a second replay completes too; SIGTERM stops
everything. Flags that do not go with shards yet are refused, naming them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from up_runner import Up, replay, running_up, wait_for


def _replay(up: Up, trace: str) -> dict[str, object]:
    done = replay(up, "--trace", trace, "--qps", "1", "--num-queries", "12")
    out, err = done.communicate(timeout=240)
    assert done.returncode == 0, err
    doc: dict[str, object] = json.loads(out)
    return doc


def test_up_with_shards_serves_both_and_survives_a_dead_shard(tmp_path: Path) -> None:
    with running_up(tmp_path, "--shards", "2", "--spares", "1", "--time-scale", "50") as up:
        addresses = up.coordinator.split(",")
        assert len(addresses) == 3
        shards = up.banner["shards"]
        assert "shard 0 (hf:{s0}:)" in shards and "shard 1 (hf:{s1}:)" in shards
        assert f"{addresses[2]} spare" in shards
        first = _replay(up, "trace3")
        assert first["completed"] == first["num_queries"] == 12
        victim = up.service_pid("hexgen_coordinator", "hf:{s0}:")
        os.kill(victim, signal.SIGKILL)
        up.wait_stderr(r"coordinator s0 exited \(code -9\); not restarted", timeout_s=15)
        spare_log = up.log_dir / "coordinator-spare0.log"
        wait_for(
            "the spare holds shard 0", lambda: "took over shard 0" in spare_log.read_text(), 30
        )
        again = _replay(up, "trace2")  # new queries, on both shards again
        assert again["completed"] == again["num_queries"] == 12
        assert "resubmitted" not in again  # new ids: this work ran after the takeover
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=60) == 0
    assert "stopping" in up.stderr


@pytest.mark.parametrize("flag", ["--secure", "--redis-cluster"])
def test_up_refuses_what_shards_do_not_support_yet(flag: str, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "hexgen_cli", "up", "--shards", "2", flag]
    if flag == "--redis-cluster":
        argv += ["--redis-url", "redis://127.0.0.1:6379/0"]
    else:
        argv += ["--log-dir", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert f"--shards: not yet with {flag}" in done.stderr
