"""Named combinations of a dispatcher, a local queue and a stage budget.

`--policy` takes a preset name, or ``DISPATCH+QUEUE[+BUDGET]`` for any combination of
registered policies with their default parameters (e.g. ``least-work+urgency+dag``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from hexgen_flow.errors import ConfigError, UnknownNameError
from hexgen_flow.policies.registration import BUDGETS, DISPATCHERS, QUEUES

__all__ = ["PRESETS", "PolicyRef", "Preset", "resolve_policy"]


@dataclass(frozen=True, slots=True)
class PolicyRef:
    """A registered policy name with parameter overrides."""

    name: str
    params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def with_params(self, **params: Any) -> PolicyRef:
        return replace(self, params=MappingProxyType({**self.params, **params}))


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    dispatch: PolicyRef
    queue: PolicyRef
    budget: PolicyRef
    description: str

    @property
    def has_alpha(self) -> bool:
        """Whether the dispatcher takes the α knob (and `--alpha auto` tunes it)."""
        return "alpha" in DISPATCHERS.parameters(self.dispatch.name)

    def with_alpha(self, alpha: float) -> Preset:
        if not self.has_alpha:
            raise ConfigError(f"policy {self.name!r} has no alpha")
        return replace(self, dispatch=self.dispatch.with_params(alpha=alpha))

    @property
    def alpha(self) -> float | None:
        if not self.has_alpha:
            return None
        default = DISPATCHERS.parameters(self.dispatch.name)["alpha"]
        return float(self.dispatch.params.get("alpha", default))


_PAPER_WB = PolicyRef("workload-balanced")
_PAPER_BUDGET = PolicyRef("template")
# The tail weight's exponent (docs/design.md, "The tail weight"; measured in
# docs/experiments/2026-12-02-tail-weight.md): 3 had the best mean ratio over the best
# router on every cluster of the band, 2 a similar worst row.
_HEXGEN_WB = PolicyRef("marginal-latency", MappingProxyType({"tail_power": 3.0}))

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "hexgen-flow",
            _HEXGEN_WB,
            PolicyRef("urgency", MappingProxyType({"estimate": "call"})),
            PolicyRef("dag"),
            "HexGen-Flow: workload balance on marginal latency (per-call estimates, "
            "outstanding work, live batch sizes, prefix affinity, seconds weighted by how "
            "late each query runs) + urgency queue on DAG-aware stage budgets",
        ),
        Preset(
            "hexgen-flow-paper",
            _PAPER_WB,
            PolicyRef("urgency"),
            _PAPER_BUDGET,
            "the published algorithm: workload-balanced (cumulative work, per-step "
            "estimates) + urgency on the template stage budget",
        ),
        Preset(
            "vllm",
            PolicyRef("round-robin"),
            PolicyRef("fcfs"),
            _PAPER_BUDGET,
            "vLLM: round-robin + FCFS",
        ),
        Preset(
            "ray-serve",
            PolicyRef("pow2"),
            PolicyRef("fcfs"),
            _PAPER_BUDGET,
            "Ray Serve: power of two choices on in-flight calls + FCFS",
        ),
        Preset(
            "llf",
            PolicyRef("least-work"),
            PolicyRef("llf"),
            _PAPER_BUDGET,
            "least outstanding work + query-level least laxity",
        ),
        Preset(
            "vtc",
            PolicyRef("round-robin"),
            PolicyRef("vtc"),
            _PAPER_BUDGET,
            "round-robin + virtual token counter fairness",
        ),
        Preset(
            "qlm",
            PolicyRef("round-robin"),
            PolicyRef("qlm"),
            _PAPER_BUDGET,
            "round-robin + QLM request groups",
        ),
        Preset(
            "wb-only",
            _PAPER_WB,
            PolicyRef("fcfs"),
            _PAPER_BUDGET,
            "ablation: the paper's workload-balanced dispatch + FCFS",
        ),
        Preset(
            "pq-only",
            PolicyRef("round-robin"),
            PolicyRef("urgency"),
            _PAPER_BUDGET,
            "ablation: round-robin + the paper's urgency queue",
        ),
        # The load-aware routers people run in production, each with FCFS: the bench
        # measures every claim against the best of them as well as against `vllm`.
        Preset(
            "least-requests",
            PolicyRef("least-requests"),
            PolicyRef("fcfs"),
            _PAPER_BUDGET,
            "vLLM production stack / llm-d queue depth: fewest calls in flight + FCFS",
        ),
        Preset(
            "least-work",
            PolicyRef("least-work"),
            PolicyRef("fcfs"),
            _PAPER_BUDGET,
            "least outstanding estimated work + FCFS",
        ),
        # Prefix-cache-aware routers (vLLM V1 caches prefixes by default).
        Preset(
            "llm-d",
            PolicyRef("prefix-queue"),
            PolicyRef("fcfs"),
            _PAPER_BUDGET,
            "llm-d's default profile: queue scorer (2) + prefix-cache scorer (3) + FCFS",
        ),
        Preset(
            "dynamo",
            PolicyRef("kv-overlap"),
            PolicyRef("fcfs"),
            _PAPER_BUDGET,
            "NVIDIA Dynamo's KV router: least new prefill + decode KV tokens + FCFS",
        ),
        # Stronger baselines: a router that learns latency online, and a program-aware
        # scheduler for agents (neither knows deadlines or latency tables).
        Preset(
            "llm-d-predicted",
            PolicyRef("predicted-latency"),
            PolicyRef("fcfs"),
            _PAPER_BUDGET,
            "llm-d's predicted-latency router: lowest TTFT + TPOT x tokens, learnt online "
            "per instance from the calls it placed + FCFS",
        ),
        Preset(
            "autellix",
            PolicyRef("autellix-lb"),
            PolicyRef("atlas"),
            _PAPER_BUDGET,
            "Autellix: long calls kept on their program's engine, short ones least loaded + "
            "ATLAS (program's least attained service, multi-level, anti-starvation)",
        ),
    )
}


def resolve_policy(name: str) -> Preset:
    """A preset by name, or a ``DISPATCH+QUEUE[+BUDGET]`` combination."""
    preset = PRESETS.get(name)
    if preset is not None:
        return preset
    if "+" not in name:
        error = UnknownNameError("policy", name, list(PRESETS))
        raise ConfigError(f"{error}; or DISPATCH+QUEUE[+BUDGET] from `hexgen-flow policies`")
    parts = name.split("+")
    if len(parts) not in (2, 3):
        raise ConfigError(f"policy {name!r}: write DISPATCH+QUEUE or DISPATCH+QUEUE+BUDGET")
    dispatch, queue = parts[0], parts[1]
    budget = parts[2] if len(parts) == 3 else "template"
    DISPATCHERS.factory(dispatch)
    QUEUES.factory(queue)
    BUDGETS.factory(budget)
    return Preset(
        name,
        PolicyRef(dispatch),
        PolicyRef(queue),
        PolicyRef(budget),
        f"{dispatch} dispatch + {queue} queue + {budget} budget",
    )
