"""The coordinator's settings: one typed tree, every field with a default."""

from __future__ import annotations

from dataclasses import dataclass

from hexgen_flow.cluster import DEFAULT_CLUSTER, DEFAULT_MODEL

__all__ = ["DEFAULT_LISTEN", "CoordinatorConfig"]

DEFAULT_LISTEN = "127.0.0.1:50051"


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    listen: str = DEFAULT_LISTEN
    """The clients' door: where the CoordinatorService listens."""
    worker_listen: str = ""
    """The workers' door: where the WorkerService listens; empty: on `listen` too (allowed
    on a loopback address only)."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Where workflow state lives (``redis://USER@HOST:PORT/DB`` for an ACL user)."""
    redis_password: str = ""
    """The password of the Redis user (``--redis-password-file``); empty: none."""
    redis_prefix: str = "hf:"
    """Prefix of every Redis key (several clusters can share one Redis); on a Redis Cluster
    it holds a hash tag (``hf:{0}:``), so that every key is in the tag's slot."""
    redis_cluster: bool = False
    """`redis_url` is a node of a Redis Cluster (``--redis-cluster``), not a single Redis."""
    shards: tuple[str, ...] = ()
    """Every shard's key prefix, in the same order on every coordinator (``--shards``);
    empty: one coordinator owns every workflow. With shards, `redis_prefix` is the shard this
    coordinator prefers (any free one when it names none of them); it serves the one whose
    lease it gets (`hexgen_coordinator.shards`)."""
    advertise: str = ""
    """The address clients reach this coordinator at, published in its shard's lease for
    the others' redirects; empty: `listen`."""
    lease_ttl_s: float = 3.0
    """A shard's lease lasts this long (wall seconds) unless renewed: a spare takes over a
    dead coordinator's shard within about this time."""
    cluster: str = DEFAULT_CLUSTER
    """The instance slots, as `--cluster` writes them; workers take these slots."""
    model: str = DEFAULT_MODEL
    """Model served by every slot the cluster string does not say otherwise for."""
    calibration: str | None = None
    """Where the estimator's latency numbers come from (``--calibration``); None: the cluster
    file's ``calibration:``, else ``aiconfigurator``. The workers must be given the same."""
    policy: str = "hexgen-flow"
    """Preset (or DISPATCH+QUEUE[+BUDGET]) deciding dispatch, local queues and budgets."""
    alpha: float | None = None
    """Initial α; None keeps the one stored in Redis, else the preset's default."""
    time_scale: float = 1.0
    """Cluster seconds per wall second (simulated engines replay faster); a cluster keeps
    the time scale it was first started with."""
    slo_scale: float = 3.0
    """A query's SLO is slo_scale x SLO_base unless it gives its own."""
    heartbeat_interval_s: float = 0.5
    """How often workers report (wall seconds)."""
    heartbeat_timeout_s: float = 2.0
    """A worker silent this long (wall seconds) is declared dead and its calls redispatched."""
    resume_grace_s: float = 3.0
    """After a restart, how long (wall seconds) workers get to reconnect and claim the calls
    they still hold before those calls are dispatched again."""
    seed: int = 0
    """Seeds the dispatcher's random generator (pow2)."""
    metrics_listen: str = ""
    """Where Prometheus scrapes the coordinator's metrics (``HOST:PORT``, path /metrics);
    empty: not served. With `api_keys_file` a scrape needs an operator's key, with
    `tls_cert` it is HTTPS (`hexgen_service.metrics_server`); beyond loopback both, or
    `insecure`."""
    metrics_max_tenants: int = 100
    """Distinct tenants whose metrics carry their own ``tenant`` label (the first seen);
    later ones are counted as ``tenant="other"`` (`hexgen_coordinator.metrics.TenantLabels`);
    0: none."""
    worker_token: str = ""
    """The token a worker's Connect must carry (`hexgen_service.worker_token`); empty:
    any worker may connect."""
    # ---------------------------------------------------------------- security
    api_keys_file: str = ""
    """The API keys file (`hexgen_service.auth`); empty: clients are not authenticated."""
    tls_cert: str = ""
    """PEM certificate both doors serve TLS with; empty: plaintext."""
    tls_key: str = ""
    """Its private key."""
    tls_ca: str = ""
    """The CA whose client certificates the workers' door requires (mutual TLS); empty:
    workers show no certificate."""
    insecure: bool = False
    """Listen on a non-loopback address without protection (protected mode off)."""
    learn_costs: bool = False
    """Learn each instance's prefill and decode costs online from the calls its worker
    served, with the calibration as the prior (`hexgen_flow.learning`): dispatch, the
    urgency queues' estimates, stage budgets and admission plan with what was learned."""
    gc_tuning: bool = True
    """Freeze the objects alive after start-up and raise the young generation's threshold
    (`hexgen_service.gc_tuning`), so full collections stay short."""
    event_loop: str = "auto"
    """The asyncio event loop (`hexgen_service.event_loop`): uvloop where installed."""
    pipelined_redis: bool = True
    """Send the completion script and the write-behind over one pipelined connection
    (`hexgen_coordinator.pipelined_redis`) rather than redis-py's pool; a single Redis
    only (a Redis Cluster or Sentinel keeps redis-py's client)."""
    # ---------------------------------------------------------------- faults and retention
    max_call_attempts: int = 3
    """Dispatches a call gets when its engine reports an error; after the last one fails its
    query ends FAILED with the error as the reason."""
    retention_s: float = 3600.0
    """Wall seconds a finished query (its hash and event log) stays in Redis."""
    stream_maxlen: int = 10_000
    """Approximate length the `completions` and `finished` streams are trimmed to."""
    session_idle_s: float = 300.0
    """Wall seconds without a call after which a workflow session is closed (its calls
    never given skipped), unless the session asked for another timeout."""
    # ---------------------------------------------------------------- admission control
    admission: str = "reject"
    """What to do with a query predicted to miss its SLO under the current load: "reject"
    (RESOURCE_EXHAUSTED with a retry-after hint), "best-effort" (admit it at the lowest
    urgency) or "off" (admit everything)."""
    admission_slack: float = 1.0
    """A query is admitted when its predicted completion is within slack x its SLO."""
    max_running_queries: int = 10_000
    """Running queries the coordinator holds at most (RESOURCE_EXHAUSTED beyond)."""
    max_tenant_queries: int = 0
    """Running queries one tenant may hold at most; 0: no per-tenant limit."""
    max_tenant_prompt_bytes: int = 256 << 20
    """Prompt bytes one tenant may have stored at once (its running calls' prompts, kept
    until each call finishes); a tenant's own ``max_prompt_bytes`` in the API keys file
    overrides it. RESOURCE_EXHAUSTED beyond."""
    redis_memory_limit: float = 0.9
    """Share of Redis's ``maxmemory`` above which new work (submissions, sessions, calls) is
    refused with RESOURCE_EXHAUSTED, before Redis would refuse writes; a Redis without
    ``maxmemory`` is not watched."""
    # ---------------------------------------------------------------- input limits
    max_prompt_bytes: int = 1 << 20
    """Largest prompt of one call (UTF-8 bytes)."""
    max_request_bytes: int = 8 << 20
    """Largest request the clients' door reads (a whole SubmitQuery or RunQuery with its
    prompts); gRPC refuses a larger one with RESOURCE_EXHAUSTED before reading it. The
    other methods take less (`hexgen_coordinator.edge.request_limits`)."""
    max_output_tokens: int = 0
    """Most output tokens one call may ask for; 0: the longest context of the cluster's
    models."""
    max_calls: int = 1024
    """Most calls in one workflow (repeats unrolled)."""
    max_stages: int = 256
    """Most stages in one workflow (repeats unrolled)."""
    max_id_bytes: int = 256
    """Longest query id."""
    max_tenant_bytes: int = 64
    """Longest tenant name."""
    max_slo_s: float = 86_400.0
    """Largest SLO a query may ask for (seconds on the cluster clock)."""
