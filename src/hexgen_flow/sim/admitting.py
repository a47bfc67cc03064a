"""The simulator with the coordinator's admission control at arrivals (`--admission reject`).

The coordinator asks `hexgen_flow.admission.AdmissionModel` whether a query can still meet
its SLO before it stores it; this simulation asks the same model at each arrival, refuses
the queries predicted to miss (they never run) and tracks the admitted ones, so the
predictor can be measured on the simulator's traffic: how many admitted queries meet their
SLO, and how many refused ones would have (run the same queries without it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hexgen_flow.admission import AdmissionMode, AdmissionModel, Verdict, decide
from hexgen_flow.cluster import Cluster
from hexgen_flow.policies.presets import Preset
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.workload import Query

__all__ = ["AdmittingSimulation"]


class AdmittingSimulation(Simulation):
    """A `Simulation` that refuses the queries `hexgen_flow.admission.decide` refuses
    (``--admission reject``): those `AdmissionModel` predicts to finish later than `slack`
    x their SLO, to push an admitted query past its deadline, or to miss their SLO even
    alone on the whole cluster. `weight_of`: each tenant's weight in fair admission."""

    def __init__(
        self,
        queries: Sequence[Query],
        cluster: Cluster,
        preset: Preset,
        config: SimConfig,
        *,
        slack: float = 1.0,
        weight_of: Callable[[str], float] | None = None,
        truth: Cluster | None = None,
    ) -> None:
        super().__init__(queries, cluster, preset, config, truth=truth)
        self.admission = AdmissionModel(self.cluster, self.estimator, weight_of=weight_of)
        self.slack = slack
        self.rejected = 0
        """Queries refused at arrival."""
        self.infeasible = 0
        """Of those, the ones refused for good (`Verdict.INFEASIBLE`)."""
        self.rejected_ids: set[str] = set()
        """The ids of the refused queries."""

    def _arrive(self, index: int, now: float) -> None:
        query = self.planned(index)  # admission plans with the lengths the scheduler believes
        slo_s = self.slo_of(query)
        prediction = self.admission.predict(
            query.workflow,
            now,
            self.scheduler.load.available,
            tenant=query.tenant,
            window_s=self.slack * slo_s,
        )
        decision = decide(prediction, slo_s, mode=AdmissionMode.REJECT, slack=self.slack)
        if not decision.verdict.admitted:
            self.rejected += 1
            self.infeasible += decision.verdict is Verdict.INFEASIBLE
            self.rejected_ids.add(query.query_id)
            return
        self.admission.track(self._start(index, now, slo_s), self.slack)
