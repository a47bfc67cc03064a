"""How an OpenAI request becomes coordinator work: a call of a workflow session.

- The workflow context comes from headers (`WorkflowContext.from_headers`):
  ``X-Hexgen-Workflow`` (the workflow's id), ``X-Hexgen-Stage`` (the stage the call belongs
  to; default ``chat``), ``X-Hexgen-Slo-S`` (the workflow's end-to-end SLO in cluster
  seconds; without it the coordinator's default scale x SLO_base) and ``X-Hexgen-Template``
  (the stages the workflow expects, e.g. ``chess``), the last two read on a workflow's
  first request.
- The first request of a workflow opens it (OpenWorkflow): with its template, or, without
  one, expecting just this request's stage; the coordinator adds the stages later
  requests name. Every request is then one call (RunCall) of its stage: the coordinator
  budgets it from the time the workflow has left. A workflow ends when it is closed
  (``POST /v1/workflows/{id}/close``) or after the coordinator's idle timeout.
- A request without ``X-Hexgen-Workflow`` is a workflow of its own (``gw-<uuid>``),
  opened, given its one call and closed at once. When its call is not taken (the
  coordinator refuses it, or anything else fails before it is), the workflow is cancelled
  at once: nobody will give it a call, and it must not wait for the idle timeout, counted
  as work by admission. A named workflow goes on (its other calls are wanted).
- The ids the headers give (workflow, stage, template) are at most `MAX_ID_CHARACTERS`
  (the coordinator accepts no longer one): 400 naming the header. A header that is given
  empty (``X-Hexgen-Stage: ``) is a 400 too, not taken for its default.
- Idle sessions end: a workflow is opened with an idle timeout (``X-Hexgen-Idle-S`` on
  its first request, else the gateway's ``--session-idle-s``, 60 s by default): a
  framework that never closes its workflows leaves none running for longer; the
  coordinator closes it after that many wall seconds without a call.
- The call's options (sampling, stop, seed, tools, response_format) travel with it to
  the engine. An engine that cannot honour one fails the call with ``unsupported option
  <field>: ...``; the request is then answered 400 naming that field.
- The call declares ``input_tokens`` = the prompt's characters / 4 (rounded up, at least
  1; a tokenizer-free estimate, good enough for scheduling), ``output_tokens`` =
  max_tokens. The text is the CALL_TOKENS chunks as they stream (when the engine streams)
  and the rest of CALL_FINISHED's full text; its finish reason, tool calls and token
  counts are CALL_FINISHED's, what the engine did (the estimates stand in where the engine
  does not say).
- The workflow's trace: OpenWorkflow's answer (`QueryInfo.traceparent`) and RunCall's first
  one give the traceparent of the workflow's root span, remembered with the workflow's id
  (`WorkflowMapper.trace_of`): the parent of the spans of its later requests
  (`hexgen_gateway.app`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import grpc

from hexgen_api.v1 import coordinator_pb2, workflow_pb2
from hexgen_client.client import CoordinatorClient
from hexgen_client.errors import CoordinatorError
from hexgen_flow.workload import canonical_step
from hexgen_gateway.callers import caller_id
from hexgen_gateway.errors import OpenAIError, bad_request, from_coordinator
from hexgen_service.convert import MAX_ID_CHARACTERS

__all__ = [
    "HEADER_CALL",
    "HEADER_DEADLINE",
    "HEADER_IDLE",
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
HEADER_CALL = "X-Hexgen-Call"
HEADER_DEADLINE = "X-Hexgen-Deadline-S"
HEADER_IDLE = "X-Hexgen-Idle-S"
UNSUPPORTED_OPTION = re.compile(r"unsupported option (\w+): ([^\n]*)")
"""How a call's error names an option its engine cannot honour (the worker's
`hexgen_worker.engines.base.UnsupportedOptionError`), in the query's failure reason."""

CHARS_PER_TOKEN = 4
"""The prompt's token estimate: characters / 4, OpenAI's rule of thumb for English."""
_OPENED_KEPT = 100_000
"""Workflow ids a gateway remembers having opened (older ones are opened again: a no-op)."""
_UNSURE = frozenset({500, 502, 504})
"""The statuses of a refused OpenWorkflow after which the workflow may exist all the same
(the coordinator may have opened it without the answer reaching the gateway)."""
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
    idle_s: float | None = None
    """``X-Hexgen-Idle-S``: the workflow's idle timeout (None: the gateway's)."""

    @classmethod
    def from_headers(cls, headers: Mapping[str, str], default_stage: str) -> WorkflowContext:
        workflow = _id_header(headers, HEADER_WORKFLOW)
        stage = _id_header(headers, HEADER_STAGE) or default_stage
        slo_s = _seconds_header(headers, HEADER_SLO)
        idle_s = _seconds_header(headers, HEADER_IDLE)
        template = _id_header(headers, HEADER_TEMPLATE) or None
        if workflow:
            return cls(workflow, stage, slo_s, template, idle_s=idle_s)
        return cls(f"gw-{uuid.uuid4().hex}", stage, slo_s, template, named=False, idle_s=idle_s)


def _seconds_header(headers: Mapping[str, str], name: str) -> float | None:
    """The header `name`, a finite number of seconds > 0; None when not given."""
    text = headers.get(name, "").strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        shown = text if len(text) <= 40 else f"{text[:40]}..."
        raise bad_request(f"{name} must be a finite number of seconds > 0, got {shown!r}", name)
    return seconds


def _id_header(headers: Mapping[str, str], name: str) -> str:
    """The header `name`, stripped ("" when not given); 400 when it is given empty, or
    longer than any id the coordinator takes (a long one would not even fit the metadata
    of the coordinator's error)."""
    raw = headers.get(name)
    if raw is None:
        return ""
    value = raw.strip()
    if not value:
        raise bad_request(f"{name} is empty: give an id, or leave the header out", name)
    if len(value) > MAX_ID_CHARACTERS:
        raise bad_request(
            f"{name} must be at most {MAX_ID_CHARACTERS} characters, got {len(value)}", name
        )
    return value


@dataclass(frozen=True, slots=True)
class CallRequest:
    """The one LLM call of a request."""

    prompt: str
    output_tokens: int
    prompt_param: str
    """The request's name for the prompt (``messages`` or ``prompt``), for errors."""
    messages: tuple[workflow_pb2.ChatMessage, ...] = ()
    """A chat request's messages: the engine applies the model's chat template to them;
    `prompt` is their plain rendering, for engines without one."""
    options: workflow_pb2.CallOptions | None = None
    """How to generate (sampling, stop, seed, tools, response_format); None: defaults."""

    @property
    def input_tokens(self) -> int:
        return estimate_tokens(self.prompt)

    def param_of(self) -> dict[str, str]:
        """The coordinator's field names -> the request's (see `from_coordinator`). A call
        that fits no instance's KV cache (the coordinator's field: the call) is named by the
        larger of its prompt and its max tokens; a RunCall too large as a whole (the
        coordinator's field: the request) by its prompt, the only part that can be."""
        whole = "max_tokens" if self.output_tokens >= self.input_tokens else self.prompt_param
        return {
            "query_id": HEADER_WORKFLOW,
            "workflow_id": HEADER_WORKFLOW,
            "stage": HEADER_STAGE,
            "slo_s": HEADER_SLO,
            "slo_scale": HEADER_SLO,
            "step": HEADER_STAGE,
            "id": HEADER_STAGE,
            "prompt": self.prompt_param,
            "messages": "messages",
            "input_tokens": self.prompt_param,
            "output_tokens": "max_tokens",
            "max_tokens": "max_tokens",
            "options": "tools"
            if self.options is not None and self.options.tools_json
            else self.prompt_param,
            "call": whole,
            "calls": whole,
            "request": self.prompt_param,
            "idle_timeout_s": HEADER_IDLE,
        }


@dataclass(slots=True)
class StartedCall:
    """A call the coordinator took: its ids, its stage deadline, and its text."""

    context: WorkflowContext
    call_id: str
    deadline_s: float
    """The call's stage deadline, cluster seconds."""
    call: CallRequest
    _client: CoordinatorClient
    _events: AsyncIterator[coordinator_pb2.RunCallResponse]
    _timeout_s: float
    text: str = ""
    """The full text, once `deltas` has ended."""
    instance: str = ""
    """The instance that ran the call (e.g. ``A100#0``)."""
    finish_reason: str = ""
    """Why generation ended, as the engine says ("" until the end, or when it does not)."""
    tool_calls: tuple[workflow_pb2.ToolCall, ...] = ()
    """The tools the model called."""
    engine_prompt_tokens: int = 0
    engine_output_tokens: int = 0
    """The tokens as the engine counted them (0: it does not say)."""
    traceparent: str = ""
    """The W3C traceparent of the workflow's root span, as the coordinator gave it ("":
    it did not)."""
    _streamed: list[str] = field(default_factory=list)

    @property
    def query_id(self) -> str:
        """The workflow's id (its query id in the coordinator)."""
        return self.context.workflow

    @property
    def prompt_tokens(self) -> int:
        """The prompt's tokens: the engine's count, else the estimate (characters / 4)."""
        return self.engine_prompt_tokens or self.call.input_tokens

    @property
    def completion_tokens(self) -> int:
        """Tokens generated: the engine's count; where it does not say, the declared output
        for a simulated engine's placeholder, else characters / 4."""
        if self.engine_output_tokens > 0:
            return self.engine_output_tokens
        simulated = simulated_tokens(self.text)
        if simulated is not None:
            return self.call.output_tokens
        return estimate_tokens(self.text) if self.text else 0

    async def deltas(self) -> AsyncIterator[str]:
        """The text as it comes: CALL_TOKENS chunks, then what CALL_FINISHED's full text adds
        to them. Raises `OpenAIError` when the workflow fails (500), is cancelled (500) or
        the call runs past the request timeout (504)."""
        try:
            async with asyncio.timeout(self._timeout_s):
                async for response in self._events:
                    for piece in self._apply(response.event):
                        yield piece
        except TimeoutError:
            await self.cancel()
            raise OpenAIError(
                504,
                f"call {self.call_id} did not finish within {self._timeout_s:g} s",
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
        """Nobody wants the answer (the client went away, a timeout): a workflow of the
        request's own is cancelled; a named one goes on (its other calls are wanted)."""
        if not self.context.named:
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
            self.finish_reason = event.finish_reason
            self.tool_calls = tuple(event.tool_calls)
            self.engine_prompt_tokens = event.prompt_tokens
            self.engine_output_tokens = event.output_tokens
            streamed = "".join(self._streamed)
            if event.text.startswith(streamed):
                rest = event.text[len(streamed) :]
                return [rest] if rest else []
            # Chunks of an attempt that failed were sent already: they cannot be taken back.
            log.warning(
                "call %s: the finished text does not extend the streamed chunks", self.call_id
            )
            return []
        if kind == K.QUERY_EVENT_KIND_FAILED:
            unsupported = UNSUPPORTED_OPTION.search(event.text)
            if unsupported is not None:  # the engine cannot honour an option of the request
                raise bad_request(
                    f"the serving engine cannot honour {unsupported.group(1)}: "
                    f"{unsupported.group(2)}",
                    unsupported.group(1),
                    "unsupported_parameter",
                )
            raise OpenAIError(
                500, f"workflow {self.query_id} failed: {event.text}", type="server_error"
            )
        if kind == K.QUERY_EVENT_KIND_CANCELLED:
            raise OpenAIError(500, f"workflow {self.query_id} was cancelled", type="server_error")
        return []


class WorkflowMapper:
    """Starts the coordinator work of a request (see the module docstring)."""

    def __init__(
        self,
        client: CoordinatorClient,
        *,
        request_timeout_s: float,
        session_idle_s: float | None = None,
    ) -> None:
        self.client = client
        self.request_timeout_s = request_timeout_s
        self.session_idle_s = session_idle_s
        """The idle timeout of the workflows this gateway opens (a request's
        ``X-Hexgen-Idle-S`` overrides it); None: the coordinator's ``--session-idle-s``."""
        self._discarding: set[asyncio.Task[None]] = set()
        """Cancellations of workflows whose call was not taken, held until done."""
        self._opened: OrderedDict[tuple[str, str], str] = OrderedDict()
        """(caller, workflow) this gateway opened (the latest `_OPENED_KEPT`): not opened
        again for that caller. Another caller naming the same workflow id opens it with its
        own key: the coordinator, not this memory, decides whose the workflow is. The value
        is the W3C traceparent of the workflow's root span ("" until the coordinator says),
        the parent of the spans of the workflow's later requests (`trace_of`)."""

    def trace_of(self, context: WorkflowContext) -> str:
        """The traceparent of the root span of the request's workflow, as the coordinator
        gave it when this gateway opened the workflow or gave it a call; "" when not known
        (a workflow not seen yet for this caller)."""
        return self._opened.get((caller_id(), context.workflow), "")

    def _learn_trace(self, context: WorkflowContext, traceparent: str) -> None:
        key = (caller_id(), context.workflow)
        if traceparent and key in self._opened:
            self._opened[key] = traceparent

    async def start(self, context: WorkflowContext, call: CallRequest) -> StartedCall:
        """Give the request's call to its workflow (opening it first if need be) and open
        its event stream; `OpenAIError` when the coordinator refuses it (400, 404, 409,
        429, 503, 504, 500). A workflow of the request's own whose call was not taken is
        cancelled before this returns (see the module docstring)."""
        opened = False  # whether the workflow may exist (for a workflow of the request's own)
        try:
            if (caller_id(), context.workflow) not in self._opened:
                try:
                    await self._open(context, call, call.param_of())
                except OpenAIError as exc:
                    opened = exc.status in _UNSURE
                    raise
                except BaseException:  # cancelled, or a bug: it may have been opened
                    opened = True
                    raise
            opened = True
            return await self._give(context, call)
        except BaseException as exc:
            if opened and not context.named:
                await self._discard(context.workflow, exc)
            raise

    async def _give(self, context: WorkflowContext, call: CallRequest) -> StartedCall:
        """RunCall, up to its first response; the workflow is open."""
        param_of = call.param_of()
        events = self.client.run_call(
            context.workflow,
            context.stage,
            call.prompt,
            max_tokens=call.output_tokens,
            input_tokens=call.input_tokens,
            messages=call.messages,
            options=call.options,
        )
        try:
            # Open the stream now, while the request's span is current (its context travels
            # in the RPC's metadata); the first response names the call and its deadline.
            first = await anext(events)
        except CoordinatorError as exc:
            raise from_coordinator(exc, param_of) from None
        except StopAsyncIteration:
            raise OpenAIError(
                500, "the coordinator ended the call's stream", type="server_error"
            ) from None
        if not context.named:  # the request is the whole workflow: nothing more will come
            with contextlib.suppress(CoordinatorError):
                await self.client.close_workflow(context.workflow)
        self._learn_trace(context, first.traceparent)
        return StartedCall(
            context,
            first.call_id,
            first.deadline_s,
            call,
            self.client,
            events,
            self.request_timeout_s,
            traceparent=first.traceparent,
        )

    async def _discard(self, workflow: str, why: BaseException) -> None:
        """Cancel `workflow`, a workflow of a request's own whose call was not taken; done
        even when the request itself is cancelled meanwhile (the client went away)."""
        reason = why.message if isinstance(why, OpenAIError) else type(why).__name__
        log.info("workflow %s: its call was not taken (%s): cancelling it", workflow, reason)
        task = asyncio.get_running_loop().create_task(self._cancel_quietly(workflow))
        self._discarding.add(task)
        task.add_done_callback(self._discarding.discard)
        await asyncio.shield(task)

    async def _cancel_quietly(self, workflow: str) -> None:
        try:
            await self.client.cancel(workflow)
        except CoordinatorError as exc:  # it ends after the idle timeout all the same
            log.warning("workflow %s: could not cancel it: %s", workflow, exc)

    async def _open(
        self, context: WorkflowContext, call: CallRequest, param_of: Mapping[str, str]
    ) -> None:
        expected = None
        if not context.template:
            step = canonical_step(context.stage) or "chat"
            expected = workflow_pb2.Workflow(
                stages=[
                    workflow_pb2.Stage(
                        id=context.stage,
                        step=step,
                        calls=[
                            workflow_pb2.LLMCall(
                                input_tokens=call.input_tokens, output_tokens=call.output_tokens
                            )
                        ],
                    )
                ]
            )
        traceparent = ""
        try:
            opened = await self.client.open_workflow(
                context.workflow,
                template=context.template or "",
                expected=expected,
                slo_s=context.slo_s or 0.0,
                idle_timeout_s=context.idle_s or self.session_idle_s or 0.0,
            )
            traceparent = opened.workflow.traceparent
        except CoordinatorError as exc:
            # Known with other content: opened by an earlier request (another gateway, or
            # this one before a restart) that had other headers. Its calls are welcome.
            if exc.code != grpc.StatusCode.ALREADY_EXISTS:
                raise from_coordinator(exc, {**param_of, "template": HEADER_TEMPLATE}) from None
        if not context.named:  # given its one call at once: nothing to remember
            return
        self._opened[caller_id(), context.workflow] = traceparent
        while len(self._opened) > _OPENED_KEPT:
            self._opened.popitem(last=False)

    async def close(self, workflow: str) -> coordinator_pb2.QueryInfo:
        """Close a workflow (`POST /v1/workflows/{id}/close`)."""
        self._opened.pop((caller_id(), workflow), None)
        try:
            return await self.client.close_workflow(workflow)
        except CoordinatorError as exc:
            raise from_coordinator(exc, {"workflow_id": HEADER_WORKFLOW}) from None
