"""The cluster clock: one time base for the coordinator, the workers and the tuner.

Cluster time is seconds since the cluster's epoch, times its time scale. A simulated
cluster at time scale 20 lives 20 cluster seconds per wall second, so a trace replays 20x
faster while every policy, deadline and metric stays in the latency model's seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["ClusterClock"]


@dataclass(frozen=True, slots=True)
class ClusterClock:
    epoch_unix_s: float
    """Wall-clock origin (Unix seconds) of cluster time 0."""
    time_scale: float = 1.0
    """Cluster seconds per wall second."""

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")

    @classmethod
    def starting_now(cls, time_scale: float = 1.0) -> ClusterClock:
        return cls(time.time(), time_scale)

    def now(self) -> float:
        return (time.time() - self.epoch_unix_s) * self.time_scale

    def wall_delay(self, cluster_seconds: float) -> float:
        """Wall seconds that `cluster_seconds` of cluster time take (never negative)."""
        return max(cluster_seconds, 0.0) / self.time_scale

    def wall_time(self, cluster_time_s: float) -> float:
        """Unix time at which the cluster clock reads `cluster_time_s`."""
        return self.epoch_unix_s + cluster_time_s / self.time_scale
