"""The gateway's settings: one frozen dataclass, every field with a default."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hexgen_client.addresses import DEFAULT_COORDINATOR, DEFAULT_GATEWAY
from hexgen_flow.errors import ConfigError
from hexgen_service.convert import MAX_TOKENS_PER_CALL
from hexgen_service.exposure import refuse_unprotected

__all__ = ["DEFAULT_GATEWAY", "DEFAULT_MAX_BODY_BYTES", "GatewayConfig"]

DEFAULT_MAX_BODY_BYTES = 8 << 20
"""8 MiB: room for the coordinator's largest prompt (``--max-prompt-bytes``, 1 MiB by
default) even when JSON escapes each of its characters (``\\u0001``: 6 bytes)."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """What ``python -m hexgen_gateway`` runs with."""

    listen: str = DEFAULT_GATEWAY
    """HOST:PORT of the HTTP server (the OpenAI-compatible API)."""
    coordinator: str = DEFAULT_COORDINATOR
    """The coordinator every request becomes a workflow of; a comma list: a sharded mesh's
    coordinators, each workflow sent to its shard's owner (`hexgen_client.routing`)."""
    default_stage: str = "chat"
    """The step of a request without an ``X-Hexgen-Stage`` header."""
    default_max_tokens: int = 256
    """Output tokens declared for a request without ``max_tokens``."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Largest request body read; a larger one is answered 413 before it is read (by its
    ``Content-Length``) or as soon as it grows past it."""
    request_timeout_s: float = 600.0
    """Wall seconds a request may take (admission to the last token); past it the query is
    cancelled and the answer is 504."""
    rpc_timeout_s: float = 10.0
    """Deadline of each unary RPC to the coordinator (SubmitQuery, ClusterStatus, ...)."""
    models_ttl_s: float = 5.0
    """How long the cluster's model names (ClusterStatus) are reused before asking again
    (per caller's key: one caller's answer is never another's)."""
    tls_cert: str | None = None
    """The HTTPS certificate (PEM): with `tls_key`, the gateway serves HTTPS only."""
    tls_key: str | None = None
    """The private key of `tls_cert`."""
    tls_ca: str | None = None
    """The CA to verify a TLS coordinator with (None: ``$HEXGEN_FLOW_TLS_CA``, else a
    plaintext channel)."""
    api_key_file: str = ""
    """The gateway's own key, used only for its ``/health`` ClusterStatus; callers' requests
    always carry their own ``Authorization: Bearer`` key and never this one. Empty: none."""
    insecure: bool = False
    """Listen beyond loopback over plain HTTP (protected mode refuses it otherwise)."""
    session_idle_s: float | None = 60.0
    """Wall seconds without a call after which the coordinator closes a workflow this
    gateway opened (a request's ``X-Hexgen-Idle-S`` overrides it on the workflow's first
    request): agent frameworks rarely close their workflows. None: the coordinator's
    ``--session-idle-s``."""
    metrics: bool = True
    """Serve ``GET /metrics`` (the gateway's Prometheus metrics) on the API's port."""

    def __post_init__(self) -> None:
        if not 1 <= self.default_max_tokens <= MAX_TOKENS_PER_CALL:
            raise ConfigError(
                f"default max tokens must be from 1 to {MAX_TOKENS_PER_CALL}, "
                f"got {self.default_max_tokens}"
            )
        if self.max_body_bytes < 1:
            raise ConfigError(f"max body bytes must be >= 1, got {self.max_body_bytes}")
        for name in ("request_timeout_s", "rpc_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name.replace('_', '-')} must be finite and > 0, got {value}")
        if not self.models_ttl_s >= 0:
            raise ConfigError(f"models ttl must be >= 0, got {self.models_ttl_s}")
        if self.session_idle_s is not None and not (
            math.isfinite(self.session_idle_s) and self.session_idle_s > 0
        ):
            raise ConfigError(f"session-idle-s must be finite and > 0, got {self.session_idle_s}")
        if not self.default_stage.strip():
            raise ConfigError("the default stage must be a non-empty name")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key: give both or neither")
        refuse_unprotected(
            "--listen",
            self.listen,
            protected=self.https,
            insecure=self.insecure,
            needs="--tls-cert/--tls-key",
        )

    @property
    def https(self) -> bool:
        """Whether the gateway serves HTTPS."""
        return self.tls_cert is not None
