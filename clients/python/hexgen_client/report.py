"""Plain-text and JSON renderings of the coordinator's messages for the CLI
(``hexgen-flow ask`` and ``hexgen-flow status``)."""

from __future__ import annotations

from typing import Any

from hexgen_api.v1 import coordinator_pb2

__all__ = ["event_kind", "event_line", "state_name", "status_json", "status_lines"]

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
            }
            for i in status.instances
        ],
    }


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
    header = (
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
