"""One worker, several coordinator shards: how their calls share one queue and one engine.

A worker started with ``--coordinator`` repeated keeps one link per coordinator (link 0,
1, ... in the order given). Each coordinator numbers its calls, releases and clock on its
own, so `ShardMap` maps them onto the worker's one local queue and engine:

- **Call ids.** Coordinators name calls ``QUERY/STAGE.INDEX`` from client-chosen query ids,
  and nothing stops two shards from holding a query of the same id: call ids can collide.
  The engine and the queue see ``LINK/CALL_ID`` (`engine_id`), which is unique whatever the
  ids (the link number has no ``/``); with one coordinator, the call id itself, as before.
  A call handed over to another link (`hexgen_worker.handover`) keeps the engine id it was
  dispatched under, recorded for its new (link, call id) (`hand_over`); a call its old link
  is dispatched later under the same id gets ``LINK.N/CALL_ID``, which no plain id can be.
- **Release order.** ``DispatchCall.sequence`` and ``query_sequence`` count per
  coordinator, and the local queues key their members by ``seq``: the queue sees
  ``sequence × links + link`` (`order`), unique, and in each shard's own order.
- **Clocks.** Each shard fixes its clock's epoch in Redis under its own prefix when it
  first starts, so shards started at different times have different epochs. The worker
  runs its queue and engine on one clock (the first welcome's) and moves every time a
  link sends or receives onto or off it (`to_local`, `to_link`); an epoch is an offset.
- **What every welcome must agree on** (`check_agreement`): the cluster, the queue policy
  and its parameters, and the time scale. The local queue and the engine are built from
  them once for all shards, and an engine runs at one time scale. A disagreement is a
  `ConfigError` naming the field and both coordinators' values. What may differ: the slot
  and instance name (each coordinator assigns its own; they must be of this worker's GPU
  type and model, `WorkerState.configure` checks), the epoch (above), the heartbeat
  interval (each link beats at its own) and the calls to drop (each link's own). The
  calibration is not in the welcome: the worker's own ``--calibration`` serves every link.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from hexgen_flow.errors import ConfigError
from hexgen_service.clock import ClusterClock
from hexgen_worker.engines.base import translate_time
from hexgen_worker.welcome import WelcomeSettings

__all__ = ["ShardMap"]


class ShardMap:
    """The links of one worker (`names`: their coordinators' addresses) and what each
    welcomed it with; see the module docstring."""

    def __init__(self, names: Sequence[str]) -> None:
        if not names:
            raise ConfigError("a worker needs at least one coordinator")
        self.names = tuple(names)
        self.links = len(self.names)
        self.settings: list[WelcomeSettings | None] = [None] * self.links
        """Each link's latest welcome (kept while the link is down: its calls stay here)."""
        self.local_clock: ClusterClock | None = None
        """The clock the queue and the engine run on."""
        self.up = [False] * self.links
        """Whether each link is welcomed and its stream up (each `CoordinatorLink` keeps its
        own): a down link's calls may be handed over (`hexgen_worker.handover`)."""
        self._moved: dict[tuple[int, str], str] = {}
        """(link, call id) -> engine id, for calls held under another id than the plain one."""
        self._owners: dict[str, tuple[int, str]] = {}
        """The reverse of `_moved`."""
        self._renamed = 0

    # ------------------------------------------------------------------ ids and order

    def engine_id(self, link: int, call_id: str, *, new: bool = False) -> str:
        """The id the queue and the engine know a link's call by; `new`: for a call being
        dispatched (an id another's call holds is then replaced by a fresh one, kept)."""
        if self.links == 1:
            return call_id
        plain = f"{link}/{call_id}"
        if not self._moved:  # no call was ever handed over: always so but after a takeover
            return plain
        known = self._moved.get((link, call_id))
        if known is not None:
            return known
        if plain not in self._owners:
            return plain
        # A call handed over to another link holds this link's plain id.
        fresh = f"{link}.{self._renamed + 1}/{call_id}"
        if new:
            self._renamed += 1
            self._record(link, call_id, fresh)
        return fresh  # not new: an id no call holds, so a lookup finds nothing

    def hand_over(self, source: int, target: int, call_id: str) -> None:
        """Link `source`'s call `call_id` is now link `target`'s, under the same engine id
        (the caller checked that `target` holds no call of that id)."""
        engine_id = self.engine_id(source, call_id)
        self.forget(source, call_id)
        if engine_id != f"{target}/{call_id}":  # (handed back: its plain id again)
            self._record(target, call_id, engine_id)

    def forget(self, link: int, call_id: str) -> None:
        """Link `link`'s call left the queue and the engine: its engine id is free again."""
        engine_id = self._moved.pop((link, call_id), None)
        if engine_id is not None:
            del self._owners[engine_id]

    def _record(self, link: int, call_id: str, engine_id: str) -> None:
        self._moved[(link, call_id)] = engine_id
        self._owners[engine_id] = (link, call_id)

    def order(self, link: int, sequence: int) -> int:
        """A link's release (or query) sequence number as the local queue orders it."""
        return sequence * self.links + link

    # ------------------------------------------------------------------ clocks

    def to_local(self, link: int, t: float) -> float:
        """Link `link`'s clock reading `t` on the local clock."""
        clock = self._clock(link)
        if clock is None or self.local_clock is None or clock == self.local_clock:
            return t
        return translate_time(t, clock, self.local_clock)

    def to_link(self, link: int, t: float) -> float:
        """Local clock reading `t` on link `link`'s clock."""
        clock = self._clock(link)
        if clock is None or self.local_clock is None or clock == self.local_clock:
            return t
        return translate_time(t, self.local_clock, clock)

    def _clock(self, link: int) -> ClusterClock | None:
        settings = self.settings[link]
        return settings.clock if settings is not None else None

    # ------------------------------------------------------------------ welcomes

    def others_welcomed(self, link: int) -> bool:
        """Whether another link has been welcomed (its calls may be held here)."""
        return any(s is not None for i, s in enumerate(self.settings) if i != link)

    def check_agreement(self, link: int, settings: WelcomeSettings) -> None:
        """Raise `ConfigError` when `settings` (link `link`'s welcome) disagrees with another
        link's on what the worker builds once for all of them."""
        mine = _shared_fields(settings)
        for other, theirs in enumerate(self.settings):
            if other == link or theirs is None:
                continue
            for field, value in _shared_fields(theirs).items():
                if mine[field] != value:
                    raise ConfigError(
                        f"welcome.{field}: coordinator {self.names[link]} says {mine[field]}, "
                        f"coordinator {self.names[other]} says {value}; coordinator shards "
                        "that share a worker must agree on it"
                    )


def _shared_fields(settings: WelcomeSettings) -> dict[str, str]:
    """What every link's welcome must agree on, by the welcome's field names, as text."""
    return {
        "cluster": repr(settings.cluster),
        "queue_policy": repr(settings.queue_policy),
        "queue_params_json": json.dumps(dict(settings.queue_params), sort_keys=True),
        "time_scale": repr(settings.clock.time_scale),
    }
