"""``hexgen-flow check-state``: the coordinator's fsck of workflow state, run as a process.

The check reads the coordinator's Redis layout, which only the coordinator's package knows
(`hexgen_coordinator.check_state`); the command line starts it by module name, as it starts
the services, so that it never imports them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

from hexgen_cli.mesh import require_mesh

__all__ = ["register"]


def register(commands: Any) -> None:
    """Add ``check-state`` to the command parser."""
    cmd = commands.add_parser(
        "check-state",
        help="check workflow state in Redis: duplicate or missing completions, stuck "
        "queries, orphan keys, stale prompts (exit 1 if any)",
        description="An fsck for the coordinator's Redis state. Prints {queries, calls, "
        "running, duplicate_completions, missing_completions, stuck_queries, orphan_keys, "
        "kept_prompts, stale_prompts} and exits 1 when any of duplicate_completions, "
        "missing_completions, stuck_queries, orphan_keys or stale_prompts is non-zero.",
    )
    cmd.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/0",
        help="redis://[USER@]HOST:PORT/DB, or Redis behind Sentinel: "
        "redis+sentinel://[USER@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB] (default %(default)s)",
    )
    cmd.add_argument(
        "--prefix",
        default=None,
        help="the coordinator's --redis-prefix (default hf:, with --redis-cluster hf:{0}:)",
    )
    cmd.add_argument(
        "--redis-cluster",
        action="store_true",
        help="--redis-url is a node of a Redis Cluster (the keys are scanned on every master)",
    )
    cmd.add_argument(
        "--stuck-after-s",
        type=float,
        default=None,
        metavar="S",
        help="also count queries still running S cluster seconds after arrival as stuck",
    )
    cmd.add_argument("--json", action="store_true", help="print one JSON object")
    cmd.add_argument(
        "--redis-password-file",
        default=None,
        metavar="FILE",
        help="the password of the Redis user in --redis-url (a secured mesh: "
        "redis://coordinator@HOST:PORT/0 and AUTH_DIR/redis/coordinator.password)",
    )
    cmd.set_defaults(handler=_cmd_check_state)


def _cmd_check_state(args: argparse.Namespace) -> int:
    require_mesh("check-state")
    argv = ["--redis-url", args.redis_url]
    if args.prefix is not None:
        argv += ["--prefix", args.prefix]
    if args.redis_cluster:
        argv.append("--redis-cluster")
    if args.stuck_after_s is not None:
        argv += ["--stuck-after-s", repr(args.stuck_after_s)]
    if args.json:
        argv.append("--json")
    if args.redis_password_file:
        argv += ["--redis-password-file", args.redis_password_file]
    done = subprocess.run(
        [sys.executable, "-m", "hexgen_coordinator.check_state", *argv], check=False
    )
    return done.returncode
