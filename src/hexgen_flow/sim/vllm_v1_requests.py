"""The requests inside the vLLM V1 engine model (`hexgen_flow.sim.vllm_v1`): one call's
record (`Request`, in one of the states `WAITING`, `PREFILL`, `DECODE`, `FINISHED`) and
the decoding ones in aggregate (`DecodeBatch`).

Every decode adds one token per step, so against the engine's global step counter S a
decoding request's context is `base + S` and its last step is a fixed `fin`: nothing per
request changes from step to step. `DecodeBatch` answers what the engine asks of all
decodes at once, whatever the number of steps: the KV tokens a step reads (a running sum),
the blocks any number of steps allocate (counters of decodes by the step phase, modulo the
block size, at which their context crosses a block boundary and takes a new block), and
the next finishing step (a heap with lazy deletion).
"""

from __future__ import annotations

import heapq
from typing import Final

from hexgen_flow.runtime import CallTicket
from hexgen_flow.sim.prefix_cache import PrefixEntry

__all__ = ["DECODE", "FINISHED", "PREFILL", "WAITING", "DecodeBatch", "Request"]

WAITING: Final = 0
PREFILL: Final = 1
DECODE: Final = 2
FINISHED: Final = 3


class Request:
    """One call inside the engine."""

    __slots__ = (
        "base",
        "done",
        "entry",
        "fin",
        "first",
        "gen",
        "hseq",
        "key",
        "out",
        "pblocks",
        "prompt",
        "scale",
        "shared",
        "state",
        "target",
        "ticket",
    )

    def __init__(
        self,
        ticket: CallTicket,
        prompt: int,
        out: int,
        scale: float,
        key: object,
        pblocks: int,
        first: int,
    ) -> None:
        # The engine hands over what it read of the ticket (one Request per call).
        self.ticket = ticket
        self.prompt = prompt  # the call's input tokens
        self.out = out  # the ticket's output tokens: what it really generates
        self.scale = scale  # its prefill over the prefill curve: what its chunks scale by
        self.key = key  # prefix-cache key, or None
        self.pblocks = pblocks  # full blocks of its shared prefix
        self.state = WAITING
        self.gen = 0  # output tokens generated (while decoding: at its last state change)
        self.target = self.prompt  # tokens to compute before decoding (+ gen after preemption)
        self.done = 0  # tokens of target computed
        self.first = first  # while waiting: blocks it needs to start
        self.shared = 0  # of its blocks, those counted in its prefix-cache entry
        self.entry: PrefixEntry | None = None
        self.base = 0  # while decoding: its context is base + the step counter
        self.fin = 0  # while decoding: the step counter after its last step
        self.hseq = -1  # sequence number of its live entry in the finish heap


class DecodeBatch:
    """The requests decoding now, by their `base` and `fin` (set before `add`)."""

    __slots__ = ("_mask", "_size", "count", "heap", "hseq", "phase", "sum_k")

    def __init__(self, block_size: int) -> None:
        if block_size <= 0 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self._mask = block_size - 1
        self._size = block_size
        self.count = 0
        """Requests decoding (read-only outside)."""
        self.sum_k = 0
        """Sum of (base + 1): the KV read of step S is sum_k + count x S (read-only outside:
        the engine's step reads it inline)."""
        # Decodes by the step phase at which they take a new block: a decode whose context
        # is base + S takes one in step S when base + S is a multiple of the block size,
        # i.e. when S = -base mod block size, so phase[S mod block size] counts the
        # decodes that allocate in step S, and a run of steps reads a (circular) slice.
        self.phase = [0] * block_size
        """The decodes by block phase (read-only outside: the engine's step reads it)."""
        self.heap: list[tuple[int, int, Request]] = []
        """(fin, hseq, request) of every decode, stale ones too (lazily dropped): a top
        `fin` above a step means no decode finishes by it (read-only outside)."""
        self.hseq = 0
        """The last heap sequence number given (the engine's step adds decodes inline, as
        `add` does: it runs for every call)."""

    def add(self, req: Request) -> None:
        self.count += 1
        base = req.base
        self.sum_k += base + 1
        self.phase[-base & self._mask] += 1
        self.hseq = hseq = self.hseq + 1
        req.hseq = hseq
        heapq.heappush(self.heap, (req.fin, hseq, req))

    def remove(self, req: Request) -> None:
        """Take a decoding request out (its heap entry goes stale)."""
        self.count -= 1
        self.sum_k -= req.base + 1
        self.phase[-req.base & self._mask] -= 1
        req.hseq = -1

    def kv_tokens(self, s: int) -> int:
        """KV-cache tokens the decodes read in step `s`."""
        return self.sum_k + self.count * s

    def step_blocks(self, s: int) -> int:
        """Blocks the decodes allocate in step `s`."""
        return self.phase[s & self._mask]

    def blocks(self, s: int, steps: int) -> int:
        """Blocks the decodes allocate in `steps` steps from step `s`."""
        if not self.count or steps <= 0:
            return 0
        size, mask = self._size, self._mask
        # divmod(steps, size) for a power-of-two size, without the builtin's call
        cycles, rest = steps // size, steps & mask
        need = cycles * self.count
        if rest:
            phase = self.phase
            first = s & mask
            end = first + rest
            if end <= size:
                need += sum(phase[first:end])
            else:
                need += sum(phase[first:]) + sum(phase[: end - size])
        return need

    def next_fin(self) -> int:
        """The step counter after the next decode's last step (some request decodes)."""
        heap = self.heap
        while heap[0][2].hseq != heap[0][1]:
            heapq.heappop(heap)  # stale: the request left decoding since
        return heap[0][0]

    def pop_finished(self, s: int) -> list[Request]:
        """Take out the decodes whose last step ends by step `s`, in finishing order."""
        heap, heappop, mask, phase = self.heap, heapq.heappop, self._mask, self.phase
        done: list[Request] = []
        while heap and heap[0][0] <= s:
            _, hseq, req = heappop(heap)
            if req.hseq == hseq:
                # `remove`, inlined: a finish takes every decode out this way
                self.count -= 1
                self.sum_k -= req.base + 1
                phase[-req.base & mask] -= 1
                req.hseq = -1
                done.append(req)
        return done
