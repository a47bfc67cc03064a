"""`latency_model` and `parse_cluster` pinned to the ``chess-measured`` calibration.

The tests that check the published algorithm by hand, its golden latencies and the measured
tables themselves were written against the authors' measured tables (docs/algorithm.md): they
keep testing those tables, whatever the default calibration is (``aiconfigurator`` now).
"""

from __future__ import annotations

from typing import Any

from hexgen_flow.cluster import Cluster
from hexgen_flow.cluster import parse_cluster as _parse_cluster
from hexgen_flow.latency import LatencyModel
from hexgen_flow.latency import latency_model as _latency_model

__all__ = ["CALIBRATION", "latency_model", "parse_cluster"]

CALIBRATION = "chess-measured"


def latency_model(model: str, gpu: str, **kwargs: Any) -> LatencyModel:
    return _latency_model(model, gpu, calibration=CALIBRATION, **kwargs)


def parse_cluster(spec: str, **kwargs: Any) -> Cluster:
    return _parse_cluster(spec, calibration=CALIBRATION, **kwargs)
