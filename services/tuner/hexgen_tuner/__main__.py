"""``python -m hexgen_tuner``: run the α tuner until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import NoReturn

import redis
import redis.asyncio as aioredis

from hexgen_flow.errors import HexgenFlowError
from hexgen_service.telemetry import setup_logging
from hexgen_tuner.config import TunerConfig
from hexgen_tuner.service import serve

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
        "--coordinator", default=d.coordinator, help=f"HOST:PORT (default {d.coordinator})"
    )
    parser.add_argument("--redis-url", default=d.redis_url, help=f"(default {d.redis_url})")
    parser.add_argument(
        "--redis-prefix", default=d.redis_prefix, help=f"key prefix (default {d.redis_prefix})"
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
        help=f"finished queries replayed per run (default {d.window})",
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
        help="serve Prometheus metrics on http://HOST:PORT/metrics (default: not served)",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    args = parser.parse_args(argv)
    setup_logging(args.log_level.upper())
    try:
        return TunerConfig(
            listen=args.listen,
            coordinator=args.coordinator,
            redis_url=args.redis_url,
            redis_prefix=args.redis_prefix,
            period_s=args.period_s,
            window=args.window,
            min_queries=args.min_queries,
            seed=args.seed,
            tolerance=args.tolerance,
            calibration=args.calibration,
            metrics_listen=args.metrics_listen,
        )
    except HexgenFlowError as exc:
        parser.error(str(exc))


async def _check_redis(url: str) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        await client.ping()
    finally:
        await client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    try:
        asyncio.run(_check_redis(config.redis_url))
    except (redis.RedisError, OSError, ValueError) as exc:
        print(f"{PROG}: error: cannot reach Redis at {config.redis_url}: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except OSError as exc:  # the listen address is taken or invalid
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
