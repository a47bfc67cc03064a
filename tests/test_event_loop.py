"""The services' event loop (`hexgen_service.event_loop`): ``auto`` is uvloop where it is
installed (a dependency of the mesh on Linux), each choice really runs on its loop, and a
bad choice is refused naming the flag, by the function and by the coordinator's CLI."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import subprocess
import sys

import pytest

from hexgen_flow.errors import ConfigError
from hexgen_service.event_loop import resolve_event_loop, run

HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_each_choice_runs_on_its_loop() -> None:
    assert run(_loop_module(), "asyncio").startswith("asyncio")
    if HAVE_UVLOOP:
        assert run(_loop_module(), "uvloop").startswith("uvloop")
        assert run(_loop_module(), "auto").startswith("uvloop")
    else:
        assert run(_loop_module(), "auto").startswith("asyncio")


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop has no Windows build")
def test_auto_is_uvloop_where_the_mesh_is_installed() -> None:
    assert HAVE_UVLOOP, "uvloop is a dependency of the mesh extra on this platform"
    assert resolve_event_loop("auto") == "uvloop"


def test_an_unknown_loop_is_refused_naming_the_flag() -> None:
    coroutine = _loop_module()
    with pytest.raises(ConfigError, match="--event-loop: 'tokio' is not one of"):
        run(coroutine, "tokio")
    assert inspect.getcoroutinestate(coroutine) == inspect.CORO_CLOSED  # not left unawaited


def test_the_coordinator_refuses_an_unknown_loop() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hexgen_coordinator", "--event-loop", "tokio"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--event-loop" in done.stderr and "tokio" in done.stderr
