"""Which prefix the mesh's Redis keys carry: one rule for the coordinator, the tuner and
check-state.

On a Redis Cluster a Lua script, a pipeline or a transaction may touch one slot only. Every
key a coordinator writes starts with its prefix, so a hash tag in the prefix (``hf:{0}:``)
puts all of them in that tag's one slot; coordinator shards, each with a tag of its own,
spread over the cluster's masters.
"""

from __future__ import annotations

from hexgen_flow.errors import ConfigError
from hexgen_service.redis_schema import CLUSTER_PREFIX, DEFAULT_PREFIX

__all__ = ["CLUSTER_PREFIX", "DEFAULT_PREFIX", "cluster_prefix"]


def cluster_prefix(prefix: str | None, default: str = DEFAULT_PREFIX, *, cluster: bool) -> str:
    """The key prefix to run with: `prefix` as given (None: `default`, or on a Redis Cluster
    `CLUSTER_PREFIX`). On a cluster it must hold a hash tag (``{...}``, the first pair of
    braces with something between, as Redis reads it); ConfigError naming --redis-prefix
    otherwise."""
    if prefix is None:
        return CLUSTER_PREFIX if cluster else default
    if cluster and not _has_hash_tag(prefix):
        raise ConfigError(
            f"--redis-prefix {prefix!r}: a Redis Cluster needs a hash tag in the prefix, "
            f"e.g. {prefix + '{0}:'!r}, so that every key is in one slot"
        )
    return prefix


def _has_hash_tag(prefix: str) -> bool:
    """Whether Redis hashes every key that starts with `prefix` by the same tag: the first
    ``{`` is followed by a ``}`` with at least one character between them."""
    start = prefix.find("{")
    if start < 0:
        return False
    end = prefix.find("}", start + 1)
    return end > start + 1
