"""Protected mode: a service refuses to listen beyond this machine without protection.

Like Redis's protected mode. A door bound to a loopback address is reachable only from
this machine, so it may run open (the developer's `hexgen-flow up`). Bound anywhere else
(``0.0.0.0``, a LAN address, a host name) it must be protected (the client door: API keys
and TLS; the workers' door: mutual TLS or a worker token), or the operator must say
``--insecure`` and own the consequence.
"""

from __future__ import annotations

import ipaddress

from hexgen_flow.errors import ConfigError

__all__ = ["is_loopback", "refuse_unprotected"]


def is_loopback(address: str) -> bool:
    """Whether ``HOST:PORT`` listens on loopback only (``localhost``, 127.0.0.0/8, ::1)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def refuse_unprotected(
    flag: str, address: str, *, protected: bool, insecure: bool, needs: str
) -> None:
    """ConfigError when `address` (given by `flag`) is not loopback, not `protected` and
    `insecure` was not given; `needs` names what would protect it."""
    if protected or insecure or is_loopback(address):
        return
    raise ConfigError(
        f"{flag}: refusing to listen on {address} without {needs}: anyone who reaches it "
        f"could use it; give {needs}, listen on 127.0.0.1, or pass --insecure"
    )
