"""`python -m hexgen_coordinator`: run the coordinator until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

import grpc

from hexgen_coordinator.config import CoordinatorConfig, add_coordinator_options
from hexgen_coordinator.coordinator import Coordinator
from hexgen_coordinator.edge import door_limit
from hexgen_coordinator.redis_retry import cluster_prefix, pipelined_client, redis_client
from hexgen_coordinator.service import add_coordinator_services, add_worker_service
from hexgen_coordinator.shards import LeaseLostError, ShardLease, ShardMap
from hexgen_flow.errors import ConfigError, HexgenFlowError
from hexgen_service.auth import PUBLIC_METHODS, AuthInterceptor, KeyStore, Role
from hexgen_service.event_loop import resolve_event_loop, run
from hexgen_service.exposure import refuse_open_metrics, refuse_unprotected
from hexgen_service.gc_tuning import GcPauses, freeze_startup
from hexgen_service.metrics_server import MetricsProtection, serve_metrics
from hexgen_service.server import GrpcServer
from hexgen_service.settings import from_args
from hexgen_service.telemetry import setup_logging
from hexgen_service.tls import TlsFiles, add_tls_options

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
    """The configuration of a command line, and its log level. Every option but the TLS
    ones (`hexgen_service.tls`, shared with the other services) is a `CoordinatorConfig`
    setting, declared, parsed and checked there."""
    parser = _Parser(prog="python -m hexgen_coordinator", description=__doc__)
    add_coordinator_options(parser)
    add_tls_options(
        parser,
        serves="TLS (both doors)",
        ca_help="the workers' door requires client certificates signed by this CA (mutual TLS)",
    )
    args = parser.parse_args(argv)
    defaults = CoordinatorConfig()
    try:
        config = from_args(CoordinatorConfig, args)
        tls = TlsFiles.from_flags(
            config.tls_cert or None, config.tls_key or None, config.tls_ca or None
        )
        if tls.ca is not None and tls.cert is None:
            raise ConfigError(
                "--tls-ca: the workers' door checks client certificates over "
                "TLS; give --tls-cert and --tls-key too"
            )
        if config.api_keys_file:
            KeyStore(Path(config.api_keys_file))  # a bad file fails here, named
        _refuse_unprotected(config, tls)
        # given or not: on a Redis Cluster the default prefix is one with a hash tag
        redis_prefix = cluster_prefix(
            args.redis_prefix, defaults.redis_prefix, cluster=config.redis_cluster
        )
        shards = ShardMap(config.shards).prefixes if config.shards else ()
        for prefix in shards:
            cluster_prefix(prefix, defaults.redis_prefix, cluster=config.redis_cluster)
        advertise = config.advertise or config.listen
        if shards and (advertise.endswith(":0") or advertise.startswith(("0.0.0.0:", "[::]:"))):
            raise ConfigError(
                f"--advertise: with --shards, other coordinators redirect clients to this "
                f"one's address; {advertise!r} is not one they can reach (give --advertise)"
            )
        resolve_event_loop(config.event_loop)
    except HexgenFlowError as exc:
        parser.error(str(exc))
    config = replace(
        config,
        redis_prefix=redis_prefix,
        shards=shards,
        advertise=advertise if shards else config.advertise,
    )
    return config, config.log_level


def _refuse_unprotected(config: CoordinatorConfig, tls: TlsFiles) -> None:
    """Protected mode (`hexgen_service.exposure`) for both doors and the metrics'."""
    refuse_unprotected(
        "--listen",
        config.listen,
        protected=bool(config.api_keys_file) and tls.cert is not None,
        insecure=config.insecure,
        needs="--api-keys-file and --tls-cert/--tls-key",
    )
    if config.worker_listen:
        refuse_unprotected(
            "--worker-listen",
            config.worker_listen,
            protected=(tls.cert is not None and tls.ca is not None) or bool(config.worker_token),
            insecure=config.insecure,
            needs="--tls-ca (mutual TLS) or --worker-token-file",
        )
    else:
        refuse_unprotected(
            "--listen",
            config.listen,
            protected=False,
            insecure=config.insecure,
            needs="--worker-listen (workers and clients on one door)",
        )
    refuse_open_metrics(
        config.metrics_listen,
        tls=tls.cert is not None,
        keys=bool(config.api_keys_file),
        insecure=config.insecure,
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
    coordinator.metrics.tenants.limit = config.metrics_max_tenants
    await coordinator.start()
    gc_pause = coordinator.metrics.gc_pause
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
            coordinator.metrics.registry, config.metrics_listen, protection
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
