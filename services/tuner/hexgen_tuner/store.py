"""What the tuner keeps in Redis, so that a restarted tuner still answers ``ListTuningRuns``:

- ``P tuner:runs``: a list of JSON `TuningRunRecord`, newest first, capped;
- ``P tuner:run_seq``: the counter behind the run ids (``tune-000001``, ...).

(Their names are `hexgen_service.redis_schema`'s, with the coordinator's keys.) The α history
is not the tuner's: the coordinator records every change it applies, and ``GetAlpha`` reads
it with the coordinator's GetAlphaHistory (`hexgen_tuner.tuner.AlphaTuner.alpha_history`).

Non-finite numbers (an α not known, a P95 of a run where nothing finished) are stored as
JSON ``null`` and read back as NaN.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from hexgen_flow.tuning import AlphaPoint
from hexgen_service import redis_schema as schema

__all__ = ["TunerStore", "TuningRunRecord"]

log = logging.getLogger(__name__)


def _num(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _float(value: Any) -> float:
    return math.nan if value is None else float(value)


@dataclass(frozen=True, slots=True)
class TuningRunRecord:
    """One tuning run, as ``ListTuningRuns`` reports it."""

    run_id: str
    """``tune-NNNNNN``; also the reason given to SetAlpha."""
    started_s: float
    """Unix seconds (the tuner's records outlive any one cluster clock)."""
    finished_s: float
    """Unix seconds."""
    window_queries: int
    """Queries replayed (0 when the run stopped before replaying)."""
    qps: float
    """Arrival rate of the window, queries per second."""
    curve: tuple[AlphaPoint, ...]
    """Every α tried, sorted by α; empty when nothing was replayed."""
    best_alpha: float
    """The α the replays chose; the previous α when nothing was replayed."""
    previous_alpha: float
    """The coordinator's α when the run started (NaN when it could not be asked)."""
    applied: bool
    """Whether the coordinator took `best_alpha`."""
    reason: str
    """Why the run ended the way it did."""

    def to_json(self) -> str:
        return json.dumps(
            {
                "run_id": self.run_id,
                "started_s": self.started_s,
                "finished_s": self.finished_s,
                "window_queries": self.window_queries,
                "qps": _num(self.qps),
                "curve": [
                    {
                        "alpha": p.alpha,
                        "p95_s": _num(p.p95_s),
                        "mean_s": _num(p.mean_s),
                        "slo_attainment": _num(p.slo_attainment),
                    }
                    for p in self.curve
                ],
                "best_alpha": _num(self.best_alpha),
                "previous_alpha": _num(self.previous_alpha),
                "applied": self.applied,
                "reason": self.reason,
            },
            allow_nan=False,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> TuningRunRecord:
        doc = json.loads(text)
        return cls(
            run_id=str(doc["run_id"]),
            started_s=float(doc["started_s"]),
            finished_s=float(doc["finished_s"]),
            window_queries=int(doc["window_queries"]),
            qps=_float(doc["qps"]),
            curve=tuple(
                AlphaPoint(
                    float(p["alpha"]),
                    _float(p["p95_s"]),
                    _float(p["mean_s"]),
                    _float(p["slo_attainment"]),
                )
                for p in doc["curve"]
            ),
            best_alpha=_float(doc["best_alpha"]),
            previous_alpha=_float(doc["previous_alpha"]),
            applied=bool(doc["applied"]),
            reason=str(doc["reason"]),
        )


class TunerStore:
    """The tuner's Redis keys under `prefix`."""

    def __init__(
        self,
        client: aioredis.Redis[bytes],
        prefix: str,
        *,
        runs_kept: int = 200,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.runs_kept = runs_kept

    @property
    def runs_key(self) -> str:
        return schema.key(self.prefix, schema.TUNER_RUNS)

    @property
    def seq_key(self) -> str:
        return schema.key(self.prefix, schema.TUNER_RUN_SEQ)

    async def next_run_id(self) -> str:
        """A run id no earlier run of this tuner (or of a restarted one) has used."""
        # INCR by name: redis-py's `incr` sends INCRBY, which the tuner's Redis ACL user
        # (`hexgen_service.auth_dir.REDIS_COMMANDS`) is not given.
        raw = await self.client.execute_command("INCR", self.seq_key)  # type: ignore[no-untyped-call]
        seq = int(raw)
        return f"tune-{seq:06d}"

    async def record_run(self, run: TuningRunRecord) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.lpush(self.runs_key, run.to_json())
            pipe.ltrim(self.runs_key, 0, self.runs_kept - 1)
            await pipe.execute()

    async def runs(self, limit: int) -> list[TuningRunRecord]:
        """The last `limit` runs, newest first (unreadable entries are skipped, logged)."""
        raw = await self.client.lrange(self.runs_key, 0, limit - 1)
        return [r for r in map(self._run, raw) if r is not None]

    @staticmethod
    def _run(text: bytes) -> TuningRunRecord | None:
        try:
            return TuningRunRecord.from_json(text)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("unreadable tuning run skipped: %s", exc)
            return None
