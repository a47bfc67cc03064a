"""`hexgen-flow up` started again at once on the ports of a coordinator that was SIGKILLed.

The kill leaves the connections the coordinator had accepted in TIME_WAIT (or FIN_WAIT2)
on its ports for about a minute. gRPC's own listener binds with SO_REUSEADDR, which such
connections do not block, so the pre-check of `LocalCluster.start` (`resolve_address`)
must not refuse those ports either; a port with a live listener must still be refused.
Real processes: the coordinator and a simulated worker, on the test Redis under a private
key prefix.
"""

from __future__ import annotations

import dataclasses
import socket
import uuid
from collections.abc import Iterator

import grpc
import pytest
import redis

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import coordinator_pb2_grpc as cpb_grpc
from hexgen_launch.cluster import LocalCluster, LocalClusterConfig
from hexgen_launch.errors import ClusterError
from hexgen_launch.processes import free_port, resolve_address
from redis_here import REDIS_URL, needs_redis

pytestmark = needs_redis


@pytest.fixture
def config() -> Iterator[LocalClusterConfig]:
    prefix = f"hf-hostile-ports-{uuid.uuid4().hex[:8]}:"
    yield LocalClusterConfig(
        cluster="A100",
        listen=f"127.0.0.1:{free_port()}",
        worker_listen=f"127.0.0.1:{free_port()}",
        tuner=False,
        redis_url=REDIS_URL,
        redis_prefix=prefix,
        time_scale=50.0,
        start_timeout_s=30,
    )
    with redis.Redis.from_url(REDIS_URL) as client:
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)


def _status(address: str) -> cpb.ClusterStatusResponse:
    with grpc.insecure_channel(address) as channel:
        reply: cpb.ClusterStatusResponse = cpb_grpc.CoordinatorServiceStub(channel).ClusterStatus(
            cpb.ClusterStatusRequest(), timeout=10
        )
        return reply


def _plain_bind_refused(address: str) -> bool:
    """Whether a bind without SO_REUSEADDR fails there (what the old pre-check did)."""
    host, port = address.rsplit(":", 1)
    with socket.socket() as sock:
        try:
            sock.bind((host, int(port)))
        except OSError:
            return True
    return False


def test_up_starts_again_at_once_on_the_ports_of_a_sigkilled_coordinator(
    config: LocalClusterConfig,
) -> None:
    with LocalCluster(config) as mesh:
        assert mesh.coordinator is not None
        # Clients connected to the coordinator (a worker is connected to its door).
        channels = [grpc.insecure_channel(config.listen) for _ in range(4)]
        for channel in channels:
            cpb_grpc.CoordinatorServiceStub(channel).ClusterStatus(
                cpb.ClusterStatusRequest(), timeout=10
            )
        mesh.coordinator.kill()  # SIGKILL: the kernel closes its connections first
        for channel in channels:
            channel.close()
    # The scenario holds: the old connections still hold the port for a plain bind (the
    # door's may be free: a connection reset, with data unread, leaves no TIME_WAIT).
    assert _plain_bind_refused(config.listen)
    with LocalCluster(dataclasses.replace(config)) as again:
        assert again.coordinator_address == config.listen
        assert again.worker_address == config.worker_listen
        status = _status(config.listen)
        assert [i.connected for i in status.instances] == [True]


def test_a_port_with_a_live_listener_is_still_refused(config: LocalClusterConfig) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ClusterError, match=f"cannot listen on 127.0.0.1:{port}"):
            resolve_address(f"127.0.0.1:{port}")
        taken_door = dataclasses.replace(config, worker_listen=f"127.0.0.1:{port}")
        with pytest.raises(ClusterError, match=f"cannot listen on 127.0.0.1:{port}"):
            LocalCluster(taken_door).start()
    # A running coordinator's own gRPC listener (SO_REUSEADDR) keeps its port too.
    with (
        LocalCluster(config),
        pytest.raises(ClusterError, match=f"cannot listen on {config.listen}"),
    ):
        LocalCluster(dataclasses.replace(config, worker_listen="127.0.0.1:0")).start()
