"""Supervision, as users meet it: ``hexgen-flow up`` restarts a service that dies and the
mesh keeps serving, and a ``kill -9`` of ``up`` takes every service with it.

The mesh tests run the real commands as subprocesses: ``hexgen-flow up --time-scale 50``
(a private redis-server, the coordinator, the tuner, four simulated workers) and
``hexgen-flow replay`` of 60 trace3 queries at 2 queries per cluster second (about 8 s of
wall time), with one service SIGKILLed about 2 s in. Children are found through
``/proc/<pid>/task/*/children``. The library tests check the pieces alone: `Supervisor`'s
backoff, the private Redis's append-only file across a restart, and that a child forked on
behalf of a short-lived thread lives until its parent process dies.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from hexgen_launch.errors import ClusterError
from hexgen_launch.processes import (
    CAN_DIE_WITH_PARENT,
    ManagedProcess,
    RedisServer,
    RestartPolicy,
    Supervisor,
    find_redis_server,
)
from up_runner import (
    Up,
    alive,
    children,
    cmdline,
    has_new,
    listening,
    running_up,
    wait_for,
)
from up_runner import replay as run_replay

try:
    find_redis_server()
    HAVE_REDIS_SERVER = True
except ClusterError:
    HAVE_REDIS_SERVER = False

needs_redis_server = pytest.mark.skipif(
    not HAVE_REDIS_SERVER, reason="redis-server is not installed (apt install redis-server)"
)
needs_linux = pytest.mark.skipif(
    not CAN_DIE_WITH_PARENT, reason="children die with their parent only on Linux"
)

NUM_QUERIES = 60
QPS = 2.0  # queries per cluster second: 100 per wall second at time scale 50
TIME_SCALE = 50
KILL_AFTER_S = 2.0


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    # --admission off: 2 q/s overloads the cluster on purpose, and every query must run.
    # It and --max-call-attempts also check that `up` passes them to the coordinator.
    with running_up(
        tmp_path, "--time-scale", str(TIME_SCALE), "--admission", "off",
        "--max-call-attempts", "5",
    ) as running:  # fmt: skip
        yield running


def _replay_with_a_kill(up: Up, victim: int) -> dict[str, object]:
    """Replay while `victim` is SIGKILLed KILL_AFTER_S in; the replay's JSON."""
    started = time.monotonic()
    replay = run_replay(
        up, "--trace", "trace3", "--qps", str(QPS), "--num-queries", str(NUM_QUERIES)
    )
    time.sleep(KILL_AFTER_S)
    assert replay.poll() is None, "the replay ended before the kill"
    os.kill(victim, signal.SIGKILL)
    out, err = replay.communicate(timeout=60)
    assert replay.returncode == 0, err
    doc = json.loads(out)
    assert isinstance(doc, dict)
    print(f"replay with a kill: {time.monotonic() - started:.1f} s wall")
    return doc


@needs_redis_server
@needs_linux
def test_up_restarts_a_killed_worker_and_every_query_completes(up: Up) -> None:
    coordinator_argv = cmdline(up.service_pid("hexgen_coordinator"))
    given = dict(itertools.pairwise(coordinator_argv))
    assert given["--admission"] == "off" and given["--max-call-attempts"] == "5"
    assert "--metrics-listen" in given and "--worker-token-file" in given
    assert "restart a dead service after 0.5 s, doubling to 10 s" in up.banner["supervision"]
    victim = up.service_pid("hexgen_worker", "--slot", "1")

    doc = _replay_with_a_kill(up, victim)

    assert doc["completed"] == doc["num_queries"] == NUM_QUERIES
    assert up.proc.poll() is None  # still up
    up.wait_stderr(
        r"^hexgen-flow: worker 1 \(A100\) exited with code -9; restarting in 0\.5 s "
        r"\(restart 1\)$"
    )
    wait_for("a new worker 1", lambda: has_new(up, victim, "hexgen_worker", "--slot", "1"), 15)
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=30) == 0
    assert "hexgen-flow: stopped (restarts: worker-1 1)" in up.stderr


@needs_redis_server
@needs_linux
def test_up_restarts_a_killed_coordinator_and_every_query_completes(up: Up) -> None:
    victim = up.service_pid("hexgen_coordinator")

    doc = _replay_with_a_kill(up, victim)

    assert doc["completed"] == doc["num_queries"] == NUM_QUERIES
    assert up.proc.poll() is None
    up.wait_stderr(
        r"^hexgen-flow: coordinator exited with code -9; restarting in 0\.5 s \(restart 1\)$"
    )
    assert has_new(up, victim, "hexgen_coordinator")
    assert "Traceback" not in up.stderr
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=30) == 0
    assert "hexgen-flow: stopped (restarts: coordinator 1)" in up.stderr


@needs_redis_server
@needs_linux
def test_a_kill_9_of_up_takes_every_service_with_it(up: Up) -> None:
    kids = children(up.proc.pid)
    assert len(kids) == 8  # redis, coordinator, tuner, gateway, four workers
    addresses = [
        up.coordinator,
        up.banner["tuner"].split()[0],
        up.banner["redis"].split()[0].removeprefix("redis://").removesuffix("/0"),
    ]
    assert all(listening(a) for a in addresses)

    up.proc.kill()
    up.proc.wait(timeout=10)
    started = time.monotonic()

    wait_for("every child of up to die", lambda: not any(alive(c) for c in kids), 2)
    wait_for("the ports to close", lambda: not any(listening(a) for a in addresses), 2)
    print(f"children and ports gone {time.monotonic() - started:.2f} s after kill -9 of up")


# ---------------------------------------------------------------------- the pieces alone


def test_the_supervisor_restarts_with_exponential_backoff(tmp_path: Path) -> None:
    now = [0.0]
    supervisor = Supervisor(RestartPolicy(0.5, 2.0, 10.0), clock=lambda: now[0])
    crashing = ManagedProcess(
        "crashing", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "crashing.log"
    )
    restarted: list[float] = []

    def restart() -> None:
        restarted.append(now[0])
        crashing.start()

    supervisor.watch("crashing", crashing, restart)
    assert supervisor.step() == []  # not started: nothing to watch yet
    crashing.start()
    lines: list[str] = []
    for _ in range(5):  # it dies each time; the delays double up to the maximum
        assert crashing.popen is not None
        crashing.popen.wait(timeout=30)
        lines += supervisor.step()
        now[0] += 100 / 1000  # nothing before the delay is up
        assert supervisor.step() == []
        now[0] += 10.0
        supervisor.step()
    assert lines == [
        f"crashing exited with code 3; restarting in {d:g} s (restart {n})"
        for n, d in enumerate((0.5, 1, 2, 2, 2), start=1)
    ]
    assert supervisor.restarts == {"crashing": 5}
    assert restarted == pytest.approx([10.1 + 10.1 * n for n in range(5)])
    # Up for reset_after_s: the next restart comes after the first delay again.
    assert crashing.popen is not None
    crashing.popen.wait(timeout=30)
    now[0] += 11.0
    assert supervisor.step() == ["crashing exited with code 3; restarting in 0.5 s (restart 6)"]
    crashing.close()


def test_a_restart_that_cannot_start_is_reported_and_tried_again(tmp_path: Path) -> None:
    now = [0.0]
    supervisor = Supervisor(RestartPolicy(0.5, 10.0, 10.0), clock=lambda: now[0])
    proc = ManagedProcess("gone", [sys.executable, "-c", "pass"], tmp_path / "gone.log")
    proc.start()
    assert proc.popen is not None
    proc.popen.wait(timeout=30)
    proc.argv = [str(tmp_path / "no-such-program")]
    supervisor.watch("gone", proc)
    assert supervisor.step() == ["gone exited with code 0; restarting in 0.5 s (restart 1)"]
    now[0] += 0.5
    [failed] = supervisor.step()
    assert failed.startswith("gone did not restart: cannot start gone")
    assert supervisor.step() == [
        "gone exited with code 0; restarting in 1 s (restart 2)"  # noticed again, backed off
    ]


@needs_redis_server
def test_the_private_redis_keeps_its_state_across_a_kill_and_restart() -> None:
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url, socket_timeout=2)
        try:
            assert client.config_get("appendonly") == {"appendonly": "yes"}
            assert client.config_get("appendfsync") == {"appendfsync": "always"}
            client.set("hf:test", "kept")
            assert server.process is not None
            server.process.kill()  # SIGKILL: only what is on disk survives
            server.restart(wait=True)
            assert client.get("hf:test") == b"kept"
        finally:
            client.close()


@needs_linux
def test_a_child_outlives_the_thread_that_started_it_but_not_its_process(
    tmp_path: Path,
) -> None:
    # PR_SET_PDEATHSIG fires when the forking *thread* ends: the children are forked by a
    # thread that lives as long as the process, whichever thread asks.
    code = (
        "import sys, threading, time\n"
        "from pathlib import Path\n"
        "from hexgen_launch.processes import ManagedProcess\n"
        "def start():\n"
        "    p = ManagedProcess('sleeper', ['sleep', '60'], Path(sys.argv[1]))\n"
        "    p.start()\n"
        "    print(p.pid, flush=True)\n"
        "t = threading.Thread(target=start)\n"
        "t.start()\n"
        "t.join()\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "sleeper.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        time.sleep(0.3)
        assert alive(child)  # the thread that asked has ended
        assert cmdline(child) == ["sleep", "60"]  # the launcher exec'd it, same pid
        parent.kill()
        parent.wait(timeout=10)
        wait_for("the child to die with its parent", lambda: not alive(child), 2)
    finally:
        parent.kill()


@needs_redis_server
@needs_linux
def test_up_restarts_a_killed_redis_and_every_query_completes(up: Up) -> None:
    victim = up.redis_pid()

    doc = _replay_with_a_kill(up, victim)

    assert doc["completed"] == doc["num_queries"] == NUM_QUERIES
    assert up.proc.poll() is None
    up.wait_stderr(r"^hexgen-flow: redis-server exited with code -9; restarting in 0\.5 s")
