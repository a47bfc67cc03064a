"""vLLM V1's scheduler as an engine model of one instance: `VllmV1EngineModel` ("vllm-v1").

It follows vLLM V1's `Scheduler.schedule` and `KVCacheManager` at the level of steps
(docs/design.md, "Simulated engine", has the whole story; the measurements are in
docs/experiments/2026-12-01-vllm-v1-engine-model.md):

- A step schedules at most `max_num_batched_tokens` tokens (vLLM's OpenAI-server default:
  2048; 8192 on GPUs of 70 GiB or more other than the A100) over at most `max_num_seqs`
  (`spec.max_batch`) requests. Running requests go first, in the order they started (a
  decode is one token, a prompt being prefilled takes what is left: chunked prefill); then
  waiting requests start, in order, while fewer than `max_num_seqs` run and nobody was
  preempted in the step; the first whose blocks do not fit stops the others.
- Step time = the prefill cost of the chunks + a + b x decodes + c x KV tokens the decodes
  read. Chunks cost the call's own prefill spread along the calibration's prefill curve, so
  a prompt alone costs exactly its calibrated prefill; (a, b, c) is
  `LatencyModel.decode_step_fit`. The last prefill chunk samples the first output token.
- KV blocks of 16 tokens, allocated as tokens are computed. A waiting request starts only
  if the blocks of its whole prompt (plus what it generated before a preemption) fit:
  vLLM's `scheduler_reserve_full_isl`, on by default in current releases; `admit_full_prompt=False`
  checks only the first chunk, as earlier V1 releases did.
- When a running request cannot get a block, the request that started last is preempted
  (vLLM's FCFS rule) until the block fits: its blocks are freed, and it goes back to the
  front of the waiting list to recompute its prompt and the tokens it generated.
- Prefix caching (off by default) assumes, since a call carries no prompt text, that calls
  of one query with the same step type share the first `prefix_share` of their prompt: its
  full blocks are cached as they are computed and reused by later such calls; unused
  cached blocks count as free and are evicted least recently used first
  (`hexgen_flow.sim.prefix_cache` keeps the entries).
- `fits` (the urgency queue's admission check) accepts a call while running + waiting
  requests are fewer than `max_num_seqs` and the free blocks, less those the waiting
  requests need to start, hold what the call needs to start.

Speed: runs of steps of one shape (the same decodes, plus one prompt taking the whole
leftover budget, or waiting requests that cannot start) are one segment with a closed-form
duration, ended by the first finish, the step where the prompt completes or the blocks run
out, and cut at the step in progress when a call arrives or leaves. Decodes are tracked in
aggregate (`hexgen_flow.sim.vllm_v1_requests`, with the request record): a global step
counter gives each its context and output, a heap its last step, and 16 counters (by block
phase) the blocks any number of steps allocate.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Final

from hexgen_flow.cluster import InstanceSpec
from hexgen_flow.errors import ConfigError
from hexgen_flow.latency import DecodeStepFit
from hexgen_flow.prefix import DEFAULT_PREFIX_SHARE
from hexgen_flow.runtime import CallTicket
from hexgen_flow.sim.prefix_cache import PrefixCache, PrefixEntry
from hexgen_flow.sim.vllm_v1_requests import (
    DECODE,
    FINISHED,
    PREFILL,
    WAITING,
    DecodeBatch,
    Request,
)

__all__ = [
    "BLOCK_SIZE",
    "VllmV1EngineModel",
    "default_max_num_batched_tokens",
]

BLOCK_SIZE: Final = 16
"""vLLM's default KV-cache block size on CUDA, in tokens."""
_MASK: Final = BLOCK_SIZE - 1  # a step's block phase: the step counter & _MASK (`DecodeBatch`)

SCALES_MAX: Final = 1 << 16
"""(input, output) token pairs an engine keeps the prefill scale of (`_scale`)."""

_SERVER_BATCHED_TOKENS: Final = 2048
_LARGE_GPU_SERVER_BATCHED_TOKENS: Final = 8192


def default_max_num_batched_tokens(spec: InstanceSpec) -> int:
    """vLLM's default token budget per step for an OpenAI-compatible server on `spec`'s GPU:
    8192 on GPUs of 70 GiB or more except the A100 (where vLLM measured a larger budget to
    cost throughput), else 2048; never below `max_num_seqs`, which vLLM requires."""
    gpu = spec.latency.hardware.gpu
    a100 = any("a100" in name.lower() for name in (gpu.name, *gpu.aliases))
    large = gpu.memory_gib >= 70 and not a100
    return max(
        _LARGE_GPU_SERVER_BATCHED_TOKENS if large else _SERVER_BATCHED_TOKENS, spec.max_batch
    )


def _blocks(tokens: int) -> int:
    """Blocks that hold `tokens` (the hot paths write it out: ``-(-tokens // BLOCK_SIZE)``)."""
    return -(-tokens // BLOCK_SIZE)


class VllmV1EngineModel:
    """Execution state of one instance under vLLM V1's scheduler; the caller drives it with
    times it chooses (the interface of `BatchingEngineModel`)."""

    def __init__(
        self,
        spec: InstanceSpec,
        *,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = False,
        prefix_share: float = DEFAULT_PREFIX_SHARE,
        admit_full_prompt: bool = True,
        coalesce: bool = True,
    ) -> None:
        budget = default_max_num_batched_tokens(spec)
        if max_num_batched_tokens is not None:
            budget = max_num_batched_tokens
        if budget < spec.max_batch:
            raise ConfigError(
                f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({spec.max_batch})"
            )
        if not 0.0 <= prefix_share <= 1.0:
            raise ConfigError(f"prefix_share must be in [0, 1], got {prefix_share}")
        self.kv_capacity = spec.kv_cache_tokens
        self.max_batch = spec.max_batch
        self.max_num_batched_tokens = budget
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_share = prefix_share
        self.admit_full_prompt = admit_full_prompt
        self.coalesce = coalesce
        """Whether runs of same-shaped steps are one segment (False: every step is one
        event, the reference the coalesced model must agree with)."""
        self.step_fit: DecodeStepFit = spec.latency.decode_step_fit(
            spec.max_batch, spec.kv_cache_tokens
        )
        """The decode-step plane a + b x batch + c x KV tokens this engine charges."""
        self._a, self._b, self._c = self.step_fit.a_s, self.step_fit.b_s, self.step_fit.c_s
        self._latency = spec.latency
        self._curve = spec.latency.prefill_curve_s
        self._table = spec.latency.prefill_curve_table
        """The prefill curve by prompt tokens, up to its length (`_curve` beyond)."""
        self._scales: dict[tuple[int, int], float] = {}
        """A call's prefill over the prefill curve at its prompt, by (input, output)."""
        self._total_blocks = _blocks(spec.kv_cache_tokens)
        self.running = 0
        """Calls handed to the engine and not yet finished (waiting, running or finishing)."""
        self.preemptions = 0
        """Requests preempted so far (each preemption of a request counts)."""
        self._used = 0  # blocks held by requests and by prefix entries in use
        self._S = 0  # steps executed
        self._t = 0.0  # end of the last committed step
        self._busy = False  # that step has not been reached by `advance` yet
        self._reqs: dict[CallTicket, Request] = {}
        self._order: dict[Request, None] = {}  # running requests in the order they started
        self._tail: Request | None = None  # the running request still prefilling, if any
        self._waiting: deque[Request] = deque()
        self._waiting_blocks = 0  # blocks the waiting requests need to start
        self._pending: list[tuple[Request, int]] = []  # finished in the committed step, blocks
        self._dec = DecodeBatch(BLOCK_SIZE)  # the decoding requests, in aggregate
        # the planned segment of same-shaped steps (none while _run_n == 0)
        self._run_n = 0
        self._run_t0 = 0.0
        self._run_end = 0.0
        self._run_s0 = 0
        self._run_d = 0
        self._run_const = 0.0
        self._run_beta = 0
        self._run_c0 = 0
        self._run_blocks = 0
        self._run_tail: Request | None = None
        # the prefix cache: the blocks of its unused entries are free ones, not in _used
        self._prefixes = PrefixCache(BLOCK_SIZE)

    # ------------------------------------------------------------------ the engine interface

    @property
    def kv_used(self) -> int:
        """KV-cache tokens in allocated blocks (including the planned segment's)."""
        return (self._used + self._run_blocks) * BLOCK_SIZE

    def fits(self, ticket: CallTicket) -> bool:
        if len(self._order) + len(self._waiting) >= self.max_batch:
            return False
        start = ticket.call.input_tokens
        if start > self.max_num_batched_tokens and not self.admit_full_prompt:
            start = self.max_num_batched_tokens
        free = self._total_blocks - self._used - self._run_blocks - self._waiting_blocks
        return (start + BLOCK_SIZE - 1) // BLOCK_SIZE <= free

    def admit(self, ticket: CallTicket, now: float) -> None:
        """Put `ticket` on the waiting list at `now` (the caller checked `fits`)."""
        if self._run_n:
            self._sync(now)
        if not (self._busy or self._order or self._waiting) and self._t < now:
            self._t = now  # idle: the next step starts now
        call = ticket.call
        tokens = call.input_tokens
        key: object = None
        pblocks = 0
        if self.enable_prefix_caching:
            key = (ticket.query_id, call.step)
            pblocks = int(self.prefix_share * tokens) // BLOCK_SIZE
        out = ticket.output_tokens  # what it really generates (its call may be a belief)
        scale = self._scales.get((tokens, out))
        if scale is None:
            scale = self._scale(tokens, out)
        # `_push_waiting(req, front=False)`, inlined (this runs for every call): its
        # target is its prompt
        start = tokens
        if start > self.max_num_batched_tokens and not self.admit_full_prompt:
            start = self.max_num_batched_tokens
        first = -(-start // BLOCK_SIZE)
        req = Request(ticket, tokens, out, scale, key, pblocks, first)
        self._reqs[ticket] = req
        self._waiting.append(req)
        self._waiting_blocks += first
        self.running += 1
        ticket.admitted_s = now

    def _scale(self, input_tokens: int, output_tokens: int) -> float:
        """A call's calibrated prefill over the prefill curve at its prompt: what its chunks'
        curve costs scale by, so that the prompt alone costs exactly its prefill."""
        scale = self._scales.get((input_tokens, output_tokens))
        if scale is None:
            prefill = self._latency.split(input_tokens, output_tokens)[0]
            curve = self._curve(input_tokens)
            scale = prefill / curve if curve > 0 else 0.0
            if len(self._scales) >= SCALES_MAX:  # a service sees endless token counts
                self._scales.clear()
            self._scales[(input_tokens, output_tokens)] = scale
        return scale

    def abort(self, ticket: CallTicket, now: float) -> bool:
        """Stop a call at `now` and free its blocks; False if it is not here."""
        req = self._reqs.pop(ticket, None)
        if req is None:
            return False
        self._sync(now)
        if req.state == WAITING:
            self._waiting.remove(req)
            self._waiting_blocks -= req.first
        elif req.state == FINISHED:
            for i, (held, blocks) in enumerate(self._pending):
                if held is req:
                    del self._pending[i]
                    self._free(req, blocks)
                    break
        else:
            self._release(req)
        self.running -= 1
        return True

    def next_event_s(self) -> float:
        """When the state next changes by itself: the end of the planned segment or of the
        step in progress.

        At a step boundary with work, this is where the next step is planned (vLLM
        schedules a step when the previous one ends): every call handed over before it is
        asked, such as the calls that the boundary's finished calls released, joins it.
        """
        if self._run_n:
            return self._run_end
        if self._busy:
            return self._t
        if not (self._order or self._waiting):
            return float("inf")
        # At a step boundary: plan a segment of same-shaped steps, else commit one step
        # (what was `_plan`, inlined here: it runs at about every other event).
        s = self._S
        free = self._total_blocks - self._used
        tail = self._tail
        dec = self._dec
        d = dec.count
        n = 0
        if not self.coalesce:
            pass
        elif tail is not None:
            beta = self.max_num_batched_tokens - d
            n = (tail.target - tail.done - 1) // beta  # steps the prompt takes all budget
        elif d:
            # `_waiting_blocked(s, free)`, inlined (it runs at most step boundaries)
            waiting = self._waiting
            if (
                not waiting
                or len(self._order) >= self.max_batch
                or self._start_need(waiting[0])[1] > free - dec.phase[s & _MASK]
            ):
                n = 1 << 62
        if n > 0 and d:
            top = dec.heap[0]
            # `dec.next_fin()` when the heap's top is live (it nearly always is)
            left = (top[0] if top[2].hseq == top[1] else dec.next_fin()) - s
            n = left if left < n else n  # min(n, left), without the builtin's call
        if n > 0:
            # Within a segment no cached prefix may be evicted: an eviction can unblock the
            # waiting head (it no longer has cached blocks to take back), so it ends one.
            free -= self._prefixes.cached_free
            blocks = dec.blocks(s, n) if d else 0
            if tail is not None:
                done = tail.done
                beta = self.max_num_batched_tokens - d
                blocks += -(-(done + n * beta) // BLOCK_SIZE) + (-done // BLOCK_SIZE)
            if blocks > free:  # the most steps whose blocks fit, fewer than n
                n, blocks = self._fit_blocks(n, free)
            if n > 0:
                # Start the segment (once `_start_run`, inlined: a segment is planned about
                # every other event): its constants and its end
                self._run_s0, self._run_d, self._run_tail = s, d, tail
                kv = dec.sum_k + d * s  # `dec.kv_tokens(s)`
                self._run_const = self._a + self._b * d + self._c * kv if d else 0.0
                if tail is not None:
                    self._run_beta = self.max_num_batched_tokens - d
                    self._run_c0 = tail.done
                else:
                    self._run_beta = self._run_c0 = 0
                self._run_blocks = blocks
                self._run_n = n
                self._run_t0 = t = self._t
                self._run_end = end = t + self._run_dur(n)
                return end
        self._step()
        return self._t

    def peek_event_s(self) -> float:
        """`next_event_s` without planning: at a step boundary, the boundary itself."""
        if self._run_n:
            return self._run_end
        if self._busy or self._order or self._waiting:
            return self._t
        return float("inf")

    def advance(self, now: float) -> list[CallTicket]:
        """Move the engine to `now`; return the calls that finished, in finishing order
        (the engine moves on only when `next_event_s` plans its next step)."""
        if self._run_n and self._run_end <= now:
            self._commit_run(self._run_n)
        if not self._busy or self._t > now:
            return []
        self._busy = False
        pending = self._pending
        if not pending:
            return []
        done: list[CallTicket] = []
        reqs, prefixes, t = self._reqs, self._prefixes, self._t
        used = self._used
        for req, blocks in pending:
            used -= blocks
            # `_free`'s `prefixes.release(req)`, inlined (every call finishes here): the
            # entry's blocks stop being used when this was its last user
            entry = req.entry
            req.shared = 0
            if entry is not None:
                req.entry = None
                entry.refs -= 1
                if not entry.refs:
                    prefixes.cached_free += entry.blocks
                    prefixes.evictable[req.key] = entry  # the most recently used
                    used -= entry.blocks
            ticket = req.ticket
            del reqs[ticket]
            ticket.finished_s = t
            done.append(ticket)
        self._used = used
        self.running -= len(done)
        pending.clear()
        return done

    def progress(self, ticket: CallTicket) -> tuple[int, int] | None:
        """(tokens of the call in the KV cache, output tokens generated) as of the steps
        committed so far; None when the call is not here (or was reported finished)."""
        req = self._reqs.get(ticket)
        if req is None:
            return None
        if req.state == DECODE:
            return req.base + self._S, req.out - (req.fin - self._S)
        return req.done, req.gen

    # ------------------------------------------------------------------ planning

    def _waiting_blocked(self, s: int, free: int) -> bool:
        """Whether no waiting request can start in step `s` with `free` blocks (`next_event_s`
        inlines it)."""
        waiting = self._waiting
        if not waiting or len(self._order) >= self.max_batch:
            return True
        decodes = self._dec.step_blocks(s) if self._dec.count else 0
        return self._start_need(waiting[0])[1] > free - decodes

    def _start_need(self, req: Request) -> tuple[int, int, PrefixEntry | None]:
        """(cached blocks a waiting request would start with, the free blocks it needs to
        start: its own beyond them plus those of its entry that nobody uses now, the
        entry): `prefixes.lookup` and `_start_blocks` in one call (`_step` inlines it)."""
        key = req.key
        if key is None or req.done:
            return 0, req.first, None
        entry = self._prefixes.entries.get(key)
        if entry is None:
            return 0, req.first, None
        # `prefixes.lookup(req)`: never its last prompt token (that step samples the first
        # output), min()s without the builtin's call
        cached = hit = entry.blocks
        pblocks = req.pblocks
        hit = pblocks if pblocks < hit else hit
        last = (req.target - 1) // BLOCK_SIZE
        hit = last if last < hit else hit
        if not hit:
            return 0, req.first, entry
        revive = cached if not entry.refs else 0
        if self.admit_full_prompt:
            return hit, -(-req.target // BLOCK_SIZE) - hit + revive, entry
        return hit, self._start_blocks(req, hit) + revive, entry

    def _fit_blocks(self, n: int, free: int) -> tuple[int, int]:
        """The most steps, up to n, of the segment that would start now whose blocks fit,
        and the blocks they allocate (`next_event_s` checked n itself)."""
        s, tail, dec = self._S, self._tail, self._dec
        beta = self.max_num_batched_tokens - dec.count
        c0 = tail.done if tail is not None else 0

        def need(k: int) -> int:
            if tail is None:
                return dec.blocks(s, k)
            return dec.blocks(s, k) + _blocks(c0 + k * beta) - _blocks(c0)

        lo, hi = 0, n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if need(mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo, need(lo)

    def _run_dur(self, k: int) -> float:
        """Seconds of the segment's first k steps."""
        d = self._run_d
        dur = k * self._run_const + self._c * d * k * (k - 1) / 2 if d else 0.0
        tail = self._run_tail
        if tail is not None:
            # `_chunk_s(tail, c0, c0 + k x beta)`, inlined: `_sync` bisects on this
            table, c0 = self._table, self._run_c0
            end = c0 + k * self._run_beta
            cost = table[end] if end < len(table) else self._curve(end)
            if c0:
                cost -= table[c0] if c0 < len(table) else self._curve(c0)
            dur += tail.scale * cost if cost > 0 else 0.0
        return dur

    def _sync(self, now: float) -> None:
        """Cut the planned segment at the step in progress at `now` and commit it."""
        n = self._run_n
        if not n:
            return
        t0 = self._run_t0
        lo, hi = 0, n  # steps ended before now: lo; the step in progress: hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if t0 + self._run_dur(mid) < now:
                lo = mid
            else:
                hi = mid
        self._commit_run(hi)

    def _commit_run(self, k: int) -> None:
        tail = self._run_tail
        if k == self._run_n:
            # The whole segment: it ends where `next_event_s` summed, with the blocks
            # `_fit_blocks` counted (one allocation of them evicts as the two below would).
            self._t = self._run_end
            # `_alloc(self._run_blocks)`, inlined: every segment that runs to its end
            self._used = used = self._used + self._run_blocks
            free = self._total_blocks - used
            if self._prefixes.cached_free > free:
                self._prefixes.evict(free)
            if tail is not None:
                tail.done = self._run_c0 + k * self._run_beta
        else:
            self._t = self._run_t0 + self._run_dur(k)
            self._alloc(self._dec.blocks(self._run_s0, k))
            if tail is not None:
                done = self._run_c0 + k * self._run_beta
                self._alloc(_blocks(done) - _blocks(tail.done))
                tail.done = done
        self._run_n = 0
        self._run_blocks = 0
        self._busy = True
        if tail is not None and tail.key is not None and tail.shared < tail.pblocks:
            self._prefixes.register(tail)  # (nothing to do once its prefix is shared)
        self._S = s = self._run_s0 + k
        heap = self._dec.heap
        if heap and heap[0][0] <= s:
            self._finish_decodes()

    # ------------------------------------------------------------------ one step

    def _step(self) -> None:
        """Schedule and commit one step at the boundary `_t` (vLLM's `schedule`)."""
        # Runs for every step that is not part of a segment: the blocks in use are a local
        # (written back before any helper that reads or frees them), `len(table)` is read
        # once, and `_alloc` and what was `_to_decode` are inlined.
        s = self._S
        budget = self.max_num_batched_tokens
        total = self._total_blocks
        prefixes = self._prefixes
        table = self._table
        tlen = len(table)
        curve = self._curve
        preempted = False
        dec = self._dec
        if dec.count:
            need = dec.phase[s & _MASK]  # `dec.step_blocks(s)`
            if need > total - self._used:
                preempted = self._preempt_for_decodes(s)
            elif need:
                self._used += need
                if prefixes.cached_free > total - self._used:
                    prefixes.evict(total - self._used)
        d = dec.count  # after any preemption
        budget -= d
        cost = 0.0
        # A step's fixed cost (scheduler, model runner, sampler) is paid once however many
        # prompts join it: the largest new prompt's prefill intercept, or the decode plane's
        # `a`; each prompt chunk adds only its marginal cost (`_chunk_s` with `marginal`,
        # inlined).
        fixed = 0.0
        prefilled: list[Request] | None = None
        tail = self._tail
        if tail is not None and not preempted:
            start = tail.done
            chunk = tail.target - start
            chunk = budget if budget < chunk else chunk  # min(chunk, budget)
            end = start + chunk
            grow = (end + BLOCK_SIZE - 1) // BLOCK_SIZE - (start + BLOCK_SIZE - 1) // BLOCK_SIZE
            if grow > total - self._used:
                self._release(tail)  # the tail of the running list preempts itself
                self._preempted(tail)
                preempted = True
            else:
                if grow:
                    self._used += grow
                    if prefixes.cached_free > total - self._used:
                        prefixes.evict(total - self._used)
                if start == 0:
                    fixed = tail.scale * table[0]  # `_intercept_s`
                marginal = table[end] if end < tlen else curve(end)
                marginal -= table[start] if start < tlen else curve(start)
                cost += tail.scale * marginal if marginal > 0 else 0.0
                tail.done = end
                budget -= chunk
                if tail.key is not None and tail.shared < tail.pblocks:
                    prefixes.register(tail)  # (nothing to do once its prefix is shared)
                if end == tail.target:
                    prefilled = [tail]
                    self._tail = None
        waiting = self._waiting
        if not preempted and waiting and budget > 0:
            order = self._order
            max_batch = self.max_batch
            intercept = table[0]  # the curve at zero tokens, as `_intercept_s` reads it
            used = self._used  # written back after the loop: nothing in it frees blocks
            t = self._t
            entries = prefixes.entries
            full_prompt = self.admit_full_prompt
            # Every call starts in this loop once: the prefix cache's `lookup`, `attach` and
            # `register` and `_start_blocks` are inlined (a Python call costs about as much
            # as what each does). A request has a prefix key only with prefix caching.
            while waiting and budget > 0 and len(order) < max_batch:
                req = waiting[0]
                key = req.key
                hit = 0
                need = req.first
                entry = entries.get(key) if key is not None and not req.done else None
                if entry is not None:
                    # `prefixes.lookup(req)`: never its last prompt token (that step samples
                    # the first output); min()s without the builtin's call
                    cached = hit = entry.blocks
                    pblocks = req.pblocks
                    hit = pblocks if pblocks < hit else hit
                    last = (req.target - 1) // BLOCK_SIZE
                    hit = last if last < hit else hit
                    if hit:
                        if full_prompt:
                            need = -(-req.target // BLOCK_SIZE) - hit
                        else:
                            need = self._start_blocks(req, hit)
                        if not entry.refs:
                            need += cached  # its entry's blocks leave the free pool
                if need > total - used:
                    if order or not hit:
                        break
                    hit = 0  # an idle engine starts it without the cached prefix, not never
                waiting.popleft()
                ticket = req.ticket
                if ticket.scheduled_s is None:
                    ticket.scheduled_s = t  # this step's start
                self._waiting_blocks -= req.first
                if hit and entry is not None:  # (a hit has an entry)
                    # `prefixes.attach(req, hit)`
                    if not entry.refs:  # cached but unused: its blocks leave the free pool
                        del prefixes.evictable[key]
                        prefixes.cached_free -= cached
                        used += cached
                    entry.refs += 1
                    req.entry = entry
                    req.shared = hit
                    req.done = hit * BLOCK_SIZE
                    ticket.cached_tokens = hit * BLOCK_SIZE
                start = req.done
                chunk = req.target - start
                chunk = budget if budget < chunk else chunk  # min(chunk, budget)
                end = start + chunk
                grow = (end + BLOCK_SIZE - 1) // BLOCK_SIZE - (start + BLOCK_SIZE - 1) // BLOCK_SIZE
                if grow:
                    used += grow
                    if prefixes.cached_free > total - used:
                        prefixes.evict(total - used)
                scale = req.scale
                first = scale * intercept
                fixed = first if first > fixed else fixed  # max(fixed, first)
                marginal = table[end] if end < tlen else curve(end)
                marginal -= table[start] if start < tlen else curve(start)
                cost += scale * marginal if marginal > 0 else 0.0
                req.done = end
                budget -= chunk
                req.state = PREFILL
                order[req] = None
                if key is not None:
                    # `prefixes.register(req)`: its full prefix blocks computed beyond its
                    # entry's become the entry's
                    computed, pblocks = end // BLOCK_SIZE, req.pblocks
                    computed = pblocks if pblocks < computed else computed
                    if computed > req.shared:
                        entry = req.entry
                        if entry is None and key not in entries:
                            entry = entries[key] = PrefixEntry()
                            entry.refs = 1
                            req.entry = entry
                        if entry is not None and computed > entry.blocks:
                            req.shared += computed - entry.blocks
                            entry.blocks = computed
                if end == req.target:
                    if prefilled is None:
                        prefilled = [req]
                    else:
                        prefilled.append(req)
                else:
                    self._tail = req
            self._used = used
        if d:
            a = self._a
            # (`dec.kv_tokens(s)` inline)
            cost += (a if a > fixed else fixed) + self._b * d + self._c * (dec.sum_k + d * s)
        else:
            if not self._order:
                raise RuntimeError("vllm-v1 engine model: a step with nothing to run")
            cost += fixed
        self._S = s = s + 1
        self._t += cost
        self._busy = True
        heap = dec.heap
        if heap and heap[0][0] <= s:
            self._finish_decodes()
        if prefilled is not None:
            t = self._t
            for req in prefilled:
                if req.ticket.first_token_s is None:  # (a preempted call's recompute: not again)
                    req.ticket.first_token_s = t
                req.gen += 1  # the last chunk's step samples the next token
                if req.gen >= req.out:
                    del self._order[req]
                    req.state = FINISHED
                    self._pending.append((req, -(-req.done // BLOCK_SIZE) - req.shared))
                else:  # `_to_decode`, inlined: its first decode step is s
                    req.state = DECODE
                    req.base = base = req.done - s
                    req.fin = fin = s + req.out - req.gen
                    # `dec.add(req)`, inlined (every call starts decoding here)
                    dec.count += 1
                    dec.sum_k += base + 1
                    dec.phase[-base & _MASK] += 1
                    dec.hseq = hseq = dec.hseq + 1
                    req.hseq = hseq
                    heapq.heappush(heap, (fin, hseq, req))

    def _preempt_for_decodes(self, s: int) -> bool:
        """Allocate this step's decode blocks in running order, preempting from the tail of
        the running list while they do not fit (rare: only when the cache is full)."""
        order = list(self._order)
        mask = BLOCK_SIZE - 1
        i = 0
        while i < len(order):
            req = order[i]
            if req.state != DECODE:
                break  # the prefilling tail: scheduled after the decodes
            need = 1 if (req.base + s) & mask == 0 else 0
            while need > self._total_blocks - self._used:
                victim = order.pop()
                self._release(victim)
                self._preempted(victim)
                if victim is req:
                    return True
            self._alloc(need)
            i += 1
        return True  # called only when the blocks did not fit: someone was preempted

    # ------------------------------------------------------------------ request states

    def _finish_decodes(self) -> None:
        """Move the decodes whose last step is committed to the finished list."""
        s = self._S
        order, pending = self._order, self._pending
        dec = self._dec
        heap, phase = dec.heap, dec.phase
        heappop = heapq.heappop
        # `dec.pop_finished(s)`, inlined (every decode finishes here): stale heap entries
        # (requests that left decoding) are dropped
        while heap and heap[0][0] <= s:
            _, hseq, req = heappop(heap)
            if req.hseq != hseq:
                continue
            base = req.base
            dec.count -= 1
            dec.sum_k -= base + 1
            phase[-base & _MASK] -= 1
            req.hseq = -1
            req.done = done = base + s  # its tokens in the KV cache, for `progress`
            req.gen = req.out
            del order[req]
            req.state = FINISHED
            pending.append((req, -(-done // BLOCK_SIZE) - req.shared))

    def _release(self, req: Request) -> None:
        """Take a running request out of the running list and free its blocks."""
        if req.state == DECODE:
            blocks = _blocks(req.base + self._S)
            self._dec.remove(req)
            req.gen = req.out - (req.fin - self._S)
        else:
            blocks = _blocks(req.done)
            if req is self._tail:
                self._tail = None
        del self._order[req]
        self._free(req, blocks - req.shared)

    def _preempted(self, req: Request) -> None:
        """A released request goes back to the front of the waiting list to recompute."""
        self.preemptions += 1
        req.state = WAITING
        req.target = req.prompt + req.gen
        req.done = 0
        self._push_waiting(req, front=True)

    def _push_waiting(self, req: Request, *, front: bool) -> None:
        if front:
            self._waiting.appendleft(req)
        else:
            self._waiting.append(req)
        start = req.target
        if not self.admit_full_prompt:
            start = min(start, self.max_num_batched_tokens)
        req.first = -(-start // BLOCK_SIZE)
        self._waiting_blocks += req.first

    def _start_blocks(self, req: Request, hit: int) -> int:
        """Blocks a waiting request needs to start, beyond the `hit` cached ones: those of
        its whole prompt (`admit_full_prompt`), else of its first chunk."""
        if not hit:
            return req.first
        if self.admit_full_prompt:
            return _blocks(req.target) - hit
        start = hit * BLOCK_SIZE
        return _blocks(start + min(req.target - start, self.max_num_batched_tokens)) - hit

    def _curve_s(self, tokens: int) -> float:
        table = self._table
        return table[tokens] if tokens < len(table) else self._curve(tokens)

    def _intercept_s(self, req: Request) -> float:
        """The fixed part of a step that starts `req`'s prompt: its prefill curve at zero
        tokens (the profile's time to first token extrapolated to an empty prompt)."""
        return req.scale * self._table[0]

    def _chunk_s(self, req: Request, start: int, end: int, marginal: bool = False) -> float:
        """Seconds of computing tokens [start, end) of a request's prefill; with `marginal`,
        without the curve's intercept (the step's fixed cost, charged once per step)."""
        cost = self._curve_s(end)
        if start or marginal:
            cost -= self._curve_s(start)
        return req.scale * cost if cost > 0 else 0.0

    # ------------------------------------------------------------------ blocks

    def _alloc(self, blocks: int) -> None:
        self._used += blocks
        # Unused cached prefixes are free blocks: evict those the allocation needs (the
        # check first, as most allocations need none).
        free = self._total_blocks - self._used
        if self._prefixes.cached_free > free:
            self._prefixes.evict(free)

    def _free(self, req: Request, own_blocks: int) -> None:
        self._used -= own_blocks
        self._used -= self._prefixes.release(req)  # its entry's, if it was the last user
