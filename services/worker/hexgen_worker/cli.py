"""``python -m hexgen_worker``: one worker process.

Bad arguments exit with code 2 and one line on stderr, ``hexgen-worker: error: ...``; so
does a hello the coordinator rejects (logged) and an engine that cannot run here (vLLM not
installed). SIGTERM and SIGINT stop the worker cleanly with code 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from hexgen_flow.cluster import DEFAULT_MODEL
from hexgen_flow.errors import HexgenFlowError
from hexgen_flow.sim.engines import ENGINE_MODELS
from hexgen_service.auth import KeyStore
from hexgen_service.telemetry import setup_logging
from hexgen_service.tls import add_tls_options
from hexgen_service.worker_token import read_token
from hexgen_worker.config import ENGINE_KINDS, WorkerConfig
from hexgen_worker.worker import EXIT_REJECTED, Worker

__all__ = ["build_parser", "config_from_args", "main"]

PROG = "hexgen-worker"
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class UsageError(Exception):
    """A command-line error found by argparse."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors raise `UsageError` (printed by `main` as one line)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _engine_arg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed: Any = json.loads(value)
    except json.JSONDecodeError:
        parsed = value  # a bare string, e.g. dtype=bfloat16
    return key.strip(), parsed


def build_parser() -> argparse.ArgumentParser:
    defaults = WorkerConfig()
    parser = _Parser(
        prog=PROG,
        description="A HexGen-Flow worker: one serving instance (local queue + engine) "
        "linked to a coordinator, or to several coordinator shards at once.",
    )
    parser.add_argument(
        "--coordinator",
        required=True,
        action="append",
        metavar="HOST:PORT",
        help="the coordinator's worker door; repeat it to serve several coordinator shards "
        "at once (one queue for all of their calls)",
    )
    parser.add_argument("--worker-id", required=True, metavar="ID", help="stable across restarts")
    parser.add_argument(
        "--slot", type=int, default=defaults.slot, help="cluster slot; -1: any of my GPU type"
    )
    parser.add_argument("--gpu", required=True, help="GPU type, e.g. A100, A6000, L40S, H100")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="latency-model name")
    parser.add_argument(
        "--calibration",
        default=None,
        metavar="NAME|measured:FILE",
        help="where the simulated engine's and the local queue's latency numbers come from "
        "(default chess-measured; in a mesh, the coordinator's)",
    )
    parser.add_argument("--engine", choices=ENGINE_KINDS, default=defaults.engine)
    parser.add_argument(
        "--engine-model",
        choices=sorted(ENGINE_MODELS),
        default=defaults.engine_model,
        help="simulated engine: the engine model it runs, as the simulator's --engine "
        f"(default {defaults.engine_model})",
    )
    parser.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="simulated engine: prefix caching in the engine model (default: the engine "
        "model's; vllm-v1 caches, as vLLM V1 does)",
    )
    parser.add_argument(
        "--kv-cache-tokens", type=int, help="default: the latency model's KV capacity"
    )
    parser.add_argument("--max-batch", type=int, help="default: the latency model's (256)")
    parser.add_argument(
        "--max-concurrency", type=int, help="real engines: calls in flight (default max batch)"
    )
    parser.add_argument(
        "--max-context-tokens",
        type=int,
        default=defaults.max_context_tokens,
        help="real engines: shrink calls to this context (0: no limit)",
    )
    parser.add_argument("--openai-url", default="", metavar="URL")
    parser.add_argument("--openai-model", default="", metavar="NAME")
    parser.add_argument("--openai-api", choices=("completions", "chat"), default="completions")
    parser.add_argument(
        "--openai-priority",
        action="store_true",
        help="send the queue order as vLLM's priority (server: --scheduling-policy priority)",
    )
    parser.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="real engines: let the model stop at end-of-sequence",
    )
    parser.add_argument("--vllm-model", default="", metavar="PATH")
    parser.add_argument(
        "--vllm-arg",
        type=_engine_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra AsyncEngineArgs field, VALUE as JSON (repeatable), e.g. enforce_eager=true",
    )
    parser.add_argument(
        "--log-level", type=str.upper, choices=_LOG_LEVELS, default=defaults.log_level
    )
    parser.add_argument(
        "--worker-token-file",
        metavar="FILE",
        default=None,
        help="send the token in FILE with the stream (a coordinator with a token requires it)",
    )
    add_tls_options(
        parser,
        serves=None,
        ca_help="connect over TLS, verifying the coordinator against this CA (PEM)",
    )
    parser.add_argument(
        "--metrics-listen",
        default=defaults.metrics_listen,
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (default: not served); "
        "beyond loopback only with --metrics-tls-cert/--metrics-tls-key and --api-keys-file, "
        "or --insecure",
    )
    parser.add_argument(
        "--metrics-tls-cert",
        default=None,
        metavar="FILE",
        help="serve the metrics over HTTPS with this server certificate (PEM; not --tls-cert, "
        "the worker's client certificate)",
    )
    parser.add_argument(
        "--metrics-tls-key",
        default=None,
        metavar="FILE",
        help="the private key of --metrics-tls-cert (PEM)",
    )
    parser.add_argument(
        "--api-keys-file",
        default=None,
        metavar="FILE",
        help="answer a scrape of the metrics only with an API key of this keys file "
        "(any role: a worker's metrics name no tenant), else 401",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="serve --metrics-listen beyond loopback without HTTPS and API keys",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """The resolved configuration of parsed arguments (raises `ConfigError`)."""
    if args.api_keys_file:
        KeyStore(Path(args.api_keys_file))  # a bad file fails here, named
    return WorkerConfig(
        coordinator=args.coordinator[0],
        extra_coordinators=tuple(args.coordinator[1:]),
        worker_id=args.worker_id,
        slot=args.slot,
        gpu=args.gpu,
        model=args.model,
        calibration=args.calibration,
        engine=args.engine,
        engine_model=args.engine_model,
        prefix_caching=args.prefix_caching,
        kv_cache_tokens=args.kv_cache_tokens,
        max_batch=args.max_batch,
        max_concurrency=args.max_concurrency,
        max_context_tokens=args.max_context_tokens,
        openai_url=args.openai_url,
        openai_model=args.openai_model,
        openai_api=args.openai_api,
        openai_priority=args.openai_priority,
        ignore_eos=args.ignore_eos,
        vllm_model=args.vllm_model,
        vllm_engine_args=dict(args.vllm_arg),
        log_level=args.log_level,
        metrics_listen=args.metrics_listen,
        metrics_tls_cert=args.metrics_tls_cert or "",
        metrics_tls_key=args.metrics_tls_key or "",
        api_keys_file=args.api_keys_file or "",
        insecure=args.insecure,
        worker_token=read_token(args.worker_token_file) if args.worker_token_file else "",
        tls_ca=args.tls_ca or "",
        tls_cert=args.tls_cert or "",
        tls_key=args.tls_key or "",
    ).resolved()


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
