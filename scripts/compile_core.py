"""Compile the simulator's hot modules with mypyc (optional: a faster simulator, same results).

    .venv/bin/python scripts/compile_core.py           # in place: extensions beside the sources
    .venv/bin/python scripts/compile_core.py --clean   # remove them: back to pure Python
    .venv/bin/python scripts/compile_core.py --check   # fail if a built module's source changed
    .venv/bin/python scripts/compile_core.py --tree build/compiled  # a compiled copy of src/
    .venv/bin/python scripts/compile_core.py --wheel build/wheel     # a compiled wheel of it all

`MODULES` are the modules that hold the simulator's time under cProfile: the engine models,
the dispatcher, queues and budgets, the event loop, the protocol, the scheduler and the
ledger. mypyc turns each into a C extension (``<module>.cpython-311-<platform>.so``) placed
beside its ``.py`` under ``src/``, plus one shared library that they all load, a top-level
module (``<hash>__mypyc``) that this script moves into the package,
``src/hexgen_flow/*__mypyc.*.so``, where ``hexgen_flow/__init__.py`` registers it: a
top-level module under ``src/`` would not be importable through the editable install, which
maps the package, not ``src/``, onto the import path. It records the sources' hashes in
``src/.mypyc-sources.json``. Python's import system prefers an extension module to the
``.py`` of the same name, so once built the compiled modules run for everything that imports
``hexgen_flow`` from this tree (the editable install included); without them, or after
``--clean``, the same sources run as Python. The compiled code computes the same floats in
the same order (mypyc keeps Python's ``float`` and ``int`` semantics), so results are
byte-identical
(docs/experiments/2026-12-06-compiled-simulator.md).

An extension is tied to this Python version and to the source it was built from: after
editing a compiled module, rebuild or ``--clean``, or the stale extension keeps running
(``--check``, which tests/test_compiled_modules.py runs, catches it). ``--tree DIR`` copies
``src/`` and ``pyproject.toml`` to DIR and compiles there, leaving this tree as it is (to
run a benchmark on a compiled copy: ``PYTHONPATH=DIR/src``). Needs mypy (the ``dev`` extra)
and a C compiler.

``--wheel DIR`` is how the compiled core ships (the Docker image installs it; `make
test-compiled` tests it): it copies the project's package roots (pyproject.toml's
``[tool.setuptools.packages.find] where``), compiles that copy in place and builds one wheel
of the whole project into DIR, the extensions and the shared library inside it, tagged for
this Python and platform (``cp311-cp311-linux_x86_64``), not ``py3-none-any``. The tree the
wheel is built from is fresh, so nothing stale can ship; this tree stays as it is.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent

MODULES = [
    "hexgen_flow/sim/vllm_v1.py",
    "hexgen_flow/sim/vllm_v1_requests.py",
    "hexgen_flow/sim/prefix_cache.py",
    "hexgen_flow/sim/engine.py",
    "hexgen_flow/sim/simulator.py",
    "hexgen_flow/policies/base.py",
    "hexgen_flow/policies/dispatch.py",
    "hexgen_flow/policies/queues.py",
    "hexgen_flow/policies/budget.py",
    "hexgen_flow/runtime.py",
    "hexgen_flow/protocol.py",
    "hexgen_flow/scheduler.py",
    "hexgen_flow/estimate.py",
    "hexgen_flow/prefix.py",
    "hexgen_flow/workload.py",
    "hexgen_flow/cluster.py",
]
"""The compiled modules, relative to ``src/``."""

PACKAGE = "hexgen_flow"
"""Where the shared library goes (its ``__init__`` registers it)."""

STAMP = ".mypyc-sources.json"
"""Under ``src/``: the SHA-256 of each compiled module's source when it was built."""


def built(src: Path) -> list[Path]:
    """The extension modules and the shared library a build placed under `src`."""
    found: list[Path] = []
    for module in MODULES:
        found += [Path(p) for p in glob.glob(f"{src / module[: -len('.py')]}.*.so")]
    found += [Path(p) for p in glob.glob(str(src / "*__mypyc.*.so"))]  # an older layout
    found += [Path(p) for p in glob.glob(str(src / PACKAGE / "*__mypyc.*.so"))]
    return found


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def clean(src: Path) -> None:
    for path in [*built(src), src / STAMP]:
        if path.exists():
            path.unlink()
            print(f"removed {path}")


def stale(src: Path) -> list[str]:
    """What is wrong with the compiled modules under `src` (none built: nothing)."""
    extensions = built(src)
    if not extensions:
        return []
    stamp = src / STAMP
    if not stamp.exists():
        return [f"{len(extensions)} extension modules under {src} without {STAMP}"]
    hashes = json.loads(stamp.read_text(encoding="utf-8"))
    problems = [
        f"{module} changed since it was compiled"
        for module in MODULES
        if hashes.get(module) != digest(src / module)
    ]
    missing = [m for m in MODULES if not glob.glob(f"{src / m[: -len('.py')]}.*.so")]
    problems += [f"{module} is not compiled" for module in missing]
    return problems


def build(root: Path, opt_level: str) -> None:
    from mypyc.build import mypycify  # noqa: PLC0415 - only a build needs mypy
    from setuptools import setup  # noqa: PLC0415

    # From the tree's root, so that mypy reads the project's settings (pyproject.toml:
    # strict, mypy_path) and names the modules from src/ (explicit_package_bases).
    os.chdir(root)
    extensions = mypycify(
        [f"src/{module}" for module in MODULES], opt_level=opt_level, target_dir="build/mypyc"
    )
    setup(
        name="hexgen-flow-compiled",
        package_dir={"": "src"},  # --inplace: each extension beside its .py under src/
        ext_modules=cast(Any, extensions),  # mypyc's Extension type is distutils'/setuptools
        script_args=["build_ext", "--inplace", "--build-temp", "build/mypyc-temp"],
    )
    for shared in glob.glob(str(root / "src" / "*__mypyc.*.so")):
        shutil.move(shared, root / "src" / PACKAGE / Path(shared).name)
    hashes = {module: digest(root / "src" / module) for module in MODULES}
    (root / "src" / STAMP).write_text(json.dumps(hashes, indent=1) + "\n", encoding="utf-8")


PACKAGE_DATA = '"*" = ["py.typed"]'
"""pyproject.toml's package data for every package: the wheel's copy adds the extensions."""

BINARY_SETUP = """\
# Written by scripts/compile_core.py --wheel: the wheel carries compiled extensions, so it is
# tagged for this Python and platform rather than as pure Python.
from setuptools import setup
from setuptools.dist import Distribution


class BinaryDistribution(Distribution):
    def has_ext_modules(self) -> bool:
        return True


setup(distclass=BinaryDistribution)
"""


def copy_project(root: Path) -> None:
    """Copy what a wheel is built from (pyproject.toml, README.md and the package roots that
    pyproject.toml lists) to `root`, without built files, and mark its packages' extension
    modules as package data and its wheel as binary."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    roots = tomllib.loads(pyproject)["tool"]["setuptools"]["packages"]["find"]["where"]
    shutil.rmtree(root, ignore_errors=True)
    ignore = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info", ".mypyc-sources.json")
    for where in roots:
        shutil.copytree(ROOT / where, root / where, ignore=ignore)
    if PACKAGE_DATA not in pyproject:
        raise SystemExit(f"compile_core: pyproject.toml no longer has {PACKAGE_DATA}")
    data = PACKAGE_DATA.replace('"py.typed"]', '"py.typed", "*.so"]')
    (root / "pyproject.toml").write_text(pyproject.replace(PACKAGE_DATA, data), encoding="utf-8")
    shutil.copy2(ROOT / "README.md", root / "README.md")
    (root / "setup.py").write_text(BINARY_SETUP, encoding="utf-8")


def build_wheel(out: Path, opt_level: str) -> Path:
    """Compile a fresh copy of the project and build its wheel into `out`; return its path."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("hexgen_flow-*.whl"):
        old.unlink()
    tree = out / "tree"
    copy_project(tree)
    here = Path.cwd()
    build(tree, opt_level)
    os.chdir(here)
    # mypyc's own build folder: setuptools would pack its copy of the shared library too
    shutil.rmtree(tree / "build")
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "--wheel-dir", str(out), str(tree)], check=True)
    shutil.rmtree(tree)
    (wheel,) = out.glob("hexgen_flow-*.whl")
    return wheel


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--clean", action="store_true", help="remove the compiled modules")
    what.add_argument("--check", action="store_true", help="fail if a compiled module is stale")
    what.add_argument("--tree", type=Path, help="compile a copy of src/ in TREE/src instead")
    what.add_argument(
        "--wheel", type=Path, metavar="DIR", help="build a compiled wheel of the project in DIR"
    )
    parser.add_argument("--opt-level", default="3", help="the C compiler's -O level (mypyc's)")
    args = parser.parse_args()
    root = ROOT
    if args.check:
        problems = stale(root / "src")
        for problem in problems:
            print(f"compile_core: {problem}: rerun scripts/compile_core.py (or --clean)")
        return 1 if problems else 0
    if args.wheel is not None:
        start = time.monotonic()
        wheel = build_wheel(args.wheel, args.opt_level)
        print(
            f"built {wheel} ({len(MODULES)} modules compiled) in {time.monotonic() - start:.0f} s"
        )
        return 0
    if args.tree is not None:
        root = args.tree.resolve()
        shutil.rmtree(root / "src", ignore_errors=True)
        shutil.copytree(
            ROOT / "src", root / "src", ignore=shutil.ignore_patterns("*.so", "__pycache__")
        )
        shutil.copy2(ROOT / "pyproject.toml", root / "pyproject.toml")
    clean(root / "src")
    if args.clean:
        return 0
    start = time.monotonic()
    build(root, args.opt_level)
    print(
        f"compiled {len(MODULES)} modules into {root / 'src'} in {time.monotonic() - start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
