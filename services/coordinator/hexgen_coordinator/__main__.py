"""`python -m hexgen_coordinator`: run the coordinator until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import fields

import grpc

from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.coordinator import Coordinator
from hexgen_coordinator.edge import add_coordinator_services
from hexgen_coordinator.redis_retry import redis_client
from hexgen_flow.errors import HexgenFlowError
from hexgen_service.metrics_server import serve_metrics
from hexgen_service.server import GrpcServer
from hexgen_service.telemetry import setup_logging
from hexgen_service.worker_token import read_token

SERVICE_NAMES = ("hexgen_flow.v1.CoordinatorService", "hexgen_flow.v1.WorkerService")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]  # exits, one line
        sys.stderr.write(f"hexgen-coordinator: error: {message}\n")
        sys.exit(2)


def parse_args(argv: list[str] | None = None) -> tuple[CoordinatorConfig, str]:
    defaults = CoordinatorConfig()
    parser = _Parser(prog="python -m hexgen_coordinator", description=__doc__)
    docs = {f.name: f.name for f in fields(CoordinatorConfig)}
    parser.add_argument("--listen", default=defaults.listen)
    parser.add_argument("--redis-url", default=defaults.redis_url)
    parser.add_argument("--redis-prefix", default=defaults.redis_prefix)
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
    parser.add_argument("--max-prompt-bytes", type=int, default=defaults.max_prompt_bytes)
    parser.add_argument("--max-calls", type=int, default=defaults.max_calls)
    parser.add_argument("--max-stages", type=int, default=defaults.max_stages)
    parser.add_argument("--max-id-bytes", type=int, default=defaults.max_id_bytes)
    parser.add_argument("--max-tenant-bytes", type=int, default=defaults.max_tenant_bytes)
    parser.add_argument("--max-slo-s", type=float, default=defaults.max_slo_s)
    parser.add_argument(
        "--metrics-listen",
        default=defaults.metrics_listen,
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (default: not served)",
    )
    parser.add_argument(
        "--worker-token-file",
        metavar="FILE",
        default=None,
        help="refuse workers whose Connect does not carry the token in FILE (UNAUTHENTICATED)",
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
    ):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    for flag in ("retention_s", "admission_slack", "max_slo_s", "session_idle_s"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0")
    if args.max_tenant_queries < 0:
        parser.error("--max-tenant-queries must be >= 0 (0: no limit)")
    config = CoordinatorConfig(
        listen=args.listen,
        redis_url=args.redis_url,
        redis_prefix=args.redis_prefix,
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
        max_prompt_bytes=args.max_prompt_bytes,
        max_calls=args.max_calls,
        max_stages=args.max_stages,
        max_id_bytes=args.max_id_bytes,
        max_tenant_bytes=args.max_tenant_bytes,
        max_slo_s=args.max_slo_s,
        metrics_listen=args.metrics_listen,
    )
    return config, args.log_level


async def serve(config: CoordinatorConfig) -> None:
    # Bursts of submissions, completion batches and write-behind share the pool: callers
    # wait for a connection rather than fail when it is busy.
    redis = redis_client(config.redis_url)
    try:
        await redis.ping()
    except Exception as exc:  # any connection failure reads the same to a user
        raise SystemExit(
            f"hexgen-coordinator: error: cannot reach Redis at {config.redis_url}: {exc}"
        ) from None
    coordinator = Coordinator(config, redis)
    await coordinator.start()

    def register(server: grpc.aio.Server) -> None:
        add_coordinator_services(server, coordinator)

    server = GrpcServer(config.listen, register, SERVICE_NAMES)
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
        address, metrics_server = serve_metrics(
            coordinator.ledger.metrics.registry, config.metrics_listen
        )
        logging.getLogger("hexgen_coordinator").info("metrics on http://%s/metrics", address)
    try:
        await server.serve_until_signalled(on_stop=coordinator.stop)
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
        await redis.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


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
        asyncio.run(serve(config))
    except HexgenFlowError as exc:
        sys.stderr.write(f"hexgen-coordinator: error: {exc}\n")
        sys.exit(2)
    except OSError as exc:
        sys.stderr.write(f"hexgen-coordinator: error: {exc}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
