"""The prefix cache of the vLLM V1 engine model (`hexgen_flow.sim.vllm_v1`), in blocks.

A call carries no prompt text, so a prefix is a key (the engine uses (query, step type))
and an entry is how many full blocks of that prefix are cached and how many requests use
them. `PrefixCache` keeps the entries and the least-recently-used order of the unused
ones, and each request's share of its entry; the engine keeps its own count of used
blocks, and every method that moves blocks between used and free returns how many, for
the engine to apply:

- an entry in use holds its blocks as used ones; when its last request lets go
  (`release`) they become free but stay cached (`cached_free`), and a later request with
  the key takes them back (`attach`) unless an allocation evicted them first (`evict`,
  least recently used entry first);
- a request computing its prefix moves its own full blocks into its entry (`register`):
  they stay used, but are counted in the entry rather than in the request.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["PrefixCache", "PrefixEntry", "PrefixUser"]


class PrefixEntry:
    """Cached full blocks of one shared prefix and how many requests use them."""

    __slots__ = ("blocks", "refs")

    def __init__(self) -> None:
        self.blocks = 0
        self.refs = 0


class PrefixUser(Protocol):
    """What the prefix cache reads and writes on a request."""

    key: object
    """Its prefix key (None: it shares no prefix)."""
    pblocks: int
    """Full blocks of its shared prefix."""
    target: int
    """Tokens it computes before decoding."""
    done: int
    """Tokens of `target` computed."""
    shared: int
    """Of its blocks, those counted in its entry."""
    entry: PrefixEntry | None
    """The entry it uses, if any."""


class PrefixCache:
    """Entries by prefix key, and which of them no request uses (evictable)."""

    __slots__ = ("_block_size", "cached_free", "entries", "evictable")

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self.entries: dict[object, PrefixEntry] = {}
        """The entries by key. The engine's per-call paths (starting a request, finishing
        one) read and write these three fields inline, as `lookup`, `attach`, `register`
        and `release` do: a Python call costs about as much as the work inside them."""
        self.evictable: dict[object, PrefixEntry] = {}
        """The unused entries, least recently used first."""
        self.cached_free = 0
        """Blocks of the unused entries: free, but still cached."""

    def evict(self, free: int) -> None:
        """Evict unused entries, least recently used first, until their blocks fit in the
        `free` blocks left after an allocation (evicted blocks were free already)."""
        evictable = self.evictable
        while self.cached_free > free and evictable:
            key = next(iter(evictable))
            entry = evictable.pop(key)
            del self.entries[key]
            self.cached_free -= entry.blocks

    def release(self, req: PrefixUser) -> int:
        """`req` lets go of its entry (it freed its own blocks); return the blocks that stop
        being used: the entry's when `req` was its last user, else none."""
        entry = req.entry
        req.shared = 0
        if entry is None:
            return 0
        req.entry = None
        entry.refs -= 1
        if entry.refs:
            return 0
        self.cached_free += entry.blocks
        self.evictable[req.key] = entry  # the most recently used: evicted last
        return entry.blocks

    def lookup(self, req: PrefixUser) -> tuple[int, int]:
        """(cached prefix blocks a waiting request would start with, blocks of its entry
        that would leave the free pool because nobody uses them now)."""
        if req.key is None or req.done:
            return 0, 0
        entry = self.entries.get(req.key)
        if entry is None:
            return 0, 0
        # Its last prompt token is always computed: that step samples the first output.
        # min(entry.blocks, req.pblocks, last), without the builtin's call (a hot path)
        hit, pblocks = entry.blocks, req.pblocks
        hit = pblocks if pblocks < hit else hit
        last = (req.target - 1) // self._block_size
        hit = last if last < hit else hit
        return hit, entry.blocks if hit and entry.refs == 0 else 0

    def attach(self, req: PrefixUser, hit: int) -> int:
        """`req` starts with the first `hit` blocks of its cached entry computed (`lookup`
        gave `hit`); return the blocks that become used because nobody used them before."""
        entry = self.entries[req.key]
        revived = 0
        if entry.refs == 0:  # cached but unused: its blocks leave the free pool
            del self.evictable[req.key]
            self.cached_free -= entry.blocks
            revived = entry.blocks
        entry.refs += 1
        req.entry = entry
        req.shared = hit
        req.done = hit * self._block_size
        return revived

    def register(self, req: PrefixUser) -> None:
        """Cache the full prefix blocks `req` (with a prefix key) has computed beyond its
        entry's. No block changes hands between used and free."""
        computed, pblocks = req.done // self._block_size, req.pblocks
        computed = pblocks if pblocks < computed else computed  # min(), without the call
        if computed <= req.shared:
            return
        entry = req.entry
        if entry is None:
            if req.key in self.entries:
                return  # another request cached this prefix meanwhile: keep its own copy
            entry = self.entries[req.key] = PrefixEntry()
            entry.refs = 1
            req.entry = entry
        if computed > entry.blocks:
            # The request's own blocks past the entry's end become the entry's.
            req.shared += computed - entry.blocks
            entry.blocks = computed
