"""The coordinator's settings: one typed tree, every field with its default, its
command-line option and its check (`hexgen_service.settings`).

It lives here, beside the services' shared plumbing, rather than in `hexgen_coordinator`,
so that the launchers (`hexgen_launch`, which starts the coordinator as a process and may
not import it: tests/test_layers.py) render its command line from the same fields that
``python -m hexgen_coordinator`` parses; `hexgen_coordinator.config` re-exports it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from hexgen_flow.alpha import alpha_problem
from hexgen_flow.cluster import DEFAULT_CLUSTER, DEFAULT_MODEL
from hexgen_flow.errors import ConfigError
from hexgen_flow.lengths import SERVED_OUTPUT_LENGTHS
from hexgen_service.auth import read_secret
from hexgen_service.event_loop import EVENT_LOOPS
from hexgen_service.redis_schema import DEFAULT_PREFIX
from hexgen_service.redis_sentinel import REDIS_URL_HELP, check_redis_url
from hexgen_service.settings import (
    add_options,
    at_least,
    check_settings,
    greater_than,
    in_range,
    setting,
    to_argv,
)

__all__ = [
    "ADMISSION_MODES",
    "DEFAULT_LISTEN",
    "CoordinatorConfig",
    "add_coordinator_options",
    "coordinator_argv",
]

DEFAULT_LISTEN = "127.0.0.1:50051"
ADMISSION_MODES = ("reject", "best-effort", "off")

_POSITIVE = greater_than(0)
_ONE_OR_MORE = at_least(1)


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    listen: str = setting(DEFAULT_LISTEN, "the clients' door (CoordinatorService)")
    """The clients' door: where the CoordinatorService listens."""
    worker_listen: str = setting(
        "",
        "the workers' door (WorkerService); default: on --listen, loopback only",
        metavar="HOST:PORT",
    )
    """The workers' door: where the WorkerService listens; empty: on `listen` too (allowed
    on a loopback address only)."""
    redis_url: str = setting("redis://127.0.0.1:6379/0", f"{REDIS_URL_HELP} (default %(default)s)")
    """Where workflow state lives (``redis://USER@HOST:PORT/DB`` for an ACL user)."""
    redis_password: str = setting(
        "",
        "the password of the Redis user in --redis-url (redis://USER@HOST:PORT/DB)",
        flag="--redis-password-file",
        secret_file=read_secret,
    )
    """The password of the Redis user (``--redis-password-file``); empty: none."""
    redis_prefix: str = setting(
        DEFAULT_PREFIX,
        "prefix of every Redis key (default %(default)s; with --redis-cluster hf:{0}:, and it "
        "must hold a {hash tag})",
    )
    """Prefix of every Redis key (several clusters can share one Redis); on a Redis Cluster
    it holds a hash tag (``hf:{0}:``), so that every key is in the tag's slot."""
    redis_cluster: bool = setting(
        False, "--redis-url is a node of a Redis Cluster (every key in the prefix's slot)"
    )
    """`redis_url` is a node of a Redis Cluster (``--redis-cluster``), not a single Redis."""
    shards: tuple[str, ...] = setting(
        (),
        "every coordinator shard's key prefix, the same list on each coordinator: this one "
        "serves --redis-prefix if that shard is free, else the first free one, else waits as "
        "a spare (docs/scaling.md)",
        metavar="P0,P1,...",
    )
    """Every shard's key prefix, in the same order on every coordinator (``--shards``);
    empty: one coordinator owns every workflow. With shards, `redis_prefix` is the shard this
    coordinator prefers (any free one when it names none of them); it serves the one whose
    lease it gets (`hexgen_coordinator.shards`)."""
    advertise: str = setting(
        "",
        "with --shards: the address clients reach this coordinator at (default --listen)",
        metavar="HOST:PORT",
    )
    """The address clients reach this coordinator at, published in its shard's lease for
    the others' redirects; empty: `listen`."""
    lease_ttl_s: float = setting(
        3.0,
        "with --shards: wall seconds a shard's lease lasts unless renewed (default %(default)s)",
        check=_POSITIVE,
    )
    """A shard's lease lasts this long (wall seconds) unless renewed: a spare takes over a
    dead coordinator's shard within about this time."""
    cluster: str = setting(DEFAULT_CLUSTER, "the instance slots the workers take")
    """The instance slots, as `--cluster` writes them; workers take these slots."""
    model: str = setting(DEFAULT_MODEL, "the model of every slot the cluster does not name one for")
    """Model served by every slot the cluster string does not say otherwise for."""
    calibration: str | None = setting(
        None,
        "where the estimator's latency numbers come from (default: the cluster file's, else "
        "aiconfigurator); the workers must be given the same",
        metavar="NAME|measured:FILE",
    )
    """Where the estimator's latency numbers come from (``--calibration``); None: the cluster
    file's ``calibration:``, else ``aiconfigurator``. The workers must be given the same."""
    policy: str = setting("hexgen-flow", "a preset or DISPATCH+QUEUE[+BUDGET]")
    """Preset (or DISPATCH+QUEUE[+BUDGET]) deciding dispatch, local queues and budgets."""
    alpha: float | None = setting(
        None,
        "the initial alpha (default: the one stored in Redis, else the policy's)",
        check=alpha_problem,
    )
    """Initial α; None keeps the one stored in Redis, else the preset's default."""
    time_scale: float = setting(
        1.0, "cluster seconds per wall second (default %(default)s)", check=_POSITIVE
    )
    """Cluster seconds per wall second (simulated engines replay faster); a cluster keeps
    the time scale it was first started with."""
    slo_scale: float = setting(
        3.0, "a query's SLO is this x SLO_base unless it gives its own", check=_POSITIVE
    )
    """A query's SLO is slo_scale x SLO_base unless it gives its own."""
    heartbeat_interval_s: float = setting(0.5, "how often workers report (wall seconds)")
    """How often workers report (wall seconds)."""
    heartbeat_timeout_s: float = setting(
        2.0, "a worker silent this long (wall seconds) is declared dead"
    )
    """A worker silent this long (wall seconds) is declared dead and its calls redispatched."""
    resume_grace_s: float = setting(
        3.0, "after a restart, wall seconds workers get to reclaim the calls they hold"
    )
    """After a restart, how long (wall seconds) workers get to reconnect and claim the calls
    they still hold before those calls are dispatched again."""
    seed: int = setting(0, "seeds the dispatcher's random generator")
    """Seeds the dispatcher's random generator (pow2)."""
    metrics_listen: str = setting(
        "",
        "serve Prometheus metrics on http://HOST:PORT/metrics (default: not served); with "
        "--tls-cert/--tls-key over HTTPS, with --api-keys-file to operators' keys only "
        "(beyond loopback both, or --insecure)",
        metavar="HOST:PORT",
    )
    """Where Prometheus scrapes the coordinator's metrics (``HOST:PORT``, path /metrics);
    empty: not served. With `api_keys_file` a scrape needs an operator's key, with
    `tls_cert` it is HTTPS (`hexgen_service.metrics_server`); beyond loopback both, or
    `insecure`."""
    metrics_max_tenants: int = setting(
        100,
        "the first N distinct tenants keep a tenant label of their own in the metrics, later "
        'ones are counted as tenant="other" (default %(default)s; 0: none)',
        metavar="N",
        check=at_least(0, " (0: every tenant as 'other')"),
    )
    """Distinct tenants whose metrics carry their own ``tenant`` label (the first seen);
    later ones are counted as ``tenant="other"`` (`hexgen_coordinator.metrics.TenantLabels`);
    0: none."""
    worker_token: str = setting(
        "",
        "refuse workers whose Connect does not carry the token in FILE (UNAUTHENTICATED)",
        flag="--worker-token-file",
        secret_file=read_secret,
    )
    """The token a worker's Connect must carry (`hexgen_service.worker_token`); empty:
    any worker may connect."""
    # ---------------------------------------------------------------- security
    api_keys_file: str = setting(
        "",
        "authenticate clients with the API keys in FILE (hexgen-flow auth init)",
        metavar="FILE",
    )
    """The API keys file (`hexgen_service.auth`); empty: clients are not authenticated."""
    tls_cert: str = setting("", declared_elsewhere=True)  # hexgen_service.tls.add_tls_options
    """PEM certificate both doors serve TLS with; empty: plaintext."""
    tls_key: str = setting("", declared_elsewhere=True)
    """Its private key."""
    tls_ca: str = setting("", declared_elsewhere=True)
    """The CA whose client certificates the workers' door requires (mutual TLS); empty:
    workers show no certificate."""
    insecure: bool = setting(
        False, "allow listening beyond loopback without API keys and TLS (protected mode off)"
    )
    """Listen on a non-loopback address without protection (protected mode off)."""
    learn_costs: bool = setting(
        False,
        "learn each instance's prefill and decode costs online from the calls it served, "
        "with the calibration as the prior (default: off; hexgen_flow.learning)",
    )
    """Learn each instance's prefill and decode costs online from the calls its worker
    served, with the calibration as the prior (`hexgen_flow.learning`): dispatch, the
    urgency queues' estimates, stage budgets and admission plan with what was learned."""
    cost_journal: str = setting(
        "",
        "with --learn-costs, append what each finished call cost its instance (the cost "
        "learner's input, hexgen_flow.learning.CallCost) to FILE, one JSON object per line",
        metavar="FILE",
    )
    """With `learn_costs`, the file each call's `CallCost` is appended to as a JSON line
    (`hexgen_flow.learning.read_cost_journal` reads it back): what the learner saw, to
    replay through another fit offline; empty: none kept."""
    output_lengths: str = setting(
        "known",
        "what dispatch, stage budgets, the urgency queues' estimates and admission believe "
        "a call will generate: its declared output tokens (known), or a per-step prediction "
        "learned from finished calls, never above the declared cap (learned; default "
        "%(default)s)",
        choices=SERVED_OUTPUT_LENGTHS,
    )
    """What the scheduler believes of each call's output length (`hexgen_flow.lengths`):
    the declared tokens, or ``learned``: the 75th percentile of what calls of the same step
    generated (cold: the typical lengths of the step), capped by the call's declared
    tokens, which the engine is still asked for. A session's calls are believed as
    declared."""
    prefix_caching: bool = setting(
        True,
        "whether the workers' engines cache prompt prefixes, as vLLM does by default: "
        "dispatch then favours the instance that ran the query's earlier call of the same "
        "step (default: on; --no-prefix-caching for engines without it)",
    )
    """Whether the workers' engines cache prompt prefixes (vLLM's default, and the simulated
    engine's `vllm-v1`): the dispatcher counts a query's repeated prefix as cached where
    its earlier call of the step ran (`GlobalScheduler`'s `prefix_caching`, which
    ``simulate --no-prefix-caching`` turns off the same way)."""
    gc_tuning: bool = setting(
        True,
        "freeze the start-up objects and collect young objects less often, so that a full "
        "garbage collection does not stall the completion path (default: on)",
    )
    """Freeze the objects alive after start-up and raise the young generation's threshold
    (`hexgen_service.gc_tuning`), so full collections stay short."""
    event_loop: str = setting(
        "auto",
        "the asyncio event loop: uvloop where installed (auto), or asyncio's own "
        "(default %(default)s)",
        choices=EVENT_LOOPS,
    )
    """The asyncio event loop (`hexgen_service.event_loop`): uvloop where installed."""
    pipelined_redis: bool = setting(
        True,
        "send the completion path's Redis traffic over one pipelined connection rather than "
        "redis-py's pool (a single Redis; default: on)",
    )
    """Send the completion script and the write-behind over one pipelined connection
    (`hexgen_coordinator.pipelined_redis`) rather than redis-py's pool; a single Redis
    only (a Redis Cluster or Sentinel keeps redis-py's client)."""
    log_level: str = setting("INFO", "the log level (default %(default)s)")
    """The log level (`hexgen_service.telemetry.setup_logging`)."""
    # ---------------------------------------------------------------- faults and retention
    max_call_attempts: int = setting(
        3,
        "dispatches a call gets when its engine reports an error (default %(default)s)",
        check=_ONE_OR_MORE,
    )
    """Dispatches a call gets when its engine reports an error; after the last one fails its
    query ends FAILED with the error as the reason."""
    retention_s: float = setting(
        3600.0,
        "wall seconds a finished query stays in Redis (default %(default)s)",
        check=_POSITIVE,
    )
    """Wall seconds a finished query (its hash and event log) stays in Redis."""
    stream_maxlen: int = setting(
        10_000,
        "approximate length the completions and finished streams are trimmed to",
        check=_ONE_OR_MORE,
    )
    """Approximate length the `completions` and `finished` streams are trimmed to."""
    session_idle_s: float = setting(
        300.0,
        "close a workflow session after this many wall seconds without a call",
        check=_POSITIVE,
    )
    """Wall seconds without a call after which a workflow session is closed (its calls
    never given skipped), unless the session asked for another timeout."""
    # ---------------------------------------------------------------- admission control
    admission: str = setting(
        "reject",
        "what to do with a query predicted to miss its SLO: reject it, admit it best-effort, "
        "or admit everything (default %(default)s)",
        choices=ADMISSION_MODES,
    )
    """What to do with a query predicted to miss its SLO under the current load: "reject"
    (RESOURCE_EXHAUSTED with a retry-after hint), "best-effort" (admit it at the lowest
    urgency) or "off" (admit everything)."""
    admission_slack: float = setting(
        1.0,
        "admit a query whose predicted completion is within this x its SLO",
        check=_POSITIVE,
    )
    """A query is admitted when its predicted completion is within slack x its SLO."""
    max_running_queries: int = setting(
        10_000, "running queries the coordinator holds at most", check=_ONE_OR_MORE
    )
    """Running queries the coordinator holds at most (RESOURCE_EXHAUSTED beyond)."""
    max_tenant_queries: int = setting(
        0,
        "running queries one tenant may hold at most (0: no limit)",
        check=at_least(0, " (0: no limit)"),
    )
    """Running queries one tenant may hold at most; 0: no per-tenant limit."""
    max_tenant_prompt_bytes: int = setting(
        256 << 20,
        "prompt bytes one tenant may keep at once in running calls (RESOURCE_EXHAUSTED "
        "beyond; the keys file's max_prompt_bytes overrides it; default %(default)s)",
        check=_ONE_OR_MORE,
    )
    """Prompt bytes one tenant may have stored at once (its running calls' prompts, kept
    until each call finishes); a tenant's own ``max_prompt_bytes`` in the API keys file
    overrides it. RESOURCE_EXHAUSTED beyond."""
    redis_memory_limit: float = setting(
        0.9,
        "refuse new work while Redis holds more than this share of its maxmemory "
        "(default %(default)s)",
        metavar="SHARE",
        check=in_range(0, 1, open_low=True),
    )
    """Share of Redis's ``maxmemory`` above which new work (submissions, sessions, calls) is
    refused with RESOURCE_EXHAUSTED, before Redis would refuse writes; a Redis without
    ``maxmemory`` is not watched."""
    # ---------------------------------------------------------------- input limits
    max_prompt_bytes: int = setting(
        1 << 20, "the largest prompt of one call (UTF-8 bytes)", check=_ONE_OR_MORE
    )
    """Largest prompt of one call (UTF-8 bytes)."""
    max_request_bytes: int = setting(
        8 << 20,
        "the largest request the clients' door reads, a whole query with its prompts "
        "(default %(default)s)",
    )
    """Largest request the clients' door reads (a whole SubmitQuery or RunQuery with its
    prompts); gRPC refuses a larger one with RESOURCE_EXHAUSTED before reading it. The
    other methods take less (`hexgen_coordinator.edge.request_limits`)."""
    max_output_tokens: int = setting(
        0,
        "most output tokens one call may ask for (default 0: the longest context of the "
        "cluster's models)",
        check=at_least(0, " (0: the models' context)"),
    )
    """Most output tokens one call may ask for; 0: the longest context of the cluster's
    models."""
    max_calls: int = setting(1024, "most calls in one workflow", check=_ONE_OR_MORE)
    """Most calls in one workflow (repeats unrolled)."""
    max_stages: int = setting(256, "most stages in one workflow", check=_ONE_OR_MORE)
    """Most stages in one workflow (repeats unrolled)."""
    max_id_bytes: int = setting(256, "the longest query id", check=_ONE_OR_MORE)
    """Longest query id."""
    max_tenant_bytes: int = setting(64, "the longest tenant name", check=_ONE_OR_MORE)
    """Longest tenant name."""
    max_slo_s: float = setting(
        86_400.0, "the largest SLO a query may ask for (cluster seconds)", check=_POSITIVE
    )
    """Largest SLO a query may ask for (seconds on the cluster clock)."""

    def __post_init__(self) -> None:
        """Every setting's own check, then those between settings (`ConfigError` naming
        the flag)."""
        check_settings(self)
        if self.max_request_bytes < self.max_prompt_bytes:
            raise ConfigError(
                f"--max-request-bytes ({self.max_request_bytes}) must be at least "
                f"--max-prompt-bytes ({self.max_prompt_bytes}): a request carries its prompts"
            )
        if self.cost_journal and not self.learn_costs:
            raise ConfigError("--cost-journal needs --learn-costs: without it no cost is measured")
        check_redis_url(self.redis_url, cluster=self.redis_cluster)


def add_coordinator_options(parser: argparse.ArgumentParser) -> None:
    """Every `CoordinatorConfig` option but the TLS ones (`hexgen_service.tls`)."""
    add_options(parser, CoordinatorConfig)


def coordinator_argv(config: CoordinatorConfig, only_changed: bool = True) -> list[str]:
    """``python -m hexgen_coordinator``'s options that give `config` (with `only_changed`,
    those of the settings that differ from the defaults). The secrets (the Redis password,
    the workers' token) are given as files by the caller: `ValueError` when one is set."""
    return to_argv(config, only_changed=only_changed)
