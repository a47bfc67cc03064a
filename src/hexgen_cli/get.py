"""``hexgen-flow get ID``: one workflow's state, its stages with their deadlines, its calls."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from hexgen_cli.mesh import require_mesh
from hexgen_cli.options import add_coordinator_option, coordinator_client, print_json

__all__ = ["register"]


def register(commands: Any) -> None:
    """Add ``get`` to the command parser."""
    cmd = commands.add_parser(
        "get",
        help="a workflow's state, stages (released, deadline, finished) and calls",
        description="Show one query (workflow) the coordinator knows: its state and SLO "
        "verdict, each stage with the deadline its budget gave it, and each call with the "
        "instance that ran it. Finished queries stay readable for the coordinator's "
        "--retention-s.",
    )
    cmd.add_argument("query_id", metavar="ID", help="the query's id")
    add_coordinator_option(cmd)
    cmd.add_argument("--json", action="store_true", help="print one JSON object")
    cmd.set_defaults(handler=_cmd_get)


def _cmd_get(args: argparse.Namespace) -> int:
    require_mesh("get")
    from hexgen_client.report import query_json, query_lines  # noqa: PLC0415 - loads grpc

    async def run() -> Any:
        async with coordinator_client(args) as client:
            return await client.get(args.query_id)

    reply = asyncio.run(run())
    if args.json:
        print_json(query_json(reply))
    else:
        print("\n".join(query_lines(reply)))
    return 0
