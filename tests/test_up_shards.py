"""``hexgen-flow up --shards 2`` as a user runs it (a subprocess; its banner gives the
addresses): ``replay`` given the banner's comma list of coordinators completes its queries
on both shards; after shard 0's coordinator is SIGKILLed, `up` reports it (no restart:
the spare takes the shard over) and a second replay completes too; SIGTERM stops
everything. With ``--secure`` the same mesh takes only clients with a key, over TLS, and
its services reach Redis as their ACL users, given every shard's keys; with
``--redis-cluster`` its shards are spread over a real Redis Cluster's masters."""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import urllib.request
from pathlib import Path

import grpc
import pytest
import redis

from hexgen_api.v1 import tuner_pb2, tuner_pb2_grpc
from hexgen_coordinator.shards import ShardMap
from hexgen_service.auth import AUTH_METADATA
from hexgen_service.auth_dir import AuthDir
from redis_cluster_here import RedisClusterHere, needs_redis_cluster
from up_runner import Up, replay, running_up, wait_for

SHARDS = ShardMap(("hf:{s0}:", "hf:{s1}:"))
"""The shards of ``up --shards 2``."""


def _replay(up: Up, trace: str, num_queries: int = 12) -> dict[str, object]:
    done = replay(up, "--trace", trace, "--qps", "1", "--num-queries", str(num_queries))
    out, err = done.communicate(timeout=240)
    assert done.returncode == 0, err
    doc: dict[str, object] = json.loads(out)
    return doc


def _shards_of(report: dict[str, object]) -> set[int]:
    """The shards that ran the report's queries."""
    queries = report["queries"]
    assert isinstance(queries, list)
    return {SHARDS.shard_of(q["query_id"]) for q in queries}


def _retune(address: str, *, ca: Path | None = None, key: Path | None = None) -> str:
    """A tuning run's reason, asked of the tuner at `address` (TLS and a key, if given)."""
    channel = (
        grpc.secure_channel(address, grpc.ssl_channel_credentials(ca.read_bytes()))
        if ca is not None
        else grpc.insecure_channel(address)
    )
    metadata = ((AUTH_METADATA, f"Bearer {key.read_text().strip()}"),) if key else None
    with channel:
        stub = tuner_pb2_grpc.TunerServiceStub(channel)
        run = stub.Retune(tuner_pb2.RetuneRequest(), metadata=metadata, timeout=120).run
    return str(run.reason)


def _window_size(reason: str) -> int:
    """How many queries a run found in its window (fewer than the tuner's minimum of 20:
    ``too few queries in the window (N < 20)``)."""
    found = re.search(r"in the window \((\d+) < \d+\)", reason)
    assert found, reason
    return int(found.group(1))


def test_up_with_shards_serves_both_and_survives_a_dead_shard(tmp_path: Path) -> None:
    with running_up(tmp_path, "--shards", "2", "--spares", "1", "--time-scale", "50") as up:
        addresses = up.coordinator.split(",")
        assert len(addresses) == 3
        shards = up.banner["shards"]
        assert "shard 0 (hf:{s0}:)" in shards and "shard 1 (hf:{s1}:)" in shards
        assert f"{addresses[2]} spare" in shards
        first = _replay(up, "trace3")
        assert first["completed"] == first["num_queries"] == 12
        victim = up.service_pid("hexgen_coordinator", "hf:{s0}:")
        os.kill(victim, signal.SIGKILL)
        up.wait_stderr(r"coordinator s0 exited \(code -9\); not restarted", timeout_s=15)
        spare_log = up.log_dir / "coordinator-spare0.log"
        wait_for(
            "the spare holds shard 0", lambda: "took over shard 0" in spare_log.read_text(), 30
        )
        again = _replay(up, "trace2")  # new queries, on both shards again
        assert again["completed"] == again["num_queries"] == 12
        assert "resubmitted" not in again  # new ids: this work ran after the takeover
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=60) == 0
    assert "stopping" in up.stderr


def test_up_with_shards_secure_takes_keys_over_tls_and_redis_acl_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    auth = AuthDir(tmp_path / "auth")
    options = ("--shards", "2", "--spares", "1", "--secure", "--auth-dir", str(auth.path),
               "--tenants", "a", "--cluster", "A100,A6000", "--time-scale", "50")  # fmt: skip
    for name in ("HEXGEN_FLOW_API_KEY", "HEXGEN_FLOW_TLS_CA"):
        monkeypatch.delenv(name, raising=False)
    with running_up(tmp_path, *options) as up:
        # what a client needs: every coordinator, the CA to trust, its key
        assert len(up.coordinator.split(",")) == 3
        assert up.banner["CA (clients trust it)"] == f"export HEXGEN_FLOW_TLS_CA={auth.ca}"
        assert up.banner["tenant keys"] == str(auth.tenant_key("a"))
        assert "one ACL user per service with every shard's keys" in up.banner["redis"]
        assert "~hf:{s0}:* ~hf:{s1}:*" in auth.redis_acl.read_text()
        # a client with the CA and no key: refused at the door, whichever shard it asks
        monkeypatch.setenv("HEXGEN_FLOW_TLS_CA", str(auth.ca))
        refused = replay(up, "--num-queries", "1", "--qps", "1")
        _, err = refused.communicate(timeout=120)
        assert refused.returncode == 2 and "UNAUTHENTICATED" in err, err
        # tenant a's key: its queries run to their end on both shards
        monkeypatch.setenv("HEXGEN_FLOW_API_KEY", auth.tenant_key("a").read_text().strip())
        report = _replay(up, "trace1", num_queries=8)
        assert report["completed"] == report["num_queries"] == 8, report
        assert _shards_of(report) == {0, 1}
        # the tuner, as its Redis user, reads both shards' windows and clocks
        tuner = up.banner["tuner"].split()[0]
        assert _window_size(_retune(tuner, ca=auth.ca, key=auth.admin_key)) == 8
        gateway = up.banner["gateway"].split()[0].removesuffix("/v1")
        assert gateway.startswith("https://")
        context = ssl.create_default_context(cafile=str(auth.ca))
        with urllib.request.urlopen(f"{gateway}/health", context=context, timeout=10) as answer:
            assert answer.status == 200
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=60) == 0
    refusal = re.compile(r"NOPERM|user executing the script can't")  # a command, a script's
    for log in up.log_dir.glob("*.log"):  # Redis refused no service anything
        assert not refusal.search(log.read_text()), log


@needs_redis_cluster
def test_up_with_shards_on_a_redis_cluster(tmp_path: Path) -> None:
    with (
        RedisClusterHere() as cluster,
        running_up(
            tmp_path,
            "--shards",
            "2",
            "--spares",
            "0",
            "--redis-cluster",
            "--redis-url",
            cluster.url,
            "--cluster",
            "A100,A6000",
            "--no-gateway",
            "--time-scale",
            "50",
        ) as up,  # fmt: skip
    ):
        assert "a node of a Redis Cluster" in up.banner["redis"]
        report = _replay(up, "trace1", num_queries=8)
        assert report["completed"] == report["num_queries"] == 8, report
        assert _shards_of(report) == {0, 1}
        tuner = up.banner["tuner"].split()[0]
        assert _window_size(_retune(tuner)) == 8  # both shards' streams, from their slots
        client: redis.RedisCluster[bytes] = cluster.client()
        try:
            finished = [client.xlen(f"{p}finished") for p in SHARDS.prefixes]
            assert sum(finished) == 8 and all(finished)
            assert client.llen("hf:{0}:tuner:runs") == 1  # the tuner's own, with a hash tag
        finally:
            client.close()
