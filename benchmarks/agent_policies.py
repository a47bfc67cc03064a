"""The Text-to-SQL agent under load: hexgen-flow against round-robin and the load-aware router.

For each load level (questions per cluster second) and seed, and for each policy, it starts
a fresh `LocalCluster` (a private redis-server, the coordinator with that ``--policy``,
the OpenAI-compatible gateway and one simulated worker per instance of the paper's GPU mix
A100,A100,A6000,L40S; no tuner, admission off, so every workflow runs) and sends the SAME
workload through the gateway: the shipped Chinook questions, shuffled by the seed, each
answered by `hexgen_sql.agent.SqlAgent` (keywords, schema linking, N candidates,
revise rounds, vote; one workflow per question with a fixed end-to-end SLO), arriving open
loop at Poisson times drawn from the seed (in cluster seconds, so the offered load does not
depend on the time scale). The simulated engines answer with the synthetic responder, which
is deterministic per prompt: every policy gets the same calls and the same answers, so
execution accuracy must come out equal and only the latencies differ.

It prints, per load level and seed, a table of: policy, workflows finished (of those sent),
workflow P50/P95/mean latency in cluster seconds (the coordinator's finished - arrival),
SLO attainment (a failed workflow is a miss), execution accuracy, the LLM calls made, the
share of calls the coordinator dispatched to an A100 (its Prometheus counter), the driver's
own view (P95 from the scheduled arrival to the agent's return, and how late it started
questions: large values mean the machine, not the policy, set the figures) and
hexgen-flow's P95 divided by that row's P95 (below 1: hexgen-flow is faster); with several
seeds, a summary across them. ``--questions`` above 60 repeats the set, reshuffled, for a
sustained load. ``--out`` writes every row (with each workflow's latency) as JSON,
``--plot`` P95 and attainment against the load. Progress goes to stderr.

    .venv/bin/python benchmarks/agent_policies.py [--policies vllm least-requests hexgen-flow]
        [--rates 1 2 4] [--seeds 0] [--questions 60] [--slo-s 60] [--time-scale 5]
        [--cluster A100,A100,A6000,L40S] [--out FILE.json] [--plot FILE.png]

Sensitivity to the time scale: the mesh's own overheads (gateway, coordinator, Redis, the
agent's SQLite work, all on the same cores) are wall time, which the time scale multiplies
into cluster seconds; run it at two time scales and compare. On two shared cores 2x and 5x
agree and 20x inflates hexgen-flow's latencies (docs/text-to-sql.md, "The agent under load:
hexgen-flow against the routers", has the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import re
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hexgen_flow.metrics import percentile
from hexgen_launch.cluster import LocalCluster, LocalClusterConfig
from hexgen_launch.errors import ClusterError
from hexgen_sql.agent import AgentResult, SqlAgent
from hexgen_sql.chinook import build_chinook
from hexgen_sql.evaluate import execution_match
from hexgen_sql.questions import Question, load_questions

PAPER_CLUSTER = "A100,A100,A6000,L40S"
POLICIES = ("vllm", "least-requests", "hexgen-flow")
FLAGSHIP = "hexgen-flow"
DEFAULT_RATES = (1.0, 2.0, 4.0)
DEFAULT_SLO_S = 60.0
DEFAULT_TIME_SCALE = 5.0
DISPATCHED = re.compile(
    r'^hexgen_flow_calls_dispatched_total\{gpu_instance="(?P<instance>[^"]+)"\} (?P<value>\S+)$'
)


@dataclass(slots=True)
class Row:
    """One policy at one load level and seed."""

    policy: str
    rate: float
    seed: int
    sent: int
    workflows: int
    """Workflows that finished (the agent returned a result)."""
    failed: int
    p50_s: float
    p95_s: float
    mean_s: float
    max_s: float
    client_p95_s: float
    """P95 of the latency the driver saw, from each workflow's scheduled arrival to the
    agent's return (wall x time scale): includes the driver's and gateway's own delays and
    the close, which the coordinator's figures do not."""
    lag_p95_ms: float
    """P95 of how late (wall ms) the driver started a workflow after its scheduled arrival:
    large means the offered load was not what was asked."""
    slo_attainment: float
    execution_accuracy: float
    llm_calls: int
    calls_by_gpu: dict[str, int]
    """Calls the coordinator dispatched to each GPU type during the run (its metrics)."""
    wall_s: float
    errors: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    """Each finished workflow's latency (cluster s), in question order: attainment at any
    other SLO can be read off the JSON."""


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrival times (cluster seconds from the first, which is at 0) of `n`
    workflows at `rate` per cluster second."""
    rng = random.Random(f"arrivals-{seed}")
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def workload(questions: list[Question], n: int, seed: int) -> list[Question]:
    """`n` questions in an order drawn from `seed` (easy, medium and hard mixed over the
    run rather than in the file's order); past the end of the set, it is shuffled again
    and repeated (each repetition is a workflow of its own), for a longer, sustained load."""
    rng = random.Random(f"order-{seed}")
    picked: list[Question] = []
    while len(picked) < n:
        order = list(questions)
        rng.shuffle(order)
        picked += order
    return picked[:n]


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclass(slots=True)
class Sent:
    """One workflow as the driver saw it: wall seconds late after its scheduled arrival,
    wall seconds from the scheduled arrival to the agent's return, and the result (or the
    exception that failed it)."""

    late_s: float
    wall_s: float
    result: AgentResult | BaseException


def dispatched(metrics: str | None) -> dict[str, int]:
    """Calls dispatched so far to each GPU type, from the coordinator's Prometheus counter
    ``hexgen_flow_calls_dispatched_total{gpu_instance="A100#0"}``; empty without metrics."""
    if metrics is None:
        return {}
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    counts: dict[str, int] = {}
    for line in text.splitlines():
        found = DISPATCHED.match(line)
        if found:
            gpu = found["instance"].split("#")[0]
            counts[gpu] = counts.get(gpu, 0) + round(float(found["value"]))
    return counts


async def drive(
    gateway: str,
    metrics: str | None,
    db: Path,
    questions: list[Question],
    times: list[float],
    args: argparse.Namespace,
    label: str,
) -> tuple[list[Sent], float, dict[str, int]]:
    """Send every question at its arrival time (wall = cluster / time scale); what each
    one gave, in question order, the wall seconds of the whole run and the calls dispatched
    to each GPU type meanwhile."""
    from openai import AsyncOpenAI  # noqa: PLC0415 - the openai extra

    client = AsyncOpenAI(
        base_url=f"http://{gateway}/v1", api_key="unused", timeout=600.0, max_retries=2
    )
    agent = SqlAgent(
        client,
        db,
        candidates=args.candidates,
        rounds=args.rounds,
        slo_s=args.slo_s,
        time_scale=args.time_scale,
    )
    tag = uuid.uuid4().hex[:8]
    # one question alone first (not counted): the model listed, connections open
    await agent.answer(questions[0].question, workflow=f"warmup-{tag}")
    done = 0
    before = await asyncio.to_thread(dispatched, metrics)

    async def one(i: int, question: Question, origin: float) -> Sent:
        nonlocal done
        scheduled = origin + times[i] / args.time_scale
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        late = time.perf_counter() - scheduled
        result: AgentResult | BaseException
        try:
            result = await agent.answer(
                question.question, workflow=f"bench-{tag}-{i}-{question.id}"
            )
        except Exception as exc:  # an API error fails this workflow, not the run
            result = exc
        done += 1
        if done % 10 == 0 or done == len(questions):
            progress(f"  {label}: {done}/{len(questions)} workflows done")
        return Sent(late, time.perf_counter() - scheduled, result)

    origin = time.perf_counter()
    sent = await asyncio.gather(*(one(i, q, origin) for i, q in enumerate(questions)))
    wall_s = time.perf_counter() - origin
    await client.close()
    after = await asyncio.to_thread(dispatched, metrics)
    by_gpu = {gpu: n - before.get(gpu, 0) for gpu, n in after.items()}
    return list(sent), wall_s, by_gpu


@contextlib.contextmanager
def start_mesh(config: LocalClusterConfig, label: str) -> Iterator[LocalCluster]:
    """A started `LocalCluster`; a start that fails (a service not up in time on a busy
    machine) is reported with its logs' tails and tried once more."""
    for attempt in (1, 2):
        with tempfile.TemporaryDirectory(prefix="agent-policies-logs-") as logs:
            mesh = LocalCluster(dataclasses.replace(config, log_dir=Path(logs)))
            try:
                mesh.start()
            except ClusterError as exc:
                progress(f"{label}: the mesh did not start (attempt {attempt}): {exc}")
                for log in sorted(Path(logs).glob("*.log")):
                    tail = log.read_text(errors="replace").splitlines()[-5:]
                    progress("\n".join([f"  --- {log.name}", *(f"  {line}" for line in tail)]))
                if attempt == 2:
                    raise
                continue
            try:
                yield mesh
            finally:
                mesh.stop()
            return


def run_policy(
    policy: str,
    rate: float,
    seed: int,
    db: Path,
    questions: list[Question],
    args: argparse.Namespace,
) -> Row:
    config = LocalClusterConfig(
        cluster=args.cluster,
        policy=policy,
        time_scale=args.time_scale,
        listen="127.0.0.1:0",
        tuner=False,
        gateway=True,
        gateway_listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        admission="off",  # every workflow runs: attainment counts the late ones
        redis_appendfsync=None,  # durability is not what is measured here
    )
    times = arrivals(len(questions), rate, seed)
    label = f"{policy} at {rate:g} q/s, seed {seed}"
    progress(f"{label}: starting the mesh ({args.cluster}, time scale {args.time_scale:g}x)")
    with start_mesh(config, label) as mesh:
        assert mesh.gateway_address is not None
        sent, wall_s, by_gpu = asyncio.run(
            drive(mesh.gateway_address, mesh.metrics_address, db, questions, times, args, label)
        )
    latencies: list[float] = []
    seen = [s.wall_s * args.time_scale for s in sent]
    lags = [s.late_s * 1e3 for s in sent]
    met = correct = calls = 0
    errors: list[str] = []
    for question, one in zip(questions, sent, strict=True):
        result = one.result
        if isinstance(result, BaseException):
            errors.append(f"{question.id}: {type(result).__name__}: {result}")
            continue
        latencies.append(result.cluster_latency_s)
        met += bool(result.slo_met)
        calls += len(result.calls)
        correct += execution_match(db, result.sql, question.sql).match
    n = len(questions)
    nan = float("nan")
    row = Row(
        policy=policy,
        rate=rate,
        seed=seed,
        sent=n,
        workflows=len(latencies),
        failed=n - len(latencies),
        p50_s=percentile(latencies, 50) if latencies else nan,
        p95_s=percentile(latencies, 95) if latencies else nan,
        mean_s=sum(latencies) / len(latencies) if latencies else nan,
        max_s=max(latencies) if latencies else nan,
        client_p95_s=percentile(seen, 95),
        lag_p95_ms=percentile(lags, 95),
        slo_attainment=met / n,
        execution_accuracy=correct / n,
        llm_calls=calls,
        calls_by_gpu=by_gpu,
        wall_s=wall_s,
        errors=errors,
        latencies_s=[round(x, 3) for x in latencies],
    )
    progress(
        f"{label}: P50 {row.p50_s:.1f} s, P95 {row.p95_s:.1f} s, attainment "
        f"{100 * row.slo_attainment:.0f} %, {wall_s:.1f} s wall"
    )
    return row


def ratio(rows: list[Row], row: Row) -> float | None:
    """hexgen-flow's P95 over `row`'s, at the same load and seed; None without it."""
    flagship = [
        r for r in rows if r.policy == FLAGSHIP and (r.rate, r.seed) == (row.rate, row.seed)
    ]
    if not flagship or not row.p95_s > 0:
        return None
    return flagship[0].p95_s / row.p95_s


def a100_share(row: Row) -> str:
    """The share of the run's dispatched calls that went to an A100 (retries included)."""
    total = sum(row.calls_by_gpu.values())
    return f"{100 * row.calls_by_gpu.get('A100', 0) / total:.0f}%" if total else "-"


def table(rows: list[Row], rate: float, seed: int, slo_s: float) -> list[str]:
    here = [r for r in rows if (r.rate, r.seed) == (rate, seed)]
    lines = [
        f"load {rate:g} questions/s (Poisson, seed {seed}), SLO {slo_s:g} s:",
        f"  {'policy':<16} {'workflows':>9} {'P50 (s)':>8} {'P95 (s)':>8} {'mean (s)':>8} "
        f"{'SLO att.':>8} {'accuracy':>8} {'calls':>6} {'on A100':>7} {'driver P95':>10} "
        f"{'lag P95':>8}  "
        f"{FLAGSHIP} P95 / this",
    ]
    for r in here:
        q = ratio(rows, r)
        lines.append(
            f"  {r.policy:<16} {f'{r.workflows}/{r.sent}':>9} {r.p50_s:8.1f} {r.p95_s:8.1f} "
            f"{r.mean_s:8.1f} {100 * r.slo_attainment:7.1f}% {100 * r.execution_accuracy:7.1f}% "
            f"{r.llm_calls:6d} {a100_share(r):>7} {r.client_p95_s:9.1f}s {r.lag_p95_ms:6.0f}ms  "
            f"{'-' if q is None or r.policy == FLAGSHIP else f'{q:.2f}'}"
        )
    return lines


def summary(rows: list[Row], rates: list[float], policies: list[str]) -> list[str]:
    """Across seeds: the mean P50, P95, attainment and A100 share, and the range of
    hexgen-flow's P95 ratio (min-max over seeds)."""
    lines = [
        "across seeds (means; the ratio's min-max over seeds):",
        f"  {'load':>7}  {'policy':<16} {'P50 (s)':>8} {'P95 (s)':>8} {'SLO att.':>8} "
        f"{'accuracy':>8} {'on A100':>7}  {FLAGSHIP} P95 / this",
    ]
    for rate in rates:
        for policy in policies:
            mine = [r for r in rows if r.rate == rate and r.policy == policy]
            if not mine:
                continue
            n = len(mine)
            p50 = sum(r.p50_s for r in mine) / n
            p95 = sum(r.p95_s for r in mine) / n
            att = sum(r.slo_attainment for r in mine) / n
            acc = sum(r.execution_accuracy for r in mine) / n
            on = [sum(r.calls_by_gpu.values()) for r in mine]
            a100 = sum(r.calls_by_gpu.get("A100", 0) for r in mine)
            share = f"{100 * a100 / sum(on):.0f}%" if sum(on) else "-"
            ratios = [q for r in mine if (q := ratio(rows, r)) is not None]
            span = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios and policy != FLAGSHIP else "-"
            lines.append(
                f"  {f'{rate:g} q/s':>7}  {policy:<16} {p50:8.1f} {p95:8.1f} {100 * att:7.1f}% "
                f"{100 * acc:7.1f}% {share:>7}  {span}"
            )
    return lines


def plot(rows: list[Row], policies: list[str], path: Path, slo_s: float) -> None:
    import matplotlib  # noqa: PLC0415 - only when asked

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for policy in policies:
        rates = sorted({r.rate for r in rows if r.policy == policy})
        mine = [[r for r in rows if r.policy == policy and r.rate == x] for x in rates]
        left.plot(rates, [sum(r.p95_s for r in m) / len(m) for m in mine], "o-", label=policy)
        right.plot(
            rates, [100 * sum(r.slo_attainment for r in m) / len(m) for m in mine], "o-",
            label=policy,
        )  # fmt: skip
    left.axhline(slo_s, color="grey", linestyle=":", label=f"SLO {slo_s:g} s")
    left.set(xlabel="load (questions / cluster s)", ylabel="workflow P95 (cluster s)")
    right.set(xlabel="load (questions / cluster s)", ylabel="SLO attainment (%)", ylim=(0, 105))
    left.legend()
    right.legend()
    fig.suptitle("Text-to-SQL agent on A100,A100,A6000,L40S (simulated engines)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), metavar="POLICY")
    parser.add_argument(
        "--rates", type=float, nargs="+", default=list(DEFAULT_RATES), metavar="Q_PER_S",
        help="load levels: questions per cluster second (Poisson arrivals)",
    )  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], metavar="SEED")
    parser.add_argument(
        "--questions",
        type=int,
        default=60,
        metavar="N",
        help="workflows per run (default 60: the whole set once; more repeats it)",
    )
    parser.add_argument(
        "--slo-s", type=float, default=DEFAULT_SLO_S, help="end-to-end SLO, cluster seconds"
    )
    parser.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE)
    parser.add_argument("--cluster", default=PAPER_CLUSTER)
    parser.add_argument("--candidates", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--db", type=Path, default=None, help="Chinook database (default: built)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE.json")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE.png")
    args = parser.parse_args(argv)
    if args.questions < 1 or any(r <= 0 for r in args.rates) or args.time_scale <= 0:
        parser.error("--questions, --rates and --time-scale must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="agent-policies-") as tmp:
        db: Path = args.db or build_chinook(Path(tmp) / "chinook.db")
        pool = load_questions()
        rows: list[Row] = []
        for rate in args.rates:
            for seed in args.seeds:
                questions = workload(pool, args.questions, seed)
                for policy in args.policies:
                    rows.append(run_policy(policy, rate, seed, db, questions, args))
                print("\n".join(table(rows, rate, seed, args.slo_s)), flush=True)
                print(flush=True)
    if len(args.seeds) > 1:
        print("\n".join(summary(rows, args.rates, args.policies)))
        print()
    total = time.perf_counter() - started
    print(
        f"{args.cluster}, time scale {args.time_scale:g}x, {args.candidates} candidates, "
        f"{args.rounds} revise rounds, admission off; {total:.0f} s wall in all. Synthetic: "
        "simulated engines answered with the heuristic responder, not a model."
    )
    if args.out is not None:
        doc: dict[str, Any] = {
            "config": {
                "cluster": args.cluster,
                "policies": args.policies,
                "rates": args.rates,
                "seeds": args.seeds,
                "questions": args.questions,
                "slo_s": args.slo_s,
                "time_scale": args.time_scale,
                "candidates": args.candidates,
                "rounds": args.rounds,
            },
            "rows": [{**asdict(r), "flagship_p95_ratio": ratio(rows, r)} for r in rows],
            "wall_s": total,
            "synthetic": True,
        }
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    if args.plot is not None:
        plot(rows, args.policies, args.plot, args.slo_s)


if __name__ == "__main__":
    main()
