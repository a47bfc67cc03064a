"""α, the dispatcher's knob between an instance's predicted latency and the cluster's
balance: its range, checked in one place (the scheduler, the coordinator's ``--alpha`` and
SetAlpha, the command line's ``--alpha``)."""

from __future__ import annotations

__all__ = ["alpha_problem"]


def alpha_problem(alpha: float | None) -> str | None:
    """What is wrong with `alpha` ("must be in [0, 1]", NaN too), or None when it is a valid
    α (None too: no α given)."""
    if alpha is None or 0.0 <= alpha <= 1.0:
        return None
    return "must be in [0, 1]"
