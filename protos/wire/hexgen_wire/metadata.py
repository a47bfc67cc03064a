"""Metadata keys and environment variables that clients and services share (one definition
each; the services' modules import them from here)."""

from __future__ import annotations

__all__ = [
    "API_KEY_ENV",
    "AUTH_METADATA",
    "RETRY_AFTER_KEY",
    "SHARD_OWNER_KEY",
    "TLS_CA_ENV",
]

AUTH_METADATA = "authorization"
"""The metadata key a client sends its key in, as ``Bearer <key>`` (gRPC's convention)."""
API_KEY_ENV = "HEXGEN_FLOW_API_KEY"
"""Where clients and the CLI look for a key when no flag gives one."""
TLS_CA_ENV = "HEXGEN_FLOW_TLS_CA"
"""Where clients and the CLI look for the CA file when no flag gives one."""

RETRY_AFTER_KEY = "retry-after-s"
"""Trailing metadata of a RESOURCE_EXHAUSTED answer: wall seconds until a retry may succeed
(what the coordinator's `OverloadedError.retry_after_s` becomes on the wire)."""

SHARD_OWNER_KEY = "hexgen-shard-owner"
"""Trailing metadata of a sharded coordinator's redirect (FAILED_PRECONDITION: a workflow of
another shard): the owning coordinator's client address, ``HOST:PORT``, which clients
resend to (`hexgen_client.routing`)."""
