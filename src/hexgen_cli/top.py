"""``hexgen-flow top``: a live view of the mesh in the terminal, for people without Grafana.

Every `--interval-s` it asks the coordinator for ClusterStatus and redraws, in place on a
terminal: the queries that ended in the coordinator's recent window (SLO attainment,
latency), the policy and alpha in force, and each instance's load (calls in flight,
running, queued, KV-cache use). Not on a terminal (a pipe, a log), each refresh is printed
after the previous one. `--count N` stops after N refreshes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from hexgen_cli.mesh import require_mesh
from hexgen_cli.options import (
    add_coordinator_option,
    coordinator_client,
    positive_float,
    positive_int,
    print_json,
)

__all__ = ["register"]

_HOME_AND_CLEAR = "\x1b[H\x1b[2J"


def register(commands: Any) -> None:
    """Add ``top`` to the command parser."""
    cmd = commands.add_parser(
        "top",
        help="a live view of the mesh: attainment, alpha, each instance's load",
        description="Redraw the mesh's state every --interval-s: the queries that ended in "
        "the coordinator's recent window (SLO attainment, latency), the policy and alpha, "
        "and each instance's calls in flight, running and queued and its KV-cache use. "
        "Ctrl-C stops it.",
    )
    add_coordinator_option(cmd)
    cmd.add_argument(
        "--interval-s",
        type=positive_float,
        default=2.0,
        help="seconds between refreshes (default 2)",
    )
    cmd.add_argument(
        "--count",
        type=positive_int,
        default=None,
        help="stop after N refreshes (default: run until Ctrl-C)",
    )
    cmd.add_argument("--json", action="store_true", help="print one JSON object per refresh")
    cmd.set_defaults(handler=_cmd_top)


def _cmd_top(args: argparse.Namespace) -> int:
    require_mesh("top")
    from hexgen_client.report import recent_json, status_json, top_lines  # noqa: PLC0415

    redraw = sys.stdout.isatty() and not args.json

    async def run() -> None:
        async with coordinator_client(args) as client:
            shown = 0
            while True:
                started = time.monotonic()
                status = await client.status()
                if args.json:
                    print_json({**status_json(status), "recent": recent_json(status)})
                else:
                    lines = top_lines(status, args.coordinator)
                    stamp = time.strftime("%H:%M:%S")
                    head = f"hexgen-flow top  {stamp}  (every {args.interval_s:g} s)"
                    text = "\n".join([head, *lines])
                    print(_HOME_AND_CLEAR + text if redraw else text + "\n", flush=True)
                shown += 1
                if args.count and shown >= args.count:
                    return
                await asyncio.sleep(max(0.0, args.interval_s - (time.monotonic() - started)))

    asyncio.run(run())
    return 0
