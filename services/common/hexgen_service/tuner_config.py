"""The α tuner's settings: one typed, frozen tree, every field with its default, its
command-line option and its check (`hexgen_service.settings`).

It lives here, beside the services' shared plumbing, rather than in `hexgen_tuner`, so that
the launchers (`hexgen_launch`, which starts the tuner as a process and may not import it:
tests/test_layers.py) render its command line from the same fields that
``python -m hexgen_tuner`` parses; `hexgen_tuner.config` re-exports it. The TLS options are
`hexgen_service.tls`'s; the records' caps and the RPC deadline are set from code only.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from hexgen_flow.errors import ConfigError
from hexgen_service.exposure import refuse_open_metrics, refuse_unprotected
from hexgen_service.redis_keys import cluster_prefix
from hexgen_service.redis_schema import CLUSTER_PREFIX, DEFAULT_PREFIX
from hexgen_service.redis_sentinel import REDIS_URL_HELP, check_redis_url
from hexgen_service.settings import (
    LOG_LEVELS,
    add_options,
    at_least,
    check_settings,
    from_args,
    greater_than,
    setting,
    to_argv,
)
from hexgen_service.tls import TlsFiles

__all__ = [
    "DEFAULT_TUNER",
    "TunerConfig",
    "add_tuner_options",
    "tuner_argv",
    "tuner_config_from_args",
]

DEFAULT_TUNER = "127.0.0.1:50053"
"""Where the tuner listens unless told otherwise (`hexgen_client.addresses.DEFAULT_TUNER`)."""

_ONE_OR_MORE = at_least(1)


def _period(value: float) -> str | None:
    fine = math.isfinite(value) and value > 0
    return None if fine else f"must be a finite number of seconds > 0, got {value}"


def _tolerance(value: float) -> str | None:
    fine = math.isfinite(value) and 0 <= value < 1
    return None if fine else f"must be in [0, 1), got {value}"


@dataclass(frozen=True, slots=True)
class TunerConfig:
    """What ``python -m hexgen_tuner`` runs with."""

    listen: str = setting(DEFAULT_TUNER, "HOST:PORT (default %(default)s)")
    """Address of the TunerService (plus health and reflection)."""
    coordinator: str = setting(
        "127.0.0.1:50051",
        "HOST:PORT[,...] (default %(default)s); with --shards every coordinator",
    )
    """The coordinator whose α is tuned (ClusterStatus, SetAlpha); with shards, every
    coordinator's address, comma-separated."""
    shards: tuple[str, ...] = setting(
        (),
        "tune a sharded mesh: every shard's key prefix, as the coordinators are given "
        "them; the window is all shards' traffic and the alpha goes to every coordinator",
        metavar="P0,P1,...",
    )
    """The coordinator shards' prefixes (``--shards``, as the coordinators are given them);
    empty: one coordinator. With shards the window is every shard's traffic on one clock
    (`read_sharded_window`), the tuned α is pushed to every coordinator in `coordinator`
    that answers, and the tuner's own records stay under `redis_prefix`."""
    redis_url: str = setting("redis://127.0.0.1:6379/0", f"{REDIS_URL_HELP} (default %(default)s)")
    """The Redis the coordinator writes its ``admitted`` and ``finished`` streams to."""
    redis_prefix: str = setting(
        DEFAULT_PREFIX, f"key prefix (default %(default)s; with --redis-cluster {CLUSTER_PREFIX})"
    )
    """Prefix of every key: reads ``P admitted`` and ``P finished``, writes
    ``P + "tuner:..."``; on a Redis Cluster the coordinator's, with its hash tag
    (`cluster_prefix`: not given, `CLUSTER_PREFIX`)."""
    redis_cluster: bool = setting(
        False, "--redis-url is a node of a Redis Cluster (the prefix must hold a {hash tag})"
    )
    """`redis_url` is a node of a Redis Cluster (``--redis-cluster``)."""
    period_s: float = setting(
        30.0, "wall seconds between tuning runs (default %(default)s)", check=_period
    )
    """Wall seconds between tuning runs (the first one a period after start)."""
    window: int = setting(
        200, "latest admitted queries replayed per run (default %(default)s)", check=_ONE_OR_MORE
    )
    """How many of the most recently admitted queries a run replays (`read_window`)."""
    min_queries: int = setting(
        20,
        "fewer in the window: the run changes nothing (default %(default)s)",
        check=_ONE_OR_MORE,
    )
    """Fewer queries in the window than this: the run changes nothing."""
    seed: int = setting(0, "seed of the replays (default %(default)s)")
    """Seed of the simulations (the policies' random choices)."""
    tolerance: float = setting(
        0.05,
        "alphas within this fraction of the best replayed P95 count as the best; the "
        "current one is then kept (default %(default)s)",
        check=_tolerance,
    )
    """α whose replayed P95 is within this fraction of the best count as the best
    (`hexgen_flow.tuning.decide`): the current α is kept when it is among them, else the
    median of them is pushed. 0: any strictly better α is pushed (docs/online-tuning.md
    measures the two)."""
    calibration: str | None = setting(
        None,
        "the coordinator's latency calibration (default chess-measured)",
        metavar="NAME|measured:FILE",
    )
    """Where the replays' latency numbers come from: the coordinator's calibration (None:
    ``chess-measured``)."""
    metrics_listen: str = setting(
        "",
        "serve Prometheus metrics on http://HOST:PORT/metrics (default: not served); "
        "with --tls-cert/--tls-key over HTTPS, with --api-keys-file to operators' keys only "
        "(beyond loopback both, or --insecure)",
        metavar="HOST:PORT",
    )
    """Where to serve Prometheus metrics (``HOST:PORT``, at /metrics); empty: nowhere.
    With `api_keys_file` a scrape needs an operator's key, with `tls_cert` it is HTTPS
    (`hexgen_service.metrics_server`); beyond loopback both, or `insecure`."""
    runs_kept: int = setting(200, code_only=True, check=_ONE_OR_MORE)
    """Tuning runs kept in Redis (``ListTuningRuns``), newest first."""
    rpc_timeout_s: float = setting(10.0, code_only=True, check=greater_than(0))
    """Deadline of each RPC to the coordinator."""
    # ---------------------------------------------------------------- security
    api_keys_file: str = setting(
        "",
        "check callers' API keys against this keys file: GetAlpha needs a tenant key, "
        "ListTuningRuns and Retune an operator key (default: no keys checked)",
        metavar="FILE",
    )
    """The keys file (`hexgen_service.auth.KeyStore`) the TunerService checks callers'
    keys against: GetAlpha needs a tenant key, ListTuningRuns and Retune an operator's.
    Empty: no keys checked."""
    tls_cert: str | None = setting(None, declared_elsewhere=True)  # hexgen_service.tls
    """The TunerService's certificate (PEM): with `tls_key`, it serves TLS only."""
    tls_key: str | None = setting(None, declared_elsewhere=True)
    """The private key of `tls_cert`."""
    tls_ca: str | None = setting(None, declared_elsewhere=True)
    """The CA to verify a TLS coordinator with (None: ``$HEXGEN_FLOW_TLS_CA``, else a
    plaintext channel)."""
    api_key_file: str = setting(
        "",
        "the tuner's own (operator) API key, sent to the coordinator (default: "
        "$HEXGEN_FLOW_API_KEY, else none)",
        metavar="FILE",
    )
    """The tuner's own (operator) key, sent to the coordinator with ClusterStatus and
    SetAlpha. Empty: ``$HEXGEN_FLOW_API_KEY``, else none."""
    redis_password_file: str = setting(
        "",
        "the password of the Redis user --redis-url names (redis://tuner@HOST:PORT/0)",
        metavar="FILE",
    )
    """The password of the Redis user `redis_url` names (``redis://tuner@host:port/0``).
    Empty: the URL's own password, if any."""
    insecure: bool = setting(
        False,
        "listen (and serve --metrics-listen) beyond loopback without --api-keys-file "
        "and --tls-cert/--tls-key",
    )
    """Listen beyond loopback without keys and TLS (protected mode refuses it otherwise)."""
    log_level: str = setting(
        "INFO", "logging level (default %(default)s)", choices=LOG_LEVELS, parse=str.upper
    )
    """The log level (`hexgen_service.telemetry.setup_logging`)."""

    def __post_init__(self) -> None:
        """Every setting's own check (`ConfigError` naming the flag), then those between
        settings."""
        check_settings(self)
        if self.min_queries > self.window:
            raise ConfigError(
                f"--min-queries ({self.min_queries}) must not exceed --window ({self.window})"
            )
        tls = self.tls_files
        check_redis_url(self.redis_url, cluster=self.redis_cluster)
        cluster_prefix(self.redis_prefix, cluster=self.redis_cluster)
        for prefix in self.shards:
            cluster_prefix(prefix, cluster=self.redis_cluster)
        if self.redis_password_file and _url_has_password(self.redis_url):
            raise ConfigError(
                "--redis-password-file: --redis-url carries a password already; give it in "
                "one place"
            )
        refuse_unprotected(
            "--listen",
            self.listen,
            protected=bool(self.api_keys_file) and tls.cert is not None,
            insecure=self.insecure,
            needs="--api-keys-file and --tls-cert/--tls-key",
        )
        refuse_open_metrics(
            self.metrics_listen,
            tls=tls.cert is not None,
            keys=bool(self.api_keys_file),
            insecure=self.insecure,
        )

    @property
    def tls_files(self) -> TlsFiles:
        """The TunerService's certificate and key, and the CA its coordinator is checked
        with; ConfigError when a certificate comes without its key or the other way."""
        return TlsFiles.from_flags(self.tls_cert, self.tls_key, self.tls_ca)


def _url_has_password(url: str) -> bool:
    return urlsplit(url).password is not None


def add_tuner_options(parser: argparse.ArgumentParser) -> None:
    """Every `TunerConfig` option but the TLS ones (`hexgen_service.tls`)."""
    add_options(parser, TunerConfig)


def tuner_config_from_args(args: argparse.Namespace) -> TunerConfig:
    """The configuration of a command line parsed by `add_tuner_options`' and the TLS
    options, checked (`ConfigError` naming the flag). ``--redis-prefix`` not given on a
    Redis Cluster is `CLUSTER_PREFIX` (the coordinator's default there, with a hash tag)."""
    by_default: dict[str, Any] = {}
    if args.redis_prefix is None and args.redis_cluster:
        by_default["redis_prefix"] = CLUSTER_PREFIX
    return from_args(TunerConfig, args, by_default)


def tuner_argv(
    config: TunerConfig, only_changed: bool = True, also: tuple[str, ...] = ()
) -> list[str]:
    """``python -m hexgen_tuner``'s options that give `config`: those of the settings that
    differ from the defaults (all of them without `only_changed`, and those named in `also`
    in any case), the TLS options among them."""
    return to_argv(config, only_changed=only_changed, also=also)
