"""The token a worker shows the coordinator: who may take a slot and report calls.

Without it anyone who reaches the coordinator's port could connect as a worker, take over
a slot (its real worker's stream is closed) and report any text for the calls sent there.
A coordinator started with ``--worker-token-file FILE`` refuses a ``Connect`` whose
``x-hexgen-worker-token`` metadata is missing or differs (UNAUTHENTICATED); a worker
started with the same file sends it. `hexgen-flow up` writes a fresh random token for its
services (mode 0600) and passes it to both. The token file holds one line; surrounding
whitespace is ignored.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from hexgen_service.auth import read_secret

__all__ = ["TOKEN_METADATA", "check_token", "read_token", "write_token"]

TOKEN_METADATA = "x-hexgen-worker-token"


def read_token(path: str | Path) -> str:
    """The token in `path`; ConfigError naming the file when it cannot be read or is empty."""
    return read_secret(path, "--worker-token-file")


def write_token(path: str | Path) -> str:
    """Write a fresh random token to `path`, readable by its owner only; return it."""
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    return token


def check_token(expected: str, given: str | None) -> bool:
    """Whether `given` is `expected` (in constant time)."""
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())
