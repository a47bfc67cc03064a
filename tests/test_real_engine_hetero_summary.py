"""`benchmarks/real_engine_hetero.py --seeds`: the summary over arrival seeds, the order the
replays run in, and the option's checks. The replays themselves need vLLM and are the
real-engine tier's (tests/real_engine/test_hetero_learning.py); what is tested here is the
arithmetic that turns their measurements into the claim "lowest P95 over the seeds"."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hexgen_flow.cluster import parse_cluster
from hexgen_flow.learning import CallCost, cost_journal_line
from hexgen_flow.traces import load_trace, take_queries

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import real_engine_hetero as het


def _doc(seed: int, runs: dict[str, tuple[float, float, float]]) -> dict[str, Any]:
    """A seed's document as `_analyse` makes it, with only what `summarise` reads: per
    policy (measured P95, attainment, error of the predicted P95)."""
    return {
        "seed": seed,
        "runs": [
            {
                "policy": label,
                "measured_p95_s": p95,
                "measured_attainment": attainment,
                "p95_error": error,
            }
            for label, (p95, attainment, error) in runs.items()
        ],
    }


def test_summary_over_seeds() -> None:
    docs = [
        _doc(6, {"a": (20.0, 1.0, -0.05), "b": (22.0, 1.0, 0.10), "c": (30.0, 0.9, -0.21)}),
        # a tie: b within 2 % of a, both count as lowest, neither alone
        _doc(7, {"a": (25.0, 1.0, 0.02), "b": (25.4, 0.95, -0.12), "c": (40.0, 0.8, 0.0)}),
        _doc(8, {"a": (33.0, 0.97, 0.0), "b": (30.0, 1.0, 0.01), "c": (36.0, 0.9, 0.03)}),
    ]
    summary = het.summarise(docs)
    assert summary["seeds"] == [6, 7, 8]
    rows = {p["policy"]: p for p in summary["policies"]}
    assert [p["policy"] for p in summary["policies"]] == ["a", "b", "c"]

    a, b, c = rows["a"], rows["b"], rows["c"]
    assert a["p95_s"] == [20.0, 25.0, 33.0]
    assert a["mean_p95_s"] == pytest.approx(26.0)
    # a: lowest on 6 and 7, 10 % above b on 8
    assert a["over_lowest"] == pytest.approx(1.1 ** (1 / 3))
    assert (a["lowest"], a["lowest_alone"]) == (2, 1)
    assert b["over_lowest"] == pytest.approx((1.1 * 1.016) ** (1 / 3))
    assert (b["lowest"], b["lowest_alone"]) == (2, 1)
    assert c["over_lowest"] == pytest.approx((1.5 * 1.6 * 1.2) ** (1 / 3))
    assert (c["lowest"], c["lowest_alone"]) == (0, 0)
    assert a["mean_attainment"] == pytest.approx(0.99)
    assert (b["worst_attainment"], c["worst_attainment"]) == (0.95, 0.8)
    assert (a["worst_p95_error"], b["worst_p95_error"], c["worst_p95_error"]) == (
        0.05,
        0.12,
        0.21,
    )


def test_a_policy_alone_on_a_seed_is_lowest_there() -> None:
    summary = het.summarise([_doc(0, {"only": (12.0, 1.0, 0.0)})])
    (row,) = summary["policies"]
    assert (row["lowest"], row["lowest_alone"], row["over_lowest"]) == (1, 1, 1.0)


def test_seeds_that_ran_other_policies_are_refused() -> None:
    docs = [_doc(1, {"a": (1.0, 1.0, 0.0), "b": (2.0, 1.0, 0.0)}), _doc(2, {"a": (1.0, 1, 0)})]
    with pytest.raises(ValueError, match="seed 2 ran"):
        het.summarise(docs)
    with pytest.raises(ValueError, match="no seed"):
        het.summarise([])


def test_every_policy_runs_once_per_seed_and_the_order_rotates(tmp_path: Path) -> None:
    policies = [het.POLICIES[label] for label in het.POLICIES]
    runs = [(s, tmp_path / f"seed-{s}") for s in (6, 7, 8, 9, 10, 11)]
    order = het._schedule(runs, policies)
    assert len(order) == len(runs) * len(policies)
    n = len(policies)
    for k, run in enumerate(runs):
        block = order[k * n : (k + 1) * n]
        assert {r for r, _ in block} == {run}
        assert sorted(p.label for _, p in block) == sorted(het.POLICIES)
        assert block[0][1] == policies[k % n]  # each seed starts one policy further on
    firsts = [order[k * n][1].label for k in range(n)]
    lasts = [order[k * n + n - 1][1].label for k in range(n)]
    assert len(set(firsts)) == n and len(set(lasts)) == n


def test_one_seed_keeps_the_old_layout_and_several_get_a_folder_each(tmp_path: Path) -> None:
    parser = het.build_parser()
    assert het._runs(parser.parse_args(["--seed", "3"]), tmp_path) == [(3, tmp_path)]
    assert het._runs(parser.parse_args(["--seeds", "6,7"]), tmp_path) == [
        (6, tmp_path / "seed-6"),
        (7, tmp_path / "seed-7"),
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seeds", "6,6"], "distinct"),
        (["--seeds", "six"], "comma-separated list of integers"),
        (["--seeds", ","], "distinct"),
        (["--seed", "1", "--seeds", "6,7"], "not allowed with argument"),
    ],
)
def test_seed_options_are_checked(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        het.build_parser().parse_args(argv)
    assert message in capsys.readouterr().err


def test_the_summary_prints_a_column_per_seed(capsys: pytest.CaptureFixture[str]) -> None:
    docs = [_doc(s, {"x": (10.0 + s, 1.0, 0.0), "y": (12.0, 0.5, 0.3)}) for s in (1, 2)]
    het._print_summary(het.summarise(docs))
    out = capsys.readouterr().out
    header, x, y = out.splitlines()[2:5]
    assert header.split()[:5] == ["policy", "seed", "1", "seed", "2"]
    assert x.split()[:5] == ["x", "11.0", "s", "12.0", "s"]
    # x: lowest on both seeds, alone on seed 1; y: tied with x on seed 2, never alone,
    # half its SLOs met
    assert x.split()[-9:] == ["1.000", "2/2", "1/2", "100", "%", "100", "%", "0", "%"]
    assert y.split()[-8:] == ["1/2", "0/2", "50", "%", "50", "%", "30", "%"]


def test_a_cost_journal_replayed_grades_the_learner_without_an_engine(tmp_path: Path) -> None:
    """`replayed_curve`: the slow server's calls of a cost journal, each served alone as
    that server's own profile says (prefill 3x, decode 1.5x the fast one's), replayed
    through this version's learner: the error against that profile starts at the belief's
    and ends within 5 %, and the calls that prefilled alone are counted (the fast server's
    calls are not the slow one's)."""
    root = Path(__file__).resolve().parent.parent
    template = root / "examples" / "cpu-1core-cluster.yaml"
    fast = root / "examples" / "profiles" / "smollm2-135m-vllm-cpu-1core.yaml"
    doc = yaml.safe_load(fast.read_text())  # a server 3x slower to prefill, 1.5x to decode
    for point in doc["prefill"]:
        point["ttft_s"] *= 3.0
    for point in doc["decode"]:
        point["decode_step_s"] *= 1.5
    slow = tmp_path / "profile.server1.yaml"
    slow.write_text(yaml.safe_dump(doc))
    belief = parse_cluster(str(het.write_cluster(template, fast, tmp_path / "cluster.yaml")))
    truth = het.truth_cluster(belief, template, slow, tmp_path)
    workload = root / "benchmarks" / "workloads" / "smollm2-replay.jsonl"
    queries = take_queries(load_trace(str(workload)), 10)
    chosen = het.Setting(tmp_path / "cluster.yaml", belief, truth, tuple(queries))
    model = truth.instances[1].latency
    lines = []
    for query in queries:
        for stage in query.workflow.stages:
            for call in stage.calls:
                prefill, decode = model.split(call.input_tokens, call.output_tokens)
                for instance in (0, 1):
                    cost = CallCost(
                        instance, call.input_tokens, call.output_tokens, prefill + decode,
                        1.0, call.input_tokens + call.output_tokens / 2,
                        first_token_s=prefill, held_at_start=0,
                    )  # fmt: skip
                    lines.append(cost_journal_line(cost))
    journal = tmp_path / "costs-hexgen-flow+learn.jsonl"
    journal.write_text("".join(lines))
    curve = het.replayed_curve(journal, chosen)
    start = het.model_error(chosen.queries, belief.instances[1].latency, model, (1.0, 1.0))
    assert curve[0]["error"] == start and abs(start) > 0.2, start
    assert len(curve) > 1 and abs(curve[-1]["error"]) < 0.05, curve[-1]
    assert all(point["alone"] == point["calls"] for point in curve)
