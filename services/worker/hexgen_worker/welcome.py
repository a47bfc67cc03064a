"""The coordinator's welcome, as the worker adopts it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hexgen_service.clock import ClusterClock

__all__ = ["WelcomeSettings"]


@dataclass(frozen=True, slots=True)
class WelcomeSettings:
    """The coordinator's welcome, validated (see `hexgen_worker.convert.welcome_from_proto`)."""

    slot: int
    """Slot of the cluster this worker holds."""
    instance: str
    """Instance name, e.g. "A100#0"."""
    clock: ClusterClock
    """The cluster clock: every time sent and received is read on it."""
    cluster: str
    """The cluster as ``--cluster`` writes it."""
    queue_policy: str
    """Name of the local queue policy (a `QUEUES` name)."""
    queue_params: Mapping[str, Any]
    """The local queue's parameters."""
    heartbeat_interval_s: float
    """Wall seconds between heartbeats."""
    drop_call_ids: tuple[str, ...] = ()
    """Resident calls the coordinator no longer wants here."""
    shard: str = ""
    """The coordinator shard the coordinator holds (its Redis key prefix; empty when not
    sharded): what `hexgen_worker.handover` matches a lost link's calls by."""
