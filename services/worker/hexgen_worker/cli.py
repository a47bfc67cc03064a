"""``python -m hexgen_worker``: one worker process.

Bad arguments exit with code 2 and one line on stderr, ``hexgen-worker: error: ...``; so
does a hello the coordinator rejects (logged) and an engine that cannot run here (vLLM not
installed). SIGTERM and SIGINT stop the worker cleanly with code 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from hexgen_flow.errors import HexgenFlowError
from hexgen_service.auth import KeyStore
from hexgen_service.telemetry import setup_logging
from hexgen_service.tls import add_tls_options
from hexgen_worker.config import WorkerConfig, add_worker_options, worker_config_from_args
from hexgen_worker.worker import EXIT_REJECTED, Worker

__all__ = ["build_parser", "config_from_args", "main"]

PROG = "hexgen-worker"


class UsageError(Exception):
    """A command-line error found by argparse."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors raise `UsageError` (printed by `main` as one line)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The command line: every `WorkerConfig` option (declared there) and the TLS ones."""
    parser = _Parser(
        prog=PROG,
        description="A HexGen-Flow worker: one serving instance (local queue + engine) "
        "linked to a coordinator, or to several coordinator shards at once.",
    )
    add_worker_options(parser)
    add_tls_options(
        parser,
        serves=None,
        ca_help="connect over TLS, verifying the coordinator against this CA (PEM)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """The resolved configuration of parsed arguments (raises `ConfigError`)."""
    if args.api_keys_file:
        KeyStore(Path(args.api_keys_file))  # a bad file fails here, named
    return worker_config_from_args(args).resolved()


async def _serve(config: WorkerConfig) -> int:
    worker = Worker(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, worker.stop)
    return await worker.run()


def main(argv: Sequence[str] | None = None) -> int:
    """Run a worker; returns the exit status."""
    try:
        config = config_from_args(build_parser().parse_args(argv))
    except (UsageError, HexgenFlowError) as exc:
        print(f"{PROG}: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_REJECTED
    setup_logging(config.log_level)
    try:
        return asyncio.run(_serve(config))
    except HexgenFlowError as exc:  # e.g. the engine cannot run here
        print(f"{PROG}: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_REJECTED
    except KeyboardInterrupt:  # a second Ctrl-C while stopping
        return 0


def _one_line(text: str) -> str:
    return " ".join(text.split())
