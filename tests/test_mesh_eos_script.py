"""A scripted end of sequence (`hexgen_service.eos_script`, a worker's ``--eos-script``):
the file's checks, and a real mesh (coordinator, workers and Redis as processes) whose
coordinator learns output lengths under the caps its client declares while the workers stop
each call where the script says, as a model would stop at its end of sequence; and the
same mesh with a worker and then the coordinator SIGKILLed mid-run."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_client.client import CoordinatorClient
from hexgen_coordinator.ledger import call_id_of
from hexgen_flow.errors import ConfigError
from hexgen_flow.lengths import MaxTokensBelief, believed_query
from hexgen_flow.traces import load_trace, take_queries
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


def _scripted_mesh(
    tmp_path: Path, script: dict[str, int], cluster: str, **options: Any
) -> LocalClusterConfig:
    """A local mesh learning output lengths on `cluster`, one simulated worker per
    instance, each stopping calls where `script` (written under `tmp_path`) says."""
    path = tmp_path / "eos.json"
    EosScript(script).write(path)
    worker = WorkerLaunch("simulated", ("--eos-script", str(path)))
    return LocalClusterConfig(
        cluster=cluster,
        policy="hexgen-flow",
        output_lengths="learned",
        listen="127.0.0.1:0",
        tuner=False,
        time_scale=50.0,
        log_dir=tmp_path / "logs",
        workers=(worker,) * len(cluster.split(",")),
        **options,
    )


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
    config = _scripted_mesh(tmp_path, script, "A100,A6000")

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


@needs_redis_server
def test_killed_workers_and_coordinators_lose_nothing_and_stop_each_call_where_scripted(
    tmp_path: Path,
) -> None:
    """The same setting under faults: 160 queries of trace3, every call declared at the
    trace's longest output and stopped by the script at its recorded length. A worker is
    SIGKILLed with calls in flight (and started again), then the coordinator is SIGKILLed
    and restarted. Every query completes, every call completes exactly once (the Redis
    `completions` stream), and every call, the ones moved to another worker included,
    generated what the script says: a call id names the same end on whichever worker runs
    it, after the coordinator that dispatched it is gone."""
    queries = take_queries(load_trace("trace3"), 160)
    calls = {
        call_id_of(q.query_id, k, i): c.output_tokens
        for q in queries
        for k, stage in enumerate(q.workflow.stages)
        for i, c in enumerate(stage.calls)
    }
    cap = max(calls.values())
    assert len(set(calls.values())) > 10  # the script says many different ends
    declared = [believed_query(q, MaxTokensBelief(cap)) for q in queries]
    config = _scripted_mesh(
        tmp_path, calls, "A100,A100,A6000,L40S", start_timeout_s=30, admission="off"
    )
    killed = 1

    def disturb(mesh: LocalCluster) -> None:
        assert mesh.status().instances[killed].in_flight > 0, "nothing to lose yet"
        mesh.kill_worker(killed)
        time.sleep(1.0)
        mesh.start_worker(killed)
        time.sleep(1.0)
        mesh.restart_coordinator()

    async def run(mesh: LocalCluster) -> tuple[dict[str, int], int]:
        async with CoordinatorClient(mesh.coordinator_address) as client:
            replaying = asyncio.create_task(replay(client, declared, 0.5, seed=0, retry_s=60))
            await asyncio.sleep(4.0)
            assert not replaying.done(), "the run ended before it could be disturbed"
            await asyncio.to_thread(disturb, mesh)
            metrics = await replaying
        assert metrics.completed == len(queries)
        async with CoordinatorClient(mesh.coordinator_address) as client:
            generated, moved = {}, 0
            for query in queries:
                reply = await client.get(query.query_id)
                for event in reply.events:
                    if event.kind == cpb.QueryEventKind.QUERY_EVENT_KIND_CALL_FINISHED:
                        generated[event.call_id] = event.output_tokens
                    elif event.kind == cpb.QueryEventKind.QUERY_EVENT_KIND_CALL_REDISPATCHED:
                        moved += 1
        return generated, moved

    with LocalCluster(config) as mesh:
        generated, moved = asyncio.run(run(mesh))
        assert mesh.redis_url is not None
        store = redis.Redis.from_url(mesh.redis_url)
        try:
            entries = store.xrange(f"{mesh.config.redis_prefix}completions")
        finally:
            store.close()
    done = Counter(fields[b"call_id"].decode() for _, fields in entries)
    assert set(done) == set(calls), "calls lost or unknown calls completed"
    assert [c for c, n in done.items() if n != 1] == [], "completed more than once"
    assert moved > 0  # the kill took calls in flight with it
    assert generated == calls
