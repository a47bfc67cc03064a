"""deploy/k8s's coordinator shards (docs/kubernetes.md, "Shards"): two shards and a spare,
the shard list in one place (the ConfigMap hexgen-shards). Each overlay is rendered by a
real kustomize (tests/k8s_render.py), and each service's command line, its $(VAR)s expanded
as the kubelet expands them for a pod and its Secrets where the pod sees them, is read by
that service's own argument parser: every coordinator pod is given every shard (each prefix
with a hash tag), pod N prefers shard N, the pods beyond the shards are spares, and each
advertises its own name; the workers, the gateway and the tuner dial every coordinator pod,
by names the server certificate carries; the tuner tunes the coordinators' shards; one
coordinator may be down at a time. The coordinator's probe is run too: a spare's closed
door passes it."""

from __future__ import annotations

import base64
import contextlib
import copy
import io
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hexgen_cli.main import build_parser as cli_parser
from hexgen_client.addresses import split_addresses
from hexgen_coordinator.__main__ import parse_args as coordinator_args
from hexgen_coordinator.shards import ShardMap
from hexgen_flow.errors import ConfigError, HexgenFlowError
from hexgen_gateway.__main__ import parse_config as gateway_config
from hexgen_service.redis_keys import cluster_prefix
from hexgen_tuner.__main__ import parse_config as tuner_config
from hexgen_worker.cli import UsageError, config_from_args
from hexgen_worker.cli import build_parser as worker_parser
from k8s_render import (
    K8S,
    ROOT,
    SHARDS,
    Doc,
    containers,
    coordinator_hosts,
    load,
    mount_secrets,
    named,
    needs_kustomize,
    pod_labels,
    render,
    selects,
    with_env,
)

OVERLAYS = ("local", "production")
SPARES = 1
"""The base's spare coordinators: its pods beyond the shard count."""
CLIENTS_DOOR = 50051
WORKERS_DOOR = 50052
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Doc]]:
    rendered = render(tmp_path_factory.mktemp("k8s"), OVERLAYS)
    return {overlay: load(path) for overlay, path in rendered.items()}


def _shards_config(docs: list[Doc]) -> dict[str, str]:
    (config,) = (
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("hexgen-shards-")
    )
    data: dict[str, str] = config["data"]
    return data


def _reaches(docs: list[Doc], source: dict[str, str], target: dict[str, str], port: int) -> bool:
    """Whether a NetworkPolicy lets pods labelled `source` reach `port` of `target`'s."""
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        if not selects(policy["spec"]["podSelector"], target):
            continue
        for rule in policy["spec"].get("ingress", []):
            ports = [p.get("port") for p in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            peers = rule.get("from")
            if not peers or any(
                "podSelector" in p and selects(p["podSelector"], source) for p in peers
            ):
                return True
    return False


def _worker_config(argv: list[str]) -> Any:
    return config_from_args(worker_parser().parse_args(argv))


def shard_problems(docs: list[Doc], at: Path) -> list[str]:
    """What the render's shard wiring gets wrong (empty: nothing); `at`: a scratch folder
    for the pods' secrets."""
    found: list[str] = []

    def parsed(
        who: str, parse: Callable[[list[str]], Any], workload: Doc, fields: dict[str, str]
    ) -> Any:
        """The workload's command line, as `who` runs it, read by `parse`; None, reported,
        when the service refuses it (its parser exits)."""
        (container,) = containers(workload)
        secrets = at / who
        mount_secrets(docs, workload, secrets)
        argv = [
            with_env(a, container, docs, fields).replace("/run/secrets/", f"{secrets}/")
            for a in container["args"]
        ]
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                return parse(argv)
        except (SystemExit, HexgenFlowError, UsageError) as exc:
            said = (stderr.getvalue().strip() or str(exc)).split(": error: ", 1)[-1]
            found.append(f"{who}: its command line is refused: {said}")
            return None

    shards = ShardMap.parse(_shards_config(docs)["shards"]).prefixes
    for prefix in shards:
        try:
            cluster_prefix(prefix, cluster=True)
        except ConfigError:
            found.append(f"shard {prefix!r}: no hash tag, so not one Redis Cluster slot")
    coordinator = named(docs, "StatefulSet", "coordinator")
    replicas = coordinator["spec"]["replicas"]
    if replicas != len(shards) + SPARES:
        found.append(f"{replicas} replicas for {len(shards)} shards and {SPARES} spare(s)")
    hosts = [f"coordinator-{k}.{coordinator['spec']['serviceName']}" for k in range(replicas)]
    for k, host in enumerate(hosts):
        fields = {"metadata.name": f"coordinator-{k}", POD_INDEX: str(k)}
        args = parsed(host, coordinator_args, coordinator, fields)
        if args is None:
            continue
        config = args[0]
        if config.shards != shards:
            found.append(f"{host}: --shards {list(config.shards)}, not {list(shards)}")
        preferred = ShardMap(shards).index(config.redis_prefix)
        if preferred != (k if k < len(shards) else None):  # a spare prefers none
            found.append(f"{host}: prefers shard {preferred} ({config.redis_prefix})")
        if config.advertise != f"{host}:{CLIENTS_DOOR}":
            found.append(f"{host}: advertises {config.advertise}")

    def dials(who: str, dialled: tuple[str, ...], port: int) -> None:
        if sorted(dialled) != [f"{h}:{port}" for h in hosts]:
            found.append(f"{who}: dials {list(dialled)}, not every coordinator pod's {port}")

    for w in docs:
        name = w["metadata"]["name"]
        if w["kind"] == "Deployment" and name.startswith("worker-"):
            config = parsed(name, _worker_config, w, {"metadata.name": f"{name}-0"})
            if config is not None:
                dials(name, (config.coordinator, *config.extra_coordinators), WORKERS_DOOR)
    gateway = parsed("gateway", gateway_config, named(docs, "Deployment", "gateway"), {})
    if gateway is not None:
        dials("gateway", split_addresses(gateway[0].coordinator), CLIENTS_DOOR)
    tuner = parsed("tuner", tuner_config, named(docs, "Deployment", "tuner"), {})
    if tuner is not None:
        dials("tuner", split_addresses(tuner.coordinator), CLIENTS_DOOR)
        if tuner.shards != shards:
            found.append(f"tuner: --shards {list(tuner.shards)}, not {list(shards)}")

    target = pod_labels(coordinator)
    for client in ("gateway", "tuner"):
        source = pod_labels(named(docs, "Deployment", client))
        if not _reaches(docs, source, target, CLIENTS_DOOR):
            found.append(f"{client}: no NetworkPolicy lets it reach the coordinators' 50051")
    (tls,) = (
        d
        for d in docs
        if d["kind"] == "Secret" and d["metadata"]["name"].startswith("hexgen-server-tls-")
    )
    cert = x509.load_pem_x509_certificate(base64.b64decode(tls["data"]["server-cert"]))
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    missing = set(hosts) - set(san.get_values_for_type(x509.DNSName))
    if missing:
        found.append(f"the server certificate does not name {sorted(missing)}")
    budget = named(docs, "PodDisruptionBudget", "coordinator")["spec"]
    if budget.get("maxUnavailable") != 1 or "minAvailable" in budget:
        found.append(f"PodDisruptionBudget/coordinator: {budget}, not one down at a time")
    return found


@needs_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_coordinator_pod_is_wired_as_a_shard_or_spare(
    docs: dict[str, list[Doc]], overlay: str, tmp_path: Path
) -> None:
    assert shard_problems(docs[overlay], tmp_path) == []
    assert len(SHARDS) == 2 and SPARES == 1  # the base's choice (docs/kubernetes.md)


def _args(docs: list[Doc], kind: str, name: str) -> list[str]:
    args: list[str] = containers(named(docs, kind, name))[0]["args"]
    return args


def _set(args: list[str], flag: str, value: str) -> None:
    (i,) = (i for i, a in enumerate(args) if a.startswith(f"{flag}="))
    args[i] = f"{flag}={value}"


def _mutations() -> dict[str, tuple[Callable[[list[Doc]], None], str]]:
    """Ways to break the shards' wiring, and the problem each must produce."""

    def forget_the_spare(docs: list[Doc]) -> None:
        args = _args(docs, "Deployment", "worker-l40s")
        args.remove("--coordinator=coordinator-2.coordinator-workers:50052")

    def spec(docs: list[Doc], kind: str, name: str) -> Doc:
        found: Doc = named(docs, kind, name)["spec"]
        return found

    def no_clients_door(docs: list[Doc]) -> None:
        docs.remove(named(docs, "NetworkPolicy", "coordinator-clients-door"))

    return {
        "a worker without the spare": (forget_the_spare, "worker-l40s: dials"),
        "the gateway to one Service": (
            lambda d: _set(_args(d, "Deployment", "gateway"), "--coordinator", "coordinator:50051"),
            "gateway: dials ['coordinator:50051']",
        ),
        "the tuner on one shard": (
            lambda d: _set(_args(d, "Deployment", "tuner"), "--shards", "hf:{s0}:"),
            "tuner: --shards ['hf:{s0}:']",
        ),
        "no spare": (
            lambda d: spec(d, "StatefulSet", "coordinator").update(replicas=2),
            "2 replicas for 2 shards and 1 spare(s)",
        ),
        "no hash tags": (
            lambda d: _shards_config(d).update(shards="hf:s0:,hf:s1:"),
            "shard 'hf:s0:': no hash tag",
        ),
        "one prefix for all": (
            lambda d: _set(_args(d, "StatefulSet", "coordinator"), "--redis-prefix", "hf:{s0}:"),
            "coordinator-1.coordinator-workers: prefers shard 0",
        ),
        "the Service advertised": (
            lambda d: _set(_args(d, "StatefulSet", "coordinator"), "--advertise", "svc:50051"),
            "coordinator-0.coordinator-workers: advertises svc:50051",
        ),
        "clients' door shut": (no_clients_door, "gateway: no NetworkPolicy lets it reach"),
        "an unknown tuner option": (
            lambda d: _args(d, "Deployment", "tuner").append("--no-such-option=1"),
            "tuner: its command line is refused: unrecognized arguments: --no-such-option=1",
        ),
        "a gateway value out of range": (
            lambda d: _args(d, "Deployment", "gateway").append("--default-max-tokens=0"),
            "gateway: its command line is refused: --default-max-tokens must be from 1 to",
        ),
        "a coordinator value out of range": (
            lambda d: _args(d, "StatefulSet", "coordinator").append("--alpha=2"),
            "coordinator-0.coordinator-workers: its command line is refused: --alpha must be",
        ),
        "an unknown worker option": (
            lambda d: _args(d, "Deployment", "worker-l40s").append("--engines=vllm"),
            "worker-l40s: its command line is refused: unrecognized arguments: --engines=vllm",
        ),
        "two down at once": (
            lambda d: spec(d, "PodDisruptionBudget", "coordinator").update(maxUnavailable=2),
            "not one down at a time",
        ),
    }


@needs_kustomize
@pytest.mark.parametrize("mutation", list(_mutations()))
def test_shard_problems_finds_each_broken_wiring(
    docs: dict[str, list[Doc]], mutation: str, tmp_path: Path
) -> None:
    """The checks above can fail: each way of breaking the local render is reported."""
    mutate, expected = _mutations()[mutation]
    broken = copy.deepcopy(docs["local"])
    mutate(broken)
    reported = shard_problems(broken, tmp_path)
    assert any(expected in p for p in reported), reported


@needs_kustomize
def test_the_coordinators_probe_passes_a_closed_door_only(
    docs: dict[str, list[Doc]], tmp_path: Path
) -> None:
    """The coordinator's readiness and liveness probe: a door that answers SERVING passes,
    one that answers otherwise fails, and a closed one (a spare waiting for a shard, or a
    coordinator resuming the one it took) passes, so that a spare is neither restarted nor
    keeps a rolling update or a drain waiting."""
    coordinator = named(docs["local"], "StatefulSet", "coordinator")
    (container,) = containers(coordinator)
    probe = container["readinessProbe"]["exec"]["command"]
    assert container["livenessProbe"]["exec"]["command"] == probe
    secrets = mount_secrets(docs["local"], coordinator, tmp_path / "secrets")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    key = (secrets / "server-key").read_bytes()
    cert = (secrets / "server-cert").read_bytes()
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))

    def run(door: int) -> int:
        script = probe[2].replace("/run/secrets/", f"{secrets}/").replace("50051", str(door))
        result = subprocess.run(
            [sys.executable, *probe[1:2], script], capture_output=True, timeout=60, check=False
        )
        return result.returncode

    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert run(port) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert run(port) == 1
    finally:
        server.stop(None)
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        free = closed.getsockname()[1]
    assert run(free) == 0


def _auth_init_commands() -> Iterator[tuple[str, list[str]]]:
    """Each ``hexgen-flow auth init`` for an overlay that docs/kubernetes.md and the
    overlays' kustomization.yaml comments give, as the words after ``hexgen-flow``."""
    sources = [ROOT / "docs" / "kubernetes.md"]
    sources += [K8S / "overlays" / o / "kustomization.yaml" for o in OVERLAYS]
    for path in sources:
        lines = path.read_text().splitlines()
        if path.suffix == ".yaml":
            lines = [line.lstrip("#") for line in lines]
        text = "\n".join(lines).replace("\\\n", " ")
        for line in text.splitlines():
            start = line.find("hexgen-flow auth init deploy/k8s/")
            if start >= 0:
                command = line[start:].split("`")[0]  # inline code ends at its backtick
                yield f"{path.name}: {command}", shlex.split(command)[1:]


def test_the_documented_credentials_name_every_pod_and_shard() -> None:
    """What docs/kubernetes.md tells to run makes the credentials the render needs: a
    server certificate that names every coordinator pod, Redis users for every shard."""
    commands = list(_auth_init_commands())
    assert len(commands) >= 4, commands
    for where, words in commands:
        args = cli_parser().parse_args(words)
        assert set(coordinator_hosts()) <= set(args.hosts), where
        assert args.shards == SHARDS, where
