"""``python -m hexgen_tuner``: run the α tuner until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import NoReturn
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.exceptions import RedisClusterException

from hexgen_flow.errors import HexgenFlowError
from hexgen_service.redis_keys import cluster_prefix
from hexgen_service.redis_sentinel import REDIS_URL_HELP, check_redis_url
from hexgen_service.telemetry import setup_logging
from hexgen_service.tls import add_tls_options
from hexgen_tuner.config import TunerConfig
from hexgen_tuner.service import check_files, redis_client, serve

PROG = "hexgen-tuner"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{PROG}: error: {message}\n")
        sys.exit(2)


def parse_config(argv: Sequence[str] | None = None) -> TunerConfig:
    d = TunerConfig()
    parser = _Parser(
        prog="python -m hexgen_tuner",
        description="Online alpha tuning: replay recent traffic in the simulator for each "
        "alpha and push the best one to the coordinator.",
    )
    parser.add_argument("--listen", default=d.listen, help=f"HOST:PORT (default {d.listen})")
    parser.add_argument(
        "--coordinator",
        default=d.coordinator,
        help=f"HOST:PORT[,...] (default {d.coordinator}); with --shards every coordinator",
    )
    parser.add_argument(
        "--shards",
        metavar="P0,P1,...",
        default="",
        help="tune a sharded mesh: every shard's key prefix, as the coordinators are given "
        "them; the window is all shards' traffic and the alpha goes to every coordinator",
    )
    parser.add_argument(
        "--redis-url", default=d.redis_url, help=f"{REDIS_URL_HELP} (default {d.redis_url})"
    )
    parser.add_argument(
        "--redis-prefix",
        default=None,
        help=f"key prefix (default {d.redis_prefix}; with --redis-cluster hf:{{0}}:)",
    )
    parser.add_argument(
        "--redis-cluster",
        action="store_true",
        help="--redis-url is a node of a Redis Cluster (the prefix must hold a {hash tag})",
    )
    parser.add_argument(
        "--period-s",
        type=float,
        default=d.period_s,
        help=f"wall seconds between tuning runs (default {d.period_s:g})",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=d.window,
        help=f"latest admitted queries replayed per run (default {d.window})",
    )
    parser.add_argument(
        "--min-queries",
        type=int,
        default=d.min_queries,
        help=f"fewer in the window: the run changes nothing (default {d.min_queries})",
    )
    parser.add_argument(
        "--seed", type=int, default=d.seed, help=f"seed of the replays (default {d.seed})"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=d.tolerance,
        help="alphas within this fraction of the best replayed P95 count as the best; the "
        f"current one is then kept (default {d.tolerance:g})",
    )
    parser.add_argument(
        "--calibration",
        default=None,
        metavar="NAME|measured:FILE",
        help="the coordinator's latency calibration (default chess-measured)",
    )
    parser.add_argument(
        "--metrics-listen",
        default=d.metrics_listen,
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (default: not served); "
        "with --tls-cert/--tls-key over HTTPS, with --api-keys-file to operators' keys only "
        "(beyond loopback both, or --insecure)",
    )
    security = parser.add_argument_group("security (docs/security.md)")
    security.add_argument(
        "--api-keys-file",
        default=d.api_keys_file,
        metavar="FILE",
        help="check callers' API keys against this keys file: GetAlpha needs a tenant key, "
        "ListTuningRuns and Retune an operator key (default: no keys checked)",
    )
    add_tls_options(security, serves="TLS")
    security.add_argument(
        "--api-key-file",
        default=d.api_key_file,
        metavar="FILE",
        help="the tuner's own (operator) API key, sent to the coordinator (default: "
        "$HEXGEN_FLOW_API_KEY, else none)",
    )
    security.add_argument(
        "--redis-password-file",
        default=d.redis_password_file,
        metavar="FILE",
        help="the password of the Redis user --redis-url names (redis://tuner@HOST:PORT/0)",
    )
    security.add_argument(
        "--insecure",
        action="store_true",
        help="listen (and serve --metrics-listen) beyond loopback without --api-keys-file "
        "and --tls-cert/--tls-key",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    args = parser.parse_args(argv)
    setup_logging(args.log_level.upper())
    try:
        check_redis_url(args.redis_url, cluster=args.redis_cluster)
        config = TunerConfig(
            listen=args.listen,
            coordinator=args.coordinator,
            redis_url=args.redis_url,
            redis_prefix=cluster_prefix(args.redis_prefix, cluster=args.redis_cluster),
            redis_cluster=args.redis_cluster,
            shards=tuple(
                cluster_prefix(p.strip(), cluster=args.redis_cluster)
                for p in args.shards.split(",")
                if p.strip()
            ),
            period_s=args.period_s,
            window=args.window,
            min_queries=args.min_queries,
            seed=args.seed,
            tolerance=args.tolerance,
            calibration=args.calibration,
            metrics_listen=args.metrics_listen,
            api_keys_file=args.api_keys_file,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_ca=args.tls_ca,
            api_key_file=args.api_key_file,
            redis_password_file=args.redis_password_file,
            insecure=args.insecure,
        )
        check_files(config)
    except HexgenFlowError as exc:
        parser.error(str(exc))
    return config


async def _check_redis(config: TunerConfig) -> None:
    client = redis_client(config)
    try:
        await client.ping()
    finally:
        await client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


def _redacted(url: str) -> str:
    """`url` with its password, if any, replaced by ``***`` (it goes to the logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + parts.netloc.rpartition("@")[2]))


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    try:
        asyncio.run(_check_redis(config))
    except (redis.RedisError, RedisClusterException, OSError, ValueError) as exc:
        where = _redacted(config.redis_url)
        print(f"{PROG}: error: cannot reach Redis at {where}: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except (OSError, HexgenFlowError) as exc:  # the listen address is taken or invalid
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
