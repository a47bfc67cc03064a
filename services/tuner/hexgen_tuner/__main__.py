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
from hexgen_service.telemetry import setup_logging
from hexgen_service.tls import add_tls_options
from hexgen_tuner.config import TunerConfig, add_tuner_options, tuner_config_from_args
from hexgen_tuner.service import check_files, redis_client, serve

PROG = "hexgen-tuner"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{PROG}: error: {message}\n")
        sys.exit(2)


def parse_config(argv: Sequence[str] | None = None) -> TunerConfig:
    """The tuner's settings. Every option but the TLS ones (`hexgen_service.tls`, shared
    with the other services) is a `TunerConfig` setting, declared, parsed and checked
    there; the files the security options name are read here once (`check_files`)."""
    parser = _Parser(
        prog="python -m hexgen_tuner",
        description="Online alpha tuning: replay recent traffic in the simulator for each "
        "alpha and push the best one to the coordinator.",
    )
    add_tuner_options(parser)
    add_tls_options(parser, serves="TLS")
    args = parser.parse_args(argv)
    try:
        config = tuner_config_from_args(args)
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
    setup_logging(config.log_level)
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
