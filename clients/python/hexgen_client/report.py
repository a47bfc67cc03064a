"""Plain-text and JSON renderings of the coordinator's messages for the CLI
(``hexgen-flow ask``, ``hexgen-flow get`` and ``hexgen-flow status``)."""

from __future__ import annotations

from typing import Any

from hexgen_api.v1 import coordinator_pb2

__all__ = [
    "event_kind",
    "event_line",
    "query_json",
    "query_lines",
    "state_name",
    "status_json",
    "status_lines",
]

_TEXT_SHOWN = 60


def event_kind(kind: int) -> str:
    """``CALL_FINISHED`` for QUERY_EVENT_KIND_CALL_FINISHED (the number for unknown kinds)."""
    try:
        name = coordinator_pb2.QueryEventKind.Name(kind)  # type: ignore[arg-type]  # any int
    except ValueError:
        return str(kind)
    return name.removeprefix("QUERY_EVENT_KIND_")


def state_name(state: int) -> str:
    try:
        name = coordinator_pb2.QueryState.Name(state)  # type: ignore[arg-type]  # any int
    except ValueError:
        return str(state)
    return name.removeprefix("QUERY_STATE_")


def event_line(event: coordinator_pb2.QueryEvent) -> str:
    """One line per event: cluster time, kind, stage, call, instance, text (shortened)."""
    parts = [f"{event.time_s:10.2f} s", f"{event_kind(event.kind):<18}"]
    if event.stage >= 0 and event.kind != coordinator_pb2.QUERY_EVENT_KIND_SUBMITTED:
        parts.append(f"stage {event.stage:<3}")
    if event.call_id:
        parts.append(event.call_id)
    if event.instance:
        parts.append(f"on {event.instance}")
    if event.text:
        text = " ".join(event.text.split())
        if len(text) > _TEXT_SHOWN:
            text = text[: _TEXT_SHOWN - 1] + "…"
        parts.append(repr(text))
    return "  ".join(parts).rstrip()


def status_json(status: coordinator_pb2.ClusterStatusResponse) -> dict[str, Any]:
    return {
        "policy": status.policy,
        "alpha": status.alpha,
        "time_scale": status.time_scale,
        "now_s": status.now_s,
        "slo_base_s": status.slo_base_s,
        "queries_running": status.queries_running,
        "queries_finished": status.queries_finished,
        "queries_failed": status.queries_failed,
        "queries_rejected": status.queries_rejected,
        "retention_s": status.retention_s,
        "instances": [
            {
                "index": i.index,
                "name": i.name,
                "gpu": i.gpu,
                "model": i.model,
                "worker_id": i.worker_id,
                "connected": i.connected,
                "engine": i.engine,
                "in_flight": i.in_flight,
                "running": i.running,
                "queued": i.queued,
                "kv_used_tokens": i.kv_used_tokens,
                "kv_capacity_tokens": i.kv_capacity_tokens,
                "outstanding_s": i.outstanding_s,
                # 0 when the coordinator does not learn costs (--learn-costs)
                "learned_prefill_factor": i.learned_prefill_factor,
                "learned_decode_factor": i.learned_decode_factor,
                "learned_calls": i.learned_calls,
            }
            for i in status.instances
        ],
    }


def recent_json(status: coordinator_pb2.ClusterStatusResponse) -> dict[str, Any]:
    """The queries that ended in the coordinator's recent window, summed."""
    r = status.recent
    return {
        "window_s": r.window_s,
        "succeeded": r.succeeded,
        "slo_met": r.slo_met,
        "failed": r.failed,
        "cancelled": r.cancelled,
        "attainment": r.slo_met / r.succeeded if r.succeeded else None,
        "latency_p50_s": r.latency_s.p50 if r.latency_s.count else None,
        "latency_p99_s": r.latency_s.p99 if r.latency_s.count else None,
    }


def top_lines(status: coordinator_pb2.ClusterStatusResponse, address: str) -> list[str]:
    """`hexgen-flow top`'s screen: the recent outcomes, then `status_lines`."""
    r = recent_json(status)
    minutes = r["window_s"] / 60
    if r["succeeded"]:
        outcome = (
            f"{r['succeeded']} succeeded, {100 * r['attainment']:.1f} % within their SLO, "
            f"latency p50 {r['latency_p50_s']:.1f} s, p99 {r['latency_p99_s']:.1f} s"
        )
    else:
        outcome = "no query succeeded"
    if r["failed"] or r["cancelled"]:
        outcome += f"; {r['failed']} failed, {r['cancelled']} cancelled"
    return [f"last {minutes:g} min  {outcome}", *status_lines(status, address)]


def status_lines(status: coordinator_pb2.ClusterStatusResponse, address: str) -> list[str]:
    """The cluster's settings, then one row per instance."""
    lines = [
        f"coordinator  {address}",
        f"policy       {status.policy} (alpha {status.alpha:g})",
        f"clock        {status.now_s:.1f} s (time scale {status.time_scale:g}x)",
        f"SLO_base     {status.slo_base_s:.1f} s",
        f"queries      {status.queries_running} running, {status.queries_finished} finished, "
        f"{status.queries_failed} failed, {status.queries_rejected} rejected",
        "",
    ]
    header: tuple[str, ...] = (
        "slot",
        "instance",
        "model",
        "engine",
        "worker",
        "in-flight",
        "running",
        "queued",
        "KV used",
        "outstanding",
    )
    learning = any(i.learned_prefill_factor > 0 for i in status.instances)
    if learning:  # --learn-costs: what each instance costs over its calibration
        header = (*header, "learned cost")
    rows = [header]
    for i in sorted(status.instances, key=lambda i: i.index):
        kv = (
            f"{100 * i.kv_used_tokens / i.kv_capacity_tokens:.0f} %"
            if i.kv_capacity_tokens > 0
            else "-"
        )
        rows.append(
            (
                str(i.index),
                i.name,
                i.model,
                i.engine.removeprefix("ENGINE_KIND_").lower() or "-",
                i.worker_id if i.connected else "(not connected)",
                str(i.in_flight),
                str(i.running),
                str(i.queued),
                kv,
                f"{i.outstanding_s:.1f} s",
                *(
                    (
                        f"prefill x{i.learned_prefill_factor:.2f} decode "
                        f"x{i.learned_decode_factor:.2f} ({i.learned_calls} calls)",
                    )
                    if learning
                    else ()
                ),
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    numeric = {0, 5, 6, 7, 8, 9}
    for row in rows:
        cells = [
            cell.rjust(widths[c]) if c in numeric else cell.ljust(widths[c])
            for c, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _calls(events: Any) -> dict[str, dict[str, Any]]:
    """Per call id, from a query's events: stage, instance, dispatches, failures, times."""
    k = coordinator_pb2
    calls: dict[str, dict[str, Any]] = {}
    for e in events:
        if not e.call_id:
            continue
        call = calls.setdefault(
            e.call_id,
            {"call_id": e.call_id, "stage": e.stage, "instance": "", "dispatches": 0,
             "failures": 0, "started_s": None, "finished_s": None, "skipped": False,
             "deadline_updates": 0},
        )  # fmt: skip
        if e.kind in (k.QUERY_EVENT_KIND_CALL_DISPATCHED, k.QUERY_EVENT_KIND_CALL_REDISPATCHED):
            call["dispatches"] += e.kind == k.QUERY_EVENT_KIND_CALL_DISPATCHED
            call["instance"] = e.instance or call["instance"]
        elif e.kind == k.QUERY_EVENT_KIND_CALL_STARTED:
            call["started_s"] = e.time_s
        elif e.kind == k.QUERY_EVENT_KIND_CALL_FINISHED:
            call["finished_s"] = e.time_s
            call["instance"] = e.instance or call["instance"]
        elif e.kind == k.QUERY_EVENT_KIND_CALL_FAILED:
            call["failures"] += 1
        elif e.kind == k.QUERY_EVENT_KIND_CALL_SKIPPED:
            call["skipped"] = True
        elif e.kind == k.QUERY_EVENT_KIND_DEADLINE_UPDATED:
            call["deadline_updates"] += 1
    return calls


def query_json(reply: coordinator_pb2.GetQueryResponse) -> dict[str, Any]:
    """A query's state, stages (with their deadlines) and calls, as one JSON object."""
    q = reply.query
    return {
        "query_id": q.query_id,
        "tenant": q.tenant,
        "state": state_name(q.state),
        "failure_reason": q.failure_reason,
        "best_effort": q.best_effort,
        "session": ("open" if q.session_open else "closed") if q.session else None,
        "arrival_s": q.arrival_s,
        "slo_s": q.slo_s,
        "deadline_s": q.deadline_s,
        "finished_s": q.finished_s or None,
        "latency_s": (q.finished_s - q.arrival_s) if q.finished_s else None,
        "slo_met": (q.finished_s <= q.deadline_s) if q.finished_s else None,
        "stages": [
            {
                "index": st.index,
                "name": st.name or st.step,
                "step": st.step,
                "after": list(st.after),
                "calls_total": st.calls_total,
                "calls_done": st.calls_done,
                "calls_given": st.calls_given,
                "calls_skipped": st.calls_skipped,
                "released_s": st.released_s if st.released_s or st.deadline_s else None,
                "finished_s": st.finished_s or None,
                "deadline_s": st.deadline_s or None,
                "slack_s": (st.deadline_s - st.finished_s)
                if st.finished_s and st.deadline_s
                else None,
            }
            for st in reply.stages
        ],
        "calls": list(_calls(reply.events).values()),
    }


def _t(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def query_lines(reply: coordinator_pb2.GetQueryResponse) -> list[str]:
    """A query's state, a table of its stages with their deadlines, and its calls."""
    doc = query_json(reply)
    verdict = ""
    if doc["slo_met"] is not None:
        verdict = f", {'met' if doc['slo_met'] else 'missed'} its SLO"
    head = [
        f"query {doc['query_id']} ({doc['tenant']}): {doc['state']}{verdict}",
        f"  arrived {_t(doc['arrival_s'])} s, SLO {_t(doc['slo_s'])} s, deadline "
        f"{_t(doc['deadline_s'])} s, finished {_t(doc['finished_s'])} s",
    ]
    if doc["failure_reason"]:
        head.append(f"  failed: {doc['failure_reason']}")
    if doc["best_effort"]:
        head.append("  admitted best-effort (served after every query admitted on time)")
    if doc["session"] is not None:
        head.append(
            f"  a workflow session ({doc['session']}): calls given as they came; "
            "deadlines recomputed at every stage completion"
        )
    rows = [("stage", "name", "calls", "released s", "deadline s", "finished s", "slack s")]
    for st in doc["stages"]:
        skipped = f" ({st['calls_skipped']} skipped)" if st["calls_skipped"] else ""
        rows.append(
            (
                str(st["index"]),
                st["name"] if st["name"] == st["step"] else f"{st['name']} ({st['step']})",
                f"{st['calls_done']}/{st['calls_total']}{skipped}",
                _t(st["released_s"]),
                _t(st["deadline_s"]),
                _t(st["finished_s"]),
                _t(st["slack_s"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = [
        "  "
        + "  ".join(
            c.ljust(w) if i in (1, 2) else c.rjust(w)  # text: left-aligned
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]
    calls = [
        f"  {c['call_id']}  skipped (never given)"
        if c["skipped"]
        else f"  {c['call_id']}  on {c['instance'] or '-'}  started {_t(c['started_s'])}  "
        f"finished {_t(c['finished_s'])}"
        + (f"  ({c['dispatches']} dispatches)" if c["dispatches"] > 1 else "")
        + (f"  (deadline recomputed {c['deadline_updates']}x)" if c["deadline_updates"] else "")
        + (f"  ({c['failures']} failed)" if c["failures"] else "")
        for c in doc["calls"]
    ]
    return [*head, "", *table, "", f"calls ({len(calls)}):", *calls]
