"""`benchmarks/real_engine_hetero.py --output-lengths learned`: the mesh is given every call
at one cap (an agent's max_tokens) while its workers stop each call at its recorded length
(an EOS script), and the coordinator learns lengths; the simulator's predictions believe
what that coordinator believes. The replays need vLLM (the real-engine tier; a mesh with
an EOS script is tested in tests/test_mesh_eos_script.py); what is tested here is what the
benchmark gives the mesh and the simulator, and how kept runs are checked before anything
is measured again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from hexgen_coordinator.ledger import call_id_of
from hexgen_flow.errors import ConfigError
from hexgen_flow.lengths import OutputLengthPredictor
from hexgen_flow.sim.simulator import SimConfig
from hexgen_flow.traces import load_trace, take_queries

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import real_engine_hetero as het
from real_engine_replay import lengths_simulation, predict
from real_engine_results import save_measured

ROOT = Path(__file__).resolve().parent.parent
FAST = ROOT / "examples" / "profiles" / "smollm2-135m-vllm-cpu-1core.yaml"
WORKLOAD = ROOT / "benchmarks" / "workloads" / "smollm2-replay.jsonl"


def _work(tmp_path: Path) -> Path:
    """A benchmark folder with both servers' profiles (the slow one 2.5x the fast one)."""
    work = tmp_path / "work"
    work.mkdir()
    doc = yaml.safe_load(FAST.read_text())
    (work / "profile.server0.yaml").write_text(yaml.safe_dump(doc))
    for point in doc["prefill"]:
        point["ttft_s"] *= 2.5
    for point in doc["decode"]:
        point["decode_step_s"] *= 2.5
    (work / "profile.server1.yaml").write_text(yaml.safe_dump(doc))
    return work


def _setting(work: Path, n: int, *options: str) -> het.Setting:
    args = het.build_parser().parse_args(["--num-queries", str(n), *options])
    return het.setting(args, take_queries(load_trace(str(WORKLOAD)), n), work)


def test_the_mesh_is_given_every_call_at_the_cap_and_the_workers_its_length(
    tmp_path: Path,
) -> None:
    chosen = _setting(_work(tmp_path), 6, "--output-lengths", "learned", "--max-tokens", "40")
    assert chosen.lengths == {"output_lengths": "learned", "max_tokens": 40}
    declared, script = chosen.declared(), chosen.eos_script()
    calls = 0
    for true, given in zip(chosen.queries, declared, strict=True):
        assert (given.query_id, given.slo_s) == (true.query_id, true.slo_s)  # the same SLO
        for k, (stage, said) in enumerate(
            zip(true.workflow.stages, given.workflow.stages, strict=True)
        ):
            for i, (call, cap) in enumerate(zip(stage.calls, said.calls, strict=True)):
                assert (cap.step, cap.input_tokens, cap.output_tokens) == (
                    call.step,
                    call.input_tokens,
                    40,
                )
                # keyed by the coordinator's own call ids
                assert script.tokens(call_id_of(true.query_id, k, i), 40) == call.output_tokens
                calls += 1
    assert len(script) == calls
    # known lengths: the mesh is given the recorded lengths themselves
    known = _setting(tmp_path / "work", 6)
    assert known.lengths_cap is None and known.declared() == known.queries


def test_a_cap_below_the_workloads_longest_output_is_refused(tmp_path: Path) -> None:
    longest = r"--max-tokens 16: below the workload's longest output \(32 tokens\)"
    with pytest.raises(SystemExit, match=longest):
        _setting(_work(tmp_path), 6, "--output-lengths", "learned", "--max-tokens", "16")


def test_the_simulator_believes_what_the_coordinator_does(tmp_path: Path) -> None:
    """Under a cap the predictions' scheduler learns lengths from the calls that finished,
    cold from its prior and never above the cap, as ``--output-lengths learned`` with
    every call declared at the cap does; with known lengths it plans with the recorded
    ones."""
    work = _work(tmp_path)
    chosen = _setting(work, 6, "--output-lengths", "learned")
    config = SimConfig(0.1, prefix_caching=False)
    sim = lengths_simulation(chosen.queries, chosen.belief, "hexgen-flow", config, None, 32)
    belief = sim.core.lengths
    assert isinstance(belief, OutputLengthPredictor) and belief.cap == 32
    # cold: the prior (a full-size revision, 79 tokens) cut at the cap
    assert belief.predict("revise") == 32
    sim.run()
    recorded = sorted(
        c.output_tokens
        for q in chosen.queries
        for st in q.workflow.stages
        for c in st.calls
        if c.step == "revise"
    )
    assert belief.predict("revise") <= recorded[-1] < 32  # learned from what finished
    known = lengths_simulation(chosen.queries, chosen.belief, "hexgen-flow", config, None, None)
    assert known.core.lengths is None


def test_a_kept_folder_is_refused_under_other_lengths_or_another_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder measured with learned lengths at one rate: `--predict-from` reports the
    lengths the runs knew; with known lengths, or another cap, it refuses, naming both;
    and a resumed run at another rate is refused before any replay (`check_kept_rates`)."""
    work = _work(tmp_path)
    chosen = _setting(work, 6, "--output-lengths", "learned")
    (work / het.LENGTHS_FILE).write_text(json.dumps(chosen.lengths))
    qps = 0.5
    arrivals = {q.query_id: k / qps for k, q in enumerate(chosen.queries)}
    run = predict(
        chosen.queries, arrivals, chosen.belief, qps=qps, seed=0, policy="hexgen-flow",
        engine=None, truth=chosen.truth, lengths_cap=32,
    )  # fmt: skip
    assert het.kept_measurements([(0, work)]) == []  # profiles alone: any lengths may follow
    save_measured(work / "measured-hexgen-flow.json", 2, qps, run)
    assert het.kept_measurements([(0, work)]) == [work / "measured-hexgen-flow.json"]
    argv = ["--predict-from", str(work), "--num-queries", "6", "--policies", "hexgen-flow"]
    argv += ["--qps", str(qps)]
    assert het.main([*argv, "--output-lengths", "learned", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["output_lengths"], doc["max_tokens"]) == ("learned", 32)
    # the prediction is the measurement's own run: the same belief, the same figures
    assert doc["runs"][0]["p95_error"] == pytest.approx(0.0, abs=1e-9)
    assert het.main([*argv, "--output-lengths", "learned"]) == 0
    assert "every call declared at 32 tokens" in capsys.readouterr().out
    with pytest.raises(
        SystemExit,
        match="measured with --output-lengths learned --max-tokens 32, not --output-lengths known",
    ):
        het.main(argv)
    with pytest.raises(SystemExit, match="not --output-lengths learned --max-tokens 40"):
        het.main([*argv, "--output-lengths", "learned", "--max-tokens", "40"])
    het.check_kept_rates([(0, work)], qps)  # the rate it was measured at: resumed
    with pytest.raises(SystemExit, match=r"measured at 0\.5 q/s, but this run's rate is 0\.12 q/s"):
        het.check_kept_rates([(0, work)], 0.12)


def test_a_folder_from_before_the_option_counts_as_known_lengths(tmp_path: Path) -> None:
    work = _work(tmp_path)
    het.check_lengths(_setting(work, 6), work)
    with pytest.raises(SystemExit, match="measured with --output-lengths known"):
        het.check_lengths(_setting(work, 6, "--output-lengths", "learned"), work)


def test_a_learned_cap_below_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="learned cap must be >= 1, got 0"):
        SimConfig(0.1, learned_cap=0)
