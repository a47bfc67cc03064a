"""Arrival processes: when each query of a run arrives."""

from __future__ import annotations

import random
from collections.abc import Sequence

from hexgen_flow.errors import ConfigError
from hexgen_flow.workload import Query

__all__ = ["arrival_times", "gamma_arrivals", "gamma_gap", "renewal_times"]


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


def gamma_gap(qps: float, cv: float, rng: random.Random) -> float:
    """One inter-arrival gap of the renewal process of `gamma_arrivals` (rate `qps`, gap
    coefficient of variation `cv`)."""
    if qps <= 0:
        raise ConfigError(f"qps must be > 0, got {qps}")
    if cv <= 0:
        raise ConfigError(f"arrival cv must be > 0, got {cv}")
    shape = 1.0 / (cv * cv)
    return rng.gammavariate(shape, 1.0 / (qps * shape))


def renewal_times(
    start_s: float,
    qps: float,
    cv: float,
    rng: random.Random,
    *,
    count: int | None = None,
    until_s: float | None = None,
) -> list[float]:
    """Arrivals of a renewal process (`gamma_gap`) that starts at `start_s`: the first one a
    gap after it, so that a phase of a schedule starts in its own steady state. Either the
    first `count` of them or every one before `until_s` (exactly one must be given)."""
    if (count is None) == (until_s is None):
        raise ConfigError("give either a count of arrivals or an end time, not both")
    times: list[float] = []
    t = start_s
    if count is not None:
        if count < 0:
            raise ConfigError(f"the count of arrivals must be >= 0, got {count}")
        for _ in range(count):
            t += gamma_gap(qps, cv, rng)
            times.append(t)
        return times
    assert until_s is not None  # for mypy: one of the two is set (checked above)
    while True:
        t += gamma_gap(qps, cv, rng)
        if t >= until_s:
            return times
        times.append(t)


def arrival_times(
    queries: Sequence[Query], qps: float, cv: float, rng: random.Random
) -> list[float]:
    """Arrival time of each query: its explicit `arrival_s`, else the arrival process's."""
    process = gamma_arrivals(len(queries), qps, cv, rng)
    return [
        q.arrival_s if q.arrival_s is not None else t for q, t in zip(queries, process, strict=True)
    ]
