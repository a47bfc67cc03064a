"""`python -m hexgen_coordinator`: run the coordinator until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
from dataclasses import fields, replace
from pathlib import Path

import grpc

from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.coordinator import Coordinator
from hexgen_coordinator.edge import door_limit
from hexgen_coordinator.redis_retry import cluster_prefix, pipelined_client, redis_client
from hexgen_coordinator.service import add_coordinator_services, add_worker_service
from hexgen_coordinator.shards import LeaseLostError, ShardLease, ShardMap
from hexgen_flow.errors import ConfigError, HexgenFlowError
from hexgen_service.auth import PUBLIC_METHODS, AuthInterceptor, KeyStore, Role, read_secret
from hexgen_service.event_loop import EVENT_LOOPS, resolve_event_loop, run
from hexgen_service.exposure import refuse_open_metrics, refuse_unprotected
from hexgen_service.gc_tuning import GcPauses, freeze_startup
from hexgen_service.metrics_server import MetricsProtection, serve_metrics
from hexgen_service.redis_sentinel import REDIS_URL_HELP, check_redis_url
from hexgen_service.server import GrpcServer
from hexgen_service.telemetry import setup_logging
from hexgen_service.tls import TlsFiles, add_tls_options
from hexgen_service.worker_token import read_token

CLIENT_SERVICE = "hexgen_flow.v1.CoordinatorService"
WORKER_SERVICE = "hexgen_flow.v1.WorkerService"

ROLES = {
    f"/{CLIENT_SERVICE}/": Role.TENANT,
    f"/{CLIENT_SERVICE}/SetAlpha": Role.OPERATOR,
}
"""The least role each RPC of the clients' door needs; a tenant's queries are scoped to it
in the handlers (`hexgen_coordinator.service`)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]  # exits, one line
        sys.stderr.write(f"hexgen-coordinator: error: {message}\n")
        sys.exit(2)


def parse_args(argv: list[str] | None = None) -> tuple[CoordinatorConfig, str]:
    defaults = CoordinatorConfig()
    parser = _Parser(prog="python -m hexgen_coordinator", description=__doc__)
    docs = {f.name: f.name for f in fields(CoordinatorConfig)}
    parser.add_argument(
        "--listen", default=defaults.listen, help="the clients' door (CoordinatorService)"
    )
    parser.add_argument(
        "--worker-listen",
        default=defaults.worker_listen,
        metavar="HOST:PORT",
        help="the workers' door (WorkerService); default: on --listen, loopback only",
    )
    parser.add_argument(
        "--redis-url", default=defaults.redis_url, help=f"{REDIS_URL_HELP} (default %(default)s)"
    )
    parser.add_argument(
        "--redis-password-file",
        metavar="FILE",
        default=None,
        help="the password of the Redis user in --redis-url (redis://USER@HOST:PORT/DB)",
    )
    parser.add_argument(
        "--redis-prefix",
        default=None,
        help=f"prefix of every Redis key (default {defaults.redis_prefix}; with "
        "--redis-cluster hf:{0}:, and it must hold a {hash tag})",
    )
    parser.add_argument(
        "--redis-cluster",
        action="store_true",
        help="--redis-url is a node of a Redis Cluster (every key in the prefix's slot)",
    )
    parser.add_argument(
        "--shards",
        metavar="P0,P1,...",
        default="",
        help="every coordinator shard's key prefix, the same list on each coordinator: this "
        "one serves --redis-prefix if that shard is free, else the first free one, else waits "
        "as a spare (docs/scaling.md)",
    )
    parser.add_argument(
        "--advertise",
        metavar="HOST:PORT",
        default="",
        help="with --shards: the address clients reach this coordinator at (default --listen)",
    )
    parser.add_argument("--lease-ttl-s", type=float, default=defaults.lease_ttl_s)
    parser.add_argument("--cluster", default=defaults.cluster)
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--calibration", default=None, metavar="NAME|measured:FILE")
    parser.add_argument("--policy", default=defaults.policy)
    parser.add_argument("--alpha", type=float, default=None)
    parser.add_argument("--time-scale", type=float, default=defaults.time_scale)
    parser.add_argument("--slo-scale", type=float, default=defaults.slo_scale)
    parser.add_argument("--heartbeat-interval-s", type=float, default=defaults.heartbeat_interval_s)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=defaults.heartbeat_timeout_s)
    parser.add_argument("--resume-grace-s", type=float, default=defaults.resume_grace_s)
    parser.add_argument("--max-call-attempts", type=int, default=defaults.max_call_attempts)
    parser.add_argument("--retention-s", type=float, default=defaults.retention_s)
    parser.add_argument("--stream-maxlen", type=int, default=defaults.stream_maxlen)
    parser.add_argument(
        "--session-idle-s",
        type=float,
        default=defaults.session_idle_s,
        help="close a workflow session after this many wall seconds without a call",
    )
    parser.add_argument(
        "--admission", choices=("reject", "best-effort", "off"), default=defaults.admission
    )
    parser.add_argument("--admission-slack", type=float, default=defaults.admission_slack)
    parser.add_argument("--max-running-queries", type=int, default=defaults.max_running_queries)
    parser.add_argument("--max-tenant-queries", type=int, default=defaults.max_tenant_queries)
    parser.add_argument(
        "--max-tenant-prompt-bytes",
        type=int,
        default=defaults.max_tenant_prompt_bytes,
        help="prompt bytes one tenant may keep at once in running calls (RESOURCE_EXHAUSTED "
        "beyond; the keys file's max_prompt_bytes overrides it; default %(default)s)",
    )
    parser.add_argument(
        "--redis-memory-limit",
        type=float,
        default=defaults.redis_memory_limit,
        metavar="SHARE",
        help="refuse new work while Redis holds more than this share of its maxmemory "
        "(default %(default)s)",
    )
    parser.add_argument("--max-prompt-bytes", type=int, default=defaults.max_prompt_bytes)
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=defaults.max_request_bytes,
        help="the largest request the clients' door reads, a whole query with its prompts "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--max-output-tokens",
        type=int,
        default=defaults.max_output_tokens,
        help="most output tokens one call may ask for (default 0: the longest context of "
        "the cluster's models)",
    )
    parser.add_argument("--max-calls", type=int, default=defaults.max_calls)
    parser.add_argument("--max-stages", type=int, default=defaults.max_stages)
    parser.add_argument("--max-id-bytes", type=int, default=defaults.max_id_bytes)
    parser.add_argument("--max-tenant-bytes", type=int, default=defaults.max_tenant_bytes)
    parser.add_argument("--max-slo-s", type=float, default=defaults.max_slo_s)
    parser.add_argument(
        "--metrics-listen",
        default=defaults.metrics_listen,
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (default: not served); "
        "with --tls-cert/--tls-key over HTTPS, with --api-keys-file to operators' keys only "
        "(beyond loopback both, or --insecure)",
    )
    parser.add_argument(
        "--metrics-max-tenants",
        type=int,
        default=defaults.metrics_max_tenants,
        metavar="N",
        help="the first N distinct tenants keep a tenant label of their own in the metrics, "
        'later ones are counted as tenant="other" (default %(default)s; 0: none)',
    )
    parser.add_argument(
        "--worker-token-file",
        metavar="FILE",
        default=None,
        help="refuse workers whose Connect does not carry the token in FILE (UNAUTHENTICATED)",
    )
    parser.add_argument(
        "--api-keys-file",
        metavar="FILE",
        default=None,
        help="authenticate clients with the API keys in FILE (hexgen-flow auth init)",
    )
    add_tls_options(
        parser,
        serves="TLS (both doors)",
        ca_help="the workers' door requires client certificates signed by this CA (mutual TLS)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening beyond loopback without API keys and TLS (protected mode off)",
    )
    parser.add_argument(
        "--learn-costs",
        action=argparse.BooleanOptionalAction,
        default=defaults.learn_costs,
        help="learn each instance's prefill and decode costs online from the calls it served, "
        "with the calibration as the prior (default: off; hexgen_flow.learning)",
    )
    parser.add_argument(
        "--gc-tuning",
        action=argparse.BooleanOptionalAction,
        default=defaults.gc_tuning,
        help="freeze the start-up objects and collect young objects less often, so that a "
        "full garbage collection does not stall the completion path (default: on)",
    )
    parser.add_argument(
        "--pipelined-redis",
        action=argparse.BooleanOptionalAction,
        default=defaults.pipelined_redis,
        help="send the completion path's Redis traffic over one pipelined connection "
        "rather than redis-py's pool (a single Redis; default: on)",
    )
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default=defaults.event_loop,
        help="the asyncio event loop: uvloop where installed (auto), or asyncio's own "
        "(default %(default)s)",
    )
    parser.add_argument("--log-level", default="INFO")
    del docs
    args = parser.parse_args(argv)
    if args.time_scale <= 0:
        parser.error("--time-scale must be > 0")
    if args.slo_scale <= 0:
        parser.error("--slo-scale must be > 0")
    if args.alpha is not None and not 0 <= args.alpha <= 1:
        parser.error("--alpha must be in [0, 1]")
    for flag in (
        "max_call_attempts",
        "stream_maxlen",
        "max_running_queries",
        "max_prompt_bytes",
        "max_calls",
        "max_stages",
        "max_id_bytes",
        "max_tenant_bytes",
        "max_tenant_prompt_bytes",
    ):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.max_request_bytes < args.max_prompt_bytes:
        parser.error(
            f"--max-request-bytes ({args.max_request_bytes}) must be at least --max-prompt-bytes "
            f"({args.max_prompt_bytes}): a request carries its prompts"
        )
    if args.max_output_tokens < 0:
        parser.error("--max-output-tokens must be >= 0 (0: the models' context)")
    if not 0 < args.redis_memory_limit <= 1:
        parser.error("--redis-memory-limit must be in (0, 1]")
    for flag in ("retention_s", "admission_slack", "max_slo_s", "session_idle_s"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0")
    if args.max_tenant_queries < 0:
        parser.error("--max-tenant-queries must be >= 0 (0: no limit)")
    if args.metrics_max_tenants < 0:
        parser.error("--metrics-max-tenants must be >= 0 (0: every tenant as 'other')")
    try:
        tls = TlsFiles.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
        if tls.ca is not None and tls.cert is None:
            raise ConfigError(
                "--tls-ca: the workers' door checks client certificates over "
                "TLS; give --tls-cert and --tls-key too"
            )
        if args.api_keys_file:
            KeyStore(Path(args.api_keys_file))  # a bad file fails here, named
        _refuse_unprotected(args, tls)
        check_redis_url(args.redis_url, cluster=args.redis_cluster)
        redis_prefix = cluster_prefix(
            args.redis_prefix, defaults.redis_prefix, cluster=args.redis_cluster
        )
        shards = ShardMap.parse(args.shards).prefixes if args.shards else ()
        for prefix in shards:
            cluster_prefix(prefix, defaults.redis_prefix, cluster=args.redis_cluster)
        advertise = args.advertise or args.listen
        if shards and (advertise.endswith(":0") or advertise.startswith(("0.0.0.0:", "[::]:"))):
            raise ConfigError(
                f"--advertise: with --shards, other coordinators redirect clients to this "
                f"one's address; {advertise!r} is not one they can reach (give --advertise)"
            )
        if not args.lease_ttl_s > 0:
            raise ConfigError("--lease-ttl-s must be > 0")
        resolve_event_loop(args.event_loop)
        redis_password = (
            read_secret(args.redis_password_file, "--redis-password-file")
            if args.redis_password_file
            else ""
        )
    except HexgenFlowError as exc:
        parser.error(str(exc))
    config = CoordinatorConfig(
        listen=args.listen,
        worker_listen=args.worker_listen,
        redis_url=args.redis_url,
        redis_password=redis_password,
        redis_prefix=redis_prefix,
        redis_cluster=args.redis_cluster,
        shards=shards,
        advertise=advertise if shards else args.advertise,
        lease_ttl_s=args.lease_ttl_s,
        cluster=args.cluster,
        model=args.model,
        calibration=args.calibration,
        policy=args.policy,
        alpha=args.alpha,
        time_scale=args.time_scale,
        slo_scale=args.slo_scale,
        heartbeat_interval_s=args.heartbeat_interval_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        resume_grace_s=args.resume_grace_s,
        max_call_attempts=args.max_call_attempts,
        retention_s=args.retention_s,
        stream_maxlen=args.stream_maxlen,
        session_idle_s=args.session_idle_s,
        worker_token=_worker_token(args.worker_token_file, parser),
        admission=args.admission,
        admission_slack=args.admission_slack,
        max_running_queries=args.max_running_queries,
        max_tenant_queries=args.max_tenant_queries,
        max_tenant_prompt_bytes=args.max_tenant_prompt_bytes,
        redis_memory_limit=args.redis_memory_limit,
        max_prompt_bytes=args.max_prompt_bytes,
        max_request_bytes=args.max_request_bytes,
        max_output_tokens=args.max_output_tokens,
        max_calls=args.max_calls,
        max_stages=args.max_stages,
        max_id_bytes=args.max_id_bytes,
        max_tenant_bytes=args.max_tenant_bytes,
        max_slo_s=args.max_slo_s,
        metrics_listen=args.metrics_listen,
        metrics_max_tenants=args.metrics_max_tenants,
        api_keys_file=args.api_keys_file or "",
        tls_cert=args.tls_cert or "",
        tls_key=args.tls_key or "",
        tls_ca=args.tls_ca or "",
        insecure=args.insecure,
        gc_tuning=args.gc_tuning,
        learn_costs=args.learn_costs,
        event_loop=args.event_loop,
        pipelined_redis=args.pipelined_redis,
    )
    return config, args.log_level


def _refuse_unprotected(args: argparse.Namespace, tls: TlsFiles) -> None:
    """Protected mode (`hexgen_service.exposure`) for both doors and the metrics'."""
    refuse_unprotected(
        "--listen",
        args.listen,
        protected=bool(args.api_keys_file) and tls.cert is not None,
        insecure=args.insecure,
        needs="--api-keys-file and --tls-cert/--tls-key",
    )
    if args.worker_listen:
        refuse_unprotected(
            "--worker-listen",
            args.worker_listen,
            protected=(tls.cert is not None and tls.ca is not None) or bool(args.worker_token_file),
            insecure=args.insecure,
            needs="--tls-ca (mutual TLS) or --worker-token-file",
        )
    else:
        refuse_unprotected(
            "--listen",
            args.listen,
            protected=False,
            insecure=args.insecure,
            needs="--worker-listen (workers and clients on one door)",
        )
    refuse_open_metrics(
        args.metrics_listen,
        tls=tls.cert is not None,
        keys=bool(args.api_keys_file),
        insecure=args.insecure,
    )


async def serve(config: CoordinatorConfig) -> None:
    # Bursts of submissions, completion batches and write-behind share the pool: callers
    # wait for a connection rather than fail when it is busy.
    redis = redis_client(
        config.redis_url, password=config.redis_password or None, cluster=config.redis_cluster
    )
    try:
        await redis.ping()
    except Exception as exc:  # any connection failure reads the same to a user
        raise SystemExit(
            f"hexgen-coordinator: error: cannot reach Redis at {config.redis_url}: {exc}"
        ) from None
    lease: ShardLease | None = None
    holding: asyncio.Task[None] | None = None
    if config.shards:
        shards = ShardMap(config.shards)
        lease = await ShardLease.acquire(
            redis,
            shards,
            config.advertise,
            config.lease_ttl_s,
            preferred=shards.index(config.redis_prefix),
        )
        holding = asyncio.create_task(_hold(lease))
        config = replace(config, redis_prefix=lease.prefix)
        logging.getLogger("hexgen_coordinator").info(
            "serving shard %d of %d (%s) as %s",
            lease.shard,
            len(shards),
            lease.prefix,
            config.advertise,
        )
    pipelined = (
        pipelined_client(
            config.redis_url,
            password=config.redis_password or None,
            cluster=config.redis_cluster,
        )
        if config.pipelined_redis
        else None
    )
    coordinator = Coordinator(config, redis, lease, pipelined=pipelined)
    coordinator.ledger.metrics.tenants.limit = config.metrics_max_tenants
    await coordinator.start()
    gc_pause = coordinator.ledger.metrics.gc_pause
    GcPauses(observe=lambda generation, s: gc_pause.labels(str(generation)).observe(s)).install()
    if config.gc_tuning:  # after start-up: what it built (and rebuilt from Redis) is frozen
        frozen = freeze_startup()
        logging.getLogger("hexgen_coordinator").info(
            "garbage collector: %d start-up objects frozen, thresholds %s",
            frozen,
            gc.get_threshold(),
        )
    tls = TlsFiles.from_flags(
        config.tls_cert or None, config.tls_key or None, config.tls_ca or None
    )
    interceptors = []
    if coordinator.keys is not None:
        interceptors.append(
            AuthInterceptor(
                coordinator.keys,
                ROLES,
                # the workers' own check: a token or a client certificate (WorkerServicer)
                public=(*PUBLIC_METHODS, f"/{WORKER_SERVICE}/"),
            )
        )
    workers_apart = bool(config.worker_listen)

    def register(server: grpc.aio.Server) -> None:
        add_coordinator_services(server, coordinator, workers=not workers_apart)

    server = GrpcServer(
        config.listen,
        register,
        (CLIENT_SERVICE,) if workers_apart else (CLIENT_SERVICE, WORKER_SERVICE),
        tls=tls,
        interceptors=interceptors,
        max_receive_bytes=door_limit(config, workers=not workers_apart),
    )
    worker_server = None
    if workers_apart:
        worker_server = GrpcServer(
            config.worker_listen,
            lambda s: add_worker_service(s, coordinator),
            (WORKER_SERVICE,),
            tls=tls,
            require_client_cert=tls.ca is not None,
            max_receive_bytes=door_limit(config, clients=False),
        )
        await worker_server.start()
    await server.start()
    logging.getLogger("hexgen_coordinator").info(
        "coordinator on %s: cluster %s (calibration %s), policy %s, alpha %s, time scale %s",
        config.listen,
        config.cluster,
        coordinator.cluster.calibration.name,
        config.policy,
        coordinator.scheduler.alpha,
        coordinator.clock.time_scale,
    )
    metrics_server = None
    if config.metrics_listen:
        protection = MetricsProtection.of(config.tls_cert, config.tls_key, config.api_keys_file)
        address, metrics_server = serve_metrics(
            coordinator.ledger.metrics.registry, config.metrics_listen, protection
        )
        logging.getLogger("hexgen_coordinator").info(
            "metrics on %s://%s/metrics%s",
            protection.scheme,
            address,
            " (an operator's API key)" if protection.keys else "",
        )

    async def stop() -> None:
        await coordinator.stop()
        if worker_server is not None:
            await worker_server.stop()
        if lease is not None and holding is not None:
            holding.cancel()
            await lease.release()  # a spare takes the shard now, not a lease time later

    try:
        await server.serve_until_signalled(on_stop=stop)
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
        if pipelined is not None:
            await pipelined.aclose()
        await redis.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


async def _hold(lease: ShardLease) -> None:
    """Keep the shard's lease; stop the process the moment it is lost, before it can act
    as the shard's coordinator beside the one that took it (nothing graceful: a graceful
    stop would still write)."""
    try:
        await lease.keep()
    except LeaseLostError as exc:
        logging.getLogger("hexgen_coordinator").critical("%s: stopping now", exc)
        logging.shutdown()
        os._exit(3)


def _worker_token(path: str | None, parser: argparse.ArgumentParser) -> str:
    if path is None:
        return ""
    try:
        return read_token(path)
    except HexgenFlowError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> None:
    config, level = parse_args(argv)
    setup_logging(level)
    try:
        run(serve(config), config.event_loop)
    except HexgenFlowError as exc:
        sys.stderr.write(f"hexgen-coordinator: error: {exc}\n")
        sys.exit(2)
    except OSError as exc:
        sys.stderr.write(f"hexgen-coordinator: error: {exc}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
