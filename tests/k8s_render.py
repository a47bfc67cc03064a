"""Rendering deploy/k8s for the tests: the tools (a real kustomize, kubernetes-validate,
checkov from the scratch virtual environment ``.venv-k8s``, ``make k8s-tools``; another with
``HEXGEN_K8S_VENV``), the markers that skip a test without them, the credentials
docs/kubernetes.md makes for an overlay, and small readers of a render. Shared by
tests/test_k8s_manifests.py, tests/test_k8s_shards.py and tests/test_k8s_redis_url.py."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from hexgen_service.auth_dir import AuthDir

__all__ = [
    "CHECKOV",
    "K8S",
    "KUSTOMIZE",
    "ROOT",
    "SHARDS",
    "VALIDATE",
    "Doc",
    "command",
    "containers",
    "coordinator_hosts",
    "load",
    "make_credentials",
    "mount_secrets",
    "named",
    "needs_checkov",
    "needs_kustomize",
    "needs_validate",
    "pod_labels",
    "render",
    "run_tool",
    "selects",
    "with_env",
]

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"

Doc = dict[str, Any]


def _k8s_bin(name: str) -> Path | None:
    venv = Path(os.environ.get("HEXGEN_K8S_VENV", ROOT / ".venv-k8s"))
    found = venv / "bin" / name
    return found if found.is_file() else None


def _kustomize_command() -> list[str] | None:
    """A real kustomize: the scratch venv's kubectl, else kustomize or kubectl on PATH."""
    kubectl = _k8s_bin("kubectl")
    if kubectl is not None:
        return [str(kubectl), "kustomize"]
    kustomize = shutil.which("kustomize")
    if kustomize is not None:
        return [kustomize, "build"]
    on_path = shutil.which("kubectl")
    return [on_path, "kustomize"] if on_path is not None else None


KUSTOMIZE = _kustomize_command()
VALIDATE = _k8s_bin("kubernetes-validate")
CHECKOV = _k8s_bin("checkov")
_NO_TOOLS = "(make k8s-tools installs it into .venv-k8s; see tests/test_k8s_manifests.py)"
needs_kustomize = pytest.mark.skipif(
    KUSTOMIZE is None, reason=f"no kustomize (kubectl kustomize) to render deploy/k8s {_NO_TOOLS}"
)
needs_validate = pytest.mark.skipif(VALIDATE is None, reason=f"no kubernetes-validate {_NO_TOOLS}")
needs_checkov = pytest.mark.skipif(CHECKOV is None, reason=f"no checkov {_NO_TOOLS}")


def run_tool(command: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=180, check=False
    )


def _base_literals(name: str) -> dict[str, str]:
    """The literals of the base's generated ConfigMap `name`, as an overlay that leaves it
    alone renders it (the credentials must match it before anything renders)."""
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    (generator,) = (g for g in base["configMapGenerator"] if g["name"] == name)
    return dict(literal.split("=", 1) for literal in generator["literals"])


SHARDS = tuple(_base_literals("hexgen-shards")["shards"].split(","))
"""The base's shard prefixes (its ConfigMap hexgen-shards)."""


def coordinator_hosts() -> tuple[str, ...]:
    """Every coordinator pod's name, as hexgen-shards' ``coordinators`` lists them: the
    names the server certificate must carry."""
    doors = _base_literals("hexgen-shards")["coordinators"].split(",")
    return tuple(door.rpartition(":")[0] for door in doors)


def make_credentials(auth: Path) -> AuthDir:
    """What docs/kubernetes.md's ``hexgen-flow auth init`` makes in an overlay's ``auth/``:
    a server certificate that names every coordinator pod, Redis users for every shard."""
    made = AuthDir(auth)
    made.init(("demo", "health"), server_names=coordinator_hosts(), shards=SHARDS)
    return made


def render(at: Path, overlays: Sequence[str]) -> dict[str, Path]:
    """Each overlay rendered to a file under `at`, from a copy of deploy/k8s there with
    fresh credentials (never the tree's own)."""
    assert KUSTOMIZE is not None
    tree = at / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("auth"))
    out: dict[str, Path] = {}
    for overlay in overlays:
        make_credentials(tree / "overlays" / overlay / "auth")
        built = run_tool([*KUSTOMIZE, str(tree / "overlays" / overlay)])
        assert built.returncode == 0, f"kustomize {overlay}: {built.stderr}"
        out[overlay] = at / f"{overlay}.yaml"
        out[overlay].write_text(built.stdout)
    return out


def load(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def containers(workload: Doc) -> list[Doc]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def named(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} in the render"
    return found[0]


def pod_labels(workload: Doc) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels only: the manifests use no expressions) matches."""
    assert "matchExpressions" not in selector, "extend selects for matchExpressions"
    wanted: dict[str, str] = selector.get("matchLabels", {})
    return all(labels.get(k) == v for k, v in wanted.items())


def command(container: Doc) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def with_env(
    arg: str, container: Doc, docs: list[Doc], fields: Mapping[str, str] | None = None
) -> str:
    """`arg` with each ``$(VAR)`` of the container's env replaced as the kubelet expands
    it: a literal value, a ConfigMap's key by its value in the render `docs`, and a field
    of the pod's own (fieldRef) by `fields` (fieldPath: value), when given."""
    for env in container.get("env", []):
        source = env.get("valueFrom", {})
        if "value" in env:
            value = env["value"]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            value = named(docs, "ConfigMap", ref["name"])["data"][ref["key"]]
        elif "fieldRef" in source and fields is not None:
            value = fields[source["fieldRef"]["fieldPath"]]
        else:
            continue
        arg = arg.replace(f"$({env['name']})", value)
    assert "$(" not in arg, f"{arg}: a variable the container does not define"
    return arg


def mount_secrets(docs: list[Doc], workload: Doc, at: Path) -> Path:
    """Write the workload's /run/secrets projected volume, from the render's Secrets, at
    `at` (returned)."""
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    (volume,) = (
        v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "secrets"
    )
    at.mkdir(parents=True)
    for source in volume["projected"]["sources"]:
        data = secrets[source["secret"]["name"]]["data"]
        for item in source["secret"]["items"]:
            (at / item["path"]).write_bytes(base64.b64decode(data[item["key"]]))
    return at
