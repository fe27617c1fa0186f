"""The one allocator of a request's KV blocks.

Nothing else hands blocks to a request or takes them back: admission (prefix lookup, then
allocation, for a whole family at once), growth, the fork of a family sample, registration of
full blocks in the prefix cache, swap out and in, and the free behind the fence. The fence:
a block is never returned to the pool while a step that may write it is in flight; such
blocks wait in `deferred` until `step_processed` reaches the step that fenced them.

The manager is the last holder of the one release (lifecycle.py): by the time it frees a
request's blocks, everything else of the request is gone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from stopline.kv.block_pool import BlockPool, LedgerError, extend_hashes
from stopline.kv.kv_cache import KVCache, SwapSpace
from stopline.request import FinishReason, Request, RequestStatus
from stopline.stats import StopStats


@dataclass
class _Deferred:
    fence: int  # the newest step that may still write the blocks
    blocks: list[int]
    keep_cached: bool
    aborted_at: float | None


class KVManager:
    name = "kv"

    def __init__(self, pool: BlockPool, cache: KVCache | None, swap: SwapSpace | None,
                 stats: StopStats, *, prefix_caching: bool = True,
                 keep_aborted_prefix: bool = True) -> None:
        self.pool = pool
        self.cache = cache
        self.swap = swap
        self.stats = stats
        self.prefix_caching = prefix_caching
        self.keep_aborted_prefix = keep_aborted_prefix
        self.block_size = pool.block_size
        self.deferred: list[_Deferred] = []
        self.last_processed_step = -1
        # Requests (internal ids) whose KV was computed, at least in part, under weights the
        # engine no longer serves: their blocks never enter the prefix cache.
        self.stale: set[int] = set()

    # ---- counts -------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @property
    def num_available(self) -> int:
        return self.pool.num_available

    def in_flight(self, req: Request) -> bool:
        """A step that may write req's blocks has not been processed yet."""
        return req.last_scheduled_step > self.last_processed_step

    # ---- allocation ---------------------------------------------------------------------
    def block_hashes(self, req: Request, n_blocks: int) -> list[int]:
        """Chained hashes of req's first n_blocks full blocks (prompt, then output), each
        computed once per request: a request at the head of the queue is looked up again at
        every step until it fits."""
        if len(req.block_hashes) < n_blocks:
            extend_hashes(req.block_hashes, req.all_token_ids, self.block_size, n_blocks)
        return req.block_hashes[:n_blocks]

    def admit(self, req: Request, reserve: int) -> bool:
        """Blocks for every token req has (its prompt, or for a preempted request everything
        it must recompute), prefix hits first, and for a family leader its waiting samples'
        tables too (the shared full prompt blocks plus an own copy of the partial last one).
        All or nothing: False, with nothing taken, unless that plus `reserve` blocks fit."""
        bs = self.block_size
        samples = req.forks_pending
        total = self.blocks_for(req.num_tokens)
        hits: list[int] = []
        if self.prefix_caching and not req.scores_prompt:
            # Never cover the last token: its logits must be computed. A preempted request
            # also finds its own generated blocks, if nobody has needed their room since.
            # A prompt still being scored computes every position: no logits are cached.
            hits = self.pool.lookup(self.block_hashes(req, (req.num_tokens - 1) // bs))
        hits_free = sum(1 for b in hits if self.pool.refcount[b] == 0)
        partial = 1 if req.prompt_len % bs else 0
        need = total - len(hits) + hits_free + len(samples) * partial
        if not self.pool.can_allocate(need + reserve):
            return False
        self.pool.touch(hits)
        req.block_ids = hits + self.pool.allocate(total - len(hits))
        req.num_computed = len(hits) * bs
        req.num_hashed_blocks = len(hits)
        shared = req.block_ids[: req.prompt_len // bs]
        for m in samples:
            self.pool.touch(shared)
            m.block_ids = list(shared) + (self.pool.allocate(1) if partial else [])
        return True

    def import_prefix(self, token_ids: Sequence[int], n_blocks: int,
                      write: Callable[[list[int]], None]) -> int:
        """Blocks computed elsewhere (a prefill engine, stopline/disagg) enter the prefix
        cache: allocate n_blocks, `write` fills them, register their chained hashes, drop the
        reference (cached, refcount 0). The request is admitted at the same step boundary and
        finds them as prefix hits. Returns the blocks imported: 0 when the pool has no room
        (the request then computes its prompt here). If `write` raises, the blocks go back
        to the free pool unhashed and the error propagates."""
        if not self.prefix_caching:
            raise ValueError("importing a prefix needs prefix caching")
        if n_blocks <= 0 or not self.pool.can_allocate(n_blocks):
            return 0
        hashes = extend_hashes([], token_ids, self.block_size, n_blocks)
        blocks = self.pool.allocate(n_blocks)
        try:
            write(blocks)
        except BaseException:
            self.pool.release(blocks, keep_cached=False)
            raise
        for b, h in zip(blocks, hashes, strict=True):
            self.pool.register(b, h)
        self.pool.release(blocks)
        return n_blocks

    def admit_need(self, req: Request) -> int:
        """Blocks admitting req would take at the least (for a never-fits check)."""
        return self.blocks_for(req.num_tokens + 1) + len(req.forks_pending)

    def grow(self, req: Request, upto: int) -> bool:
        """Make req's table cover `upto` tokens; False (nothing taken) if the pool can't."""
        need = self.blocks_for(upto) - len(req.block_ids)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        req.block_ids += self.pool.allocate(need)
        return True

    def trim(self, req: Request) -> None:
        """Give back the blocks past req's computed tokens: those that only rejected drafts
        opened (speculative decoding). Behind the fence, like any free: the step that wrote
        them is the one being processed. They were never registered, so never cached."""
        keep = self.blocks_for(req.num_computed)
        if len(req.block_ids) > keep:
            extra, req.block_ids = req.block_ids[keep:], req.block_ids[:keep]
            self._free(req, extra, keep_cached=False, aborted_at=None)

    def fork(self, sample: Request, leader: Request) -> None:
        """A family sample takes its own copy of the leader's last, partial prompt block."""
        bs = self.block_size
        if leader.internal_id in self.stale:  # it shares the leader's old-weights prompt KV
            self.stale.add(sample.internal_id)
        if sample.prompt_len % bs and self.cache is not None:
            last = sample.prompt_len // bs
            self.cache.copy_block(leader.block_ids[last], sample.block_ids[last])

    def register(self, req: Request) -> None:
        """Make req's fully computed blocks findable in the prefix cache. Generated blocks
        too: a preempted request finds them again when it resumes, as does any request that
        shares the whole prefix."""
        if not self.prefix_caching or req.internal_id in self.stale:
            return
        n_full = req.num_computed // self.block_size
        if n_full <= req.num_hashed_blocks:
            return
        hashes = self.block_hashes(req, n_full)
        for i in range(req.num_hashed_blocks, n_full):
            self.pool.register(req.block_ids[i], hashes[i])
        req.num_hashed_blocks = n_full

    # ---- swap ---------------------------------------------------------------------------
    def can_swap(self, req: Request) -> bool:
        return (self.swap is not None and self.cache is not None and not self.in_flight(req)
                and self.swap.can_hold(len(req.block_ids)))

    def swap_in(self, req: Request, available: int) -> bool:
        """Bring a swapped request's blocks back if they (and room for what it computes next:
        its last sampled token may open a block) fit in `available`."""
        assert self.swap is not None and self.cache is not None  # only SWAPPED requests come here
        n = len(req.swap_slots)
        total = max(n, self.blocks_for(req.num_tokens))
        if total > available:
            return False
        blocks = self.pool.allocate(total)
        self.cache.write_blocks(blocks[:n], self.swap.load(req.swap_slots))
        self.swap.free(req.swap_slots)
        req.swap_slots = []
        req.block_ids = blocks
        req.num_hashed_blocks = 0  # re-registered: the new blocks' contents are identical
        return True

    def calibrate_swap(self) -> tuple[float, float] | None:
        """Time blocks out to the swap space and back before any request holds them (a few
        ms): (fixed ms per swap, ms per block). The copies are one op per layer and kind
        whatever the block count, hence the split."""
        if self.cache is None or self.swap is None or self.pool.num_used:
            return None
        cache = self.cache
        n = min(8, self.pool.num_blocks)

        def round_trip(blocks: list[int]) -> float:
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                cache.write_blocks(blocks, [t.to("cpu") for t in cache.read_blocks(blocks)])
                best = min(best, (time.perf_counter() - t0) * 1000)
            return best

        one, many = round_trip([0]), round_trip(list(range(n)))
        per_block = max(0.0, (many - one) / (n - 1)) if n > 1 else one
        return max(0.0, one - per_block), per_block

    # ---- holder: preemption and the end ---------------------------------------------------
    def preempt(self, req: Request) -> None:
        """req was just preempted: swap its blocks out (status SWAPPED) or drop them, keeping
        their prefix cached (PREEMPTED: it recomputes, finding what was not evicted)."""
        if req.status is RequestStatus.SWAPPED:
            assert self.swap is not None and self.cache is not None  # lifecycle checked can_swap
            req.swap_slots = self.swap.store(self.cache.read_blocks(req.block_ids), len(req.block_ids))
            self.stats.swapped_blocks += len(req.block_ids)
        else:
            req.num_computed = 0
            req.num_hashed_blocks = 0
        blocks, req.block_ids = req.block_ids, []
        self._free(req, blocks, keep_cached=True, aborted_at=None)

    def release(self, req: Request) -> None:
        """req ended: its blocks go back, behind the fence. A finished request's prefix stays
        cached; an aborted one's as configured; a failed one's never (its KV may be bad)."""
        reason = req.finish_reason
        keep = (reason in (FinishReason.STOP, FinishReason.LENGTH)
                or (reason in (FinishReason.ABORT, FinishReason.TIMEOUT) and self.keep_aborted_prefix))
        blocks, req.block_ids = req.block_ids, []
        self.stale.discard(req.internal_id)
        self._free(req, blocks, keep_cached=keep, aborted_at=req.aborted_at)

    def holds(self, req: Request) -> bool:
        return bool(req.block_ids) or req.internal_id in self.stale

    def new_weights(self, live: Sequence[Request]) -> int:
        """The weights changed between steps: forget every hash (cached and owned blocks),
        and keep the live requests, whose KV is from the old weights, out of the cache for
        good. Returns how many hashes were dropped."""
        for d in self.deferred:
            d.keep_cached = False
        self.stale.update(r.internal_id for r in live)
        return self.pool.forget_hashes()

    def _free(self, req: Request, blocks: list[int], keep_cached: bool,
              aborted_at: float | None) -> None:
        keep = keep_cached and self.prefix_caching
        if self.in_flight(req):
            self.deferred.append(_Deferred(req.last_scheduled_step, blocks, keep, aborted_at))
            return
        self.pool.release(blocks, keep_cached=keep)
        if aborted_at is not None:
            self.stats.abort_to_reclaim_steps.observe(0)
            self.stats.reclaim_seconds.observe(time.monotonic() - aborted_at)

    def step_processed(self, step_id: int) -> None:
        """The outputs of step `step_id` are handled: what it fenced goes back."""
        self.last_processed_step = step_id
        if not self.deferred:
            return
        still = []
        now = time.monotonic()
        for d in self.deferred:
            if d.fence > step_id:
                still.append(d)
                continue
            self.pool.release(d.blocks, keep_cached=d.keep_cached)
            if d.aborted_at is not None:
                self.stats.abort_to_reclaim_steps.observe(1)
                self.stats.reclaim_seconds.observe(now - d.aborted_at)
        self.deferred = still

    # ---- the ledger -----------------------------------------------------------------------
    def tables(self, live: Iterable[Request]) -> Iterator[Sequence[int]]:
        """Every holder of block references: live block tables and the fence's holds."""
        for r in live:
            yield r.block_ids
        for d in self.deferred:
            yield d.blocks

    def audit(self, live: Sequence[Request]) -> None:
        """The pool's ledger against every table, and the swap space against every swapped
        request. Raises LedgerError naming the first discrepancy."""
        self.pool.audit(self.tables(live))
        if self.swap is None:
            return
        held: set[int] = set()
        for r in live:
            if r.swap_slots and r.status is not RequestStatus.SWAPPED:
                raise LedgerError(f"request {r.incarnation!r} ({r.status.value}) holds swap slots")
            if held.intersection(r.swap_slots):
                raise LedgerError(f"swap slots {sorted(held.intersection(r.swap_slots))} held twice")
            held.update(r.swap_slots)
        if len(held) != self.swap.num_used:
            raise LedgerError(f"swap space: {self.swap.num_used} slots used, {len(held)} held by requests")
