"""The tuner's settings: one frozen dataclass, every field with a default."""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from hexgen_client.addresses import (
    DEFAULT_COORDINATOR,
    DEFAULT_REDIS_URL,
    DEFAULT_TUNER,
)
from hexgen_flow.errors import ConfigError
from hexgen_service.exposure import refuse_open_metrics, refuse_unprotected
from hexgen_service.redis_keys import cluster_prefix
from hexgen_service.redis_schema import DEFAULT_PREFIX
from hexgen_service.tls import TlsFiles

__all__ = ["TunerConfig"]


@dataclass(frozen=True, slots=True)
class TunerConfig:
    """What ``python -m hexgen_tuner`` runs with."""

    listen: str = DEFAULT_TUNER
    """Address of the TunerService (plus health and reflection)."""
    coordinator: str = DEFAULT_COORDINATOR
    """The coordinator whose α is tuned (ClusterStatus, SetAlpha); with shards, every
    coordinator's address, comma-separated."""
    redis_url: str = DEFAULT_REDIS_URL
    """The Redis the coordinator writes its ``admitted`` and ``finished`` streams to."""
    redis_prefix: str = DEFAULT_PREFIX
    """Prefix of every key: reads ``P admitted`` and ``P finished``, writes
    ``P + "tuner:..."``; on a Redis Cluster the coordinator's, with its hash tag
    (`cluster_prefix`)."""
    redis_cluster: bool = False
    """`redis_url` is a node of a Redis Cluster (``--redis-cluster``)."""
    shards: tuple[str, ...] = ()
    """The coordinator shards' prefixes (``--shards``, as the coordinators are given them);
    empty: one coordinator. With shards the window is every shard's traffic on one clock
    (`read_sharded_window`), the tuned α is pushed to every coordinator in `coordinator`
    that answers, and the tuner's own records stay under `redis_prefix`."""
    period_s: float = 30.0
    """Wall seconds between tuning runs (the first one a period after start)."""
    window: int = 200
    """How many of the most recently admitted queries a run replays (`read_window`)."""
    min_queries: int = 20
    """Fewer queries in the window than this: the run changes nothing."""
    runs_kept: int = 200
    """Tuning runs kept in Redis (``ListTuningRuns``), newest first."""
    history_kept: int = 1000
    """α changes kept in Redis (``GetAlpha``'s history)."""
    seed: int = 0
    """Seed of the simulations (the policies' random choices)."""
    tolerance: float = 0.05
    """α whose replayed P95 is within this fraction of the best count as the best
    (`hexgen_flow.tuning.decide`): the current α is kept when it is among them, else the
    median of them is pushed. 0: any strictly better α is pushed (docs/online-tuning.md
    measures the two)."""
    calibration: str | None = None
    """Where the replays' latency numbers come from: the coordinator's calibration (None:
    ``chess-measured``)."""
    metrics_listen: str = ""
    """Where to serve Prometheus metrics (``HOST:PORT``, at /metrics); empty: nowhere.
    With `api_keys_file` a scrape needs an operator's key, with `tls_cert` it is HTTPS
    (`hexgen_service.metrics_server`); beyond loopback both, or `insecure`."""
    rpc_timeout_s: float = 10.0
    """Deadline of each RPC to the coordinator."""
    api_keys_file: str = ""
    """The keys file (`hexgen_service.auth.KeyStore`) the TunerService checks callers'
    keys against: GetAlpha needs a tenant key, ListTuningRuns and Retune an operator's.
    Empty: no keys checked."""
    tls_cert: str | None = None
    """The TunerService's certificate (PEM): with `tls_key`, it serves TLS only."""
    tls_key: str | None = None
    """The private key of `tls_cert`."""
    tls_ca: str | None = None
    """The CA to verify a TLS coordinator with (None: ``$HEXGEN_FLOW_TLS_CA``, else a
    plaintext channel)."""
    api_key_file: str = ""
    """The tuner's own (operator) key, sent to the coordinator with ClusterStatus and
    SetAlpha. Empty: ``$HEXGEN_FLOW_API_KEY``, else none."""
    redis_password_file: str = ""
    """The password of the Redis user `redis_url` names (``redis://tuner@host:port/0``).
    Empty: the URL's own password, if any."""
    insecure: bool = False
    """Listen beyond loopback without keys and TLS (protected mode refuses it otherwise)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.period_s) and self.period_s > 0):
            raise ConfigError(f"period must be a finite number of seconds > 0, got {self.period_s}")
        for name in ("window", "min_queries", "runs_kept", "history_kept"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.min_queries > self.window:
            raise ConfigError(
                f"min-queries ({self.min_queries}) must not exceed the window ({self.window})"
            )
        if not (math.isfinite(self.tolerance) and 0 <= self.tolerance < 1):
            raise ConfigError(f"tolerance must be in [0, 1), got {self.tolerance}")
        if not self.rpc_timeout_s > 0:
            raise ConfigError(f"rpc timeout must be > 0, got {self.rpc_timeout_s}")
        tls = self.tls_files
        cluster_prefix(self.redis_prefix, cluster=self.redis_cluster)
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
