"""The packages' layers point one way, and the core stands alone.

Which package may import which, read off every ``import`` statement of the source tree
(module level and inside functions alike), and checked for real: the core imported, and the
simulator run through the CLI, in a Python where grpc, redis, protobuf and OpenTelemetry
cannot be imported at all; and the Python SDK imported in a Python where no server package,
no Redis client, no numpy and no matplotlib can be.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from importlib.metadata import requires
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PACKAGES: dict[str, Path] = {
    "hexgen_flow": ROOT / "src" / "hexgen_flow",
    "hexgen_api": ROOT / "protos" / "python" / "hexgen_api",
    "hexgen_wire": ROOT / "protos" / "wire" / "hexgen_wire",
    "hexgen_service": ROOT / "services" / "common" / "hexgen_service",
    "hexgen_coordinator": ROOT / "services" / "coordinator" / "hexgen_coordinator",
    "hexgen_worker": ROOT / "services" / "worker" / "hexgen_worker",
    "hexgen_client": ROOT / "clients" / "python" / "hexgen_client",
    "hexgen_tuner": ROOT / "services" / "tuner" / "hexgen_tuner",
    "hexgen_gateway": ROOT / "services" / "gateway" / "hexgen_gateway",
    "hexgen_launch": ROOT / "src" / "hexgen_launch",
    "hexgen_sql": ROOT / "apps" / "sql" / "hexgen_sql",
    "hexgen_cli": ROOT / "src" / "hexgen_cli",
}
"""Every top-level package of the distribution and its folder."""

MAY_IMPORT: dict[str, set[str]] = {
    # the scheduling core: model, latency, policies, simulator, tuner, bench
    "hexgen_flow": set(),
    # the generated wire API (protobuf and grpc only)
    "hexgen_api": set(),
    # the wire contract both sides share: metadata keys, a client's TLS, workflow -> proto
    "hexgen_wire": {"hexgen_flow", "hexgen_api"},
    # what the services share: servers, clocks, protobuf <-> core conversion, tracing
    "hexgen_service": {"hexgen_flow", "hexgen_api", "hexgen_wire"},
    "hexgen_coordinator": {"hexgen_flow", "hexgen_api", "hexgen_wire", "hexgen_service"},
    "hexgen_worker": {"hexgen_flow", "hexgen_api", "hexgen_wire", "hexgen_service"},
    # the SDK: the API, the wire contract and the core's plain types, no server package
    "hexgen_client": {"hexgen_flow", "hexgen_api", "hexgen_wire"},
    # the tuner talks to the coordinator as any client does
    "hexgen_tuner": {"hexgen_flow", "hexgen_api", "hexgen_wire", "hexgen_service", "hexgen_client"},
    # so does the OpenAI-compatible gateway (HTTP in front, the coordinator's client behind)
    "hexgen_gateway": {
        "hexgen_flow",
        "hexgen_api",
        "hexgen_wire",
        "hexgen_service",
        "hexgen_client",
    },
    # the local mesh launcher starts services as processes (by module name), never imports
    # them; it drives the mesh through the SDK and reads the services' shared plumbing
    "hexgen_launch": {
        "hexgen_flow",
        "hexgen_api",
        "hexgen_wire",
        "hexgen_service",
        "hexgen_client",
    },
    # the Text-to-SQL application: an OpenAI SDK client of the gateway, nothing of ours
    "hexgen_sql": set(),
    # the command line sits on top of everything it drives
    "hexgen_cli": {"hexgen_flow", "hexgen_client", "hexgen_launch", "hexgen_sql"},
}
"""Allowed imports between our packages (a package may always import itself)."""

MESH_ONLY = (
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "google",
    "redis",
    "opentelemetry",
    "fastapi",
    "starlette",
    "uvicorn",
)
"""Third-party packages of the mesh extra: the core never imports them."""

SERVER_PACKAGES = (
    "hexgen_service",
    "hexgen_coordinator",
    "hexgen_worker",
    "hexgen_tuner",
    "hexgen_gateway",
)
"""The server side's packages: the SDK never imports them."""

NOT_IN_THE_SDK = (*SERVER_PACKAGES, "hexgen_launch", "hexgen_sql", "redis", "numpy", "matplotlib")
"""What a program that only submits queries must not pull in: a server package, the
launcher or the application, the Redis client, numpy or matplotlib."""

SDK_PACKAGES = ("hexgen_client", "hexgen_wire")
"""The SDK and the wire contract it imports: neither imports anything of `NOT_IN_THE_SDK`."""


def imported_packages(package_dir: Path) -> dict[str, set[str]]:
    """Top-level module name -> the files of `package_dir` that import it, anywhere in
    the file (inside functions and TYPE_CHECKING blocks too)."""
    found: dict[str, set[str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_package_is_listed() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    roots = pyproject["tool"]["setuptools"]["packages"]["find"]["where"]
    on_disk = {
        child.name
        for root in roots
        for child in (ROOT / root).iterdir()
        if (child / "__init__.py").is_file()
    }
    assert on_disk == set(PACKAGES)
    assert set(MAY_IMPORT) == set(PACKAGES)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_imports_point_down(package: str) -> None:
    imports = imported_packages(PACKAGES[package])
    ours = {name for name in imports if name in PACKAGES and name != package}
    upward = {name: sorted(imports[name]) for name in ours - MAY_IMPORT[package]}
    assert not upward, f"{package} imports packages above it: {upward}"


def test_the_core_imports_no_mesh_package() -> None:
    imports = imported_packages(PACKAGES["hexgen_flow"])
    mesh = {name: sorted(imports[name]) for name in MESH_ONLY if name in imports}
    assert not mesh, f"the core imports mesh packages: {mesh}"


def test_the_mesh_packages_are_an_extra() -> None:
    """A plain install of the distribution brings the core only."""
    declared = requires("hexgen-flow") or []
    unconditional = [r for r in declared if "extra ==" not in r]
    mesh = [r for r in declared if 'extra == "mesh"' in r]
    names = {r.split(";")[0].split(">")[0].split("=")[0].split("[")[0].strip() for r in mesh}
    assert {"grpcio", "redis", "protobuf", "opentelemetry-sdk", "fastapi", "uvicorn"} <= names
    for requirement in unconditional:
        assert not requirement.startswith(
            ("grpc", "redis", "protobuf", "opentelemetry", "fastapi", "uvicorn")
        ), requirement


# A Python in which the mesh's packages cannot be imported, as after `pip install
# hexgen-flow` without the mesh extra.
_BLOCK_MESH = f"""
import importlib.abc, sys
class BlockMesh(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {MESH_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, BlockMesh())
"""


def run_without_mesh(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCK_MESH + code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_core_runs_without_the_mesh_packages() -> None:
    modules = sorted(
        "hexgen_flow." + ".".join(p.relative_to(PACKAGES["hexgen_flow"]).with_suffix("").parts)
        for p in PACKAGES["hexgen_flow"].rglob("*.py")
    )
    code = (
        "import importlib\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name.removesuffix('.__init__'))\n"
        "from hexgen_cli.main import main\n"
        "sys.exit(main(['simulate', '--num-queries', '20', '--alpha', '0.5', '--json']))\n"
    )
    proc = run_without_mesh(code)
    assert proc.returncode == 0, proc.stderr
    assert '"completed": 20' in proc.stdout


def test_a_mesh_command_without_the_mesh_packages_says_what_to_install() -> None:
    proc = run_without_mesh("from hexgen_cli.main import main\nsys.exit(main(['status']))\n")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("hexgen-flow: error: `hexgen-flow status` needs the service")
    assert "pip install 'hexgen-flow[mesh]'" in proc.stderr
    assert proc.stderr.count("\n") == 1


@pytest.mark.parametrize("package", SDK_PACKAGES)
def test_the_sdk_imports_no_server_package_redis_or_numpy(package: str) -> None:
    imports = imported_packages(PACKAGES[package])
    found = {name: sorted(imports[name]) for name in NOT_IN_THE_SDK if name in imports}
    assert not found, f"{package} imports what the SDK must not: {found}"


# A Python in which a module of `NOT_IN_THE_SDK` cannot be imported: the SDK must not need one.
_BLOCK_SERVER = f"""
import importlib.abc, sys
class BlockServer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {NOT_IN_THE_SDK!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, BlockServer())
"""


def test_the_sdk_imports_without_the_server_packages_redis_or_numpy() -> None:
    """``import hexgen_client``, its client and every module of it and of the wire contract,
    transitively, in a Python where none of `NOT_IN_THE_SDK` can be imported; none of them
    is loaded afterwards either."""
    modules = sorted(
        f"{package}." + ".".join(p.relative_to(PACKAGES[package]).with_suffix("").parts)
        for package in SDK_PACKAGES
        for p in PACKAGES[package].rglob("*.py")
    )
    code = (
        "import importlib\n"
        "import hexgen_client\n"
        "from hexgen_client.client import CoordinatorClient\n"
        "from hexgen_client import CoordinatorClient as Lazy\n"
        "assert Lazy is CoordinatorClient\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name.removesuffix('.__init__'))\n"
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {NOT_IN_THE_SDK!r})\n"
        "assert not loaded, loaded\n"
        "print('ok', len(sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCK_SERVER + code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")


# ------------------------------------------------------------------ the worker stream's edge

WORKER_WIRE = ("service.py", "worker_wire.py")
"""The coordinator's modules that may import the worker protocol's protobuf: the gRPC
servicer and its translator. Every other module works on `worker_messages`' types, so that
the coordinator's state is kept and tested apart from the wire (issue 28)."""

_WORKER_PROTOBUF = ("worker_pb2", "worker_pb2_grpc")


def _runtime_imports(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement under `node` except those of ``if TYPE_CHECKING:`` (whose
    ``else:`` does run)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            found.append(child)
        elif isinstance(child, ast.If) and (
            (isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING")
            or (isinstance(child.test, ast.Attribute) and child.test.attr == "TYPE_CHECKING")
        ):
            for stmt in child.orelse:
                found += _runtime_imports(ast.Module(body=[stmt], type_ignores=[]))
        else:
            found += _runtime_imports(child)
    return found


def _imported_names(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names a statement imports: ``from a.b import c`` gives ``a.b`` and
    ``a.b.c`` (c may be a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    module = "." * node.level + (node.module or "")
    return [module, *(f"{module}.{alias.name}".lstrip(".") for alias in node.names)]


def worker_protobuf_importers(
    package_dir: Path, modules: tuple[str, ...] = _WORKER_PROTOBUF
) -> dict[str, list[str]]:
    """File name -> the names of the worker protocol's protobuf (or of other `modules`) it
    imports, for every module of `package_dir` that imports one anywhere (in functions and
    TYPE_CHECKING blocks too: a type is speaking the wire as much as a value is)."""
    found: dict[str, list[str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for name in _imported_names(node):
                    if name.split(".")[-1] in modules:
                        found.setdefault(path.name, []).append(name)
    return found


def test_only_the_servicer_speaks_the_worker_protobuf() -> None:
    found = worker_protobuf_importers(PACKAGES["hexgen_coordinator"])
    others = {name: names for name, names in found.items() if name not in WORKER_WIRE}
    assert not others, (
        f"coordinator modules besides {WORKER_WIRE} import the worker protocol's protobuf "
        f"(translate at the edge, hexgen_coordinator.worker_wire): {others}"
    )
    assert set(found) == set(WORKER_WIRE)  # the edge itself still exists


def test_the_worker_protobuf_check_finds_every_form(tmp_path: Path) -> None:
    """The check above sees each way of importing the module, a function's too."""
    forms = {
        "a.py": "from hexgen_api.v1 import worker_pb2 as wpb\n",
        "b.py": "import hexgen_api.v1.worker_pb2\n",
        "c.py": "from hexgen_api.v1.worker_pb2 import CallFinished\n",
        "d.py": "def f():\n    from hexgen_api.v1 import worker_pb2_grpc\n",
        "e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from hexgen_api.v1 import worker_pb2\n",
        "clean.py": "from hexgen_api.v1 import coordinator_pb2, workflow_pb2\n",
    }
    for name, text in forms.items():
        (tmp_path / name).write_text(text)
    assert sorted(worker_protobuf_importers(tmp_path)) == ["a.py", "b.py", "c.py", "d.py", "e.py"]


def test_the_worker_messages_import_no_protobuf_or_grpc() -> None:
    """The domain types of the worker protocol run without protobuf and grpc: only a type
    annotation names the client API's messages that a dispatch carries untouched."""
    path = PACKAGES["hexgen_coordinator"] / "worker_messages.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    wire = [
        name
        for node in _runtime_imports(tree)
        for name in _imported_names(node)
        if name.split(".")[0] in ("hexgen_api", "google", "grpc")
    ]
    assert not wire, f"worker_messages imports the wire at run time: {wire}"


# ------------------------------------------------------------------ the client API's edge

_CLIENT_PROTOBUF = ("coordinator_pb2", "coordinator_pb2_grpc", "workflow_pb2")

CLIENT_PROTOBUF_SPEAKERS = {
    "service.py": "the gRPC servicer: the client API's module",
    "client_wire.py": "the client API's translator",
    "worker_messages.py": "typing only: a dispatch carries a chat's messages untouched",
}
"""The coordinator's modules that may import the client API's protobuf, and why. Every other
module (admission, sessions, session_store, coordinator, events, views, completions,
dispatch, write_behind, ledger, ...) works on `client_messages`' types (and a chat call's
`worker_messages.Chat`); a module that needs one more message of the client API gets it
translated in `client_wire`, not by joining this list."""

CLIENT_WIRE_USERS = (
    "admission.py",
    "service.py",
    "session_store.py",
    "views.py",
    "write_behind.py",
)
"""The modules that may import `client_wire`: the servicer (every request and answer), and
the owners of the client API's messages that Redis keeps as bytes: `write_behind` writes
the event log (``QueryEvent`` bytes) and `views` reads it back (GetQuery, a watch's
replay); `admission` writes a query's prompts (``LLMCall`` bytes) and its shape
(``SubmitQueryRequest`` bytes, which the `Submission` that `client_wire` decoded encodes);
`session_store` reads a stored submission for recovery, admission and views, reads the
prompts back, and writes and reads a session's given calls (``LLMCall`` bytes) and writes
its shape."""


def test_only_the_listed_modules_speak_the_client_protobuf() -> None:
    found = worker_protobuf_importers(PACKAGES["hexgen_coordinator"], _CLIENT_PROTOBUF)
    others = {name: names for name, names in found.items() if name not in CLIENT_PROTOBUF_SPEAKERS}
    assert not others, (
        "coordinator modules import the client API's protobuf (translate at the edge, "
        f"hexgen_coordinator.client_wire): {others}"
    )
    # a module freed and still listed: take it off the list, so that it stays free
    assert set(found) == set(CLIENT_PROTOBUF_SPEAKERS)


def test_the_client_protobuf_check_finds_every_form(tmp_path: Path) -> None:
    forms = {
        "a.py": "from hexgen_api.v1 import coordinator_pb2 as cpb\n",
        "b.py": "import hexgen_api.v1.workflow_pb2\n",
        "c.py": "from hexgen_api.v1.coordinator_pb2 import QueryEvent\n",
        "d.py": "def f():\n    from hexgen_api.v1 import coordinator_pb2_grpc\n",
        "e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from hexgen_api.v1 import workflow_pb2\n",
        "clean.py": "from hexgen_api.v1 import worker_pb2\n",
    }
    for name, text in forms.items():
        (tmp_path / name).write_text(text)
    found = worker_protobuf_importers(tmp_path, _CLIENT_PROTOBUF)
    assert sorted(found) == ["a.py", "b.py", "c.py", "d.py", "e.py"]


def test_only_the_edges_use_the_client_wire() -> None:
    found = worker_protobuf_importers(PACKAGES["hexgen_coordinator"], ("client_wire",))
    assert set(found) == set(CLIENT_WIRE_USERS), found


def test_the_client_messages_import_no_protobuf_or_grpc() -> None:
    """The client API's domain types run without protobuf and grpc, and name none of it."""
    path = PACKAGES["hexgen_coordinator"] / "client_messages.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    wire = [
        name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in _imported_names(node)
        if name.split(".")[0] in ("hexgen_api", "google", "grpc")
        or name.split(".")[-1] == "client_wire"
    ]
    assert not wire, f"client_messages imports the wire: {wire}"
