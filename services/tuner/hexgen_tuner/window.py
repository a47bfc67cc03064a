"""The tuning window: the most recently admitted queries, rebuilt as the simulator's input.

The coordinator appends one entry per admitted workflow declared whole to the Redis stream
``P admitted`` (``query_id, tenant, arrival_s, slo_s`` in cluster seconds, as strings,
and ``submit``, the serialized `SubmitQueryRequest` without its prompts), and one entry per
finished query to ``P finished`` (the same fields and ``finished_s``): the published
contract `hexgen_service.redis_schema` declares and decodes (`decode_query_entry`). A window is the
last N queries by arrival over both streams: a declared workflow counts from the moment it
is admitted, so a change of load or mix reaches the window one query latency sooner than
through finished queries alone; a workflow session (whose calls are not known until it
has made them) counts once it has finished. Each is rebuilt as a domain `Query`
(``hexgen_service.convert.query_from_submit``) and handed to the core's
`hexgen_flow.tuning.TuningWindow.of`, which makes its SLO explicit (the one the coordinator
gave it) and its arrival time relative to the window's first arrival, so the simulator
replays the traffic as it came (the simulator's online tuner builds its windows from its
admitted queries with the same function).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from hexgen_api.v1 import coordinator_pb2
from hexgen_flow.errors import HexgenFlowError
from hexgen_flow.tuning import TuningWindow
from hexgen_flow.workload import Query
from hexgen_service import redis_schema as schema
from hexgen_service.convert import query_from_submit
from hexgen_service.errors import InvalidFieldError
from hexgen_service.redis_schema import FinishedEntry, decode_query_entry

__all__ = [
    "RecentQuery",
    "TrafficWindow",
    "admitted_key",
    "finished_key",
    "parse_entry",
    "read_sharded_window",
    "read_window",
    "window_from_entries",
]

log = logging.getLogger(__name__)

StreamEntry = tuple[bytes | str, Mapping[bytes, bytes]]
"""One entry as redis-py returns it: (entry id, {field: value})."""


def admitted_key(prefix: str) -> str:
    return schema.key(prefix, schema.ADMITTED)


def finished_key(prefix: str) -> str:
    return schema.key(prefix, schema.FINISHED)


@dataclass(frozen=True, slots=True)
class RecentQuery:
    """One entry of the ``admitted`` or the ``finished`` stream."""

    query: Query
    """The submitted query (no arrival time; its SLO as submitted)."""
    arrival_s: float
    """When the coordinator admitted it, cluster seconds."""
    finished_s: float | None
    """When its last call finished, cluster seconds; None in an ``admitted`` entry."""
    slo_s: float
    """The SLO the coordinator resolved for it, seconds."""


def parse_entry(fields: Mapping[bytes, bytes]) -> RecentQuery:
    """One entry of either stream as a `RecentQuery` (an entry without ``finished_s`` is an
    admitted one); ValueError naming the problem otherwise."""
    entry = decode_query_entry(fields)
    field = repr(schema.StreamField.SUBMIT)
    try:
        request = coordinator_pb2.SubmitQueryRequest.FromString(entry.submit)
        query = query_from_submit(request)
    except (InvalidFieldError, HexgenFlowError) as exc:
        raise ValueError(f"field {field}: {exc}") from None
    except Exception as exc:  # protobuf's DecodeError has no stable public home
        raise ValueError(f"field {field} is not a SubmitQueryRequest ({exc})") from None
    if entry.tenant:
        query = replace(query, tenant=entry.tenant)
    arrival_s, slo_s = entry.arrival_s, entry.slo_s
    finished_s = entry.finished_s if isinstance(entry, FinishedEntry) else None
    if arrival_s < 0 or (finished_s is not None and finished_s < arrival_s):
        raise ValueError(f"times out of order: arrival_s {arrival_s}, finished_s {finished_s}")
    if slo_s <= 0:
        raise ValueError(f"slo_s must be > 0, got {slo_s}")
    return RecentQuery(query, arrival_s, finished_s, slo_s)


@dataclass(frozen=True, slots=True)
class TrafficWindow:
    """Recent traffic, ready to replay."""

    tuning: TuningWindow
    """The queries as the core's tuning run takes them."""
    skipped: int = 0
    """Entries that could not be read (logged)."""

    @property
    def queries(self) -> tuple[Query, ...]:
        """In arrival order; ``arrival_s`` from the first arrival (0), ``slo_s`` explicit."""
        return self.tuning.queries

    @property
    def qps(self) -> float:
        """Arrival rate over the window: (n - 1) / (last arrival - first); 0 when undefined."""
        return self.tuning.qps

    @property
    def span_s(self) -> float:
        """Seconds from the first arrival to the last."""
        return self.tuning.span_s


def _latest(entries: Sequence[StreamEntry]) -> tuple[dict[str, RecentQuery], int]:
    """Each query id's latest readable entry (in `entries`' order), and how many entries
    could not be read (logged)."""
    latest: dict[str, RecentQuery] = {}
    skipped = 0
    for entry_id, fields in entries:
        try:
            record = parse_entry(fields)
        except ValueError as exc:
            skipped += 1
            log.warning("tuning-window entry %r skipped: %s", entry_id, exc)
            continue
        latest.pop(record.query.query_id, None)
        latest[record.query.query_id] = record
    return latest, skipped


def _window(records: Sequence[RecentQuery], size: int | None, skipped: int) -> TrafficWindow:
    ordered = sorted(records, key=lambda r: (r.arrival_s, r.query.query_id))
    if size is not None:
        ordered = ordered[-size:] if size > 0 else []
    window = TuningWindow.of((r.query, r.arrival_s, r.slo_s) for r in ordered)
    return TrafficWindow(window, skipped)


def window_from_entries(entries: Sequence[StreamEntry], size: int | None = None) -> TrafficWindow:
    """The window of `entries` (from either stream, each stream's oldest first): a query id
    seen twice keeps its latest entry (so list the ``admitted`` entries before the
    ``finished`` ones); `size`: only the last `size` queries by arrival."""
    latest, skipped = _latest(entries)
    return _window(list(latest.values()), size, skipped)


async def _entries(client: aioredis.Redis[bytes], prefix: str, size: int) -> list[StreamEntry]:
    """The last `size` entries of ``P admitted`` then of ``P finished``,
    each oldest first (a coordinator from before the ``admitted`` stream writes only the
    second)."""
    try:
        admitted = await client.xrevrange(admitted_key(prefix), count=size)
    except NoPermissionError:
        # An ACL written before the `admitted` stream existed: keep tuning on finished
        # queries (one latency late after a change) rather than not at all.
        log.warning(
            "the tuner's Redis user may not read %r (an ACL from before it): the window is "
            "the finished queries only; `hexgen-flow auth init` writes the current ACL",
            admitted_key(prefix),
        )
        admitted = []
    finished = await client.xrevrange(finished_key(prefix), count=size)
    return [*reversed(admitted), *reversed(finished)]


async def read_window(client: aioredis.Redis[bytes], prefix: str, size: int) -> TrafficWindow:
    """The last `size` queries by arrival of the last `size` entries of each stream,
    ``P admitted`` and ``P finished``."""
    return window_from_entries(await _entries(client, prefix, size), size)


async def read_sharded_window(
    client: aioredis.Redis[bytes], prefixes: Sequence[str], size: int
) -> TrafficWindow:
    """The last `size` queries by arrival over every coordinator shard's streams (the
    prefixes of ``--shards``), on one clock: each shard keeps its own (its ``meta`` hash's
    ``epoch_unix_s`` and ``time_scale``, set by its first coordinator), so every arrival is
    moved onto the first shard's clock. A shard no coordinator has started yet (no clock)
    has no traffic and is skipped. The shards run the same workers, so the window is the
    cluster's whole traffic, and the α tuned on it is every shard's."""
    clocks: list[tuple[str, float, float]] = []
    for prefix in prefixes:
        raw_epoch, raw_scale = await client.hmget(
            schema.key(prefix, schema.META), [schema.M.EPOCH_UNIX_S, schema.M.TIME_SCALE]
        )
        if raw_epoch is not None and raw_scale is not None:
            clocks.append((prefix, float(raw_epoch), float(raw_scale)))
    if not clocks:
        return _window([], size, 0)
    _, epoch0, scale0 = clocks[0]
    records: list[RecentQuery] = []
    skipped = 0
    for prefix, shard_epoch, shard_scale in clocks:
        latest, bad = _latest(await _entries(client, prefix, size))
        skipped += bad
        for r in latest.values():
            # arrival on this shard's clock -> Unix time -> the first shard's clock
            arrival = (shard_epoch + r.arrival_s / shard_scale - epoch0) * scale0
            records.append(replace(r, arrival_s=arrival))
    return _window(records, size, skipped)
