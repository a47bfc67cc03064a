"""Prometheus text over HTTP for every service (``--metrics-listen HOST:PORT``)."""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from prometheus_client.registry import CollectorRegistry

__all__ = ["serve_metrics"]


def serve_metrics(registry: CollectorRegistry, listen: str) -> tuple[str, WSGIServer]:
    """Serve `registry` at ``http://LISTEN/metrics`` (``HOST:PORT``, port 0: any free one),
    in a thread; the address it listens on and the server (``shutdown()`` stops it)."""
    host, _, port = listen.rpartition(":")
    host = host or "127.0.0.1"
    server, _thread = start_http_server(int(port), addr=host, registry=registry)
    return f"{host}:{server.server_port}", server
