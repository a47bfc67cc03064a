"""``python -m hexgen_gateway.healthcheck [--tls-ca FILE] HOST:PORT``: exit 0 when the
gateway's ``/health`` answers 200 (the coordinator behind it answers), else 1 with one line
on stderr. With ``--tls-ca`` (a gateway serving HTTPS) it asks over HTTPS, verifying the
gateway's certificate against that CA. Standard library only (docker-compose's health check
runs it)."""

from __future__ import annotations

import argparse
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

__all__ = ["check", "main"]


def check(address: str, timeout_s: float = 3.0, *, tls_ca: str | None = None) -> str | None:
    """None when ``http://address/health`` (``https://`` with `tls_ca`) answers 200, else
    what went wrong."""
    context = None
    scheme = "http"
    if tls_ca is not None:
        try:
            context = ssl.create_default_context(cafile=tls_ca)
        except (OSError, ssl.SSLError) as exc:
            return f"--tls-ca: cannot load {tls_ca}: {exc}"
        scheme = "https"
    try:
        with urllib.request.urlopen(
            f"{scheme}://{address}/health", timeout=timeout_s, context=context
        ) as answer:
            return None if answer.status == 200 else f"HTTP {answer.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return str(getattr(exc, "reason", exc))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hexgen_gateway.healthcheck",
        description="Exit 0 when the gateway's /health answers 200, 1 otherwise.",
    )
    parser.add_argument("address", metavar="HOST:PORT", help="the gateway")
    parser.add_argument(
        "--tls-ca", default=None, metavar="FILE", help="the gateway serves HTTPS: verify it"
    )
    args = parser.parse_args(argv)
    problem = check(args.address, tls_ca=args.tls_ca)
    if problem is not None:
        sys.stderr.write(f"unhealthy: {args.address}: {problem}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
