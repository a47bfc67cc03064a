"""The TunerService over gRPC: protobuf in, protobuf out, errors as statuses; and `serve`,
which runs it (with health, reflection and tracing) and the periodic tuning loop."""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path
from typing import Never, cast

import grpc
import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from hexgen_api.v1 import coordinator_pb2, tuner_pb2, tuner_pb2_grpc
from hexgen_client.client import CoordinatorClient
from hexgen_client.errors import CoordinatorError
from hexgen_service.auth import AuthInterceptor, KeyStore, Role, read_secret
from hexgen_service.exposure import is_loopback
from hexgen_service.metrics_server import MetricsProtection, serve_metrics
from hexgen_service.redis_sentinel import async_master, parse_sentinel_url
from hexgen_service.server import GrpcServer
from hexgen_service.telemetry import client_interceptors, setup_tracing
from hexgen_service.tls import TlsFiles, ca_from_env, channel_credentials, server_credentials
from hexgen_tuner.config import TunerConfig
from hexgen_tuner.store import TuningRunRecord
from hexgen_tuner.tuner import AlphaTuner

__all__ = [
    "RULES",
    "SERVICE_NAME",
    "TunerServicer",
    "check_files",
    "redis_client",
    "run_to_proto",
    "serve",
]

log = logging.getLogger(__name__)

SERVICE_NAME = "hexgen_flow.v1.TunerService"
DEFAULT_RUNS_LIMIT = 20

RULES: dict[str, Role] = {
    f"/{SERVICE_NAME}/GetAlpha": Role.TENANT,
    f"/{SERVICE_NAME}/ListTuningRuns": Role.OPERATOR,
    f"/{SERVICE_NAME}/Retune": Role.OPERATOR,
}
"""The least role of each TunerService method (with ``--api-keys-file``): anyone with a key
may read the α in force; the runs (the traffic's shape) and starting one are an
operator's. Health checking and reflection need no key."""

Context = grpc.aio.ServicerContext


def run_to_proto(run: TuningRunRecord) -> tuner_pb2.TuningRun:
    return tuner_pb2.TuningRun(
        run_id=run.run_id,
        started_s=run.started_s,
        finished_s=run.finished_s,
        window_queries=run.window_queries,
        qps=run.qps,
        curve=[
            tuner_pb2.AlphaPoint(
                alpha=p.alpha, p95_s=p.p95_s, mean_s=p.mean_s, slo_attainment=p.slo_attainment
            )
            for p in run.curve
        ],
        best_alpha=run.best_alpha,
        previous_alpha=run.previous_alpha,
        applied=run.applied,
        reason=run.reason,
    )


def change_to_proto(change: coordinator_pb2.AlphaHistoryEntry) -> tuner_pb2.AlphaChange:
    """An entry of the coordinator's α history as GetAlpha shows it (Unix seconds, as the
    tuner's runs)."""
    return tuner_pb2.AlphaChange(time_s=change.unix_s, alpha=change.alpha, reason=change.reason)


class TunerServicer(tuner_pb2_grpc.TunerServiceServicer):
    def __init__(self, tuner: AlphaTuner) -> None:
        self.tuner = tuner

    async def GetAlpha(  # noqa: N802 - gRPC method name
        self, request: tuner_pb2.GetAlphaRequest, context: Context[object, object]
    ) -> tuner_pb2.GetAlphaResponse:
        try:
            got = await self.tuner.alpha_history()
        except CoordinatorError as exc:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"no alpha known: the coordinator at {exc.address} keeps it and its history, "
                f"and cannot be asked ({exc.code.name})",
            )
        return tuner_pb2.GetAlphaResponse(
            alpha=got.alpha, history=[change_to_proto(c) for c in got.changes]
        )

    async def ListTuningRuns(  # noqa: N802
        self, request: tuner_pb2.ListTuningRunsRequest, context: Context[object, object]
    ) -> tuner_pb2.ListTuningRunsResponse:
        if request.limit < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"limit: must be >= 0, got {request.limit}"
            )
        limit = request.limit or DEFAULT_RUNS_LIMIT
        try:
            runs = await self.tuner.store.runs(limit)
        except redis.RedisError as exc:
            await _redis_unavailable(context, exc)
        return tuner_pb2.ListTuningRunsResponse(runs=[run_to_proto(r) for r in runs])

    async def Retune(  # noqa: N802
        self, request: tuner_pb2.RetuneRequest, context: Context[object, object]
    ) -> tuner_pb2.RetuneResponse:
        try:
            run = await self.tuner.tune_once()
        except redis.RedisError as exc:
            await _redis_unavailable(context, exc)
        return tuner_pb2.RetuneResponse(run=run_to_proto(run))


async def _redis_unavailable(context: Context[object, object], exc: redis.RedisError) -> Never:
    await context.abort(grpc.StatusCode.UNAVAILABLE, f"Redis: {exc}")


def check_files(config: TunerConfig) -> None:
    """Read every file the security flags name (keys, certificates, secrets) once, so that
    a missing or malformed one is a ConfigError naming its flag before anything starts."""
    tls = config.tls_files
    if config.api_keys_file:
        KeyStore(Path(config.api_keys_file))
    if tls.cert is not None:
        server_credentials(TlsFiles(tls.cert, tls.key), require_client_cert=False)
    ca = ca_from_env(config.tls_ca)
    if ca is not None:
        channel_credentials(TlsFiles(ca=Path(ca)))
    if config.api_key_file:
        read_secret(config.api_key_file, "--api-key-file")
    if config.redis_password_file:
        read_secret(config.redis_password_file, "--redis-password-file")


def redis_client(config: TunerConfig) -> aioredis.Redis[bytes]:
    """The tuner's Redis client: `redis_url`, logged in with the password of
    `redis_password_file` when there is one; on a Redis Cluster (`redis_cluster`) the
    cluster's client, typed as a plain one (it takes the same commands, and transactions
    whose keys share one slot, as the prefix's hash tag makes them)."""
    password = (
        read_secret(config.redis_password_file, "--redis-password-file")
        if config.redis_password_file
        else None
    )
    if config.redis_cluster:
        return cast(
            "aioredis.Redis[bytes]",
            RedisCluster.from_url(config.redis_url, password=password),
        )
    sentinel = parse_sentinel_url(config.redis_url)
    if sentinel is not None:  # the master the Sentinels name
        return async_master(sentinel, password=password)
    client: aioredis.Redis[bytes] = aioredis.Redis.from_url(config.redis_url, password=password)
    return client


def coordinator_client(config: TunerConfig) -> CoordinatorClient:
    """The client of the coordinator whose α is tuned: its own key, the CA to check it."""
    key = read_secret(config.api_key_file, "--api-key-file") if config.api_key_file else None
    return CoordinatorClient(
        config.coordinator,
        timeout_s=config.rpc_timeout_s,
        interceptors=client_interceptors(),
        api_key=key,
        tls_ca=config.tls_ca,
    )


async def serve(config: TunerConfig) -> None:
    """Run the tuner until SIGTERM/SIGINT: the gRPC service and a tuning run every period."""
    tracer = setup_tracing("hexgen-tuner")
    tls = config.tls_files
    interceptors = (
        [AuthInterceptor(KeyStore(Path(config.api_keys_file)), RULES)]
        if config.api_keys_file
        else []
    )
    store_client = redis_client(config)
    coordinator = coordinator_client(config)
    tuner = AlphaTuner(config, store_client, coordinator, tracer=tracer)

    def register(server: grpc.aio.Server) -> None:
        tuner_pb2_grpc.add_TunerServiceServicer_to_server(TunerServicer(tuner), server)

    server = GrpcServer(
        config.listen,
        register,
        [SERVICE_NAME],
        tls=tls if tls.cert is not None else None,
        interceptors=interceptors,
    )
    missing = [
        *([] if config.api_keys_file else ["checks no API keys"]),
        *([] if tls.cert is not None else ["speaks plaintext"]),
    ]
    if missing and not is_loopback(config.listen):  # allowed by --insecure
        log.warning("--insecure: the TunerService on %s %s", config.listen, " and ".join(missing))
    stop = asyncio.Event()
    await server.start()
    metrics_server = None
    if config.metrics_listen:
        protection = MetricsProtection.of(tls.cert, tls.key, config.api_keys_file)
        address, metrics_server = serve_metrics(
            tuner.metrics.registry, config.metrics_listen, protection
        )
        log.info(
            "metrics on %s://%s/metrics%s",
            protection.scheme,
            address,
            " (an operator's API key)" if protection.keys else "",
        )
    loop_task = asyncio.create_task(tuner.run_periodically(stop))
    log.info(
        "tuning the coordinator at %s every %s s (window %d, at least %d queries)",
        config.coordinator,
        _g(config.period_s),
        config.window,
        config.min_queries,
    )
    try:
        await server.serve_until_signalled(on_stop=stop.set)
    finally:
        stop.set()
        await loop_task
        if metrics_server is not None:
            metrics_server.shutdown()
        await coordinator.close()
        await store_client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


def _g(value: float) -> str:
    return f"{value:g}" if math.isfinite(value) else str(value)
