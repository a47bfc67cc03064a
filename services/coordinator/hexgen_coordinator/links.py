"""A worker's link to the coordinator, and which slot a worker's hello may take.

Nothing here touches the coordinator's state: `hexgen_coordinator.workers` registers a
link in the slot `slot_for` chose, and the gRPC servicer drains its outbox (the commands of
`hexgen_coordinator.worker_messages`, which it encodes for the wire).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from hexgen_coordinator.worker_messages import Ack, Command, Hello
from hexgen_flow.cluster import Cluster
from hexgen_service.errors import InvalidFieldError

__all__ = ["SlotTakenError", "WorkerLink", "slot_for"]


class SlotTakenError(RuntimeError):
    """A worker asked for a slot another live worker holds (FAILED_PRECONDITION)."""


@dataclass(eq=False)
class WorkerLink:
    """One connected worker: the coordinator's end of its stream."""

    worker_id: str
    engine: str
    outbox: asyncio.Queue[Command | None] = field(default_factory=asyncio.Queue)
    slot: int = -1
    last_seen: float = field(default_factory=time.monotonic)
    running: int = 0
    queued: int = 0
    kv_used: int = 0
    closed: bool = False
    _acks: list[str] = field(default_factory=list)

    def send(self, message: Command) -> None:
        if not self.closed:
            self.outbox.put_nowait(message)

    def ack(self, call_id: str) -> None:
        """Acknowledge a completion; the acks of one loop turn go out as one message."""
        if not self._acks:
            asyncio.get_running_loop().call_soon(self._send_acks)
        self._acks.append(call_id)

    def _send_acks(self) -> None:
        acks, self._acks = self._acks, []
        self.send(Ack(tuple(acks)))

    def close(self) -> None:
        """End the stream: the servicer's writer stops at the None."""
        if not self.closed:
            self.closed = True
            self.outbox.put_nowait(None)


def slot_for(hello: Hello, cluster: Cluster, links: Sequence[WorkerLink | None]) -> int:
    """The slot a worker gets: the one it asks for, else the first free one of its GPU type
    (or the one it already holds); raises InvalidFieldError / SlotTakenError."""
    gpu = hello.gpu.strip().lower()
    instances = cluster.instances
    if hello.slot >= len(instances):
        raise InvalidFieldError(
            "hello.slot",
            f"{hello.slot} is not a slot of this cluster (0..{len(instances) - 1})",
        )
    if hello.slot >= 0:
        inst = instances[hello.slot]
        if inst.gpu.lower() != gpu:
            raise InvalidFieldError(
                "hello.gpu", f"slot {hello.slot} is a {inst.gpu}, the worker says {hello.gpu!r}"
            )
        holder = links[hello.slot]
        if holder is not None and holder.worker_id != hello.worker_id and not holder.closed:
            raise SlotTakenError(f"slot {hello.slot} is held by worker {holder.worker_id}")
        candidates = [hello.slot]
    else:
        candidates = [
            inst.index
            for inst, holder in zip(instances, links, strict=True)
            if inst.gpu.lower() == gpu and (holder is None or holder.worker_id == hello.worker_id)
        ]
        if not candidates:
            known = sorted({i.gpu for i in instances})
            if gpu not in {g.lower() for g in known}:
                raise InvalidFieldError(
                    "hello.gpu",
                    f"no {hello.gpu!r} slot in this cluster (GPU types: {', '.join(known)})",
                )
            raise SlotTakenError(f"every {hello.gpu} slot is held by another worker")
    slot = candidates[0]
    if hello.model and hello.model.lower() != instances[slot].model:
        raise InvalidFieldError(
            "hello.model",
            f"slot {slot} serves {instances[slot].model}, the worker says {hello.model!r}",
        )
    return slot
