"""How an OpenAI request becomes coordinator work: the one module to swap when requests
become calls of longer-lived workflow sessions.

Today every request is a **one-call workflow** of its own:

- the workflow context comes from headers (`WorkflowContext.from_headers`):
  ``X-Hexgen-Workflow`` (the workflow's id; a fresh ``gw-<uuid>`` without it),
  ``X-Hexgen-Stage`` (the stage, whose canonical name is the call's step; default
  ``chat``), ``X-Hexgen-Slo-S`` (the query's end-to-end SLO in cluster seconds; without it
  the coordinator's default scale x SLO_base), ``X-Hexgen-Template`` (recorded on the span,
  for the workflow sessions to come);
- the query id is ``{workflow}/{stage}/{n}``, n counting this gateway's requests of that
  workflow and stage from 1; an id the coordinator already knows (a restarted gateway, two
  gateways) is skipped, so a request never receives an earlier request's answer;
- the call declares ``input_tokens`` = the prompt's characters / 4 (rounded up, at least 1;
  a tokenizer-free estimate, good enough for scheduling), ``output_tokens`` = max_tokens;
- it is submitted with SubmitQuery (its QueryInfo gives the deadline, and ``created`` tells a
  known id) and followed with WatchQuery, which replays the query's log from the start:
  RunQuery in two calls. The text is the CALL_TOKENS chunks as they stream (when the engine
  streams) and the rest of CALL_FINISHED's full text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import grpc

from hexgen_api.v1 import coordinator_pb2
from hexgen_client.client import CoordinatorClient
from hexgen_client.errors import CoordinatorError
from hexgen_flow.errors import HexgenFlowError
from hexgen_flow.workload import LLMCall, Query, Workflow, canonical_step
from hexgen_gateway.errors import OpenAIError, bad_request, from_coordinator

__all__ = [
    "HEADER_DEADLINE",
    "HEADER_QUERY",
    "HEADER_SLO",
    "HEADER_STAGE",
    "HEADER_TEMPLATE",
    "HEADER_WORKFLOW",
    "CallRequest",
    "StartedCall",
    "WorkflowContext",
    "WorkflowMapper",
    "estimate_tokens",
    "simulated_tokens",
]

log = logging.getLogger(__name__)

HEADER_WORKFLOW = "X-Hexgen-Workflow"
HEADER_STAGE = "X-Hexgen-Stage"
HEADER_SLO = "X-Hexgen-Slo-S"
HEADER_TEMPLATE = "X-Hexgen-Template"
HEADER_QUERY = "X-Hexgen-Query"
HEADER_DEADLINE = "X-Hexgen-Deadline-S"

CHARS_PER_TOKEN = 4
"""The prompt's token estimate: characters / 4, OpenAI's rule of thumb for English."""
_ID_ATTEMPTS = 32
"""Known ids skipped (ever further apart) before a request gives up."""
_SIMULATED = re.compile(r"^\[simulated [^\]]*\] (\d+) tokens$")
"""The simulated engine's placeholder text (``[simulated A100] 256 tokens``)."""

K = coordinator_pb2


def estimate_tokens(text: str) -> int:
    """Tokens of `text`, estimated as characters / 4 rounded up (at least 1)."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def simulated_tokens(text: str) -> int | None:
    """The tokens a simulated engine's placeholder text stands for; None for real text."""
    match = _SIMULATED.match(text)
    return int(match.group(1)) if match else None


@dataclass(frozen=True, slots=True)
class WorkflowContext:
    """What the ``X-Hexgen-*`` headers say about the workflow a request belongs to."""

    workflow: str
    stage: str
    slo_s: float | None = None
    template: str | None = None
    named: bool = True
    """Whether the workflow id came from the request (False: generated)."""

    @classmethod
    def from_headers(cls, headers: Mapping[str, str], default_stage: str) -> WorkflowContext:
        workflow = headers.get(HEADER_WORKFLOW, "").strip()
        stage = headers.get(HEADER_STAGE, "").strip() or default_stage
        slo_text = headers.get(HEADER_SLO, "").strip()
        slo_s: float | None = None
        if slo_text:
            try:
                slo_s = float(slo_text)
            except ValueError:
                slo_s = math.nan
            if not (math.isfinite(slo_s) and slo_s > 0):
                raise bad_request(
                    f"{HEADER_SLO} must be a finite number of seconds > 0, got {slo_text!r}",
                    HEADER_SLO,
                )
        template = headers.get(HEADER_TEMPLATE, "").strip() or None
        if workflow:
            return cls(workflow, stage, slo_s, template)
        return cls(f"gw-{uuid.uuid4().hex}", stage, slo_s, template, named=False)


@dataclass(frozen=True, slots=True)
class CallRequest:
    """The one LLM call of a request."""

    prompt: str
    output_tokens: int
    prompt_param: str
    """The request's name for the prompt (``messages`` or ``prompt``), for errors."""

    @property
    def input_tokens(self) -> int:
        return estimate_tokens(self.prompt)

    def param_of(self) -> dict[str, str]:
        """The coordinator's field names -> the request's (see `from_coordinator`)."""
        return {
            "query_id": HEADER_WORKFLOW,
            "query.query_id": HEADER_WORKFLOW,
            "slo_s": HEADER_SLO,
            "slo_scale": HEADER_SLO,
            "step": HEADER_STAGE,
            "id": HEADER_STAGE,
            "prompt": self.prompt_param,
            "input_tokens": self.prompt_param,
            "output_tokens": "max_tokens",
        }


@dataclass(slots=True)
class StartedCall:
    """A request admitted by the coordinator: its ids, its QueryInfo, and its text."""

    context: WorkflowContext
    query_id: str
    info: coordinator_pb2.QueryInfo
    call: CallRequest
    _client: CoordinatorClient
    _events: AsyncIterator[coordinator_pb2.QueryEvent]
    _timeout_s: float
    text: str = ""
    """The full text, once `deltas` has ended."""
    instance: str = ""
    """The instance that ran the call (e.g. ``A100#0``)."""
    _streamed: list[str] = field(default_factory=list)

    @property
    def deadline_s(self) -> float:
        """The query's deadline, cluster seconds."""
        return self.info.deadline_s

    @property
    def completion_tokens(self) -> int:
        """Tokens of the text: the declared output for a simulated engine's placeholder,
        else characters / 4."""
        simulated = simulated_tokens(self.text)
        if simulated is not None:
            return self.call.output_tokens
        return estimate_tokens(self.text) if self.text else 0

    async def deltas(self) -> AsyncIterator[str]:
        """The text as it comes: CALL_TOKENS chunks, then what CALL_FINISHED's full text adds
        to them. Raises `OpenAIError` when the query fails (500), is cancelled (500) or
        runs past the request timeout (504, and the query is cancelled)."""
        try:
            async with asyncio.timeout(self._timeout_s):
                async for event in self._events:
                    for piece in self._apply(event):
                        yield piece
        except TimeoutError:
            await self.cancel()
            raise OpenAIError(
                504,
                f"query {self.query_id} did not finish within {self._timeout_s:g} s",
                type="timeout",
                code="timeout",
            ) from None
        except CoordinatorError as exc:
            raise from_coordinator(exc, self.call.param_of()) from None

    async def collect(self) -> str:
        """The whole text (`deltas` drained)."""
        async for _ in self.deltas():
            pass
        return self.text

    async def cancel(self) -> None:
        """Cancel the query (best effort: a client that went away, a timeout)."""
        with contextlib.suppress(CoordinatorError):
            await self._client.cancel(self.query_id)

    def _apply(self, event: coordinator_pb2.QueryEvent) -> list[str]:
        kind = event.kind
        if event.instance:
            self.instance = event.instance
        if kind == K.QUERY_EVENT_KIND_CALL_TOKENS and event.text:
            self._streamed.append(event.text)
            return [event.text]
        if kind == K.QUERY_EVENT_KIND_CALL_FINISHED:
            self.text = event.text
            streamed = "".join(self._streamed)
            if event.text.startswith(streamed):
                rest = event.text[len(streamed) :]
                return [rest] if rest else []
            # Chunks of an attempt that failed were sent already: they cannot be taken back.
            log.warning(
                "query %s: the finished text does not extend the streamed chunks", self.query_id
            )
            return []
        if kind == K.QUERY_EVENT_KIND_FAILED:
            raise OpenAIError(
                500, f"query {self.query_id} failed: {event.text}", type="server_error"
            )
        if kind == K.QUERY_EVENT_KIND_CANCELLED:
            raise OpenAIError(500, f"query {self.query_id} was cancelled", type="server_error")
        return []


class _QueryIds:
    """``{workflow}/{stage}/{n}``: n counts this process's requests per workflow and stage."""

    def __init__(self) -> None:
        self._next: dict[tuple[str, str], int] = {}

    def take(self, context: WorkflowContext, skip: int = 0) -> str:
        key = (context.workflow, context.stage)
        n = self._next.get(key, 1) + skip
        self._next[key] = n + 1
        return f"{context.workflow}/{context.stage}/{n}"


class WorkflowMapper:
    """Starts the coordinator work of a request (see the module docstring)."""

    def __init__(self, client: CoordinatorClient, *, request_timeout_s: float) -> None:
        self.client = client
        self.request_timeout_s = request_timeout_s
        self._ids = _QueryIds()

    async def start(self, context: WorkflowContext, call: CallRequest) -> StartedCall:
        """Submit the request's workflow and open its event stream; `OpenAIError` when the
        coordinator refuses it (400, 409, 429, 503, 504, 500)."""
        step = canonical_step(context.stage)
        param_of = call.param_of()
        skip = jump = 0
        for _ in range(_ID_ATTEMPTS):
            query_id = self._ids.take(context, skip)
            try:
                query = Query(
                    query_id=query_id,
                    workflow=Workflow.chain(
                        [(LLMCall(step or "chat", call.input_tokens, call.output_tokens),)]
                    ),
                    slo_s=context.slo_s,
                )
            except HexgenFlowError as exc:
                raise bad_request(str(exc), None) from None
            try:
                response = await self.client.submit(query, prompts=[[call.prompt]])
            except CoordinatorError as exc:
                if exc.code != grpc.StatusCode.ALREADY_EXISTS:
                    raise from_coordinator(exc, param_of) from None
            else:
                if response.created:
                    return await self._follow(context, call, query_id, response.query)
            # The id is known (an earlier gateway's request): try the next one, then ever
            # further on (n+1, n+2, n+4, ...), so a long history is passed in a few tries.
            skip, jump = jump, 2 * jump + 1
        raise OpenAIError(
            409,
            f"no free query id for workflow {context.workflow!r} stage {context.stage!r} "
            f"after {_ID_ATTEMPTS} attempts",
            param=HEADER_WORKFLOW,
            code="conflict",
        )

    async def _follow(
        self,
        context: WorkflowContext,
        call: CallRequest,
        query_id: str,
        info: coordinator_pb2.QueryInfo,
    ) -> StartedCall:
        events = self.client.watch(query_id)
        started = StartedCall(
            context, query_id, info, call, self.client, events, self.request_timeout_s
        )
        # Open the stream now, while the request's span is current (its context travels
        # in the RPC's metadata); the first event (SUBMITTED) comes from the stored log.
        try:
            first = await anext(events)
        except CoordinatorError as exc:
            raise from_coordinator(exc, call.param_of()) from None
        except StopAsyncIteration:
            raise OpenAIError(500, f"query {query_id}: no events", type="server_error") from None
        started._events = _prepend(first, events)
        return started


async def _prepend(
    first: coordinator_pb2.QueryEvent, rest: AsyncIterator[coordinator_pb2.QueryEvent]
) -> AsyncIterator[coordinator_pb2.QueryEvent]:
    yield first
    async for event in rest:
        yield event
