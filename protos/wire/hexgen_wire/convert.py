"""The core's workflow and query as the API's messages: what a client submits, converted
the one way both the SDK (`hexgen_client`) and the services (`hexgen_service.convert`, which
re-exports these and does the way back, with validation) use."""

from __future__ import annotations

from hexgen_api.v1 import coordinator_pb2, workflow_pb2
from hexgen_flow.workload import Query, Workflow

__all__ = ["submit_from_query", "workflow_to_proto"]


def workflow_to_proto(workflow: Workflow) -> workflow_pb2.Workflow:
    """A workflow as the proto expresses it: stages with explicit ids and `after` lists."""
    return workflow_pb2.Workflow(
        stages=[
            workflow_pb2.Stage(
                id=f"s{k}",
                step=stage.step,
                after=[f"s{j}" for j in stage.after],
                calls=[
                    workflow_pb2.LLMCall(
                        step=call.step if call.step != stage.step else "",
                        input_tokens=call.input_tokens,
                        output_tokens=call.output_tokens,
                    )
                    for call in stage.calls
                ],
            )
            for k, stage in enumerate(workflow.stages)
        ]
    )


def submit_from_query(query: Query) -> coordinator_pb2.SubmitQueryRequest:
    """The submission of `query` (its `arrival_s` is not sent: the coordinator stamps it)."""
    return coordinator_pb2.SubmitQueryRequest(
        query_id=query.query_id,
        tenant=query.tenant,
        workflow=workflow_to_proto(query.workflow),
        slo_s=query.slo_s or 0.0,
        slo_scale=query.slo_scale or 0.0,
    )
