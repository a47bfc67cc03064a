"""`python -m hexgen_coordinator.check_state`: an fsck for the workflow state in Redis.

Reads every key under the prefix (`hexgen_service.redis_schema` owns the layout) and
counts what should never happen:

- duplicate completions: a query counted down more often than it has completed calls (a
  call applied twice), a count below zero, or a call twice in the `completions` stream;
- missing completions: completed calls that were not counted, or a succeeded query whose
  calls are not all complete;
- stuck queries: a running query the `active` set does not list (no coordinator would
  resume it), an `active` id with no running query, and, with ``--stuck-after-s``, a query
  still running that long (cluster seconds) after it arrived;
- orphan keys: a finished query or event log that never expires, an event log without its
  query, and keys under the prefix that belong to nothing;
- stale prompts: a prompt kept for a call that completed, or for a query that is not
  running (no prompt may outlive its call, nor any its query).

Exit status: 0 when the last five are all zero, 1 otherwise, 2 for bad usage or no Redis.
``hexgen-flow check-state`` runs this module. With ``--redis-cluster`` the URL names a node of
a Redis Cluster, and the keys are scanned on every master.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import cast

import redis
from redis.exceptions import RedisClusterException

from hexgen_coordinator.redis_retry import cluster_prefix
from hexgen_flow.errors import HexgenFlowError
from hexgen_service import redis_schema as schema
from hexgen_service.auth import read_secret
from hexgen_service.redis_schema import DEFAULT_PREFIX, F, M, S
from hexgen_service.redis_sentinel import (
    REDIS_URL_HELP,
    check_redis_url,
    parse_sentinel_url,
    sync_master,
)

__all__ = ["StateReport", "check_state", "main"]

_FIXED = schema.COORDINATOR_KEYS
"""The coordinator's fixed keys (`hexgen_service.redis_schema`)."""
_TUNER = schema.TUNER_KEYS
"""The tuner's keys under the same prefix (a capped list and a counter)."""
_RETIRED = schema.RETIRED_KEYS
"""Keys an older version wrote and nothing reads (harmless: not orphans)."""


@dataclass
class StateReport:
    queries: int = 0
    calls: int = 0
    running: int = 0
    duplicate_completions: int = 0
    missing_completions: int = 0
    stuck_queries: int = 0
    orphan_keys: int = 0
    kept_prompts: int = 0
    """Prompts kept for calls that may still run (what a crash would redispatch)."""
    stale_prompts: int = 0
    """Prompts kept for a call that completed or a query that is not running."""
    problems: list[str] = field(default_factory=list)
    """One line per finding (at most 50 kept)."""

    @property
    def clean(self) -> bool:
        return not (
            self.duplicate_completions
            or self.missing_completions
            or self.stuck_queries
            or self.orphan_keys
            or self.stale_prompts
        )

    def note(self, line: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(line)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def check_state(
    client: redis.Redis[bytes], prefix: str, stuck_after_s: float | None
) -> StateReport:
    report = StateReport()
    fixed = {prefix + name for name in (*_FIXED, *_TUNER, *_RETIRED)}
    queries: list[str] = []
    logs: list[str] = []
    kept: list[str] = []
    for raw in client.scan_iter(match=_escape(prefix) + "*", count=1000):
        key = _text(raw)
        if key in fixed:
            continue
        where = schema.classify_key(prefix, key)
        if where is not None and where[0] == "query":
            queries.append(where[1])
        elif where is not None and where[0] == "events":
            logs.append(where[1])
        elif where is not None and where[0] == "prompts":
            kept.append(where[1])
        else:
            report.orphan_keys += 1
            report.note(f"orphan key {key!r}: not part of the layout")
    active = {_text(m) for m in client.smembers(schema.key(prefix, schema.ACTIVE))}
    meta = {_text(k): _text(v) for k, v in client.hgetall(schema.key(prefix, schema.META)).items()}
    now_s = None
    if M.EPOCH_UNIX_S in meta and M.TIME_SCALE in meta:
        now_s = (time.time() - float(meta[M.EPOCH_UNIX_S])) * float(meta[M.TIME_SCALE])
    stored: set[str] = set()
    fields_of: dict[str, dict[str, bytes]] = {}
    for query_id in queries:
        key = schema.query_key(prefix, query_id)
        kind = _text(client.type(key))  # type: ignore[no-untyped-call]
        if kind == "none":
            continue  # expired between the scan and now: nothing is wrong with that
        if kind != "hash":
            report.orphan_keys += 1
            report.note(f"orphan key {key!r}: a query key that is not a hash")
            continue
        fields = {_text(k): v for k, v in client.hgetall(key).items()}
        if not fields:
            continue  # expired between the scan and the read
        stored.add(query_id)
        fields_of[query_id] = fields
        _check_query(report, query_id, fields, client.pttl(key), active, now_s, stuck_after_s)
    for query_id in kept:
        _check_prompts(
            report, client, schema.prompts_key(prefix, query_id), fields_of.get(query_id)
        )
    for query_id in logs:
        key = schema.events_key(prefix, query_id)
        ttl = client.pttl(key)
        if query_id not in stored and ttl == -1:  # -2: expired meanwhile
            report.orphan_keys += 1
            report.note(f"orphan key {key!r}: an event log without its query")
    for query_id in active - stored:
        report.stuck_queries += 1
        report.note(f"query {query_id!r} is in the active set but not stored")
    call_id_field = schema.StreamField.CALL_ID.encode()
    seen = Counter(
        _text(entry.get(call_id_field, b""))
        # trimmed: bounded
        for _, entry in client.xrange(schema.key(prefix, schema.COMPLETIONS))
    )
    for call_id, count in seen.items():
        if call_id and count > 1:
            report.duplicate_completions += count - 1
            report.note(f"call {call_id!r} is {count} times in the completions stream")
    return report


def _check_prompts(
    report: StateReport,
    client: redis.Redis[bytes],
    key: str,
    fields: dict[str, bytes] | None,
) -> None:
    """The prompts in `key` belong to calls of a running query that have not completed."""
    calls = [_text(c) for c in client.hkeys(key)]
    if not calls:
        return  # emptied meanwhile
    state = _text(fields.get(F.STATE, b"")) if fields is not None else ""
    for call_id in calls:
        done = fields is not None and schema.is_done(
            fields.get(schema.call_field(schema.DONE, call_id))
        )
        if state == S.RUNNING and not done:
            report.kept_prompts += 1
            continue
        report.stale_prompts += 1
        why = "its call completed" if done else f"its query is {state or 'gone'}"
        report.note(f"the prompt of {call_id!r} is still kept ({key}): {why}")


def _check_query(
    report: StateReport,
    query_id: str,
    raw: dict[str, bytes],
    ttl_ms: int,
    active: set[str],
    now_s: float | None,
    stuck_after_s: float | None,
) -> None:
    if F.SUBMIT not in raw and ttl_ms != -1:
        # A write-behind that landed after its query expired (placements, events): it has
        # the retention window again and goes with it; no query is stored here.
        return
    f = {k: _text(v) for k, v in raw.items() if k not in (F.SUBMIT, F.SHAPE)}
    report.queries += 1
    try:
        state = f[F.STATE]
        total, left = int(f[F.CALLS_TOTAL]), int(f[F.CALLS_LEFT])
        stages = int(f[F.STAGES_TOTAL])
        stages_done = int(f[F.STAGES_DONE])
    except (KeyError, ValueError):
        report.orphan_keys += 1
        report.note(f"query {query_id!r}: an unreadable hash")
        return
    report.calls += total
    done = sum(
        1
        for k, v in f.items()
        if schema.parse_call_field(k, schema.DONE) is not None and schema.is_done(v)
    )
    counted = total - left
    if left < 0 or counted > done or stages_done > stages:
        report.duplicate_completions += max(counted - done, 1)
        report.note(f"query {query_id!r}: {counted} counted down, {done} calls complete")
    for k in range(stages):
        left_k = int(f.get(schema.stage_field(k, schema.STAGE_LEFT), 0))
        deps_k = int(f.get(schema.stage_field(k, schema.STAGE_DEPS), 0))
        if left_k < 0 or deps_k < 0:
            report.duplicate_completions += 1
            report.note(f"query {query_id!r}: stage {k} counted below zero")
    if done > counted:
        report.missing_completions += done - counted
        report.note(f"query {query_id!r}: {done} calls complete, {counted} counted down")
    if state == S.SUCCEEDED and (left != 0 or done != total):
        report.missing_completions += max(left, total - done, 1)
        report.note(f"query {query_id!r} succeeded with {done} of {total} calls complete")
    if state == S.RUNNING:
        report.running += 1
        if query_id not in active:
            report.stuck_queries += 1
            report.note(f"query {query_id!r} runs but is not in the active set")
        elif stuck_after_s is not None and now_s is not None:
            age = now_s - float(f.get(F.ARRIVAL_S, now_s))
            if age > stuck_after_s:
                report.stuck_queries += 1
                report.note(f"query {query_id!r} still runs {age:.0f} s after it arrived")
    elif ttl_ms == -1:  # -2: it expired while we read it
        report.orphan_keys += 1
        report.note(f"query {query_id!r} ended {state} and never expires")
    elif query_id in active:
        report.stuck_queries += 1
        report.note(f"query {query_id!r} ended {state} but is still in the active set")


def _client(url: str, password: str | None, *, cluster: bool) -> redis.Redis[bytes]:
    """A client of the Redis at `url`, or of the Redis Cluster `url` is a node of (typed as
    a plain client: it answers every command the check sends, its SCAN on every master)."""
    if cluster:
        return cast(
            "redis.Redis[bytes]",
            redis.RedisCluster.from_url(url, socket_connect_timeout=5, password=password),
        )
    sentinel = parse_sentinel_url(url)
    if sentinel is not None:  # the master the Sentinels name
        return sync_master(sentinel, password=password, socket_connect_timeout=5)
    plain: redis.Redis[bytes] = redis.Redis.from_url(
        url, socket_connect_timeout=5, password=password
    )
    return plain


def _escape(prefix: str) -> str:
    """`prefix` as a literal SCAN pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in prefix)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]  # exits, one line
        sys.stderr.write(f"hexgen-flow check-state: error: {message}\n")
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="hexgen-flow check-state", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/0",
        help=f"{REDIS_URL_HELP} (default %(default)s)",
    )
    parser.add_argument(
        "--prefix",
        default=None,
        help="the coordinator's --redis-prefix (default hf:, with --redis-cluster hf:{0}:)",
    )
    parser.add_argument(
        "--redis-cluster",
        action="store_true",
        help="--redis-url is a node of a Redis Cluster (SCAN goes over every master)",
    )
    parser.add_argument(
        "--stuck-after-s",
        type=float,
        default=None,
        help="also count queries running longer than this (cluster seconds) as stuck",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--redis-password-file",
        default=None,
        help="the password of the Redis user in --redis-url (redis://USER@HOST:PORT/DB)",
    )
    args = parser.parse_args(argv)
    password = None
    try:
        check_redis_url(args.redis_url, cluster=args.redis_cluster)
        prefix = cluster_prefix(args.prefix, DEFAULT_PREFIX, cluster=args.redis_cluster)
        if args.redis_password_file:
            password = read_secret(args.redis_password_file, "--redis-password-file")
    except HexgenFlowError as exc:
        parser.error(str(exc))
    try:
        client = _client(args.redis_url, password, cluster=args.redis_cluster)
        try:
            report = check_state(client, prefix, args.stuck_after_s)
        finally:
            client.close()
    except (redis.exceptions.ConnectionError, RedisClusterException) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        sys.stderr.write(
            f"hexgen-flow check-state: error: cannot reach {args.redis_url}: {message}\n"
        )
        return 2
    if args.json:
        print(json.dumps(asdict(report)))
    else:
        print(
            f"{report.queries} queries ({report.running} running), {report.calls} calls: "
            f"{report.duplicate_completions} duplicate completions, "
            f"{report.missing_completions} missing, {report.stuck_queries} stuck queries, "
            f"{report.orphan_keys} orphan keys, {report.stale_prompts} stale prompts "
            f"({report.kept_prompts} kept)"
        )
        for line in report.problems:
            print(f"  {line}")
        print("clean" if report.clean else "NOT clean")
    return 0 if report.clean else 1


if __name__ == "__main__":
    sys.exit(main())
