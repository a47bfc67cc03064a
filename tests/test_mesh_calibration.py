"""A local mesh started with a calibration runs every service on it, through the real path:
`LocalCluster` starts the coordinator and one simulated worker per instance as processes, and
each reports the calibration it built its latency models from."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hexgen_launch.cluster import LocalCluster, LocalClusterConfig

needs_redis_server = pytest.mark.skipif(
    subprocess.run(["which", "redis-server"], capture_output=True, check=False).returncode != 0,
    reason="redis-server is not installed (apt install redis-server)",
)


@needs_redis_server
def test_the_coordinator_and_the_workers_run_on_the_meshs_calibration(tmp_path: Path) -> None:
    config = LocalClusterConfig(
        cluster="H100,L40S",
        calibration="aiconfigurator",
        listen="127.0.0.1:0",
        tuner=False,
        log_dir=tmp_path,
        start_timeout_s=60,
    )
    with LocalCluster(config) as mesh:
        status = mesh.wait_connected()
        assert [inst.gpu for inst in status.instances] == ["H100", "L40S"]
    coordinator = (tmp_path / "coordinator.log").read_text()
    assert "(calibration aiconfigurator)" in coordinator
    for slot in (0, 1):
        assert "calibration aiconfigurator" in (tmp_path / f"worker-{slot}.log").read_text()
