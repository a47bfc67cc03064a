"""A real Prometheus for the tests (Debian's `prometheus` package: ``make test`` installs it
with scripts/ensure_prometheus.py), and the shipped scrape configurations made this
machine's:

- deploy/prometheus/prometheus.yml, as compose's Prometheus reads it: compose's service
  names become a secured `hexgen-flow up`'s metrics doors, ``/run/secrets/NAME`` the auth
  directory's file of compose's secret NAME (`compose_config`);
- deploy/k8s/base/prometheus-scrape.yml: its secrets under /etc/prometheus/secrets/hexgen-flow
  become the auth directory's files (`k8s_config`), and, to run it, its pod discovery
  becomes static targets that carry the ``__meta_kubernetes_*`` labels Kubernetes would
  give the manifests' pods (deploy/k8s/base: their labels and prometheus.io annotations,
  the port annotation rewritten to the local door), so that the config's own relabelling
  picks and names the targets (`k8s_static_config`).

Only the targets, the secrets' paths (and, where asked, the scrape interval) change: every
other line is the shipped one.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from compose_file import AUTH_DIR, ROOT, compose_doc
from hexgen_launch.processes import free_port
from hexgen_service.auth_dir import AuthDir
from up_runner import Up

__all__ = [
    "COMPOSE_SCRAPE",
    "K8S_SCRAPE",
    "PROMETHEUS",
    "PROMTOOL",
    "Prometheus",
    "compose_config",
    "doors",
    "k8s_config",
    "k8s_static_config",
    "needs_prometheus",
    "promtool_check",
    "running_prometheus",
    "write_config",
]

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="no prometheus/promtool (Debian: apt-get install prometheus; `make test` installs "
    "it with scripts/ensure_prometheus.py)",
)

COMPOSE_SCRAPE = ROOT / "deploy" / "prometheus" / "prometheus.yml"
K8S_SCRAPE = ROOT / "deploy" / "k8s" / "base" / "prometheus-scrape.yml"
K8S_SECRETS = "/etc/prometheus/secrets/hexgen-flow/"


def doors(up: Up) -> dict[str, str]:
    """The banner's metrics doors as ``{"coordinator": "127.0.0.1:P", "tuner": ...,
    "worker-0": ...}`` (addresses on 0.0.0.0 are reached here on 127.0.0.1)."""
    text = up.banner["metrics"]
    urls = re.findall(r"(https?)://([0-9.]+):(\d+)/metrics", text)
    assert urls and all(scheme == "https" for scheme, _, _ in urls), text
    ports = [port for _, _, port in urls]
    names = ["coordinator", "tuner", *(f"worker-{i}" for i in range(len(ports) - 2))]
    return {name: f"127.0.0.1:{port}" for name, port in zip(names, ports, strict=True)}


def compose_config(up: Up, auth: AuthDir) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml made this machine's: compose's services become `up`'s
    doors (workers this mesh does not run are dropped, and so is a job left without
    targets), /run/secrets/NAME the auth directory's file of compose's secret NAME."""
    config: dict[str, Any] = yaml.safe_load(COMPOSE_SCRAPE.read_text())
    secrets = compose_doc()["secrets"]
    given = set(compose_doc()["services"]["prometheus"].get("secrets", []))

    def secret(path: str) -> str:
        name = path.removeprefix("/run/secrets/")
        assert path.startswith("/run/secrets/") and name in given, path
        return str(auth.path / secrets[name]["file"].removeprefix(AUTH_DIR + "/"))

    found = doors(up)
    jobs = []
    for job in config["scrape_configs"]:
        assert job["scheme"] == "https", job["job_name"]
        job["tls_config"]["ca_file"] = secret(job["tls_config"]["ca_file"])
        credentials = job["authorization"]["credentials_file"]
        job["authorization"]["credentials_file"] = secret(credentials)
        for static in job["static_configs"]:
            static["targets"] = [
                found[target.split(":")[0]]
                for target in static["targets"]
                if target.split(":")[0] in found
            ]
        if any(static["targets"] for static in job["static_configs"]):
            jobs.append(job)
    config["scrape_configs"] = jobs
    return config


def k8s_config(auth: AuthDir) -> dict[str, Any]:
    """deploy/k8s/base/prometheus-scrape.yml with its secrets' paths made the auth
    directory's (`ca`: its CA, `operator-key`: an operator's key, the tuner's;
    `worker-key`: the `health` tenant's key, as the file's comment says), pod discovery
    kept: what `promtool check config` reads."""
    config: dict[str, Any] = yaml.safe_load(K8S_SCRAPE.read_text())
    files = {
        "ca": auth.ca,
        "operator-key": auth.tuner_key,
        "worker-key": auth.tenant_key("health"),
    }

    def secret(path: str) -> str:
        assert path.startswith(K8S_SECRETS), path
        return str(files[path.removeprefix(K8S_SECRETS)])

    for job in config["scrape_configs"]:
        job["tls_config"]["ca_file"] = secret(job["tls_config"]["ca_file"])
        credentials = job["authorization"]["credentials_file"]
        job["authorization"]["credentials_file"] = secret(credentials)
    return config


def _sanitized(name: str) -> str:
    """A Kubernetes label or annotation name as Prometheus's discovery spells it."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _pod_templates() -> dict[str, dict[str, Any]]:
    """The base manifests' pod templates' metadata, by workload name."""
    templates: dict[str, dict[str, Any]] = {}
    for path in sorted((ROOT / "deploy" / "k8s" / "base").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            template = (doc or {}).get("spec", {}).get("template")
            if template:
                templates[doc["metadata"]["name"]] = template["metadata"]
    return templates


def k8s_static_config(up: Up, auth: AuthDir, gpus: list[str]) -> dict[str, Any]:
    """`k8s_config` with each job's pod discovery replaced by the pods Kubernetes would
    list: the coordinator's, the tuner's, a worker's for each of `up`'s workers (the pool
    of its GPU, `gpus[i]`) and the gateway's (no scrape annotation: the config must drop
    it), each with the ``__meta_kubernetes_*`` labels of its template in deploy/k8s/base
    and its port annotation set to the local door's port."""
    config = k8s_config(auth)
    templates = _pod_templates()
    found = doors(up)
    pods: list[tuple[str, str, dict[str, Any]]] = [
        ("coordinator-0", found["coordinator"], templates["coordinator"]),
        ("tuner-1", found["tuner"], templates["tuner"]),
        ("gateway-2", "127.0.0.1:1", templates["gateway"]),
        *(
            (f"worker-{i}", found[f"worker-{i}"], templates[f"worker-{gpu.lower()}"])
            for i, gpu in enumerate(gpus)
        ),
    ]
    groups = []
    for pod, address, meta in pods:
        host, port = address.rsplit(":", 1)
        labels = {"__meta_kubernetes_namespace": "hexgen-flow", "__meta_kubernetes_pod_name": pod}
        for name, value in (meta.get("labels") or {}).items():
            labels[f"__meta_kubernetes_pod_label_{_sanitized(name)}"] = str(value)
        annotations = dict(meta.get("annotations") or {})
        if "prometheus.io/port" in annotations:
            annotations["prometheus.io/port"] = port  # the local door's, not the pod's
        for name, value in annotations.items():
            labels[f"__meta_kubernetes_pod_annotation_{_sanitized(name)}"] = str(value)
        # A pod's address is its IP and a container port: the config's relabelling must
        # put the annotation's port in its place.
        groups.append({"targets": [f"{host}:9"], "labels": labels})
    for job in config["scrape_configs"]:
        assert "kubernetes_sd_configs" in job, job["job_name"]
        del job["kubernetes_sd_configs"]
        job["static_configs"] = copy.deepcopy(groups)
    return config


def write_config(config: dict[str, Any], path: Path, *, scrape_interval_s: int | None) -> Path:
    """Write `config` to `path`, with every job's scrape interval `scrape_interval_s` when
    given (the tests' short runs)."""
    config = copy.deepcopy(config)
    if scrape_interval_s is not None:
        interval = f"{scrape_interval_s}s"
        config["global"] = {
            **config.get("global", {}),
            "scrape_interval": interval,
            "evaluation_interval": interval,
        }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def promtool_check(path: Path) -> bool:
    """`promtool check config` passes on `path`: True; False (and a warning) when this
    promtool cannot read a service discovery `path` uses (Debian's is built without
    Kubernetes discovery: "field kubernetes_sd_configs not found"); fails otherwise."""
    assert PROMTOOL is not None
    checked = subprocess.run(
        [PROMTOOL, "check", "config", str(path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    said = checked.stdout + checked.stderr
    missing = re.findall(r"field (\w+_sd_configs) not found in type config.ScrapeConfig", said)
    if checked.returncode and missing:
        warnings.warn(
            f"promtool check config {path}: this promtool has no {', '.join(set(missing))} "
            "(Debian builds it without): not checked",
            stacklevel=2,
        )
        return False
    assert checked.returncode == 0, f"{path}:\n{said}"
    return True


class Prometheus:
    """A running Prometheus's HTTP API."""

    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        answer = httpx.get(f"{self.url}{path}?{query}", timeout=10)
        body = answer.json()
        assert answer.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of `expr` now (/api/v1/query)."""
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        result: list[dict[str, Any]] = data["result"]
        return result

    def targets(self) -> dict[str, tuple[str, str]]:
        """``"JOB INSTANCE" -> (health, last error)`` of the active targets."""
        active = self.get("/api/v1/targets")["activeTargets"]
        return {
            f"{t['labels']['job']} {t['labels']['instance']}": (t["health"], t["lastError"])
            for t in active
        }

    def wait_targets(self, count: int, timeout_s: float = 60) -> dict[str, tuple[str, str]]:
        """The targets once `count` are scraped (none unknown), or when `timeout_s` ends."""
        deadline = time.monotonic() + timeout_s
        health: dict[str, tuple[str, str]] = {}
        while time.monotonic() < deadline:
            try:
                health = self.targets()
            except (httpx.TransportError, json.JSONDecodeError, AssertionError):
                time.sleep(0.3)
                continue
            if len(health) >= count and all(h != "unknown" for h, _ in health.values()):
                break
            time.sleep(0.3)
        return health


@contextmanager
def running_prometheus(config: Path, folder: Path) -> Iterator[Prometheus]:
    """A Prometheus reading `config`, its data and log under `folder`, stopped at the end."""
    assert PROMETHEUS is not None
    folder.mkdir(parents=True, exist_ok=True)
    web = f"127.0.0.1:{free_port()}"
    with (folder / "prometheus.log").open("w") as log:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address={web}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield Prometheus(f"http://{web}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
