"""The one place where policies get their names. Import-side-effect free: it only fills the
three registries defined here."""

from __future__ import annotations

from hexgen_flow.policies.autellix import AutellixDispatcher
from hexgen_flow.policies.base import Dispatcher, LocalQueue, StageBudget
from hexgen_flow.policies.budget import DagStageBudget, EndToEndBudget, TemplateStageBudget
from hexgen_flow.policies.dispatch import (
    LeastRequestsDispatcher,
    LeastWorkDispatcher,
    MarginalLatencyDispatcher,
    PowerOfTwoDispatcher,
    RoundRobinDispatcher,
    WorkloadBalancedDispatcher,
)
from hexgen_flow.policies.predicted_latency import PredictedLatencyDispatcher
from hexgen_flow.policies.prefix_routers import KvOverlapDispatcher, PrefixQueueDispatcher
from hexgen_flow.policies.queues import (
    AtlasQueue,
    FcfsQueue,
    LeastLaxityQueue,
    QlmQueue,
    ShortestJobFirstQueue,
    UrgencyQueue,
    VirtualTokenCounterQueue,
)
from hexgen_flow.policies.registry import Registry

__all__ = ["BUDGETS", "DISPATCHERS", "QUEUES"]

DISPATCHERS: Registry[Dispatcher] = Registry("dispatch policy")
DISPATCHERS.register("workload-balanced", WorkloadBalancedDispatcher)
DISPATCHERS.register("marginal-latency", MarginalLatencyDispatcher)
DISPATCHERS.register("round-robin", RoundRobinDispatcher)
DISPATCHERS.register("pow2", PowerOfTwoDispatcher)
DISPATCHERS.register("least-work", LeastWorkDispatcher)
DISPATCHERS.register("least-requests", LeastRequestsDispatcher)
DISPATCHERS.register("prefix-queue", PrefixQueueDispatcher)
DISPATCHERS.register("kv-overlap", KvOverlapDispatcher)
DISPATCHERS.register("predicted-latency", PredictedLatencyDispatcher)
DISPATCHERS.register("autellix-lb", AutellixDispatcher)

QUEUES: Registry[LocalQueue] = Registry("queue policy")
QUEUES.register("urgency", UrgencyQueue)
QUEUES.register("fcfs", FcfsQueue)
QUEUES.register("llf", LeastLaxityQueue)
QUEUES.register("vtc", VirtualTokenCounterQueue)
QUEUES.register("qlm", QlmQueue)
QUEUES.register("sjf", ShortestJobFirstQueue)
QUEUES.register("atlas", AtlasQueue)

BUDGETS: Registry[StageBudget] = Registry("stage budget")
BUDGETS.register("template", TemplateStageBudget)
BUDGETS.register("e2e", EndToEndBudget)
BUDGETS.register("dag", DagStageBudget)
