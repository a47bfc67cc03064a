"""`hexgen-flow up` for real, as the mesh tests run it: a subprocess whose banner gives the
addresses, whose children are found through ``/proc/<pid>/task/*/children``, and whose
stderr shows what its supervisor did."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# ---------------------------------------------------------------------------- processes


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    """Running, not a zombie (orphans may go unreaped where PID 1 does not reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return []


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as sock:
        sock.settimeout(1)
        try:
            sock.connect((host, int(port)))
        except OSError:
            return False
    return True


def wait_for(what: str, predicate: Callable[[], object], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(0.05)


# --------------------------------------------------------------------------- `up`, for real


@dataclass
class Up:
    proc: subprocess.Popen[str]
    banner: dict[str, str]
    stderr_path: Path
    log_dir: Path

    @property
    def coordinator(self) -> str:
        return self.banner["coordinator"]

    @property
    def worker_door(self) -> str:
        """The coordinator's door for workers (the banner's ``workers  door HOST:PORT; ...``)."""
        return self.banner["workers"].split()[1].rstrip(";")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def service_pid(self, module: str, *args: str) -> int:
        """The pid of `up`'s child running `python -m module` with `args` in its argv."""
        for pid in children(self.proc.pid):
            argv = cmdline(pid)
            if module in argv and alive(pid) and all(a in argv for a in args):
                return pid
        raise AssertionError(f"no live child runs {module} {args}")

    def redis_pid(self) -> int:
        """The pid of `up`'s private redis-server."""
        for pid in children(self.proc.pid):
            if comm(pid) == "redis-server" and alive(pid):
                return pid
        raise AssertionError("no redis-server child")

    def wait_stderr(self, pattern: str, timeout_s: float = 15) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            found = re.search(pattern, self.stderr, re.MULTILINE)
            if found:
                return found
            assert self.proc.poll() is None, f"up exited: {self.stderr}"
            assert time.monotonic() < deadline, f"{pattern!r} not in up's stderr: {self.stderr}"
            time.sleep(0.05)


def read_banner(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, str]:
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("Ctrl-C"):
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    assert lines and lines[-1].startswith("Ctrl-C"), f"up did not come up: {lines}"
    return {
        key: value.strip() for key, value in (line.strip().split("  ", 1) for line in lines[1:-1])
    }


@contextmanager
def running_up(tmp_path: Path, *options: str, banner_timeout_s: float = 60) -> Iterator[Up]:
    """`hexgen-flow up` with `options` (and its logs under `tmp_path`), stopped at the end."""
    stderr_path = tmp_path / "up.stderr"
    log_dir = tmp_path / "logs"
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hexgen_cli", "up", "--listen", "127.0.0.1:0",
             "--tuner-listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0",
             "--metrics-listen", "127.0.0.1:0", *options,
             "--log-dir", str(log_dir)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )  # fmt: skip
    try:
        yield Up(proc, read_banner(proc, timeout_s=banner_timeout_s), stderr_path, log_dir)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def replay(up: Up, *options: str) -> subprocess.Popen[str]:
    """`hexgen-flow replay --json` against `up`'s coordinator, running."""
    return subprocess.Popen(
        [sys.executable, "-m", "hexgen_cli", "replay", "--coordinator", up.coordinator,
         "--json", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def has_new(up: Up, old: int, module: str, *args: str) -> bool:
    """Whether a live child other than `old` runs `module` with `args`."""
    try:
        pid = up.service_pid(module, *args)
    except AssertionError:
        return False
    return pid != old


def check_state(redis_url: str, *options: str) -> tuple[int, dict[str, object]]:
    """``hexgen-flow check-state --json`` as a user runs it: (exit status, report)."""
    import json

    done = subprocess.run(
        [sys.executable, "-m", "hexgen_cli", "check-state", "--redis-url", redis_url,
         "--json", *options],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.stdout, done.stderr
    report = json.loads(done.stdout)
    assert isinstance(report, dict)
    return done.returncode, report


__all__: Sequence[str] = [
    "Up",
    "alive",
    "check_state",
    "children",
    "cmdline",
    "comm",
    "has_new",
    "listening",
    "replay",
    "running_up",
    "wait_for",
]
