"""Where a query's shared prompt prefixes are cached: what prefix-aware dispatch reads.

A call carries token counts, not its prompt, so which calls share a prefix is an
assumption, the one the simulated engine makes too (docs/design.md, "Prefix caching"): the
calls of one query with the same step type share the first `DEFAULT_PREFIX_SHARE` of
their prompt (the schema and question that a CHESS agent repeats in every candidate,
revision and test). vLLM V1 caches prefixes by default, so the instance that last ran such
a call probably still holds that prefix; another instance recomputes it.

`PrefixHomes` remembers, per (query, step type), the instance its last call was dispatched
to: the routing-side index that llm-d's prefix-cache scorer and Dynamo's KV router keep
(approximate mode: where requests went, not what the engines report). It is bounded, least
recently used query first out, and the driver forgets a query when it ends (the simulator
when it finishes, the coordinator whatever its outcome), so a long-running coordinator does
not grow with the queries it served; a query that falls out only costs cache hits.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

from hexgen_flow.errors import ConfigError

__all__ = ["DEFAULT_PREFIX_SHARE", "PREFIX_HOMES_MAX", "PrefixHomes", "checked_prefix_share"]

DEFAULT_PREFIX_SHARE: Final = 0.75
"""The share of a call's prompt assumed common to the calls of its query with its step type."""


def checked_prefix_share(prefix_share: float) -> float:
    """`prefix_share` (a dispatcher's parameter) if it is a share, else `ConfigError`."""
    if not 0.0 <= prefix_share <= 1.0:
        raise ConfigError(f"prefix_share must be in [0, 1], got {prefix_share}")
    return prefix_share


PREFIX_HOMES_MAX: Final = 16_384
"""Queries `PrefixHomes` keeps at most (a bound for a driver that never forgets)."""


class PrefixHomes:
    """query id -> step type -> the instance its last call of that type went to; a bounded
    LRU over queries."""

    __slots__ = ("_max", "changes", "homes")

    def __init__(self, max_queries: int = PREFIX_HOMES_MAX) -> None:
        if max_queries < 1:
            raise ValueError(f"max_queries must be >= 1, got {max_queries}")
        self.homes: OrderedDict[str, dict[str, int]] = OrderedDict()
        """query id -> step type -> instance (read-only outside: the dispatcher's score
        loop reads it inline, as `get` does, once per call)."""
        self._max = max_queries
        self.changes = 0
        """How many times a home was set or a query forgotten: a reader that saw the same
        count saw the same homes (read-only outside)."""

    def get(self, query_id: str, step: str) -> int | None:
        """The instance that last got a call of `query_id` with type `step`, or None."""
        steps = self.homes.get(query_id)
        return None if steps is None else steps.get(step)

    def put(self, query_id: str, step: str, instance: int) -> None:
        """A call of `query_id` with type `step` went to `instance`."""
        self.changes += 1
        homes = self.homes
        steps = homes.get(query_id)
        if steps is None:
            homes[query_id] = {step: instance}
            if len(homes) > self._max:
                homes.popitem(last=False)
        else:
            steps[step] = instance
            homes.move_to_end(query_id)

    def forget(self, query_id: str) -> None:
        """`query_id` ended: its prefixes are no use to anyone."""
        self.changes += 1
        self.homes.pop(query_id, None)

    def __len__(self) -> int:
        """Queries with a home."""
        return len(self.homes)
