"""The mesh's Redis layout, in one place: every key name, hash field, per-call field format
and stream entry the coordinator writes and the coordinator, check-state and the tuner read.

Pure names and functions (no Redis client): the coordinator's async store
(`hexgen_coordinator.store`, `hexgen_coordinator.session_store`), its recovery and views,
the synchronous checker (`hexgen_coordinator.check_state`) and the tuner
(`hexgen_tuner.window`, `hexgen_tuner.store`) all spell the layout through this module.
Nothing here may be renamed: existing Redis data must stay readable.

Key layout (every key starts with the configured prefix P, default ``hf:``)::

    P meta                 hash   epoch_unix_s, time_scale, alpha
    P qseq                 string arrival counter of queries (query_seq)
    P active               set    ids of running queries (what a restarted coordinator resumes)
    P q:{id}               hash   the query: submit (SubmitQueryRequest bytes without its
                                  prompts), shape (the same, what the streams keep),
                                  digest (SHA-256 of its prompts: what a resubmission of
                                  the same id is matched against), tenant, index, arrival_s, slo_s,
                                  deadline_s, state, reason, finished_s, calls_total,
                                  calls_left, stages_total, stages_done, trace (the
                                  W3C traceparent of the workflow's root span),
                                  best_effort ("1" if admitted best-effort);
                                  per stage k: s{k}:left, s{k}:deps, s{k}:rel, s{k}:fin, s{k}:dl;
                                  per call: p:{call_id} = "slot:seq:attempt", where it was
                                  last dispatched; c:{call_id} = "done" once complete
                                  ("skipped": a session's call never given);
                                  f:{call_id} = failed attempts; a workflow session's
                                  fields (session, idle_s, g:{call_id}, x:{k}, z:{k}): see
                                  `hexgen_coordinator.session_store`
    P ev:{id}              list   the query's events (QueryEvent bytes), in order
    P pr:{id}              hash   call_id -> the call's prompt (LLMCall bytes: prompt and chat
                                  messages), only while the call may still run: the
                                  completion of a call drops its prompt, the end of the query
                                  (succeeded, failed, cancelled) drops them all
    P completions          stream one entry per finished call (`CompletionEntry`)
    P admitted             stream one entry per admitted workflow declared whole, with its
                                  shape (`AdmittedEntry`: what the tuner replays: its window
                                  is the latest admitted queries, finished or not)
    P finished             stream one entry per finished query, with its shape
                                  (`FinishedEntry`: a workflow session's shape is known
                                  only here)
    P alpha:history        list   JSON of the latest alpha changes (`AlphaChange`): the mesh's
                                  one α history, the coordinator's (every change it
                                  applies; the tuner reads it through the coordinator's
                                  GetAlphaHistory RPC, never here)
    P learned              hash   instance name -> JSON of its cost learner's state (with
                                  --learn-costs: what a restarted coordinator carries on from)
    P lengths              hash   step type -> JSON list of its recent output lengths (with
                                  --output-lengths learned: what a restarted coordinator
                                  believes from)
    P lease                string a coordinator shard's lease (`hexgen_coordinator.shards`)
    P tuner:runs           list   the tuner's runs (JSON), newest first, capped
    P tuner:run_seq        string the counter behind the tuner's run ids

A key an older version wrote and nothing reads any more (`RETIRED_KEYS`: an older tuner's
own α history, ``P tuner:alpha_history``) is harmless: it is left as it was (the tuner's
Redis user may not delete it), takes no part in anything, and check-state counts it as part
of the layout, not as an orphan; ``DEL`` it by hand at leisure.

No id can make two keys collide: a query's keys sit in different namespaces (``q:``,
``ev:``, ``pr:``), and none can spell a fixed key.

The Lua scripts of `hexgen_coordinator.store` and `hexgen_coordinator.session_store` spell
field names inside their text; every string literal they use is one `LUA_LITERALS` declares
(tests/test_redis_schema.py checks it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

__all__ = [
    "ACTIVE",
    "ADMITTED",
    "ADMITTED_FIELDS",
    "ALPHA_HISTORY",
    "BEST_EFFORT_YES",
    "CALL_DONE",
    "CALL_SKIPPED",
    "CLUSTER_PREFIX",
    "COMPLETIONS",
    "COMPLETION_FIELDS",
    "COORDINATOR_KEYS",
    "DEFAULT_PREFIX",
    "FINISHED",
    "FINISHED_FIELDS",
    "LEARNED",
    "LEASE",
    "LENGTHS",
    "LUA_LITERALS",
    "META",
    "QSEQ",
    "QUERY_FIELDS",
    "RETIRED_KEYS",
    "TUNER_KEYS",
    "TUNER_NS",
    "TUNER_RUNS",
    "TUNER_RUN_SEQ",
    "AdmittedEntry",
    "AlphaChange",
    "CompletionEntry",
    "F",
    "FinishedEntry",
    "M",
    "Placement",
    "S",
    "call_field",
    "classify_key",
    "decode_admitted",
    "decode_alpha_change",
    "decode_completion",
    "decode_finished",
    "decode_query_entry",
    "encode_alpha_change",
    "encode_completion",
    "events_key",
    "field_pattern",
    "format_placement",
    "is_done",
    "key",
    "parse_call_field",
    "parse_placement",
    "parse_stage_field",
    "prompts_key",
    "query_key",
    "stage_field",
]

# ---------------------------------------------------------------------------- prefixes

DEFAULT_PREFIX: Final = "hf:"
"""The key prefix on a single Redis when none is given."""
CLUSTER_PREFIX: Final = "hf:{0}:"
"""The key prefix on a Redis Cluster when none is given: ``hf:`` with a hash tag."""

# ---------------------------------------------------------------------------- fixed keys

META: Final = "meta"
QSEQ: Final = "qseq"
ACTIVE: Final = "active"
COMPLETIONS: Final = "completions"
ADMITTED: Final = "admitted"
FINISHED: Final = "finished"
ALPHA_HISTORY: Final = "alpha:history"
LEARNED: Final = "learned"
"""The cost learners' states (--learn-costs)."""
LENGTHS: Final = "lengths"
"""The output-length belief's recent lengths (--output-lengths learned)."""
LEASE: Final = "lease"
"""A coordinator shard's lease (`hexgen_coordinator.shards`)."""

COORDINATOR_KEYS: Final = (
    META,
    QSEQ,
    ACTIVE,
    COMPLETIONS,
    ADMITTED,
    FINISHED,
    ALPHA_HISTORY,
    LEARNED,
    LENGTHS,
    LEASE,
)
"""The coordinator's fixed keys (names after the prefix)."""

TUNER_NS: Final = "tuner:"
"""Every tuner key starts with it (its Redis ACL user's pattern: ``P tuner:*``)."""
TUNER_RUNS: Final = TUNER_NS + "runs"
TUNER_RUN_SEQ: Final = TUNER_NS + "run_seq"
TUNER_KEYS: Final = (TUNER_RUNS, TUNER_RUN_SEQ)
"""The tuner's keys under the same prefix (a capped list and a counter)."""

RETIRED_KEYS: Final = (TUNER_NS + "alpha_history",)
"""Fixed keys an older version wrote that nothing writes or reads any more: an older tuner's
own α history (the coordinator's ``alpha:history`` is the one history now). One left in
Redis is harmless; `classify_key` names it ("retired", name), so check-state does not count
it as an orphan."""

# ---------------------------------------------------------------------------- a query's keys

QUERY_NS: Final = "q:"
EVENTS_NS: Final = "ev:"
PROMPTS_NS: Final = "pr:"
_QUERY_KINDS: Final = {QUERY_NS: "query", EVENTS_NS: "events", PROMPTS_NS: "prompts"}


def key(prefix: str, name: str) -> str:
    """A fixed key (`COORDINATOR_KEYS`, `TUNER_KEYS`) under `prefix`."""
    return prefix + name


def query_key(prefix: str, query_id: str) -> str:
    """``P q:{id}``: the query's hash."""
    return f"{prefix}{QUERY_NS}{query_id}"


def events_key(prefix: str, query_id: str) -> str:
    """``P ev:{id}``: the query's event log."""
    return f"{prefix}{EVENTS_NS}{query_id}"


def prompts_key(prefix: str, query_id: str) -> str:
    """``P pr:{id}``: the prompts of its calls that may still run."""
    return f"{prefix}{PROMPTS_NS}{query_id}"


def classify_key(prefix: str, name: str) -> tuple[str, str] | None:
    """What the key `name` is in the layout under `prefix`: ("fixed", its name) for a fixed
    key (the coordinator's or the tuner's), ("retired", its name) for one of `RETIRED_KEYS`,
    ("query" | "events" | "prompts", query id) for a query's; None for a key under the
    prefix that belongs to nothing (or not under it)."""
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix) :]
    if rest in COORDINATOR_KEYS or rest in TUNER_KEYS:
        return ("fixed", rest)
    if rest in RETIRED_KEYS:
        return ("retired", rest)
    for ns, kind in _QUERY_KINDS.items():
        if rest.startswith(ns):
            return (kind, rest[len(ns) :])
    return None


# ---------------------------------------------------------------------------- a query's hash


class F:
    """The fields of a query's hash ``P q:{id}`` (`QUERY_FIELDS`)."""

    SUBMIT: Final = "submit"
    SHAPE: Final = "shape"
    DIGEST: Final = "digest"
    TENANT: Final = "tenant"
    INDEX: Final = "index"
    ARRIVAL_S: Final = "arrival_s"
    SLO_S: Final = "slo_s"
    DEADLINE_S: Final = "deadline_s"
    STATE: Final = "state"
    REASON: Final = "reason"
    FINISHED_S: Final = "finished_s"
    CALLS_TOTAL: Final = "calls_total"
    CALLS_LEFT: Final = "calls_left"
    STAGES_TOTAL: Final = "stages_total"
    STAGES_DONE: Final = "stages_done"
    SESSION: Final = "session"
    """A workflow session's: "open" while it takes calls, then "closed"."""
    IDLE_S: Final = "idle_s"
    """A workflow session's idle timeout, wall seconds."""
    TRACE: Final = "trace"
    """The W3C traceparent of the query's root span (its coordinator ``query`` span): the
    spans of every later request, call and coordinator are parented into its trace (absent
    in a query stored before it was kept)."""
    BEST_EFFORT: Final = "best_effort"
    """`BEST_EFFORT_YES` for a query admitted best-effort (absent otherwise): a restarted
    coordinator runs it after every query held to its SLO, as the one before did."""


BEST_EFFORT_YES: Final = "1"
"""A best-effort query's ``best_effort`` field."""

QUERY_FIELDS: Final = frozenset(v for k, v in vars(F).items() if k.isupper() and isinstance(v, str))
"""Every fixed field name of a query's hash."""


class S:
    """The values of a query's ``state`` and of a session's ``session`` field."""

    RUNNING: Final = "running"
    SUCCEEDED: Final = "succeeded"
    CANCELLED: Final = "cancelled"
    FAILED: Final = "failed"
    OPEN: Final = "open"
    CLOSED: Final = "closed"


STAGE: Final = "s"
"""A stage field is ``s{k}:{name}``, name one of `STAGE_FIELDS`."""
STAGE_LEFT: Final = "left"
STAGE_DEPS: Final = "deps"
STAGE_REL: Final = "rel"
STAGE_FIN: Final = "fin"
STAGE_DL: Final = "dl"
STAGE_FIELDS: Final = (STAGE_LEFT, STAGE_DEPS, STAGE_REL, STAGE_FIN, STAGE_DL)
"""Per stage: calls left, dependencies left, released at, finished at, deadline."""


def stage_field(k: int, name: str) -> str:
    """``s{k}:{name}`` (name one of `STAGE_FIELDS`)."""
    return f"{STAGE}{k}:{name}"


def parse_stage_field(name: str) -> tuple[int, str] | None:
    """(k, field name) of a stage field ``s{k}:{name}``; None for anything else."""
    if not name.startswith(STAGE):
        return None
    k, sep, what = name[len(STAGE) :].partition(":")
    if not sep or not k.isdigit() or what not in STAGE_FIELDS:
        return None
    return int(k), what


PLACED: Final = "p:"
"""``p:{call_id}`` = "slot:seq:attempt": where the call was last dispatched (`Placement`)."""
DONE: Final = "c:"
"""``c:{call_id}`` = "done" once complete, "skipped" for a session's call never given."""
FAILURES: Final = "f:"
"""``f:{call_id}`` = failed attempts."""
GIVEN: Final = "g:"
"""A session's ``g:{call_id}``: a given call (LLMCall bytes in base64, no prompt)."""
STAGE_NAME: Final = "x:"
"""A session's ``x:{k}``: the name of stage k, added by a call the workflow did not expect."""
STAGE_CLOSED: Final = "z:"
"""A session's ``z:{k}`` = "1": stage k takes no more calls."""
STAGE_CLOSED_YES: Final = "1"
CALL_NAMESPACES: Final = (PLACED, DONE, FAILURES, GIVEN, STAGE_NAME, STAGE_CLOSED)
"""The per-call (and a session's per-stage) field namespaces: ``{ns}{call_id or k}``."""

CALL_DONE: Final = "done"
CALL_SKIPPED: Final = "skipped"
SESSION_CALL: Final = "/session"
"""``c:{query_id}/session``: the one call an open session holds (done when it closes)."""


def call_field(ns: str, which: str | int) -> str:
    """``{ns}{which}`` (ns one of `CALL_NAMESPACES`: a call id, or a session's stage)."""
    return f"{ns}{which}"


def parse_call_field(name: str, ns: str) -> str | None:
    """The call id (or stage) of a ``{ns}{...}`` field; None if `name` is not one."""
    return name[len(ns) :] if name.startswith(ns) else None


def is_done(value: str | bytes | None) -> bool:
    """Whether a ``c:{call_id}`` value says the call is over (done, or skipped)."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value in (CALL_DONE, CALL_SKIPPED)


def field_pattern(name: str) -> str | None:
    """The declared pattern a field of a query's hash matches (``"state"``,
    ``"s{k}:left"``, ``"p:{call_id}"``, ...); None for a field the layout does not know."""
    if name in QUERY_FIELDS:
        return name
    stage = parse_stage_field(name)
    if stage is not None:
        return f"{STAGE}{{k}}:{stage[1]}"
    for ns in CALL_NAMESPACES:
        rest = parse_call_field(name, ns)
        if rest:
            which = "{k}" if ns in (STAGE_NAME, STAGE_CLOSED) else "{call_id}"
            if which == "{k}" and not rest.isdigit():
                return None
            return ns + which
    return None


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a call was dispatched: a slot, the call's release order, the attempt."""

    slot: int
    seq: int
    attempt: int

    def encode(self) -> str:
        return format_placement(self)


def format_placement(placement: Placement) -> str:
    """A ``p:{call_id}`` value: ``"slot:seq:attempt"``."""
    return f"{placement.slot}:{placement.seq}:{placement.attempt}"


def parse_placement(value: str) -> Placement | None:
    """A p:{id} field's placement (``"slot:seq"`` of an older layout: attempt 0); None for
    anything unreadable."""
    parts = value.split(":")
    if len(parts) not in (2, 3):
        return None
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        return None
    return Placement(nums[0], nums[1], nums[2] if len(nums) == 3 else 0)


PLACEMENT_LUA_PATTERN: Final = "^(-?%d+):(-?%d+):?(%d*)$"
"""`parse_placement` in Lua (a string.match pattern)."""
UNPLACED_LUA_PREFIX: Final = "-1:0:"
"""A call between attempts: on no slot (``-1:0:{attempt}``)."""

# ---------------------------------------------------------------------------- meta


class M:
    """The fields of the ``meta`` hash."""

    EPOCH_UNIX_S: Final = "epoch_unix_s"
    TIME_SCALE: Final = "time_scale"
    ALPHA: Final = "alpha"


@dataclass(frozen=True, slots=True)
class AlphaChange:
    """One entry of the α history, the coordinator's ``alpha:history`` (JSON ``{"time_s",
    "alpha", "reason"}``): `time_s` on its cluster clock; the reason SetAlpha's (a tuning
    run's id when the tuner set it) or, for the α a coordinator started with, where that
    came from. (An older tuner's ``tuner:alpha_history``, `RETIRED_KEYS`, held the same
    entries with Unix times.)"""

    time_s: float
    alpha: float
    reason: str

    def to_json(self) -> str:
        return encode_alpha_change(self.time_s, self.alpha, self.reason)

    @classmethod
    def from_json(cls, text: str | bytes) -> AlphaChange:
        return decode_alpha_change(text)


def encode_alpha_change(time_s: float, alpha: float, reason: str) -> str:
    """One entry of the α history (JSON; `AlphaChange`)."""
    return json.dumps({"time_s": time_s, "alpha": alpha, "reason": reason})


def decode_alpha_change(text: str | bytes) -> AlphaChange:
    """An entry `encode_alpha_change` wrote (`ValueError`, `KeyError` or `TypeError` when
    it is not one)."""
    doc = json.loads(text)
    return AlphaChange(float(doc["time_s"]), float(doc["alpha"]), str(doc["reason"]))


# ---------------------------------------------------------------------------- streams


class StreamField:
    """The field names of the streams' entries."""

    QUERY_ID: Final = "query_id"
    TENANT: Final = "tenant"
    ARRIVAL_S: Final = "arrival_s"
    SLO_S: Final = "slo_s"
    SUBMIT: Final = "submit"
    """The query's shape: SubmitQueryRequest bytes without prompts."""
    FINISHED_S: Final = "finished_s"
    CALL_ID: Final = "call_id"
    STAGE: Final = "stage"
    STEP: Final = "step"
    INPUT_TOKENS: Final = "input_tokens"
    OUTPUT_TOKENS: Final = "output_tokens"
    INSTANCE: Final = "instance"
    GPU: Final = "gpu"
    RELEASED_S: Final = "released_s"
    STARTED_S: Final = "started_s"


_SF = StreamField
ADMITTED_FIELDS: Final = (_SF.QUERY_ID, _SF.TENANT, _SF.ARRIVAL_S, _SF.SLO_S, _SF.SUBMIT)
"""An ``admitted`` entry's fields, in the order the coordinator writes them."""
FINISHED_FIELDS: Final = (
    _SF.QUERY_ID,
    _SF.TENANT,
    _SF.ARRIVAL_S,
    _SF.FINISHED_S,
    _SF.SLO_S,
    _SF.SUBMIT,
)
"""A ``finished`` entry's fields, in the order the coordinator writes them."""
COMPLETION_FIELDS: Final = (
    _SF.QUERY_ID,
    _SF.CALL_ID,
    _SF.STAGE,
    _SF.STEP,
    _SF.INPUT_TOKENS,
    _SF.OUTPUT_TOKENS,
    _SF.INSTANCE,
    _SF.GPU,
    _SF.RELEASED_S,
    _SF.STARTED_S,
    _SF.FINISHED_S,
)
"""A ``completions`` entry's fields, in the order the coordinator writes them."""

StreamFields = Mapping[bytes, bytes]
"""An entry's fields as redis-py returns them."""


@dataclass(frozen=True, slots=True)
class AdmittedEntry:
    """One entry of the ``admitted`` stream: a workflow declared whole, admitted."""

    query_id: str
    tenant: str
    arrival_s: float
    """When the coordinator admitted it, cluster seconds."""
    slo_s: float
    """The SLO the coordinator resolved for it, seconds."""
    submit: bytes
    """Its shape: SubmitQueryRequest bytes without prompts."""


@dataclass(frozen=True, slots=True)
class FinishedEntry(AdmittedEntry):
    """One entry of the ``finished`` stream: a query that succeeded (a session's shape as
    it ran)."""

    finished_s: float
    """When its last call finished, cluster seconds."""


def _text(fields: StreamFields, name: str) -> str:
    return fields.get(name.encode(), b"").decode("utf-8", "replace")


def _number(fields: StreamFields, name: str) -> float:
    raw = fields.get(name.encode())
    if raw is None:
        raise ValueError(f"field {name!r} is missing")
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(f"field {name!r} is not finite: {raw!r}")
    return value


def _submit(fields: StreamFields) -> bytes:
    submit = fields.get(_SF.SUBMIT.encode())
    if submit is None:
        raise ValueError(f"field {_SF.SUBMIT!r} is missing")
    return submit


def decode_admitted(fields: StreamFields) -> AdmittedEntry:
    """An ``admitted`` entry; ValueError naming the problem (a missing or non-finite
    field)."""
    submit = _submit(fields)
    return AdmittedEntry(
        _text(fields, _SF.QUERY_ID),
        _text(fields, _SF.TENANT),
        _number(fields, _SF.ARRIVAL_S),
        _number(fields, _SF.SLO_S),
        submit,
    )


def decode_finished(fields: StreamFields) -> FinishedEntry:
    """A ``finished`` entry; ValueError naming the problem."""
    submit = _submit(fields)
    return FinishedEntry(
        _text(fields, _SF.QUERY_ID),
        _text(fields, _SF.TENANT),
        _number(fields, _SF.ARRIVAL_S),
        _number(fields, _SF.SLO_S),
        submit,
        _number(fields, _SF.FINISHED_S),
    )


def decode_query_entry(fields: StreamFields) -> AdmittedEntry:
    """An entry of either stream: a `FinishedEntry` if it has ``finished_s``, else an
    `AdmittedEntry`; ValueError naming the problem."""
    if _SF.FINISHED_S.encode() in fields:
        return decode_finished(fields)
    return decode_admitted(fields)


@dataclass(frozen=True, slots=True)
class CompletionEntry:
    """One entry of the ``completions`` stream: a call that finished."""

    query_id: str
    call_id: str
    stage: int
    step: str
    input_tokens: int
    output_tokens: int
    instance: str
    """The instance it ran on ('' if unknown)."""
    gpu: str
    released_s: float
    started_s: float
    finished_s: float


def encode_completion(entry: CompletionEntry) -> dict[str, str | int | float]:
    """The fields of a ``completions`` entry, as the coordinator writes them (times as
    ``repr`` of the float, so they read back exactly)."""
    return {
        _SF.QUERY_ID: entry.query_id,
        _SF.CALL_ID: entry.call_id,
        _SF.STAGE: entry.stage,
        _SF.STEP: entry.step,
        _SF.INPUT_TOKENS: entry.input_tokens,
        _SF.OUTPUT_TOKENS: entry.output_tokens,
        _SF.INSTANCE: entry.instance,
        _SF.GPU: entry.gpu,
        _SF.RELEASED_S: repr(entry.released_s),
        _SF.STARTED_S: repr(entry.started_s),
        _SF.FINISHED_S: repr(entry.finished_s),
    }


def decode_completion(fields: StreamFields) -> CompletionEntry:
    """A ``completions`` entry; ValueError naming the problem."""
    try:
        return CompletionEntry(
            _text(fields, _SF.QUERY_ID),
            _text(fields, _SF.CALL_ID),
            int(_number(fields, _SF.STAGE)),
            _text(fields, _SF.STEP),
            int(_number(fields, _SF.INPUT_TOKENS)),
            int(_number(fields, _SF.OUTPUT_TOKENS)),
            _text(fields, _SF.INSTANCE),
            _text(fields, _SF.GPU),
            _number(fields, _SF.RELEASED_S),
            _number(fields, _SF.STARTED_S),
            _number(fields, _SF.FINISHED_S),
        )
    except ValueError as exc:
        raise ValueError(f"a completions entry: {exc}") from None


# ---------------------------------------------------------------------------- Lua

LUA_LITERALS: Final = frozenset(
    {
        *QUERY_FIELDS,
        *(vars(S)[k] for k in vars(S) if k.isupper()),
        STAGE,
        *(":" + name for name in STAGE_FIELDS),
        *CALL_NAMESPACES,
        CALL_DONE,
        CALL_SKIPPED,
        SESSION_CALL,
        STAGE_CLOSED_YES,
        BEST_EFFORT_YES,
        PLACEMENT_LUA_PATTERN,
        UNPLACED_LUA_PREFIX,
        *ADMITTED_FIELDS,
        *FINISHED_FIELDS,
        # the session's `give` modes (hexgen_coordinator.session_store.GiveMode)
        "replace",
        "join",
        "new",
        # script arguments: '' (none), '0' / '1' (flags)
        "",
        "0",
    }
)
"""Every string literal the coordinator's Lua scripts may spell, besides Redis command
names (upper case) and XADD's ``MAXLEN ~ *``."""
