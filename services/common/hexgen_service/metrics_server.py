"""Prometheus text over HTTP for every service (``--metrics-listen HOST:PORT``).

A metrics door is open (plain HTTP, no credential: the developer's ``hexgen-flow up`` on
loopback) unless its service is secured: given a certificate and its key it serves HTTPS
only, and given the service's keys file (``--api-keys-file``) it answers a scrape only
with an ``Authorization: Bearer <API key>`` of the least role the service asks for
(`MetricsProtection.role`: an operator's for the coordinator and the tuner), else 401
(no, a malformed, unknown, expired or revoked key) or 403 (a key of a lower role), each
refusal with one audit line (logger ``hexgen.audit``) as the gRPC doors write. Keys are
re-read within a second of a change, as everywhere (`hexgen_service.auth.KeyStore`).
``/health`` answers 200 without a credential, for probes: it tells nothing but that the
process serves. Protected mode (`hexgen_service.exposure.refuse_open_metrics`) keeps a
door beyond loopback without both from starting, unless the operator says ``--insecure``.

The TLS handshake runs in the connection's own thread with a deadline, never in the
accepting one, so a client that connects and says nothing stalls no other scrape.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.registry import CollectorRegistry

from hexgen_flow.errors import ConfigError
from hexgen_service.auth import AuthError, KeyStore, Role, bearer_key

__all__ = ["HEALTH_PATH", "MetricsProtection", "serve_metrics"]

audit = logging.getLogger("hexgen.audit")

HEALTH_PATH = "/health"
"""Answers 200 ``ok`` to anyone (a probe's target); every other path needs the credential."""
_TIMEOUT_S = 10.0
"""Seconds a connection may take to finish its TLS handshake, and to send its request."""

_App = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


@dataclass(frozen=True, slots=True)
class MetricsProtection:
    """How a metrics door is protected; the defaults: not at all (plain HTTP, anyone)."""

    tls_cert: Path | None = None
    """The certificate (PEM) the door serves HTTPS with; None: plain HTTP."""
    tls_key: Path | None = None
    """Its private key."""
    api_keys_file: Path | None = None
    """The keys file whose keys (of `role` or higher) may scrape; None: anyone may."""
    role: Role = Role.OPERATOR
    """The least role a scrape's key needs."""

    @staticmethod
    def of(
        tls_cert: str | Path | None,
        tls_key: str | Path | None,
        api_keys_file: str | Path | None,
        role: Role = Role.OPERATOR,
    ) -> MetricsProtection:
        """From a service's flags (empty strings and None: not given)."""

        def path(value: str | Path | None) -> Path | None:
            return Path(value) if value else None

        return MetricsProtection(path(tls_cert), path(tls_key), path(api_keys_file), role)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None and self.tls_key is not None

    @property
    def keys(self) -> bool:
        return self.api_keys_file is not None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server side of the door's TLS (TLS 1.2 or later); None: plain HTTP.
        ConfigError naming the files when they do not load."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"--metrics-listen: cannot serve TLS with {self.tls_cert} and {self.tls_key}: {exc}"
            ) from None
        return context


class _Handler(WSGIRequestHandler):
    timeout = _TIMEOUT_S  # a client that opens a connection and sends nothing goes

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing (a scrape every few seconds)."""


class _Server(ThreadingMixIn, WSGIServer):
    """A thread per connection; with `tls`, its handshake runs in that thread."""

    daemon_threads = True
    tls: ssl.SSLContext | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(_TIMEOUT_S)
        try:
            conn = self.tls.wrap_socket(request, server_side=True)
        except OSError:  # a plaintext client, a failed or slow handshake (SSLError is one)
            return
        try:
            super().finish_request(conn, client_address)
        finally:
            conn.close()


def _guarded(metrics: _App, keys: KeyStore | None, role: Role) -> _App:
    """`metrics` behind the key check (none without `keys`), and ``/health`` beside it."""
    lock = threading.Lock()  # one KeyStore, read and refreshed from every scrape's thread

    def reply(
        start_response: Callable[..., Any], status: str, text: str, *extra: Any
    ) -> list[bytes]:
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"), *extra])
        return [f"{text}\n".encode()]

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == HEALTH_PATH:
            return reply(start_response, "200 OK", "ok")
        if keys is not None:
            try:
                with lock:
                    principal = keys.authenticate(bearer_key(environ.get("HTTP_AUTHORIZATION")))
                if not principal.may(role):
                    reason = (
                        f"permission denied: the metrics need the {role.label} role; key "
                        f"{principal.key_id} of tenant {principal.tenant!r} is "
                        f"{principal.role.label}"
                    )
                    audit.warning("denied metrics %s: %s", path, reason)
                    return reply(start_response, "403 Forbidden", reason)
            except AuthError as exc:
                audit.warning("denied metrics %s: %s", path, exc)
                challenge = ("WWW-Authenticate", 'Bearer realm="hexgen-flow metrics"')
                return reply(start_response, "401 Unauthorized", str(exc), challenge)
        return metrics(environ, start_response)

    return app


def serve_metrics(
    registry: CollectorRegistry, listen: str, protection: MetricsProtection | None = None
) -> tuple[str, WSGIServer]:
    """Serve `registry` at ``http(s)://LISTEN/metrics`` (``HOST:PORT``, port 0: any free
    one) in a thread, protected as `protection` says (None: open); the address it listens
    on and the server (``shutdown()`` stops it). ConfigError when its TLS files or keys
    file do not load."""
    protection = protection or MetricsProtection()
    host, _, port = listen.rpartition(":")
    host = host or "127.0.0.1"
    keys = KeyStore(protection.api_keys_file) if protection.api_keys_file is not None else None
    context = protection.ssl_context()
    family, _, _, _, sockaddr = socket.getaddrinfo(
        host.strip("[]"), int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class Server(_Server):
        address_family = family
        tls = context

    app = _guarded(make_wsgi_app(registry), keys, protection.role)
    server = make_server(str(sockaddr[0]), int(port), app, Server, handler_class=_Handler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return f"{host}:{server.server_port}", server
