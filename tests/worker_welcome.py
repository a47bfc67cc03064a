"""A worker's welcome as the tests build it (`hexgen_worker.WelcomeSettings`): slot 0 of
the cluster A100,A6000, the urgency queue with per-call estimates, a one-second heartbeat;
every field can be overridden. Shared by the worker-state tests, one link and several."""

from __future__ import annotations

from typing import Any

from hexgen_service.clock import ClusterClock
from hexgen_worker import WelcomeSettings

__all__ = ["welcome_settings"]


def welcome_settings(clock: ClusterClock, **overrides: Any) -> WelcomeSettings:
    fields: dict[str, Any] = {
        "slot": 0,
        "instance": "A100#0",
        "clock": clock,
        "cluster": "A100,A6000",
        "queue_policy": "urgency",
        "queue_params": {"estimate": "call"},
        "heartbeat_interval_s": 1.0,
    }
    fields.update(overrides)
    return WelcomeSettings(**fields)
