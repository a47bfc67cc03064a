"""``python -m hexgen_gateway.healthcheck HOST:PORT``: exit 0 when the gateway's
``/health`` answers 200 (the coordinator behind it answers), else 1 with one line on
stderr. Standard library only (docker-compose's health check runs it)."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

__all__ = ["check", "main"]


def check(address: str, timeout_s: float = 3.0) -> str | None:
    """None when ``http://address/health`` answers 200, else what went wrong."""
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout_s) as answer:
            return None if answer.status == 200 else f"HTTP {answer.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return str(getattr(exc, "reason", exc))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        sys.stderr.write("usage: python -m hexgen_gateway.healthcheck HOST:PORT\n")
        return 2
    problem = check(args[0])
    if problem is not None:
        sys.stderr.write(f"unhealthy: {args[0]}: {problem}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
