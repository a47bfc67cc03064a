"""deploy/k8s pointed at Redis behind Sentinel (docs/kubernetes.md, "External Redis"): an
overlay that merges ``scheme``, ``address`` and ``path`` into the ConfigMap hexgen-redis
gives the coordinator and the tuner a ``redis+sentinel://`` URL that they accept, each
logged in as its own ACL user. Rendered by a real kustomize (tests/k8s_render.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from hexgen_service.redis_sentinel import SentinelUrl, check_redis_url, parse_sentinel_url
from k8s_render import (
    K8S,
    KUSTOMIZE,
    command,
    containers,
    make_credentials,
    named,
    needs_kustomize,
    run_tool,
    with_env,
)


@needs_kustomize
def test_an_overlay_points_the_mesh_at_redis_behind_sentinel(tmp_path: Path) -> None:
    """docs/kubernetes.md, "External Redis": merging scheme, address and path into the
    ConfigMap hexgen-redis gives the coordinator and the tuner a Sentinel URL that they
    accept, each logged in as its own ACL user."""
    assert KUSTOMIZE is not None
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("auth"))
    make_credentials(tree / "overlays" / "local" / "auth")
    sentinel = tree / "overlays" / "sentinel"
    sentinel.mkdir()
    (sentinel / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\n"
        "kind: Kustomization\n"
        "resources: [../local]\n"
        "configMapGenerator:\n"
        "  - name: hexgen-redis\n"
        "    behavior: merge\n"
        "    literals:\n"
        "      - scheme=redis+sentinel\n"
        "      - address=sentinel-0.sentinel:26379,sentinel-1.sentinel:26379\n"
        "      - path=hexgen/2\n"
    )
    built = run_tool([*KUSTOMIZE, str(sentinel)])
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    for kind, name in (("StatefulSet", "coordinator"), ("Deployment", "tuner")):
        (container,) = containers(named(docs, kind, name))
        (url,) = (
            with_env(a, container, docs)[len("--redis-url=") :]
            for a in command(container)
            if a.startswith("--redis-url=")
        )
        check_redis_url(url)  # what the service checks at start-up
        assert parse_sentinel_url(url) == SentinelUrl(
            (("sentinel-0.sentinel", 26379), ("sentinel-1.sentinel", 26379)), "hexgen", 2, name
        ), name
