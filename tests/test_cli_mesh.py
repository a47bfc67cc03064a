"""The mesh commands of ``hexgen-flow`` (up, replay, ask, status, demo), run for real as
subprocesses: bad arguments and an unreachable coordinator exit with code 2 and one line
on stderr, and the library commands never load grpc."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runner import run_cli
from hexgen_launch.processes import free_port


def assert_usage_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith("hexgen-flow: error: ")
    assert proc.stderr.count("\n") == 1, proc.stderr  # one line
    for fragment in fragments:
        assert fragment in proc.stderr


def test_the_library_commands_do_not_load_grpc() -> None:
    code = (
        "import sys, hexgen_cli as cli\n"
        "cli.build_parser()\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'redis'))\n"
        "print(loaded)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("replay", "--trace", "trace1"), ("--qps",)),
        (("replay", "--qps", "0"), ("--qps", "> 0")),
        (("status", "--coordinator", "localhost"), ("HOST:PORT",)),
        (("ask", "--trace", "trace1", "--file", "x.jsonl"), ("not allowed with",)),
        (("ask", "--index", "90"), ("--index 90: trace1 has queries 0 to 89",)),
        (("ask", "--trace", "no-such-trace"), ("no-such-trace",)),
        (("up", "--cluster", "A100,Z80"), ("Z80",)),
        (("up", "--policy", "fastest"), ("unknown policy 'fastest'",)),
        (("up", "--tuner-period-s", "-1"), ("--tuner-period-s",)),
        (("demo", "--time-scale", "0"), ("--time-scale",)),
        (("demo", "--trace", "no-such-trace"), ("no-such-trace",)),
        (("up", "--listen", "127.0.0.1:99999"), ("HOST:PORT",)),
        (("up", "--gateway-listen", "localhost"), ("--gateway-listen", "HOST:PORT")),
        (("up", "--admission", "maybe"), ("--admission", "invalid choice: 'maybe'")),
        (("up", "--retention-s", "0"), ("--retention-s",)),
        (("up", "--max-call-attempts", "0"), ("--max-call-attempts",)),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: tuple[str, ...], fragments: tuple[str]) -> None:
    assert_usage_error(run_cli(*args), *fragments)


@pytest.mark.parametrize(
    "args",
    [
        ("status",),
        ("status", "--json"),
        ("replay", "--qps", "1", "--num-queries", "3"),
        ("ask", "--index", "2"),
    ],
)
def test_an_unreachable_coordinator_is_one_clear_line(args: tuple[str, ...]) -> None:
    address = f"127.0.0.1:{free_port()}"
    proc = run_cli(*args, "--coordinator", address)
    assert_usage_error(proc)
    assert proc.stderr == (
        f"hexgen-flow: error: cannot reach the coordinator at {address}: "
        "is `hexgen-flow up` running?\n"
    )


def test_up_without_redis_server_says_how_to_install_it(tmp_path: Path) -> None:
    # PATH without redis-server (the CLI runs from sys.executable's absolute path).
    env = {**os.environ, "PATH": str(tmp_path)}
    proc = run_cli(
        "up", "--listen", "127.0.0.1:0", "--tuner-listen", "127.0.0.1:0",
        "--gateway-listen", "127.0.0.1:0", env=env,
    )  # fmt: skip
    assert_usage_error(proc, "redis-server not found", "apt install redis-server")


def test_choosing_no_command_lists_the_mesh_commands() -> None:
    proc = run_cli()
    assert_usage_error(proc, "up, replay, ask, status", "demo")


def test_up_documents_supervision_and_the_coordinator_options() -> None:
    proc = run_cli("up", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for fragment in (
        "--admission {reject,best-effort,off}",
        "--retention-s FLOAT",
        "--max-call-attempts N",
        "A service that dies is restarted",
        "kill -9",
        "--gateway, --no-gateway",
        "--gateway-listen HOST:PORT",
        "default 127.0.0.1:8000",
    ):
        assert fragment in text


MESH_COMMANDS = (
    ("status",),
    ("status", "--json"),
    ("replay", "--qps", "1", "--num-queries", "3"),
    ("ask", "--index", "2"),
    ("get", "trace1-0"),
    ("top", "--count", "1"),
)


@pytest.mark.parametrize("args", MESH_COMMANDS)
def test_every_mesh_command_defaults_to_hexgen_coordinator(args: tuple[str, ...]) -> None:
    # Where the Go and TypeScript clients' examples look: $HEXGEN_COORDINATOR, then the
    # default address. Nothing listens at the variable's address, so the error names it.
    address = f"127.0.0.1:{free_port()}"
    proc = run_cli(*args, env={**os.environ, "HEXGEN_COORDINATOR": address})
    assert_usage_error(proc)
    assert proc.stderr == (
        f"hexgen-flow: error: cannot reach the coordinator at {address}: "
        "is `hexgen-flow up` running?\n"
    )
    # --coordinator still wins over the variable.
    given = f"127.0.0.1:{free_port()}"
    proc = run_cli(*args, "--coordinator", given, env={**os.environ, "HEXGEN_COORDINATOR": address})
    assert_usage_error(proc, f"at {given}:")


def test_a_bad_hexgen_coordinator_is_one_line_naming_it() -> None:
    env = {**os.environ, "HEXGEN_COORDINATOR": "localhost"}
    assert_usage_error(run_cli("status", env=env), "$HEXGEN_COORDINATOR='localhost'", "HOST:PORT")
    # Commands that do not talk to a coordinator do not read it.
    assert run_cli("policies", env=env).returncode == 0


@pytest.mark.parametrize("command", ["status", "replay", "ask", "get", "top", "eval"])
def test_the_help_of_every_mesh_command_names_hexgen_coordinator(command: str) -> None:
    proc = run_cli(command, "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "--coordinator HOST:PORT[,...]" in text
    assert "default: $HEXGEN_COORDINATOR when set, else 127.0.0.1:50051" in text


def _readme() -> str:
    return " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())


def test_the_readme_demo_figures_are_what_the_simulator_predicts() -> None:
    # `demo` prints the mesh's figures beside the simulator's for the same queries, seed,
    # cluster, policy and alpha (the coordinator's initial 0.5); the simulator's side is
    # deterministic, so the README's must be what `simulate` gives today. (The mesh's side
    # depends on the machine: the README gives what it measured, and where.)
    readme = _readme()
    paragraph = re.search(
        r"`hexgen-flow demo` \(trace3, 100 queries, λ 0\.5, alpha 0\.5\) measured P95 .*? "
        r"against the simulator's ([\d.]+) s",
        readme,
    )
    assert paragraph, "README's demo paragraph changed shape"
    row = re.search(
        r"\| mesh vs simulator, trace3, 200 queries, λ 0\.2, time scale 20 \| "
        r"P95 ([\d.]+) s vs ([\d.]+) s .*?SLO attainment ([\d.]+) % vs ([\d.]+) %",
        readme,
    )
    assert row, "README's demo row changed shape"
    assert "`hexgen-flow demo --trace trace3 --num-queries 200 --qps 0.2 --time-scale 20`" in (
        readme
    )
    for queries, qps, p95, attainment in (
        ("100", "0.5", paragraph[1], None),
        ("200", "0.2", row[2], row[4]),
    ):
        proc = run_cli(
            "simulate", "--trace", "trace3", "--num-queries", queries, "--qps", qps,
            "--alpha", "0.5", "--json",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert f"{doc['latency_s']['p95']:.1f}" == p95, (queries, qps)
        if attainment is not None:
            assert f"{100 * doc['slo_attainment']:.0f}" == f"{float(attainment):.0f}"
