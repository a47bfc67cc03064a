"""What `up` (one coordinator or `--shards`) tells its coordinators, read off its options
once: both launch paths build their `LocalClusterConfig` from these fields."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["coordinator_fields"]


def coordinator_fields(args: argparse.Namespace) -> dict[str, Any]:
    """`up`'s coordinator settings as `hexgen_launch.cluster_config.LocalClusterConfig`
    fields (the cluster, time scale and addresses go separately)."""
    return {
        "calibration": args.calibration,
        "policy": args.policy,
        "alpha": args.alpha,
        "slo_scale": args.slo_scale,
        "admission": args.admission,
        "learn_costs": args.learn_costs,
        "output_lengths": args.output_lengths,
        "retention_s": args.retention_s,
        "max_call_attempts": args.max_call_attempts,
    }
