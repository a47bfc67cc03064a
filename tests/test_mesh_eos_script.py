"""A scripted end of sequence (`hexgen_service.eos_script`, a worker's ``--eos-script``):
the file's checks, and a real mesh (coordinator, workers and Redis as processes) whose
coordinator learns output lengths under the caps its client declares while the workers stop
each call where the script says, as a model would stop at its end of sequence."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_client.client import CoordinatorClient
from hexgen_flow.errors import ConfigError
from hexgen_flow.workload import LLMCall, Query, Workflow
from hexgen_launch.cluster import LocalCluster, LocalClusterConfig, WorkerLaunch
from hexgen_launch.replay import replay
from hexgen_service.eos_script import EosScript
from hexgen_worker.cli import build_parser, config_from_args

needs_redis_server = pytest.mark.skipif(
    subprocess.run(["which", "redis-server"], capture_output=True, check=False).returncode != 0,
    reason="redis-server is not installed (apt install redis-server)",
)

CAP = 64
"""Every call's declared output tokens (an agent's max_tokens)."""


def test_a_call_is_asked_for_its_scripted_tokens_never_past_its_cap() -> None:
    script = EosScript({"q/0.0": 7, "q/1.0": 500})
    assert script.tokens("q/0.0", CAP) == 7
    assert script.tokens("q/1.0", CAP) == CAP  # the model would have gone on: cut at the cap
    assert script.tokens("other/0.0", CAP) == CAP  # not named: to the cap


def test_a_written_script_reads_back(tmp_path: Path) -> None:
    EosScript({"q/0.0": 7, "q/1.2": 3}).write(tmp_path / "eos.json")
    script = EosScript.read(tmp_path / "eos.json")
    assert len(script) == 2 and script.tokens("q/1.2", CAP) == 3


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (None, "No such file"),
        ("{", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"q/0.0": 0}', "'q/0.0': output tokens must be an integer >= 1, got 0"),
        ('{"q/0.0": 2.5}', "got 2.5"),
        ('{"q/0.0": true}', "got True"),
    ],
)
def test_a_bad_script_stops_the_worker_at_start_naming_the_file(
    tmp_path: Path, text: str | None, says: str
) -> None:
    path = tmp_path / "eos.json"
    if text is not None:
        path.write_text(text)
    args = build_parser().parse_args(
        [
            "--coordinator",
            "127.0.0.1:1",
            "--worker-id",
            "w",
            "--gpu",
            "A100",
            "--eos-script",
            str(path),
        ]
    )
    with pytest.raises(ConfigError, match="--eos-script") as caught:
        config_from_args(args)
    assert str(path) in str(caught.value) and says in str(caught.value)


@needs_redis_server
def test_a_mesh_learns_the_lengths_its_workers_stop_at_while_its_client_declares_caps(
    tmp_path: Path,
) -> None:
    """Ten two-stage queries, every call declared at `CAP`; the script stops extraction
    calls after 5 tokens and revisions after 12, but leaves one query's revision out (it
    runs to its cap). Every call finishes with the tokens the script gave it, and the
    coordinator, learning lengths (``--output-lengths learned``), reports those counts."""
    queries = [
        Query(
            f"eos-{i}",
            Workflow.chain(
                [(LLMCall("extract_keywords", 120, CAP),), (LLMCall("revise", 200, CAP),)]
            ),
            slo_s=600.0,
        )
        for i in range(10)
    ]
    script = {f"eos-{i}/0.0": 5 for i in range(10)} | {f"eos-{i}/1.0": 12 for i in range(9)}
    path = tmp_path / "eos.json"
    EosScript(script).write(path)
    worker = WorkerLaunch("simulated", ("--eos-script", str(path)))
    config = LocalClusterConfig(
        cluster="A100,A6000",
        policy="hexgen-flow",
        output_lengths="learned",
        listen="127.0.0.1:0",
        tuner=False,
        time_scale=50.0,
        log_dir=tmp_path / "logs",
        workers=(worker, worker),
    )

    async def run(address: str) -> dict[str, int]:
        async with CoordinatorClient(address) as client:
            metrics = await replay(client, queries, 2.0, seed=0)
            assert metrics.completed == len(queries)
            generated = {}
            for query in queries:
                for event in (await client.get(query.query_id)).events:
                    if event.kind == cpb.QueryEventKind.QUERY_EVENT_KIND_CALL_FINISHED:
                        generated[event.call_id] = event.output_tokens
            return generated

    with LocalCluster(config) as mesh:
        generated = asyncio.run(run(mesh.coordinator_address))
    assert generated == script | {"eos-9/1.0": CAP}
