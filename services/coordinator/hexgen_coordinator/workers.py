"""Workers joining and leaving their slots.

A worker that connects takes a slot (`links.slot_for`), reclaims the calls it still holds
and gets again those it lost; a worker whose stream ends or whose heartbeats stop loses its
slot, and its calls are dispatched elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence

from hexgen_coordinator.completions import Completions
from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.dispatch import Dispatch
from hexgen_coordinator.ledger import Calls, Clock, Slots
from hexgen_coordinator.links import WorkerLink, slot_for
from hexgen_coordinator.recovery import Recovery
from hexgen_coordinator.worker_messages import Heartbeat, Hello, Welcome
from hexgen_coordinator.write_behind import WriteBehind
from hexgen_flow.cluster import Cluster
from hexgen_flow.protocol import (
    Action,
    InstanceBack,
    InstanceLost,
    Lost,
    OthersReported,
    Scheduler,
)

__all__ = ["WorkerSlots"]

log = logging.getLogger("hexgen_coordinator.coordinator")  # the coordinator's one logger


class WorkerSlots:
    def __init__(
        self,
        config: CoordinatorConfig,
        cluster: Cluster,
        core: Scheduler,
        calls: Calls,
        slots: Slots,
        clock: Clock,
        dispatch: Dispatch,
        writes: WriteBehind,
        recovery: Recovery,
        completions: Completions,
    ) -> None:
        self.config = config
        self.cluster = cluster
        self.core = core
        self.scheduler = core.policy
        """Read only here (its preset; a worker's report of other shards' load)."""
        self.calls = calls
        self.slots = slots
        self.clock = clock
        self.dispatch = dispatch
        self.writes = writes
        self.recovery = recovery
        self.completions = completions
        self._counting: set[asyncio.Task[None]] = set()

    def connect(self, hello: Hello, link: WorkerLink) -> Welcome:
        """Give a worker its slot; raises InvalidFieldError / SlotTakenError."""
        calls, slots, clock = self.calls, self.slots, self.clock
        slot = slot_for(hello, self.cluster, slots.links)
        old = slots.links[slot]
        if old is not None and old is not link:
            old.close()  # the same worker reconnecting: its old stream is dead
        link.slot = slot
        slots.hold(slot, link)
        now = clock.now()
        drop = []
        for call_id in hello.resident_call_ids:
            ticket = calls.tickets.get(call_id)
            if ticket is not None and ticket.instance == slot:
                continue
            if ticket is not None and ticket.instance < 0 and calls.adoptable.get(call_id) == slot:
                self.recovery.adopt(ticket, slot)
                continue
            drop.append(call_id)
        # Calls this slot should hold but the worker does not (it restarted): the core
        # sends a waiting one again, and a running one died with it: that counts as an
        # attempt. Then parked calls go out.
        resident = set(hello.resident_call_ids)
        lacking = tuple(
            t for t in calls.tickets.values() if t.instance == slot and t.call_id not in resident
        )
        actions = self.core.handle(InstanceBack(slot, now, lacking))
        welcome = Welcome(
            slot=slot,
            instance=self.cluster.instances[slot].name,
            epoch_unix_s=clock.epoch_unix_s,
            time_scale=clock.time_scale,
            cluster=self.cluster.inline,
            queue_policy=self.scheduler.preset.queue.name,
            queue_params_json=json.dumps(dict(self.scheduler.preset.queue.params)),
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            drop_call_ids=tuple(drop),
            # The shard held (the lease's prefix, `__main__.serve`): a worker shared by
            # shards hands this shard's calls over to us when their coordinator died.
            shard=self.config.redis_prefix if self.config.shards else "",
        )
        link.send(welcome)
        self._lost_running(
            self.dispatch.carry_out(actions, now),
            slot,
            f"worker {hello.worker_id} came back without it",
        )
        log.info("worker %s (%s) holds slot %d", hello.worker_id, link.engine, slot)
        return welcome

    def on_heartbeat(self, link: WorkerLink, msg: Heartbeat) -> None:
        link.last_seen = time.monotonic()
        link.running, link.queued, link.kv_used = msg.running, msg.queued, msg.kv_used_tokens
        if link.slot >= 0 and self.slots.links[link.slot] is link:
            # A worker shared by coordinator shards reports what the other shards have on it
            # (0 from a worker of this coordinator alone, or from one older than these
            # fields). The dispatcher then counts those calls as in flight there.
            # Approximate: they are as of this heartbeat (the calls other shards dispatched
            # since are unseen until the next), and their seconds are the worker's estimate
            # with its own latency model, not this coordinator's. Their weights are the ones
            # their coordinators charged (0 from a worker older than the field).
            self.core.handle(
                OthersReported(
                    link.slot,
                    msg.others_in_flight,
                    msg.others_outstanding_s,
                    msg.others_tokens,
                    msg.others_weight,
                    msg.others_weighted_outstanding_s,
                )
            )

    def disconnect(self, link: WorkerLink, reason: str) -> None:
        """The worker's stream ended: its calls go elsewhere."""
        slots = self.slots
        link.close()
        if link.slot < 0 or slots.links[link.slot] is not link:
            return
        slot = link.slot
        slots.free(slot)
        now = self.clock.now()
        actions = self.core.handle(InstanceLost(slot, now))
        lost = [a for a in actions if isinstance(a, Lost)]
        log.warning(
            "worker %s left slot %d (%s); redispatching %d calls (%d were running there)",
            link.worker_id,
            slot,
            reason,
            len(actions),
            len(lost),
        )
        why = f"worker {link.worker_id} lost: {reason}"
        self._lost_running(lost, slot, why)
        self.dispatch.carry_out([a for a in actions if not isinstance(a, Lost)], now, reason=why)

    def _lost_running(self, actions: Sequence[Action], slot: int, reason: str) -> None:
        """Calls that were running on `slot` when its worker died (the core's `Lost`; off
        the instance already): counted as failed attempts, then sent again or failed
        (`Completions.lost_while_running`)."""
        for action in actions:
            assert isinstance(action, Lost), action
            ticket = action.ticket
            task = asyncio.create_task(
                self.completions.lost_while_running(ticket, slot, ticket.attempt, reason)
            )
            self._counting.add(task)
            task.add_done_callback(self._counting.discard)

    async def watch_heartbeats(self) -> None:
        """Disconnect every worker silent for longer than `heartbeat_timeout_s`."""
        timeout = self.config.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(timeout / 4, 0.25))
            now = time.monotonic()
            for link in list(self.slots.links):
                if link is not None and now - link.last_seen > timeout:
                    self.disconnect(link, f"no heartbeat for {now - link.last_seen:.1f} s")
