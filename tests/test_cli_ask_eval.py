"""`hexgen-flow ask --db` and `hexgen-flow eval` as a user runs them: real subprocesses
against `hexgen-flow up`'s gateway (simulated engines: the SQL is the synthetic responder's,
not a model's), and the recorded trace replayed by `hexgen-flow simulate`."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli_runner import one_error_line, run_cli, run_json
from hexgen_flow.traces import load_trace
from hexgen_launch.processes import free_port
from hexgen_sql.evaluate import execution_match
from hexgen_sql.questions import load_questions
from sql_fixtures import chinook_db_fixture  # noqa: F401
from up_runner import Up, running_up

TIME_SCALE = "50"
ROOT = Path(__file__).resolve().parents[1]

needs_redis_server = pytest.mark.skipif(
    subprocess.run(["which", "redis-server"], capture_output=True, check=False).returncode != 0,
    reason="redis-server is not installed (apt install redis-server)",
)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    with running_up(
        tmp_path_factory.mktemp("cli-sql"),
        "--cluster", "A100,A6000",
        "--time-scale", TIME_SCALE,
        "--no-tuner",
        "--admission", "off",  # a call whose SLO is too short still runs (and misses it)
        "--gateway-listen", "127.0.0.1:0",
    ) as running:  # fmt: skip
        yield running


def gateway(up: Up) -> list[str]:
    return ["--gateway", up.banner["gateway"].split(" ", 1)[0], "--time-scale", TIME_SCALE]


@needs_redis_server
def test_ask_json(up: Up, chinook_db: Path) -> None:
    doc = run_json(
        "ask", "--db", str(chinook_db), "How many tracks are there?", *gateway(up),
        "--slo-s", "600",
    )  # fmt: skip
    assert doc["sql"].upper().startswith("SELECT COUNT(*) FROM TRACK")
    assert doc["columns"] == ["COUNT(*)"] and doc["rows"] == [[3503]]
    stages = [s["stage"] for s in doc["stages"]]
    assert stages[:3] == ["extract_keywords", "information_retriever", "generate_candidate"]
    assert doc["stages"][2]["calls"] == 3
    assert doc["latency_s"] > 0 and doc["slo_met"] is True
    # the coordinator's own arrival-to-finish, within the client's wall time on the clock
    assert 0 < doc["cluster_latency_s"] <= doc["latency_s"] * float(TIME_SCALE)
    assert doc["synthetic"] is True  # the responder's label, seen through the gateway
    assert doc["workflow"].startswith("sql-")


@needs_redis_server
def test_ask_prints_the_sql_its_rows_and_the_timeline(up: Up, chinook_db: Path) -> None:
    proc = run_cli(
        "ask", "--db", str(chinook_db), "List the names of all genres.", *gateway(up),
        "--slo-s", "1", "--candidates", "2", "--rounds", "1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("SQL: SELECT") and "Genre" in lines[0]
    assert lines[0].endswith("(synthetic: the simulated engine's heuristics, not a model)")
    assert lines[1] == "Name" and "Rock" in proc.stdout
    assert "(25 rows, 5 not shown)" in lines
    assert any(line.split()[:1] == ["generate_candidate"] and "2 calls" in line for line in lines)
    assert lines[-1].endswith("SLO 1 s: MISSED")  # a call alone takes longer
    assert lines[-2].startswith("workflow sql-") and "hexgen-flow get sql-" in lines[-2]


@needs_redis_server
def test_eval_records_a_trace_that_simulate_replays(
    up: Up, chinook_db: Path, tmp_path: Path
) -> None:
    record = tmp_path / "runs.jsonl"
    proc = run_cli(
        "eval", "--db", str(chinook_db), *gateway(up), "--limit", "5", "--concurrency", "2",
        "--slo-s", "600", "--record", str(record), "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "eval: 5/5 done" in proc.stderr  # progress on stderr, the result on stdout
    doc = json.loads(proc.stdout)
    gold = {q.id: q.sql for q in load_questions()[:5]}
    assert doc["questions"] == 5 and doc["failed"] == 0
    assert [r["id"] for r in doc["runs"]] == list(gold)
    for run in doc["runs"]:  # accuracy is execution_match against the gold, question by question
        assert run["correct"] == execution_match(chinook_db, run["sql"], gold[run["id"]]).match
    correct = sum(r["correct"] for r in doc["runs"])
    assert doc["correct"] == correct and doc["execution_accuracy"] == correct / 5
    assert doc["slo_attainment"] == 1.0 and doc["synthetic"] is True
    assert 0 < doc["latency_s"]["p50"] <= doc["latency_s"]["p95"]

    queries = load_trace(str(record))
    assert [q.query_id for q in queries] == list(gold)
    for query, run in zip(queries, doc["runs"], strict=True):
        steps = [s.step for s in query.workflow.stages]
        assert steps[:2] == ["extract_keywords", "generate_candidate"]
        assert len(query.workflow.stages[1].calls) == 3
        assert steps.count("revise") <= 2  # one stage per round, at most --rounds
        revise_calls = sum(len(s.calls) for s in query.workflow.stages if s.step == "revise")
        assert revise_calls == run["revise_calls"]
        assert query.slo_s == 600
    replay = run_json("simulate", "--trace", str(record), "--cluster", "A100,A6000")
    assert replay["completed"] == 5 and replay["num_queries"] == 5


def test_usage_errors_are_one_line(tmp_path: Path) -> None:
    assert "needs --db" in one_error_line(run_cli("ask", "How many tracks?"))
    missing = tmp_path / "missing.db"
    line = one_error_line(run_cli("ask", "--db", str(missing), "How many tracks?"))
    assert "no such file" in line and "build_chinook" in line
    assert "needs the question" in one_error_line(run_cli("ask", "--db", str(missing)))
    assert "--db" in one_error_line(run_cli("eval"))
    assert "--json is an option of ask --db" in one_error_line(run_cli("ask", "--json"))


def _answers(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@needs_redis_server
def test_ask_without_a_gateway_starts_an_embedded_mesh(chinook_db: Path) -> None:
    if _answers(8000):
        pytest.skip("something answers on 127.0.0.1:8000: ask would use it")
    proc = run_cli(
        "ask", "--db", str(chinook_db), "How many artists are there?", "--json", timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "starting an embedded local mesh" in proc.stderr
    assert "SIMULATED" in proc.stderr and "synthetic" in proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["synthetic"] is True and doc["rows"] == [[275]]


@pytest.fixture(scope="module")
def web_page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real HTTP server that is not an OpenAI API (Python's http.server with an HTML page
    at every path the agent asks for); its URL."""
    root = tmp_path_factory.mktemp("web")
    (root / "v1").mkdir()
    for page in (root / "index.html", root / "v1" / "models"):
        page.write_text("<html><body>a web page</body></html>\n")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not _answers(port):
            assert server.poll() is None and time.monotonic() < deadline, (
                "http.server did not start"
            )
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.mark.parametrize("command", ["ask", "eval"])
def test_a_gateway_url_that_is_not_an_openai_api_is_one_line_naming_it(
    command: str, web_page: str, chinook_db: Path
) -> None:
    question = ["How many artists are there?"] if command == "ask" else ["--limit", "1"]
    proc = run_cli(
        command, "--db", str(chinook_db), *question, "--gateway", web_page, "--time-scale", "1"
    )
    line = one_error_line(proc)  # exit 2, one line, no traceback
    assert f"{web_page}/v1 is not an OpenAI-compatible API" in line
    assert f"GET {web_page}/v1/models answered HTTP 200" in line


@pytest.mark.parametrize("command", ["ask", "eval"])
def test_a_dead_gateway_is_one_line_naming_its_url(command: str, chinook_db: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    question = ["How many artists are there?"] if command == "ask" else ["--limit", "1"]
    proc = run_cli(command, "--db", str(chinook_db), *question, "--gateway", url)
    line = one_error_line(proc)
    assert line.startswith(f"hexgen-flow: error: cannot reach the gateway at {url}: "), line


@needs_redis_server
@pytest.mark.parametrize("command", ["ask", "eval"])
def test_a_model_the_gateway_does_not_serve_is_a_usage_error(
    command: str, up: Up, chinook_db: Path
) -> None:
    question = ["How many artists are there?"] if command == "ask" else ["--limit", "1"]
    proc = run_cli(command, "--db", str(chinook_db), *question, *gateway(up), "--model", "gpt-4")
    line = one_error_line(proc)  # exit 2, as every unknown name (README, "Bad input")
    url = up.banner["gateway"].split(" ", 1)[0]
    assert line == f"hexgen-flow: error: --model gpt-4: the gateway at {url} serves llama-3.1-70b"


@needs_redis_server
def test_the_documented_slo_refusal_is_what_runs(tmp_path: Path, chinook_db: Path) -> None:
    """docs/text-to-sql.md: on `up --cluster A100,A6000 --time-scale 50 --no-tuner` (admission
    on, the default) the agent's workflow is predicted at about N s, so `--slo-s R` (R < N) is
    refused with one line and exit 1, and `--slo-s 60` runs."""
    doc = " ".join((ROOT / "docs" / "text-to-sql.md").read_text().split())
    claim = re.search(
        r"predicted at about (\d+) s on A100,A6000, so `--slo-s (\d+)` is refused", doc
    )
    assert claim, "docs/text-to-sql.md no longer states which SLO is refused"
    least_s, refused_slo = int(claim[1]), claim[2]
    with running_up(
        tmp_path, "--cluster", "A100,A6000", "--time-scale", TIME_SCALE, "--no-tuner"
    ) as mesh:  # fmt: skip
        url = mesh.banner["gateway"].split(" ", 1)[0]
        ask = ["ask", "--db", str(chinook_db), "How many tracks are there in each genre?"]
        at = ["--gateway", url, "--coordinator", mesh.coordinator]
        refused = run_cli(*ask, *at, "--slo-s", refused_slo)
        assert refused.returncode == 1 and refused.stdout == "", refused.stderr
        assert "Traceback" not in refused.stderr and refused.stderr.count("\n") == 1
        assert refused.stderr.startswith(f"hexgen-flow: error: the gateway at {url}: ")
        assert f"needs about {least_s} s even alone" in refused.stderr, refused.stderr
        admitted = run_cli(*ask, *at, "--slo-s", "60")
        assert admitted.returncode == 0, admitted.stderr
        assert admitted.stdout.splitlines()[-1].endswith("SLO 60 s: met")
