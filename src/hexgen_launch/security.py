"""What a client, and an operator's tools, need of a secured mesh's credentials: the
auth directory (`AuthDir`), the keys file (`KeyStore`, `Role`, `TenantLimits`) and reading
a one-line secret. The command line reaches them here, as it reaches everything of the
mesh's server side, through the launcher package (the SDK, `hexgen_client`, has none of
it)."""

from __future__ import annotations

from hexgen_service.auth import KeyRecord, KeyStore, Role, TenantLimits, read_secret
from hexgen_service.auth_dir import AuthDir
from hexgen_service.certs import write_private
from hexgen_service.exposure import is_loopback
from hexgen_service.tls import ca_from_env

__all__ = [
    "AuthDir",
    "KeyRecord",
    "KeyStore",
    "Role",
    "TenantLimits",
    "ca_from_env",
    "is_loopback",
    "read_secret",
    "write_private",
]
