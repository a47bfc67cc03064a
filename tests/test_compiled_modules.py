"""The mypyc build (scripts/compile_core.py): a compiled module never runs stale, and the
compiled wheel, the one the Docker image installs, runs every hot module compiled.

An extension module beside a source takes precedence over it on import, so one built from an
older version of the source would silently run old code. Without a build there is nothing
to check. `make test-compiled` builds the wheel (``--wheel build/wheel``), installs it into
``build/compiled-site`` and runs the core's tests with that folder first on the path, naming
it in ``HEXGEN_EXPECT_COMPILED``; the second test here runs only then."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SITE = os.environ.get("HEXGEN_EXPECT_COMPILED")


def test_no_compiled_module_is_stale() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_core.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def compiled_modules() -> list[str]:
    """compile_core.MODULES as dotted names."""
    spec = importlib.util.spec_from_file_location("compile_core", ROOT / "scripts/compile_core.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    modules: list[str] = script.MODULES
    return [m.removesuffix(".py").replace("/", ".") for m in modules]


@pytest.mark.skipif(SITE is None, reason="make test-compiled only: the installed compiled wheel")
def test_the_installed_wheel_runs_every_hot_module_compiled() -> None:
    assert SITE is not None
    site = Path(SITE).resolve()
    names = compiled_modules()
    assert names
    for name in names:
        path = Path(importlib.import_module(name).__file__ or "")
        assert path.suffix == ".so", f"{name} runs as Python from {path}"
        assert path.is_relative_to(site), f"{name} comes from {path}, not the wheel in {site}"
    # Tagged as what it is: a build for this interpreter and platform, not pure Python.
    (dist,) = importlib.metadata.distributions(name="hexgen-flow", path=[str(site)])
    wheel = dist.read_text("WHEEL") or ""
    assert "Root-Is-Purelib: false" in wheel, wheel
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert f"Tag: {tag}-{tag}-" in wheel, wheel
    # The packages beside the core come from the same wheel: the services run it compiled.
    coordinator = importlib.import_module("hexgen_coordinator")
    assert Path(coordinator.__file__ or "").is_relative_to(site)
