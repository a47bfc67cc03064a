"""What every command group shares: option value types, the defaults, and output helpers.

Value types raise `argparse.ArgumentTypeError`, which the parser turns into one line on
stderr and exit code 2 (`hexgen_cli.main`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from hexgen_client.addresses import (  # no grpc at import
    DEFAULT_COORDINATOR,
    split_addresses,
)
from hexgen_flow.alpha import alpha_problem
from hexgen_flow.calibration import DEFAULT_CALIBRATION, calibration_names, resolve_calibration
from hexgen_flow.errors import HexgenFlowError
from hexgen_flow.lengths import DEFAULT_MAX_TOKENS, OutputLengths
from hexgen_flow.metrics import json_safe
from hexgen_flow.sim.engines import DEFAULT_ENGINE_MODEL, ENGINE_MODELS, check_engine_model

__all__ = [
    "DEFAULT_ARRIVAL_CV",
    "DEFAULT_POLICY",
    "DEFAULT_QPS",
    "DEFAULT_SEED",
    "DEFAULT_SLO_SCALE",
    "DEFAULT_TRACE",
    "PROG",
    "add_calibration_option",
    "add_coordinator_option",
    "add_engine_options",
    "address",
    "alpha_or_auto",
    "coordinator_addresses",
    "coordinator_client",
    "engine_model",
    "info",
    "integer",
    "positive_float",
    "positive_int",
    "print_json",
    "print_rows",
    "unit_interval",
]

PROG = "hexgen-flow"
DEFAULT_TRACE = "trace1"
DEFAULT_POLICY = "hexgen-flow"
DEFAULT_QPS = 0.5
DEFAULT_SLO_SCALE = 3.0
DEFAULT_SEED = 0
DEFAULT_ARRIVAL_CV = 1.0


# ------------------------------------------------------------------------ option value types


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def alpha_or_auto(text: str) -> float | None:
    """A float in [0, 1], or None for ``auto``."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number in [0, 1] or 'auto', got {text!r}"
        ) from None
    if alpha_problem(value) is not None:
        raise argparse.ArgumentTypeError(f"must be in [0, 1] or 'auto', got {text}")
    return value


def unit_interval(text: str) -> float:
    value = alpha_or_auto(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def address(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT, e.g. {DEFAULT_COORDINATOR}; got {text!r}"
        )
    return text


def coordinator_addresses(text: str) -> str:
    """``HOST:PORT``, or a sharded mesh's coordinators as a comma list, each checked."""
    try:
        addresses = split_addresses(text)
    except HexgenFlowError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return ",".join(address(a) for a in addresses)


def calibration(text: str) -> str:
    """A calibration name or ``measured:FILE``, checked (the file read) before anything runs."""
    try:
        resolve_calibration(text)
    except HexgenFlowError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_calibration_option(parser: argparse.ArgumentParser, *, file_default: bool = True) -> None:
    """``--calibration``; `file_default`: the command reads a cluster file, whose
    ``calibration:`` is the default when the option is not given."""
    fallback = "the cluster file's calibration:, else " if file_default else ""
    parser.add_argument(
        "--calibration",
        type=calibration,
        default=None,
        metavar="NAME|measured:FILE",
        help=f"where the latency numbers come from: {', '.join(calibration_names())} (see "
        f"`{PROG} calibrations`; default: {fallback}{DEFAULT_CALIBRATION})",
    )


def add_belief_options(parser: argparse.ArgumentParser, *, max_tokens: bool = True) -> None:
    """What the simulated scheduler believes and learns, apart from what the simulated
    engines execute (``--calibration``): ``--planner-calibration``, ``--planner-error``,
    ``--learn-costs``, ``--output-lengths`` and (`max_tokens`) ``--max-tokens``
    (docs/design.md, "Truth, belief and learning what each instance costs")."""
    parser.add_argument(
        "--planner-calibration",
        type=calibration,
        default=None,
        metavar="NAME|measured:FILE",
        help="the latency numbers every policy, the alpha tuner and admission plan with; the "
        "simulated engines still run --calibration's (default: the same as --calibration, a "
        "scheduler that knows its engines exactly)",
    )
    parser.add_argument(
        "--planner-error",
        type=planner_errors,
        default=None,
        metavar="GPU:prefill=F,GPU:decode=G",
        help="the planner believes these GPU types' prefill or decode times F (G) times what "
        "its calibration says, e.g. L40S:prefill=3,A6000:prefill=3 (default: no error)",
    )
    parser.add_argument(
        "--learn-costs",
        action="store_true",
        help="the scheduler learns each instance's prefill and decode costs online from the "
        "calls it served, with the planner's calibration as the prior (docs/design.md, "
        '"Truth, belief and learning what each instance costs")',
    )
    parser.add_argument(
        "--output-lengths",
        type=output_lengths,
        default=OutputLengths.KNOWN,
        metavar="known|learned|max-tokens",
        help="what the scheduler knows of each call's output length: the workload's (known, "
        "the default), a per-step prediction learned from finished calls (learned)"
        + (", or the cap --max-tokens (max-tokens)" if max_tokens else ", or a cap (max-tokens)")
        + "; the engines always generate the workload's",
    )
    if max_tokens:
        parser.add_argument(
            "--max-tokens",
            type=positive_int,
            default=DEFAULT_MAX_TOKENS,
            metavar="N",
            help="the cap believed under --output-lengths max-tokens "
            f"(default {DEFAULT_MAX_TOKENS})",
        )


def output_lengths(text: str) -> OutputLengths:
    """``--output-lengths``: known, learned or max-tokens."""
    try:
        return OutputLengths.parse(text)
    except HexgenFlowError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def planner_errors(text: str) -> dict[str, tuple[float, float]]:
    """``GPU:prefill=F,GPU:decode=G,...``: how the planner misjudges each GPU type."""
    errors: dict[str, list[float]] = {}
    for item in text.split(","):
        gpu, sep, rest = item.strip().partition(":")
        part, eq, value = rest.partition("=")
        if not (sep and eq and gpu and part in ("prefill", "decode")):
            raise argparse.ArgumentTypeError(
                f"expected GPU:prefill=FACTOR or GPU:decode=FACTOR, got {item.strip()!r}"
            )
        try:
            factor = float(value)
        except ValueError:
            factor = math.nan
        if not (factor > 0 and math.isfinite(factor)):
            raise argparse.ArgumentTypeError(
                f"{gpu}:{part} factor must be a finite number > 0, got {value!r}"
            )
        errors.setdefault(gpu, [1.0, 1.0])[0 if part == "prefill" else 1] = factor
    return {gpu: (p, d) for gpu, (p, d) in errors.items()}


def engine_model(text: str) -> str:
    """An engine model's name (`hexgen_flow.sim.engines.ENGINE_MODELS`)."""
    try:
        return check_engine_model(text)
    except HexgenFlowError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """``--engine`` and ``--prefix-caching``: the simulated engine model of every instance."""
    parser.add_argument(
        "--engine",
        type=engine_model,
        default=DEFAULT_ENGINE_MODEL,
        metavar="NAME",
        help=f"engine model of every instance: {', '.join(sorted(ENGINE_MODELS))} "
        f'(docs/design.md, "Simulated engine"; default {DEFAULT_ENGINE_MODEL})',
    )
    parser.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefix caching in the engine model (default: on with vllm-v1, as vLLM V1 "
        "serves; prefill-first has none; calls of one query with the same step type are "
        "assumed to share most of their prompt)",
    )


def add_coordinator_option(parser: argparse.ArgumentParser) -> None:
    """``--coordinator`` and the credentials to call it with (a secured mesh)."""
    parser.add_argument(
        "--coordinator",
        type=coordinator_addresses,
        default=DEFAULT_COORDINATOR,
        metavar="HOST:PORT[,...]",
        help=f"the coordinator's address (default {DEFAULT_COORDINATOR}); a sharded mesh's "
        "coordinators as a comma list (each query goes to its shard's owner)",
    )
    parser.add_argument(
        "--api-key-file",
        metavar="FILE",
        default=None,
        help="the API key to call a secured coordinator with (default: $HEXGEN_FLOW_API_KEY)",
    )
    parser.add_argument(
        "--tls-ca",
        metavar="FILE",
        default=None,
        help="connect over TLS, verifying the coordinator with this CA (default: "
        "$HEXGEN_FLOW_TLS_CA; neither: plaintext)",
    )


def coordinator_client(args: argparse.Namespace, **options: Any) -> Any:
    """A `CoordinatorClient` for ``--coordinator`` with the key and CA of
    `add_coordinator_option` (imports grpc: call it in a command's handler)."""
    from hexgen_client.client import CoordinatorClient  # noqa: PLC0415 - loads grpc
    from hexgen_launch.security import read_secret  # noqa: PLC0415

    key = read_secret(args.api_key_file, "--api-key-file") if args.api_key_file else None
    return CoordinatorClient(args.coordinator, api_key=key, tls_ca=args.tls_ca, **options)


# ---------------------------------------------------------------------------------- output


def print_json(doc: dict[str, Any]) -> None:
    """The one JSON object of a ``--json`` run, on one line; NaN and infinity as null."""
    print(json.dumps(json_safe(doc), allow_nan=False))


def info(message: str) -> None:
    """Progress and notes: stderr, so that stdout stays the command's result."""
    print(message, file=sys.stderr)


def print_rows(
    rows: Sequence[tuple[str, str]], out: TextIO | None = None, *, indent: str = ""
) -> None:
    """A two-column table: keys padded to the longest."""
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{indent}{key:<{width}}  {value}", file=out or sys.stdout)
