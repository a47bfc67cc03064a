"""Regenerate the README's results block from the benchmark (its table, band and goodput).

    python scripts/readme_results.py --write   # run the benchmark slice, rewrite both files
    python scripts/readme_results.py --check   # rerun it; exit 1, with a diff, if stale
    python scripts/readme_results.py --stable --write   # the headline block (stable regimes)

Runs `hexgen_flow.bench.README_PLAN`, the slice of the full benchmark that the block needs
(the same figures as `make bench`; about 20 minutes on two cores, most of it the goodput
searches), saves its results document as `benchmarks/readme-results.json` and renders the
block that sits between the two `results:` HTML comments in README.md from it.

The test suite cannot afford the whole slice on every run, so tests/test_readme_results.py
checks the two halves separately: the README block is what the committed document renders
to, and a sample of the document's simulations, rerun, gives the committed figures exactly
(every simulation is a pure function of its task). A change of simulated behaviour fails
that test until this script is rerun.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hexgen_flow.bench import README_PLAN, run_plan
from hexgen_flow.bench.readme import (
    README_BEGIN,
    README_END,
    readme_block,
    render_readme_block,
    replace_readme_block,
)
from hexgen_flow.bench.stable import (
    STABLE_BEGIN,
    STABLE_END,
    STABLE_PLAN,
    render_stable_readme,
    run_stable,
)
from hexgen_flow.metrics import json_safe

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "readme-results.json"
"""The results document the README's block is rendered from."""
STABLE_RESULTS = ROOT / "benchmarks" / "stable-results.json"
"""What the README's headline block is rendered from (``--stable``)."""
DRIFTED = "README results drifted from the code: run `make readme-results`"


def dump(doc: dict[str, Any]) -> str:
    return json.dumps(json_safe(doc), indent=1, allow_nan=False) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite README.md and the results")
    mode.add_argument("--check", action="store_true", help="exit 1 if either is stale")
    parser.add_argument(
        "--workers", type=int, default=2, help="worker processes (default 2; 1: this one)"
    )
    parser.add_argument(
        "--stable",
        action="store_true",
        help="the headline block instead: the stable-regime part (hexgen_flow.bench.stable, "
        "~40 minutes on two cores) into benchmarks/stable-results.json",
    )
    args = parser.parse_args()

    if args.stable:
        markers = (STABLE_BEGIN, STABLE_END)
        results = STABLE_RESULTS

        def run() -> dict[str, Any]:
            return run_stable(STABLE_PLAN, workers=args.workers)

        render: Callable[[dict[str, Any]], str] = render_stable_readme
    else:
        markers = (README_BEGIN, README_END)
        results = RESULTS

        def run() -> dict[str, Any]:
            return run_plan(README_PLAN, workers=args.workers)

        render = render_readme_block
    text = README.read_text()
    current = readme_block(text, *markers)  # fails first if the markers are broken
    # Through JSON and back, so the block is rendered from exactly what is committed.
    doc = json.loads(dump(run()))
    fresh = render(doc)
    if args.write:
        results.write_text(dump(doc))
        if fresh != current:
            README.write_text(replace_readme_block(text, fresh, *markers))
        print(f"README.md results block {'rewritten' if fresh != current else 'up to date'}")
        return
    stale = not results.exists() or json.loads(results.read_text()) != doc
    if fresh != current or stale:
        sys.stdout.writelines(
            difflib.unified_diff(
                current.splitlines(keepends=True),
                fresh.splitlines(keepends=True),
                "README.md (results block)",
                "regenerated",
            )
        )
        sys.exit(DRIFTED)
    print("README results are up to date")


if __name__ == "__main__":
    main()
