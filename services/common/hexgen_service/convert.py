"""Protobuf <-> domain conversion: the one place where messages meet the core's objects.

Requests are validated here, and a bad field raises `InvalidFieldError` naming its path,
which the services turn into INVALID_ARGUMENT. No protobuf message goes past this module
into a policy.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass

from hexgen_api.v1 import coordinator_pb2, worker_pb2, workflow_pb2
from hexgen_flow.errors import WorkloadError
from hexgen_flow.runtime import CallTicket
from hexgen_flow.templates import template
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow, canonical_step
from hexgen_service.errors import InvalidFieldError
from hexgen_wire.convert import submit_from_query, workflow_to_proto  # the wire contract

__all__ = [
    "MAX_BYTES_PER_TOKEN",
    "MAX_CALLS_PER_QUERY",
    "MAX_TOKENS_PER_CALL",
    "SubmitLimits",
    "check_declared_tokens",
    "check_text",
    "dispatch_to_ticket",
    "expand_workflow",
    "name_problem",
    "parse_submit",
    "query_from_submit",
    "stage_names",
    "submit_from_query",
    "template_to_proto",
    "without_prompts",
    "workflow_from_proto",
    "workflow_to_proto",
]

# Guards against a request that would take the coordinator down rather than be served.
MAX_CALLS_PER_QUERY = 10_000
MAX_TOKENS_PER_CALL = 10_000_000
MAX_ID_CHARACTERS = 256
MAX_BYTES_PER_TOKEN = 128
"""The most UTF-8 bytes of prompt one token is taken to cover when a declared token count
is checked against its prompt without a tokenizer: far beyond any real text (about 4 bytes
a token in English, fewer in code and most other languages) and beyond the longest tokens
of byte-level BPE vocabularies (runs of separators), so an honest count always passes and
a count that claims a 1 MiB prompt is 10 tokens does not."""

# C0 and C1 control characters (NUL, newlines, escapes, DEL): never part of an id or name.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})
"""Unicode categories never part of an id or name either: control (Cc), format (Cf: bidi
overrides such as U+202E, zero-width characters such as U+200B), line and paragraph
separators (Zl, Zp), surrogates (Cs), private use (Co) and unassigned (Cn): characters that
are invisible, or that make a name display as another one."""


def name_problem(value: str) -> str | None:
    """Why `value` cannot be an id or a name (one line; a character is named by its code
    point, never written out), or None: a character of `_REFUSED_CATEGORIES`, or leading or
    trailing whitespace (``'default '`` would be another tenant than ``'default'``)."""
    if value.isascii():
        found = _CONTROL.search(value)
        bad = found.group() if found is not None else None
    else:
        bad = next((c for c in value if unicodedata.category(c) in _REFUSED_CATEGORIES), None)
    if bad is not None:
        name = unicodedata.name(bad, "")
        what = f"U+{ord(bad):04X}{' ' + name if name else ''}, {unicodedata.category(bad)}"
        return f"must not contain control characters or invisible formatting ({what})"
    if value != value.strip():
        return "must not start or end with whitespace"
    return None


@dataclass(frozen=True, slots=True)
class SubmitLimits:
    """How large a submission may be. The defaults are what `parse_submit` has always
    accepted (a query stored by an earlier coordinator parses again); the coordinator
    passes its own (`--max-calls`, `--max-prompt-bytes`, ...). Sizes of strings are UTF-8
    bytes, except `max_id_chars`."""

    max_calls: int = MAX_CALLS_PER_QUERY
    """Calls of the workflow, repeats unrolled."""
    max_stages: int = MAX_CALLS_PER_QUERY
    """Stages of the workflow, repeats unrolled."""
    max_prompt_bytes: int | None = None
    """Largest prompt of one call; None: no limit."""
    max_id_bytes: int | None = None
    """Longest query id (and stage id, step name); None: only `max_id_chars`."""
    max_id_chars: int = MAX_ID_CHARACTERS
    max_tenant_bytes: int | None = None
    """Longest tenant name; None: no limit."""
    max_slo_s: float = math.inf
    """Largest slo_s."""
    allow_control_characters: bool = True
    """Whether ids, tenant, stage ids and step names may hold control characters (NUL,
    newlines, ...), invisible or bidi formatting characters, and leading or trailing
    whitespace (`name_problem`). The default allows them: stored submissions, checked by
    the coordinator that took them, parse again as they are."""


DEFAULT_LIMITS = SubmitLimits()


def check_text(field: str, value: str, max_bytes: int | None, limits: SubmitLimits) -> None:
    """`InvalidFieldError` on `field` when `value` is longer than `max_bytes` (UTF-8) or,
    unless `limits` allow control characters, is no usable name (`name_problem`)."""
    if max_bytes is not None:
        size = len(value.encode("utf-8"))
        if size > max_bytes:
            raise InvalidFieldError(field, f"must be at most {max_bytes} bytes, got {size}")
    if not limits.allow_control_characters:
        problem = name_problem(value)
        if problem is not None:
            raise InvalidFieldError(field, problem)


def check_declared_tokens(field: str, input_tokens: int, prompt_bytes: int) -> None:
    """`InvalidFieldError` on `field` when `input_tokens` is fewer than a prompt of
    `prompt_bytes` UTF-8 bytes can hold (`MAX_BYTES_PER_TOKEN`): admission plans with the
    declared size, so a count far below the prompt would let a large call in as a small
    one."""
    least = -(-prompt_bytes // MAX_BYTES_PER_TOKEN)
    if input_tokens < least:
        raise InvalidFieldError(
            field,
            f"{input_tokens} tokens cannot cover a prompt of {prompt_bytes} bytes (at least "
            f"{least} at {MAX_BYTES_PER_TOKEN} bytes a token): give the prompt's real token "
            "count",
        )


def workflow_from_proto(pb: workflow_pb2.Workflow, field: str = "workflow") -> Workflow:
    """Validate and expand a proto workflow (repeats unrolled) into the domain model."""
    return expand_workflow(pb, field)[0]


def expand_workflow(
    pb: workflow_pb2.Workflow, field: str = "workflow", limits: SubmitLimits = DEFAULT_LIMITS
) -> tuple[Workflow, list[tuple[str, ...]]]:
    """The domain workflow and, per expanded stage, the prompts of its calls ("" if none)."""
    if not pb.stages:
        raise InvalidFieldError(f"{field}.stages", "a workflow needs at least one stage")
    stages: list[Stage] = []
    prompts: list[tuple[str, ...]] = []
    last_of: dict[str, int] = {}
    total_calls = 0
    max_calls = min(limits.max_calls, MAX_CALLS_PER_QUERY)
    max_prompt = limits.max_prompt_bytes
    for n, spb in enumerate(pb.stages):
        where = f"{field}.stages[{n}]"
        if len(stages) >= limits.max_stages:
            raise InvalidFieldError(
                f"{field}.stages", f"the workflow exceeds {limits.max_stages} stages"
            )
        check_text(f"{where}.id", spb.id, limits.max_id_bytes, limits)
        sid = spb.id or f"#{n}"
        if sid in last_of:
            raise InvalidFieldError(f"{where}.id", f"duplicate stage id {sid!r}")
        if not spb.step:
            raise InvalidFieldError(f"{where}.step", "must not be empty")
        check_text(f"{where}.step", spb.step, limits.max_id_bytes, limits)
        if not spb.calls:
            raise InvalidFieldError(f"{where}.calls", "a stage needs at least one call")
        if len(spb.calls) > max_calls:
            raise InvalidFieldError(f"{where}.calls", f"the workflow exceeds {max_calls} calls")
        if spb.repeat < 0:
            raise InvalidFieldError(f"{where}.repeat", f"must be >= 0, got {spb.repeat}")
        step = canonical_step(spb.step)
        calls = []
        for c, cpb in enumerate(spb.calls):
            cwhere = f"{where}.calls[{c}]"
            for name in ("input_tokens", "output_tokens"):
                value = getattr(cpb, name)
                if not 1 <= value <= MAX_TOKENS_PER_CALL:
                    raise InvalidFieldError(
                        f"{cwhere}.{name}", f"must be in [1, {MAX_TOKENS_PER_CALL}], got {value}"
                    )
            if cpb.step:
                check_text(f"{cwhere}.step", cpb.step, limits.max_id_bytes, limits)
            if cpb.messages:
                raise InvalidFieldError(
                    f"{cwhere}.messages",
                    "chat messages are given with RunCall (a workflow session); give a prompt",
                )
            if max_prompt is not None and len(cpb.prompt) > max_prompt // 4:
                size = len(cpb.prompt.encode("utf-8"))
                if size > max_prompt:
                    raise InvalidFieldError(
                        f"{cwhere}.prompt", f"must be at most {max_prompt} bytes, got {size}"
                    )
            calls.append(
                LLMCall(
                    canonical_step(cpb.step) if cpb.step else step,
                    cpb.input_tokens,
                    cpb.output_tokens,
                )
            )
        after = []
        for a, dep in enumerate(spb.after):
            if dep not in last_of:
                raise InvalidFieldError(
                    f"{where}.after[{a}]", f"{dep!r} is not the id of an earlier stage"
                )
            after.append(last_of[dep])
        deps = tuple(sorted(set(after)))
        stage_prompts = tuple(cpb.prompt for cpb in spb.calls)
        for _ in range(max(spb.repeat, 1)):
            total_calls += len(calls)
            if total_calls > max_calls:
                raise InvalidFieldError(
                    f"{where}.repeat" if spb.repeat > 1 else f"{where}.calls",
                    f"the workflow exceeds {max_calls} calls",
                )
            if len(stages) >= limits.max_stages:
                raise InvalidFieldError(
                    f"{where}.repeat", f"the workflow exceeds {limits.max_stages} stages"
                )
            stages.append(Stage(step=step, calls=tuple(calls), after=deps))
            prompts.append(stage_prompts)
            deps = (len(stages) - 1,)
        last_of[sid] = len(stages) - 1
    try:
        return Workflow(tuple(stages)), prompts
    except WorkloadError as exc:
        raise InvalidFieldError(field, str(exc)) from None


def stage_names(pb: workflow_pb2.Workflow) -> list[str]:
    """The name of each expanded stage (repeats unrolled): its id, else its step. A call of a
    workflow session names its stage by it."""
    names: list[str] = []
    for spb in pb.stages:
        names += [spb.id or canonical_step(spb.step)] * max(spb.repeat, 1)
    return names


def template_to_proto(name: str, field: str = "template") -> workflow_pb2.Workflow:
    """A named template's expected workflow (`hexgen_flow.templates`); an unknown name is
    an `InvalidFieldError` on `field` that lists the known ones."""
    try:
        stages = template(name)
    except KeyError as exc:
        raise InvalidFieldError(field, str(exc.args[0])) from None
    return workflow_pb2.Workflow(
        stages=[
            workflow_pb2.Stage(
                id=stage.name,
                step=stage.step,
                after=list(stage.after),
                repeat=stage.repeat,
                calls=[
                    workflow_pb2.LLMCall(
                        input_tokens=stage.tokens[0], output_tokens=stage.tokens[1]
                    )
                    for _ in range(stage.calls)
                ],
            )
            for stage in stages
        ]
    )


def query_from_submit(request: coordinator_pb2.SubmitQueryRequest) -> Query:
    """The domain query of a submission (its SLO is resolved by the coordinator)."""
    return parse_submit(request)[0]


def parse_submit(
    request: coordinator_pb2.SubmitQueryRequest, limits: SubmitLimits = DEFAULT_LIMITS
) -> tuple[Query, list[tuple[str, ...]]]:
    """The domain query of a submission and, per expanded stage, its calls' prompts;
    `InvalidFieldError` naming the first field outside `limits` (default: what the
    coordinator has always accepted)."""
    if not request.query_id:
        raise InvalidFieldError("query_id", "must not be empty (it is the idempotency key)")
    if len(request.query_id) > limits.max_id_chars:
        raise InvalidFieldError("query_id", f"must be at most {limits.max_id_chars} characters")
    check_text("query_id", request.query_id, limits.max_id_bytes, limits)
    check_text("tenant", request.tenant, limits.max_tenant_bytes, limits)
    for name in ("slo_s", "slo_scale"):
        value = getattr(request, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidFieldError(name, f"must be a finite number >= 0, got {value}")
    if request.slo_s > limits.max_slo_s:
        raise InvalidFieldError(
            "slo_s", f"must be at most {limits.max_slo_s:g} s, got {request.slo_s:g}"
        )
    if request.slo_s and request.slo_scale:
        raise InvalidFieldError("slo_s", "give slo_s or slo_scale, not both")
    if not request.HasField("workflow"):
        raise InvalidFieldError("workflow", "is required")
    workflow, prompts = expand_workflow(request.workflow, "workflow", limits)
    try:
        query = Query(
            query_id=request.query_id,
            workflow=workflow,
            tenant=request.tenant or "default",
            slo_s=request.slo_s or None,
            slo_scale=request.slo_scale or None,
        )
    except WorkloadError as exc:  # e.g. a denormal SLO that is not > 0
        raise InvalidFieldError("query", str(exc)) from None
    return query, prompts


def without_prompts(request: coordinator_pb2.SubmitQueryRequest) -> bytes:
    """The submission's bytes with every prompt emptied: its shape, which is all that a
    replay of the workflow (the tuner's window) needs, at a fraction of the size."""
    shape = coordinator_pb2.SubmitQueryRequest()
    shape.CopyFrom(request)
    for stage in shape.workflow.stages:
        for call in stage.calls:
            call.prompt = ""
    return shape.SerializeToString()


def dispatch_to_ticket(pb: worker_pb2.DispatchCall) -> CallTicket:
    """The worker-side ticket of a dispatched call."""
    return CallTicket.detached(
        seq=pb.sequence,
        call_id=pb.call_id,
        query_id=pb.query_id,
        query_seq=pb.query_sequence,
        tenant=pb.tenant,
        stage=pb.stage,
        # planned with what the coordinator believes it generates (`expected_output_tokens`,
        # 0 when that is the declared); the engine runs `output_tokens` (below)
        call=LLMCall(pb.step, pb.input_tokens, pb.expected_output_tokens or pb.output_tokens),
        released_s=pb.released_s,
        deadline_s=pb.deadline_s,
        query_deadline_s=pb.query_deadline_s,
        remaining_after_s=pb.remaining_after_s,
        attempt=pb.attempt,
        # 0 (absent) from a coordinator older than the field; a weight is positive
        weight=pb.weight if math.isfinite(pb.weight) and pb.weight > 0 else 1.0,
        output_tokens=pb.output_tokens,
    )
