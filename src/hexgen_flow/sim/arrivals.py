"""Arrival processes: when each query of a run arrives."""

from __future__ import annotations

import random
from collections.abc import Sequence

from hexgen_flow.errors import ConfigError
from hexgen_flow.workload import Query

__all__ = ["arrival_times", "gamma_arrivals"]


def gamma_arrivals(n: int, qps: float, cv: float, rng: random.Random) -> list[float]:
    """`n` arrival times of a renewal process with rate `qps` and gap coefficient of variation
    `cv`: Gamma gaps with shape 1/cv^2 (cv = 1 is Poisson, cv > 1 is bursty). The first query
    arrives at 0."""
    if qps <= 0:
        raise ConfigError(f"qps must be > 0, got {qps}")
    if cv <= 0:
        raise ConfigError(f"arrival cv must be > 0, got {cv}")
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (qps * shape)
    times = [0.0]
    t = 0.0
    for _ in range(n - 1):
        t += rng.gammavariate(shape, scale)
        times.append(t)
    return times[:n]


def arrival_times(
    queries: Sequence[Query], qps: float, cv: float, rng: random.Random
) -> list[float]:
    """Arrival time of each query: its explicit `arrival_s`, else the arrival process's."""
    process = gamma_arrivals(len(queries), qps, cv, rng)
    return [
        q.arrival_s if q.arrival_s is not None else t for q, t in zip(queries, process, strict=True)
    ]
