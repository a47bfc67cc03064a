"""The coordinator's `ClusterStatusResponse` as the simulator's objects: its cluster
(`cluster_from_status`) and its policy (`preset_from_status`), for the tuner's what-if
simulations and the benchmarks that compare a mesh with ``hexgen-flow simulate``."""

from __future__ import annotations

from hexgen_api.v1 import coordinator_pb2
from hexgen_flow.cluster import Cluster
from hexgen_flow.policies.presets import Preset, resolve_policy

__all__ = ["cluster_from_status", "preset_from_status"]


def cluster_from_status(
    status: coordinator_pb2.ClusterStatusResponse,
    calibration: str | None = None,
    *,
    learned: bool = True,
) -> Cluster:
    """The coordinator's cluster as the simulator builds it: each slot's GPU and model, and
    its KV-cache size where the coordinator reports one, with latency from `calibration`
    (the coordinator's; the status does not carry it; None: ``aiconfigurator``). With
    `learned`, an instance whose costs the coordinator learned (``--learn-costs``) runs
    what it learned: its calibration scaled by the learned prefill and decode factors, as
    the coordinator's dispatcher believes it."""
    entries: list[dict[str, object]] = []
    for inst in sorted(status.instances, key=lambda i: i.index):
        entry: dict[str, object] = {"gpu": inst.gpu, "model": inst.model}
        if inst.kv_capacity_tokens > 0:
            entry["kv_cache_tokens"] = int(inst.kv_capacity_tokens)
        entries.append(entry)
    ordered = sorted(status.instances, key=lambda i: i.index)
    gpus = ",".join(inst.gpu for inst in ordered)
    cluster = Cluster.build(entries, gpus, calibration=calibration)
    factors = [
        (i.learned_prefill_factor, i.learned_decode_factor)
        if learned
        and i.learned_calls > 0
        and min(i.learned_prefill_factor, i.learned_decode_factor) > 0
        else None
        for i in ordered
    ]
    return cluster.with_learned(factors) if any(factors) else cluster


def preset_from_status(status: coordinator_pb2.ClusterStatusResponse) -> Preset:
    """The coordinator's policy, with its current α when the policy has one."""
    preset = resolve_policy(status.policy)
    return preset.with_alpha(status.alpha) if preset.has_alpha else preset
