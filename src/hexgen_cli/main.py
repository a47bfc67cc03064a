"""The parser, assembled from the command groups, and `main`: exit codes and error lines."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from hexgen_cli import (
    auth,
    bench,
    calibrations,
    check_state,
    demo,
    estimate,
    get,
    mesh,
    policies,
    profile,
    simulation,
    sql_ask,
    sql_eval,
    top,
    up,
)
from hexgen_cli.options import PROG, coordinator_addresses
from hexgen_client.addresses import DEFAULT_COORDINATOR
from hexgen_flow import __version__
from hexgen_flow.errors import HexgenFlowError

__all__ = ["COMMANDS", "COORDINATOR_ENV", "build_parser", "main"]

COMMANDS = (
    "simulate",
    "tune",
    "policies",
    "calibrations",
    "bench",
    "estimate",
    "profile",
    "up",
    "replay",
    "ask",
    "status",
    "get",
    "check-state",
    "demo",
    "eval",
    "top",
    "auth",
)
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
COORDINATOR_ENV = "HEXGEN_COORDINATOR"
"""The coordinator every mesh command talks to when ``--coordinator`` is not given (the Go
and TypeScript clients' examples and live tests read it too)."""


class UsageError(Exception):
    """A command-line error found by argparse (unknown option, bad value)."""


class _Parser(argparse.ArgumentParser):
    """argparse, except that errors raise `UsageError` (printed by `main` as one line)
    instead of printing the usage block and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Deadline-aware scheduling of agentic LLM workflows on heterogeneous "
        "GPU clusters: simulator, alpha tuner and benchmark, the latency model beside the "
        "physical floors (estimate), and the service mesh (up, "
        "replay, ask, status, demo), and the Text-to-SQL agent (ask --db, eval).",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    simulation.register(commands)  # simulate, tune
    policies.register(commands)
    calibrations.register(commands)
    bench.register(commands)
    estimate.register(commands)
    profile.register(commands)
    up.register(commands)
    mesh.register(commands)  # replay, ask, status
    sql_ask.extend_ask(commands)  # ask --db FILE "question": the Text-to-SQL agent
    sql_eval.register(commands)
    get.register(commands)
    check_state.register(commands)
    demo.register(commands)
    top.register(commands)
    auth.register(commands)
    for command in commands.choices.values():
        _coordinator_from_environment(command)
    return parser


class _FromEnvironment(str):
    """``--coordinator``'s default when `COORDINATOR_ENV` is set: argparse checks a string
    default with the option's type only when the option is not given, so a bad value is
    refused only by the commands that would use it, naming the variable."""

    __slots__ = ()


def _coordinator_from_environment(parser: argparse.ArgumentParser) -> None:
    """``--coordinator`` (`hexgen_cli.options.add_coordinator_option`) defaults to
    ``$HEXGEN_COORDINATOR`` when that is set and not empty, and says so in ``--help``."""
    for action in parser._actions:  # argparse has no public list of a parser's actions
        if action.dest != "coordinator" or "--coordinator" not in action.option_strings:
            continue
        action.help = (
            f"the coordinator's address (default: ${COORDINATOR_ENV} when set, else "
            f"{DEFAULT_COORDINATOR}); a sharded mesh's coordinators as a comma list (each "
            "query goes to its shard's owner)"
        )
        value = os.environ.get(COORDINATOR_ENV, "").strip()
        if value:
            action.default = _FromEnvironment(value)
            action.type = _checked_coordinator


def _checked_coordinator(text: str) -> str:
    """`coordinator_addresses`, naming ``$HEXGEN_COORDINATOR`` when the value came from it."""
    if not isinstance(text, _FromEnvironment):
        return coordinator_addresses(text)
    try:
        return coordinator_addresses(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(
            f"${COORDINATOR_ENV}={text!r} is not a coordinator address: {exc}"
        ) from None


def _one_line(message: str) -> str:
    return " ".join(message.split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            raise UsageError(f"choose a command: {', '.join(COMMANDS)} (see {PROG} --help)")
        status: int = args.handler(args)
        sys.stdout.flush()
    except (UsageError, HexgenFlowError) as exc:
        print(f"{PROG}: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`hexgen-flow policies | head`): not an error of ours. Point
        # stdout at devnull so that the interpreter's final flush does not complain again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return status
