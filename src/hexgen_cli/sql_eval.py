"""``eval``: the Text-to-SQL agent over a question set, through an OpenAI-compatible
gateway: execution accuracy against the gold SQL, workflow latency (P50/P95) and SLO
attainment; ``--record`` writes the runs as a HexGen-Flow JSONL trace (one query per
question, its stages and calls with the token counts the server's ``usage`` reported) that
``hexgen-flow simulate --trace FILE`` replays."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hexgen_cli.options import PROG, add_coordinator_option, info, positive_int, print_json
from hexgen_cli.sql_ask import add_agent_options, check_db, make_agent, open_gateway
from hexgen_flow.errors import ConfigError
from hexgen_flow.metrics import percentile

if TYPE_CHECKING:
    from hexgen_client.sql.agent import AgentResult, SqlAgent
    from hexgen_client.sql.questions import Question

__all__ = ["EvalRun", "register", "trace_record"]


@dataclass(slots=True)
class EvalRun:
    """One question's run: when it started (wall seconds from the first), the agent's
    result (None when the agent failed: `error`) and whether it matched the gold."""

    question: Question
    started_s: float
    result: AgentResult | None
    correct: bool
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
        f"`{PROG} simulate --trace FILE`. Progress goes to stderr.",
    )
    add_agent_options(ev)
    add_coordinator_option(ev)
    ev.add_argument(
        "--questions",
        type=Path,
        default=None,
        metavar="FILE",
        help="JSONL questions with gold SQL (default: hexgen_client's Chinook questions)",
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
    agent: SqlAgent, db: Path, questions: list[Question], concurrency: int
) -> list[EvalRun]:
    from hexgen_client.sql.evaluate import execution_match  # noqa: PLC0415

    gate = asyncio.Semaphore(concurrency)
    # workflow ids are the coordinator's query ids: unique per run (a finished workflow
    # takes no more calls, so a second eval on the same mesh must not reuse them)
    tag = uuid.uuid4().hex[:8]
    origin = time.perf_counter()
    runs: list[EvalRun] = []

    async def one(question: Question) -> EvalRun:
        async with gate:
            started = time.perf_counter() - origin
            try:
                result = await agent.answer(question.question, workflow=f"eval-{tag}-{question.id}")
            except Exception as exc:  # an API error fails this question, not the run
                run = EvalRun(question, started, None, False, f"{type(exc).__name__}: {exc}")
            else:
                match = await asyncio.to_thread(execution_match, db, result.sql, question.sql)
                run = EvalRun(question, started, result, match.match, result.error)
        runs.append(run)
        correct = sum(r.correct for r in runs)
        info(f"{PROG} eval: {len(runs)}/{len(questions)} done, {correct} correct")
        return run

    return list(await asyncio.gather(*(one(q) for q in questions)))


def _summary(runs: list[EvalRun], slo_s: float | None) -> dict[str, Any]:
    answered = [r.result for r in runs if r.result is not None]
    latencies = [r.cluster_latency_s for r in answered]
    correct = sum(r.correct for r in runs)
    met = [r.slo_met for r in answered]
    return {
        "questions": len(runs),
        "correct": correct,
        "execution_accuracy": correct / len(runs) if runs else 0.0,
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


def _cmd_eval(args: argparse.Namespace) -> int:
    from hexgen_client.sql.questions import load_questions  # noqa: PLC0415

    if args.db is None:
        raise ConfigError("eval needs --db FILE (the database the questions are about)")
    db = check_db(args)
    try:
        questions = load_questions(args.questions)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--questions: {exc}") from None
    questions = questions[: args.limit] if args.limit else questions
    if not questions:
        raise ConfigError("--questions holds no questions")
    with open_gateway(args, "eval") as gateway:
        agent = make_agent(args, gateway, db)
        started = time.perf_counter()
        runs = asyncio.run(_run_all(agent, db, questions, args.concurrency))
        wall_s = time.perf_counter() - started
    if args.record is not None:
        records = [r for r in map(trace_record, runs) if r is not None]
        args.record.write_text("".join(json.dumps(r) + "\n" for r in records))
        info(f"{PROG} eval: {len(records)} queries written to {args.record}")
    summary = _summary(runs, args.slo_s)
    synthetic = bool(gateway.synthetic) or any(r.result and r.result.synthetic for r in runs)
    summary.update({"wall_s": wall_s, "time_scale": gateway.time_scale, "synthetic": synthetic})
    if args.json:
        summary["runs"] = [
            {
                "id": r.question.id,
                "correct": r.correct,
                "sql": r.result.sql if r.result else None,
                "latency_s": r.result.cluster_latency_s if r.result else None,
                "slo_met": r.result.slo_met if r.result else None,
                "revise_calls": sum(c.stage == "revise" for c in r.result.calls) if r.result else 0,
                "error": r.error,
            }
            for r in runs
        ]
        print_json(summary)
        return 0
    lat = summary["latency_s"]
    print(
        f"{summary['questions']} questions: execution accuracy "
        f"{100 * summary['execution_accuracy']:.1f} % ({summary['correct']} correct, "
        f"{summary['failed']} failed)"
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
