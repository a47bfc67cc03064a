"""Workers show a token (`hexgen_service.worker_token`): a process that reaches the
coordinator's port cannot take a slot, nor report calls, without it. Real processes: a
`hexgen-flow up` mesh, whose workers carry the token it wrote, and forged workers."""

from __future__ import annotations

import asyncio
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hexgen_client.client import CoordinatorClient
from up_runner import Up, running_up

needs_redis_server = pytest.mark.skipif(
    subprocess.run(["which", "redis-server"], capture_output=True, check=False).returncode != 0,
    reason="redis-server is not installed (apt install redis-server)",
)
pytestmark = needs_redis_server


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    folder = tmp_path_factory.mktemp("token")
    with running_up(folder, "--cluster", "A100,A6000", "--no-tuner", "--no-gateway") as running:
        yield running


def _forged_worker(up: Up, *options: str) -> subprocess.CompletedProcess[str]:
    """A worker claiming the real one's id and slot: the takeover an attacker would try."""
    return subprocess.run(
        [sys.executable, "-m", "hexgen_worker", "--coordinator", up.worker_door,
         "--worker-id", "local-worker-1", "--slot", "1", "--gpu", "A6000", *options],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _slot_1(up: Up) -> tuple[str, bool]:
    async def ask() -> tuple[str, bool]:
        async with CoordinatorClient(up.coordinator) as client:
            inst = (await client.status()).instances[1]
            return inst.worker_id, inst.connected

    return asyncio.run(ask())


def test_up_writes_a_private_token_and_its_workers_show_it(up: Up) -> None:
    path = Path(up.banner["workers"].split("the token in ")[1].split()[0])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_text().strip()) >= 32
    assert _slot_1(up) == ("local-worker-1", True)


def test_a_worker_without_the_token_is_refused_and_takes_nothing(up: Up) -> None:
    done = _forged_worker(up)
    assert done.returncode == 2, done.stderr
    assert "UNAUTHENTICATED: worker token missing" in done.stderr
    assert _slot_1(up) == ("local-worker-1", True)  # the real worker kept its slot


def test_a_worker_with_another_token_is_refused(up: Up, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    done = _forged_worker(up, "--worker-token-file", str(wrong))
    assert done.returncode == 2, done.stderr
    assert "UNAUTHENTICATED: worker token invalid" in done.stderr
    assert _slot_1(up) == ("local-worker-1", True)
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    done = _forged_worker(up, "--worker-token-file", str(empty))
    assert done.returncode == 2 and "is empty" in done.stderr
