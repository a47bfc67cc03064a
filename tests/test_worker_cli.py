"""``python -m hexgen_worker``: bad arguments exit with code 2 and one line; SIGTERM exits 0."""

from __future__ import annotations

import importlib.util
import signal
import socket
import subprocess
import sys
import time

import pytest

from hexgen_worker.cli import build_parser, config_from_args, main

BASE = ["--coordinator", "localhost:50051", "--worker-id", "w1", "--gpu", "A100"]

ERROR_CASES = [
    (["--coordinator", "localhost:1", "--gpu", "A100"], "--worker-id"),
    ([*BASE[:4], "--gpu", "H900"], "A6000"),
    (["--coordinator", "nohost", *BASE[2:]], "HOST:PORT"),
    ([*BASE, "--coordinator", "nohost"], "HOST:PORT"),
    ([*BASE, "--coordinator", "localhost:50051"], "localhost:50051 is given twice"),
    ([*BASE, "--engine", "openai"], "--openai-url"),
    ([*BASE, "--engine", "vllm"], "--vllm-model"),
    ([*BASE, "--engine", "tgi"], "invalid choice"),
    ([*BASE, "--max-batch", "0"], "--max-batch"),
    ([*BASE, "--kv-cache-tokens", "-5"], "--kv-cache-tokens"),
    ([*BASE, "--slot", "-2"], "--slot"),
    ([*BASE, "--slot", "x"], "--slot"),
    ([*BASE, "--model", "gpt-9"], "llama-3.1-70b"),
    ([*BASE, "--vllm-arg", "enforce_eager"], "KEY=VALUE"),
    ([*BASE, "--bogus"], "unrecognized arguments"),
]


@pytest.mark.parametrize(("args", "expected"), ERROR_CASES, ids=[e for _, e in ERROR_CASES])
def test_bad_arguments_exit_2_with_one_line(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("hexgen-worker: error: ") and expected in lines[0]


def test_arguments_fill_the_config() -> None:
    args = build_parser().parse_args(
        [
            *BASE,
            *("--gpu", "a6000", "--slot", "2", "--max-batch", "64"),
            *("--vllm-arg", "enforce_eager=true", "--vllm-arg", "dtype=bfloat16"),
        ]
    )
    config = config_from_args(args)
    assert (config.gpu, config.slot, config.max_batch, config.max_concurrency) == (
        "A6000",
        2,
        64,
        64,
    )
    assert config.kv_cache_tokens is not None and 100_000 < config.kv_cache_tokens < 200_000
    assert config.vllm_engine_args == {"enforce_eager": True, "dtype": "bfloat16"}
    assert config.coordinators == ("localhost:50051",)


def test_coordinator_repeated_links_every_shard_in_order() -> None:
    args = build_parser().parse_args([*BASE, "--coordinator", "10.0.0.2:50052"])
    config = config_from_args(args)
    assert config.coordinator == "localhost:50051"
    assert config.coordinators == ("localhost:50051", "10.0.0.2:50052")


def run_worker(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "hexgen_worker", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_process_exits_2_with_one_line() -> None:
    proc = run_worker(*BASE[:4], "--gpu", "H900")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "unknown GPU type 'H900'" in err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_missing_vllm_exits_2_with_one_line() -> None:
    proc = run_worker(*BASE, "--engine", "vllm", "--vllm-model", "/models/none")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "hexgen-flow[vllm]" in lines[0], err


def test_sigterm_stops_a_worker_with_exit_0() -> None:
    with socket.socket() as probe:  # a port where no coordinator listens: it keeps retrying
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = run_worker("--coordinator", f"127.0.0.1:{port}", *BASE[2:])
    assert proc.stderr is not None
    deadline = time.monotonic() + 20
    for line in proc.stderr:  # wait until it runs (engine started, retrying the link)
        if "simulated engine" in line or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "stopped" in err
