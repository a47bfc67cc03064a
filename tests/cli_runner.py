"""The real ``hexgen-flow`` command in a subprocess, as a user runs it, for the CLI tests.

One place for the output contract every command keeps: ``--json`` prints exactly one JSON
object on stdout; bad input exits with code 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

__all__ = ["one_error_line", "run_cli", "run_json"]


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hexgen_cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def run_json(*args: str, timeout: float = 60) -> dict[str, Any]:
    """Run with ``--json``: exit 0 and exactly one JSON object on stdout, nothing else."""
    proc = run_cli(*args, "--json", timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.endswith("\n") and proc.stdout.count("\n") == 1, proc.stdout
    doc = json.loads(proc.stdout)
    assert isinstance(doc, dict)
    return doc


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one line of a usage error: exit 2, nothing on stdout, no traceback."""
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hexgen-flow: error: "), lines[0]
    return lines[0]


def interruptible(argv: list[str]) -> list[str]:
    """`argv` run with SIGINT at its default, for a child the test interrupts with SIGINT.

    A shell without job control starts a background command with SIGINT ignored, children
    inherit that, and Python then never installs its KeyboardInterrupt handler: the Ctrl-C
    tests failed when the suite itself was started in the background with `&`. The wrapper
    resets SIGINT and execs `argv` (a default disposition survives exec; a handler would
    not, and `preexec_fn` is unsafe beside threads).
    """
    reset = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    return [sys.executable, "-c", reset, *argv]
