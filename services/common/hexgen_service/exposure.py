"""Protected mode: a service refuses to listen beyond this machine without protection.

Like Redis's protected mode. A door bound to a loopback address is reachable only from
this machine, so it may run open (the developer's `hexgen-flow up`). Bound anywhere else
(``0.0.0.0``, a LAN address, a host name) it must be protected (the client door: API keys
and TLS; the workers' door: mutual TLS or a worker token), or the operator must say
``--insecure`` and own the consequence.

A metrics door (``--metrics-listen``, `hexgen_service.metrics_server`) follows the same
rule: beyond loopback it must serve TLS and check API keys (`refuse_open_metrics`).
"""

from __future__ import annotations

import ipaddress

from hexgen_flow.errors import ConfigError

__all__ = ["METRICS_RISK", "is_loopback", "refuse_open_metrics", "refuse_unprotected"]

METRICS_RISK = "anyone who reaches it could read its metrics"
"""What an open metrics door gives away (`refuse_open_metrics`'s message)."""


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
    flag: str,
    address: str,
    *,
    protected: bool,
    insecure: bool,
    needs: str,
    risk: str = "anyone who reaches it could use it",
) -> None:
    """ConfigError when `address` (given by `flag`) is not loopback, not `protected` and
    `insecure` was not given; `needs` names what would protect it, `risk` what an open
    door gives away."""
    if protected or insecure or is_loopback(address):
        return
    raise ConfigError(
        f"{flag}: refusing to listen on {address} without {needs}: {risk}; give {needs}, "
        "listen on 127.0.0.1, or pass --insecure"
    )


def refuse_open_metrics(
    listen: str, *, tls: bool, keys: bool, insecure: bool, tls_flags: str = "--tls-cert/--tls-key"
) -> None:
    """Protected mode for a metrics door (``--metrics-listen``; empty: none is served):
    beyond loopback it must serve TLS (`tls`, given by `tls_flags`) and take only API keys
    (`keys`: ``--api-keys-file``), as the clients' door must. The bearer key of a scrape
    crosses the network, so keys without TLS do not protect it."""
    if listen:
        refuse_unprotected(
            "--metrics-listen",
            listen,
            protected=tls and keys,
            insecure=insecure,
            needs=f"--api-keys-file and {tls_flags}",
            risk=METRICS_RISK,
        )
