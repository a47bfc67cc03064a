"""``hexgen-flow top``: a live view of the mesh in the terminal, for people without Grafana.

Every `--interval-s` it asks the coordinator for ClusterStatus and redraws, in place on a
terminal: the queries that ended in the coordinator's recent window (SLO attainment,
latency), the policy and alpha in force, and each instance's load (calls in flight,
running, queued, KV-cache use). Not on a terminal (a pipe, a log), each refresh is printed
after the previous one. `--count N` stops after N refreshes.

The interval's default follows the coordinator's clock: 2 s on a real-time mesh, but a
replay at time scale 50 is over in a few wall seconds, so at a fast clock a refresh comes
every `CLUSTER_SECONDS_PER_REFRESH` cluster seconds (`default_interval_s`), never more
often than every `MIN_INTERVAL_S`.

The columns come from two readings, which the screen's legend names: ``in-flight`` is the
coordinator's own count at the moment of the status (calls dispatched to the instance whose
completion it has not seen, a call on its way to the worker or a completion on its way back
included), ``running`` and ``queued`` are what the worker's engine reported at its last
heartbeat (every 0.5 s wall by default: 25 cluster seconds at time scale 50, longer than
many calls). They agree on an idle or steady mesh and disagree while calls come and go
faster than the heartbeat.
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
DEFAULT_INTERVAL_S = 2.0
"""Wall seconds between refreshes on a mesh whose clock runs at most 10x real time."""
CLUSTER_SECONDS_PER_REFRESH = 20.0
"""At a faster clock: cluster seconds between refreshes."""
MIN_INTERVAL_S = 0.25
LEGEND = (
    "in-flight: calls the coordinator dispatched there and has not seen finish (now); "
    "running, queued: the worker's engine at its last heartbeat"
)


def default_interval_s(time_scale: float) -> float:
    """The refresh interval when `--interval-s` is not given, for a coordinator whose clock
    runs `time_scale` cluster seconds per wall second: 2 s up to 10x, then 20 cluster
    seconds (1 s at 20x, 0.4 s at 50x), at least 0.25 s."""
    if not time_scale > 0:
        return DEFAULT_INTERVAL_S
    return max(MIN_INTERVAL_S, min(DEFAULT_INTERVAL_S, CLUSTER_SECONDS_PER_REFRESH / time_scale))


def register(commands: Any) -> None:
    """Add ``top`` to the command parser."""
    cmd = commands.add_parser(
        "top",
        help="a live view of the mesh: attainment, alpha, each instance's load",
        description="Redraw the mesh's state every --interval-s: the queries that ended in "
        "the coordinator's recent window (SLO attainment, latency), the policy and alpha, "
        "and each instance's calls in flight (the coordinator's count, now), running and "
        "queued (the worker's engine, at its last heartbeat) and its KV-cache use. "
        "Ctrl-C stops it.",
    )
    add_coordinator_option(cmd)
    cmd.add_argument(
        "--interval-s",
        type=positive_float,
        default=None,
        metavar="S",
        help=f"wall seconds between refreshes (default: {DEFAULT_INTERVAL_S:g} s, or "
        f"{CLUSTER_SECONDS_PER_REFRESH:g} cluster seconds when the coordinator's clock runs "
        f"faster than {CLUSTER_SECONDS_PER_REFRESH / DEFAULT_INTERVAL_S:g}x real time, e.g. "
        f"{default_interval_s(50):g} s at time scale 50; at least {MIN_INTERVAL_S:g} s)",
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
                interval_s: float = args.interval_s or default_interval_s(status.time_scale)
                if args.json:
                    print_json({**status_json(status), "recent": recent_json(status)})
                else:
                    lines = top_lines(status, args.coordinator)
                    stamp = time.strftime("%H:%M:%S")
                    cluster_s = interval_s * status.time_scale
                    head = (
                        f"hexgen-flow top  {stamp}  (every {interval_s:g} s = "
                        f"{cluster_s:.3g} cluster s)"
                    )
                    text = "\n".join([head, *lines, "", LEGEND])
                    print(_HOME_AND_CLEAR + text if redraw else text + "\n", flush=True)
                shown += 1
                if args.count and shown >= args.count:
                    return
                await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))

    asyncio.run(run())
    return 0
