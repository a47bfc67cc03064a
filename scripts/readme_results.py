"""Regenerate the README's results block from the benchmark (its table and goodput sentence).

    python scripts/readme_results.py --write   # rewrite the block (make readme-results)
    python scripts/readme_results.py --check   # exit 1, with a diff, if README.md is stale

Runs `hexgen_flow.bench.README_PLAN`, the slice of the full benchmark that the block needs
(the same figures as `make bench`, in a fraction of its time), and renders the block that
sits between the two `results:` HTML comments in README.md. tests/test_readme_results.py
runs the same comparison in the test suite, so CI fails when the code and the README drift.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from hexgen_flow.bench import README_PLAN, run_plan
from hexgen_flow.bench.readme import readme_block, render_readme_block, replace_readme_block

README = Path(__file__).resolve().parent.parent / "README.md"
DRIFTED = "README results drifted from the code: run `make readme-results`"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the block in README.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if the block is stale")
    parser.add_argument(
        "--workers", type=int, default=2, help="worker processes (default 2; 1: this one)"
    )
    args = parser.parse_args()

    text = README.read_text()
    current = readme_block(text)  # fails before the benchmark runs if the markers are broken
    fresh = render_readme_block(run_plan(README_PLAN, workers=args.workers))
    if args.write:
        if fresh != current:
            README.write_text(replace_readme_block(text, fresh))
        print(f"README.md results block {'rewritten' if fresh != current else 'up to date'}")
        return
    if fresh != current:
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
