"""The OpenAI-compatible gateway's settings: one typed, frozen tree, every field with its
default, its command-line option and its check (`hexgen_service.settings`).

It lives here, beside the services' shared plumbing, rather than in `hexgen_gateway`, so
that the launchers (`hexgen_launch`, which starts the gateway as a process and may not
import it: tests/test_layers.py) render its command line from the same fields that
``python -m hexgen_gateway`` parses; `hexgen_gateway.config` re-exports it.

``--coordinator`` is spelled by hand here (it may be given again and again, each a comma
list: a sharded mesh's coordinators); the TLS options are `hexgen_service.tls`'s; the
RPC deadline and the models' cache time are set from code only.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from hexgen_flow.errors import ConfigError
from hexgen_service.convert import MAX_TOKENS_PER_CALL
from hexgen_service.exposure import refuse_unprotected
from hexgen_service.settings import (
    LOG_LEVELS,
    add_options,
    at_least,
    check_settings,
    from_args,
    setting,
    to_argv,
)

__all__ = [
    "DEFAULT_GATEWAY",
    "DEFAULT_MAX_BODY_BYTES",
    "GatewayConfig",
    "add_gateway_options",
    "address",
    "gateway_argv",
    "gateway_config_from_args",
]

DEFAULT_GATEWAY = "127.0.0.1:8000"
"""Where the gateway serves unless told otherwise (`hexgen_client.addresses.DEFAULT_GATEWAY`)."""
DEFAULT_COORDINATOR = "127.0.0.1:50051"
"""`hexgen_client.addresses.DEFAULT_COORDINATOR`."""
DEFAULT_MAX_BODY_BYTES = 8 << 20
"""8 MiB: room for the coordinator's largest prompt (``--max-prompt-bytes``, 1 MiB by
default) even when JSON escapes each of its characters (``\\u0001``: 6 bytes)."""


def address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port); `ValueError` ("expected HOST:PORT, got ...")."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def _host_port(text: str) -> str | None:
    try:
        address(text)
    except ValueError as exc:
        return f"must be HOST:PORT, {str(exc).removeprefix('expected HOST:PORT, ')}"
    return None


def _host_ports(text: str) -> str | None:
    pieces = [p.strip() for p in text.split(",") if p.strip()]
    if not pieces:
        return f"must name a coordinator (HOST:PORT), got {text!r}"
    return next((p for p in map(_host_port, pieces) if p is not None), None)


def _max_tokens(value: int) -> str | None:
    fine = 1 <= value <= MAX_TOKENS_PER_CALL
    return None if fine else f"must be from 1 to {MAX_TOKENS_PER_CALL}, got {value}"


def _positive_finite(value: float) -> str | None:
    return None if math.isfinite(value) and value > 0 else f"must be finite and > 0, got {value}"


def _idle(value: float) -> str | None:
    fine = math.isfinite(value) and value >= 0
    return None if fine else f"must be finite and >= 0 (0: the coordinator's), got {value}"


def _not_negative(value: float) -> str | None:
    return None if value >= 0 else f"must be >= 0, got {value}"  # NaN fails too


def _stage(value: str) -> str | None:
    return None if value.strip() else "must be a non-empty name"


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """What ``python -m hexgen_gateway`` runs with."""

    listen: str = setting(DEFAULT_GATEWAY, "HOST:PORT (default %(default)s)", check=_host_port)
    """HOST:PORT of the HTTP server (the OpenAI-compatible API)."""
    coordinator: str = setting(
        DEFAULT_COORDINATOR, flag="--coordinator", by_hand=True, check=_host_ports
    )
    """The coordinator every request becomes a workflow of; a comma list: a sharded mesh's
    coordinators, each workflow sent to its shard's owner (`hexgen_client.routing`)."""
    default_stage: str = setting(
        "chat", "the stage of a request without X-Hexgen-Stage (default %(default)s)",
        check=_stage,
    )  # fmt: skip
    """The step of a request without an ``X-Hexgen-Stage`` header."""
    default_max_tokens: int = setting(
        256, "output tokens of a request without max_tokens (default %(default)s)",
        check=_max_tokens,
    )  # fmt: skip
    """Output tokens declared for a request without ``max_tokens``."""
    max_body_bytes: int = setting(
        DEFAULT_MAX_BODY_BYTES,
        "largest request body; a larger one is answered 413 before it is read "
        "(default %(default)s, 8 MiB: the coordinator's --max-prompt-bytes must fit)",
        check=at_least(1),
    )
    """Largest request body read; a larger one is answered 413 before it is read (by its
    ``Content-Length``) or as soon as it grows past it."""
    request_timeout_s: float = setting(
        600.0,
        "wall seconds a request may take before it is cancelled and answered 504 "
        "(default %(default)s)",
        check=_positive_finite,
    )
    """Wall seconds a request may take (admission to the last token); past it the query is
    cancelled and the answer is 504."""
    rpc_timeout_s: float = setting(10.0, code_only=True, check=_positive_finite)
    """Deadline of each unary RPC to the coordinator (SubmitQuery, ClusterStatus, ...)."""
    models_ttl_s: float = setting(5.0, code_only=True, check=_not_negative)
    """How long the cluster's model names (ClusterStatus) are reused before asking again
    (per caller's key: one caller's answer is never another's)."""
    session_idle_s: float = setting(
        60.0,
        "wall seconds without a call after which a workflow this gateway opened is "
        "closed (a request's X-Hexgen-Idle-S overrides it; 0: the coordinator's "
        "--session-idle-s) (default %(default)s)",
        check=_idle,
    )
    """Wall seconds without a call after which the coordinator closes a workflow this
    gateway opened (a request's ``X-Hexgen-Idle-S`` overrides it on the workflow's first
    request): agent frameworks rarely close their workflows. 0: the coordinator's
    ``--session-idle-s``."""
    metrics: bool = setting(
        True, "serve GET /metrics, the gateway's Prometheus metrics (default: on)"
    )
    """Serve ``GET /metrics`` (the gateway's Prometheus metrics) on the API's port."""
    # ---------------------------------------------------------------- security
    tls_cert: str | None = setting(None, declared_elsewhere=True)  # hexgen_service.tls
    """The HTTPS certificate (PEM): with `tls_key`, the gateway serves HTTPS only."""
    tls_key: str | None = setting(None, declared_elsewhere=True)
    """The private key of `tls_cert`."""
    tls_ca: str | None = setting(None, declared_elsewhere=True)
    """The CA to verify a TLS coordinator with (None: ``$HEXGEN_FLOW_TLS_CA``, else a
    plaintext channel)."""
    api_key_file: str = setting(
        "",
        "the gateway's own API key, for its /health only; requests always carry their "
        "caller's Authorization: Bearer key (default: none)",
        metavar="FILE",
    )
    """The gateway's own key, used only for its ``/health`` ClusterStatus; callers' requests
    always carry their own ``Authorization: Bearer`` key and never this one. Empty: none."""
    insecure: bool = setting(
        False, "listen beyond loopback over plain HTTP (without --tls-cert/--tls-key)"
    )
    """Listen beyond loopback over plain HTTP (protected mode refuses it otherwise)."""
    log_level: str = setting(
        "INFO", "logging level (default %(default)s)", choices=LOG_LEVELS, parse=str.upper
    )
    """The log level (`hexgen_service.telemetry.setup_logging`, and uvicorn's)."""

    def __post_init__(self) -> None:
        """Every setting's own check (`ConfigError` naming the flag), then those between
        settings."""
        check_settings(self)
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


def add_gateway_options(parser: argparse.ArgumentParser) -> None:
    """Every `GatewayConfig` option but the TLS ones (`hexgen_service.tls`)."""
    parser.add_argument(
        "--coordinator",
        action="append",
        metavar="HOST:PORT",
        help=f"the coordinator (default {DEFAULT_COORDINATOR}); a sharded mesh's coordinators: "
        "repeat it or give a comma list (each workflow goes to its shard's owner)",
    )
    add_options(parser, GatewayConfig)


def gateway_config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The configuration of a command line parsed by `add_gateway_options`' and the TLS
    options, checked (`ConfigError` naming the flag): every ``--coordinator`` given, each
    address once, in the order given, as one comma list."""
    given = [a.strip() for piece in args.coordinator or () for a in piece.split(",")]
    coordinators = ",".join(dict.fromkeys(a for a in given if a))
    if args.coordinator and not coordinators:
        raise ConfigError(f"--coordinator: no coordinator address in {args.coordinator!r}")
    by_hand = {"coordinator": coordinators} if coordinators else {}
    return from_args(GatewayConfig, args, by_hand)


def gateway_argv(
    config: GatewayConfig, only_changed: bool = True, also: tuple[str, ...] = ()
) -> list[str]:
    """``python -m hexgen_gateway``'s options that give `config`: ``--listen`` (when said),
    then ``--coordinator`` (when not the default, or named in `also`, or without
    `only_changed`), then the other settings that differ from the defaults (all of them
    without `only_changed`, and those named in `also` in any case)."""
    rendered = to_argv(config, only_changed=only_changed, also=also)
    said = not only_changed or "coordinator" in also or config.coordinator != DEFAULT_COORDINATOR
    coordinator = ["--coordinator", config.coordinator] if said else []
    at = 2 if rendered[:1] == ["--listen"] else 0
    return [*rendered[:at], *coordinator, *rendered[at:]]
