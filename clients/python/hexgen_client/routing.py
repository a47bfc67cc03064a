"""Which coordinator a query's RPC goes to, learnt from the coordinators' redirects.

A sharded mesh runs several coordinators, each owning the workflows whose id hashes to its
shard; any of them answers an RPC about a workflow of another shard with a redirect
(FAILED_PRECONDITION, the owner's ``HOST:PORT`` in the trailing metadata
`SHARD_OWNER_KEY`), or with UNAVAILABLE while that shard has no coordinator (a takeover).
The client needs no shard map of its own: `ShardRouter` remembers, per query id, the owner
it was last sent to (a bounded LRU), and otherwise sends to its default address. One RPC
is one `Route`: it starts there, follows redirects (a few hops; a circle is
`ShardRedirectLoopError`) and, when an address does not answer, moves on to the next
configured address not tried yet (which redirects to the current owner), until none is
left: then `CoordinatorUnavailableError`, which callers already retry.

With one address nothing changes: no redirect comes, and an unreachable coordinator is the
same `CoordinatorUnavailableError` as ever.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import grpc

from hexgen_client.errors import (
    CoordinatorError,
    CoordinatorUnavailableError,
    ShardRedirectLoopError,
)
from hexgen_wire.metadata import SHARD_OWNER_KEY

__all__ = ["MAX_REDIRECTS", "OWNERS_KEPT", "Route", "ShardRouter", "owner_of"]

MAX_REDIRECTS = 3
"""Redirects one RPC follows: one suffices when the coordinators agree, a second covers an
owner that changed (a takeover) between two answers."""
OWNERS_KEPT = 10_000
"""Query ids whose owner is remembered (the most recently used ones)."""


def owner_of(exc: grpc.aio.AioRpcError) -> str | None:
    """The owner's address a redirect names, None when `exc` is no redirect."""
    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == SHARD_OWNER_KEY:
            owner = value.decode() if isinstance(value, bytes) else str(value)
            return owner.strip() or None
    return None


class ShardRouter:
    """The client's memory of where queries live: their owners, and the default address."""

    def __init__(self, addresses: Sequence[str], *, owners_kept: int = OWNERS_KEPT) -> None:
        if not addresses:
            raise ValueError("a router needs at least one address")
        self.addresses = tuple(addresses)
        """The configured coordinators, in the order they are tried."""
        self.owners_kept = owners_kept
        self._default = 0
        self._owners: OrderedDict[str, str] = OrderedDict()

    @property
    def default(self) -> str:
        """Where an RPC goes when no owner is known (and ClusterStatus, SetAlpha): the first
        configured address, moved on to the next when it stops answering."""
        return self.addresses[self._default]

    def owner(self, query_id: str) -> str | None:
        """The address last learnt to own `query_id`, None when none was."""
        owner = self._owners.get(query_id)
        if owner is not None:
            self._owners.move_to_end(query_id)
        return owner

    def learn(self, query_id: str, owner: str) -> None:
        self._owners[query_id] = owner
        self._owners.move_to_end(query_id)
        while len(self._owners) > self.owners_kept:
            self._owners.popitem(last=False)

    def went_away(self, address: str) -> None:
        """Nothing answers at `address` (any more): forget it as an owner, so that the next
        RPC about its queries asks the others (a dead shard's queries are taken over at
        another address), and no longer prefer it as the default."""
        for query_id in [q for q, a in self._owners.items() if a == address]:
            del self._owners[query_id]
        if self.default == address:
            self._default = (self._default + 1) % len(self.addresses)

    def candidates(self) -> tuple[str, ...]:
        """The configured addresses from the default on, wrapping around."""
        k = self._default
        return self.addresses[k:] + self.addresses[:k]

    def route(self, query_id: str | None) -> Route:
        """The route of one RPC about `query_id` (None: not about a query, no redirect)."""
        return Route(self, query_id)


class Route:
    """The addresses one RPC tries: `address` now; `reroute` after each failure."""

    def __init__(self, router: ShardRouter, query_id: str | None) -> None:
        self.router = router
        self.query_id = query_id
        owner = router.owner(query_id) if query_id is not None else None
        self.address = owner or router.default
        self._tried = [self.address]
        """Every address the RPC was sent to, in order."""
        self._redirecting: set[str] = set()
        """The addresses that answered with a redirect: one named as owner is a circle."""
        self._unavailable: dict[str, CoordinatorUnavailableError] = {}
        self._notes: list[str] = []
        """What each address tried said, for the error when none could serve."""

    def reroute(self, error: CoordinatorError, owner: str | None) -> CoordinatorError | None:
        """After `error` at `address` (`owner`: the owner its redirect names): None to send
        the RPC again, to the updated `address`; else the error to raise."""
        address = self.address
        if isinstance(error, CoordinatorUnavailableError):
            if not error.answered:
                self.router.went_away(address)
            self._unavailable[address] = error
            said = error.details if error.answered else "no answer"
            self._notes.append(f"{address}: {said}")
            return self._next_configured(error)
        if owner is None or self.query_id is None:
            return error
        self._notes.append(f"{address}: redirected to {owner}")
        self._redirecting.add(address)
        if owner in self._redirecting or len(self._redirecting) > MAX_REDIRECTS:
            return ShardRedirectLoopError(self.query_id, [*self._tried, owner], error.details)
        if owner in self._unavailable:
            # The owner named is one that just could not serve (dead, its lease not yet
            # expired): the others may know a successor, else it is worth a retry.
            return self._next_configured(self._unavailable[owner])
        self.router.learn(self.query_id, owner)
        self._go(owner)
        return None

    def _go(self, address: str) -> None:
        self.address = address
        self._tried.append(address)

    def _next_configured(self, last: CoordinatorUnavailableError) -> CoordinatorError | None:
        for address in self.router.candidates():
            if address not in self._tried:
                self._go(address)
                return None
        if len(self._tried) == 1:
            return last  # one address, as without shards: its own error, unchanged
        what = f"query {self.query_id!r}" if self.query_id is not None else "the request"
        return CoordinatorUnavailableError(
            ",".join(self._tried),
            last.details,
            message=f"no coordinator can serve {what} now ({'; '.join(self._notes)}): are "
            "they running? (a shard being taken over is served again within seconds)",
        )
