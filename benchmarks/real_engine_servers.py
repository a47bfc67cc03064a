"""The vLLM OpenAI servers `real_engine_replay.py` measures: each confined to a core of its
own, started on demand and warmed up, then profiled all at once with ``hexgen-flow profile``
(docs/real-engines.md, "Predicted vs measured")."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import yaml

from hexgen_launch.processes import ManagedProcess, free_port, stop_processes, vllm_cpu_env

__all__ = [
    "MAX_BATCH",
    "MAX_MODEL_LEN",
    "SERVED_MODEL",
    "CpuQuota",
    "Servers",
    "info",
    "profile_servers",
    "server_argv",
]

SERVED_MODEL = "smollm2-135m"
"""The name the vLLM servers serve the model under (and the profile's model)."""
MAX_MODEL_LEN = 2048
MAX_BATCH = 8
"""vLLM's --max-num-seqs, the workers' max batch and the cluster file's max_batch."""
START_TIMEOUT_S = 300.0
STOP_GRACE_S = 30.0


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


class CpuQuota:
    """A cgroup that holds its processes to `share` of one core (Linux CFS bandwidth
    control: `share` x 100 ms of CPU time per 100 ms period, cgroup v1's cpu controller or
    v2's cpu.max); a process started through `wrap` joins it before it runs, and so do its
    children. Needs root (or a delegated cgroup); `close` removes it once it is empty."""

    PERIOD_US = 100_000

    def __init__(self, name: str, share: float) -> None:
        if not 0 < share <= 1:
            raise SystemExit(f"a CPU quota must be a share of a core in (0, 1], got {share}")
        v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
        self.share = share
        quota = str(round(share * self.PERIOD_US))
        try:
            if (v1 / "cpu.cfs_quota_us").is_file():
                self.path = v1 / name
                self.path.mkdir(exist_ok=True)
                (self.path / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(quota)
            elif "cpu" in (v2 / "cgroup.controllers").read_text().split():
                self.path = v2 / name
                self.path.mkdir(exist_ok=True)
                (self.path / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
            else:
                raise OSError("no cgroup cpu controller is mounted")
        except OSError as exc:
            raise SystemExit(
                f"cannot make a cgroup that slows a server to {share:g} of a core: {exc} "
                "(it needs root and the cgroup cpu controller)"
            ) from None

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """`argv`, started inside this cgroup."""
        procs = self.path / "cgroup.procs"
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *argv]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


class Servers:
    """vLLM OpenAI servers, started on demand and kept for the next run (server i confined
    to core i modulo the cores this process may use, and held to `shares[i]` of that core
    when given); `close` stops them all."""

    def __init__(
        self,
        python: str,
        model_dir: str,
        log_dir: Path,
        dtype: str,
        shares: dict[int, float] | None = None,
    ) -> None:
        self.python = python
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.dtype = dtype
        self.cores = sorted(os.sched_getaffinity(0))
        self.procs: list[ManagedProcess] = []
        self.urls: list[str] = []
        self.quotas = {
            i: CpuQuota(f"hexgen-bench-{os.getpid()}-server{i}", share)
            for i, share in (shares or {}).items()
        }

    def core(self, i: int) -> int:
        return self.cores[i % len(self.cores)]

    def ensure(self, n: int) -> list[str]:
        """The URLs of `n` healthy, warmed-up servers (starting the missing ones together)."""
        fresh = []
        for i in range(len(self.procs), n):
            port = free_port()
            core = self.core(i)
            argv = server_argv(self.python, self.model_dir, port, self.dtype, core)
            if i in self.quotas:
                argv = self.quotas[i].wrap(argv)
            env = {**os.environ, **vllm_cpu_env(self.python, core)}
            proc = ManagedProcess(f"vllm server {i}", argv, self.log_dir / f"vllm-{i}.log", env)
            held = f", held to {self.quotas[i].share:g} of it" if i in self.quotas else ""
            info(f"  starting vLLM server {i} on port {port}, confined to core {core}{held}")
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
        for quota in self.quotas.values():
            quota.close()


# ------------------------------------------------------------------------------ profiling


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
