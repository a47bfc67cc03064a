"""The optional mypyc build (scripts/compile_core.py): a compiled module never runs stale.

An extension module beside a source takes precedence over it on import, so one built from an
older version of the source would silently run old code. Without a build there is nothing
to check; `make test-compiled` runs the core's tests against a compiled copy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_compiled_module_is_stale() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_core.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
