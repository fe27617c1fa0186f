"""The one allocator of a request's KV blocks.

Nothing else hands blocks to a request or takes them back: admission (prefix lookup, then
allocation, for a whole family at once), growth, the fork of a family sample, registration of
full blocks in the prefix cache, swap out and in, the free of blocks a sliding window has
passed, and the free behind the fence. The fence:
a block is never returned to the pool while a step that may write it is in flight; such
blocks wait in `deferred` until `step_processed` reaches the step that fenced them.

The manager is also the one owner and writer of each request's KV state (`SeqKV`): its
block table, its computed, in-flight, cached and hashed counts, its prefix hashes, its fence
step and its swap slots.
Others read them through it (`table`, `computed`, `cached`, `prefilling` ...); the rule
for whether a request can ever fit the pool (`fits`) lives here only.

Sliding windows and layer groups (docs/sliding-window.md). The layers are grouped by window
(`kv_cache.layer_groups`): one group for most models, two for Gemma 3 (its global layers,
then its local ones). Each group has its own block pool and K/V tensors, and a request one
block table per group, all starting at position 0; group 0's table is `table(req)`.
Under a group's window, `slide` gives back the blocks its layers have slid past while the
request runs, behind the fence; their table entries become HOLE. Holes are always a table's
leading entries (`dropped` of them): the ledger, swap, forks, the prefix cache and the P/D
split (`export_prefix` / `import_prefix`, group by group) see live blocks only, and a prefix
hit needs only the blocks each group's window reads.
A windowed group's table beside a global group grows chunk by chunk: to compute [start, end)
it needs the blocks from the first one the window of `start` reads to the block of end - 1,
so its pool may be far smaller than the global group's (kv_cache.make_cache sizes it). Every count
(admission, growth, the never-fits rule, swap-in, the shortage that preemption covers) is
each group's own. A request fits only if every group's pool has room.

The manager is the last holder of the one release (lifecycle.py): by the time it frees a
request's blocks and swap slots, everything else of the request is gone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

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
    group: int = 0  # the layer group whose pool the blocks are of


HOLE = -1  # a table entry whose block every layer of its group has slid past (given back)


def group_window(layer_windows: Sequence[int]) -> int:
    """The window of layers that would share each block in one group: the largest of
    theirs; 0 (every block kept) when any layer attends to all positions, or none has a
    window. (The engine groups layers by window instead: kv_cache.layer_groups.)"""
    return max(layer_windows) if layer_windows and all(layer_windows) else 0


@dataclass
class GroupTable:
    """A request's block table in one layer group after the first (see SeqKV)."""

    block_ids: list[int] = field(default_factory=list)
    dropped: int = 0  # leading entries the group's window passed (HOLE)

    def live(self) -> list[int]:
        return self.block_ids[self.dropped:] if self.dropped else self.block_ids


@dataclass
class SeqKV:
    """One request's KV state. Written by the KV manager alone."""

    block_ids: list[int] = field(default_factory=list)  # the block table (of layer group 0)
    computed: int = 0  # tokens whose K/V sit in the table (or will, once the step in flight lands)
    inflight: int = 0  # of those, the tokens the step in flight computes
    cached: int = 0  # prompt tokens served from the prefix cache at first admission
    hashed: int = 0  # leading full blocks registered in the prefix cache
    # Chained hashes of the leading full blocks of prompt + output, extended as blocks fill.
    hashes: list[int] = field(default_factory=list)
    swap_slots: list[int] = field(default_factory=list)  # host swap blocks while SWAPPED
    dropped: int = 0  # leading table entries the window passed (HOLE), kept while swapped
    more: list[GroupTable] = field(default_factory=list)  # the tables of groups 1 ..
    swapped: list[int] = field(default_factory=list)  # live blocks of each group in swap_slots
    fence: int = -1  # the newest step that may write (or read) the blocks
    # Some of its K/V is from weights no longer served (a weight update came while it had KV,
    # docs/engine-stops.md): its blocks never enter the prefix cache.
    stale: bool = False

    def live(self) -> list[int]:
        return self.block_ids[self.dropped:] if self.dropped else self.block_ids

    def groups(self) -> list[SeqKV | GroupTable]:
        """The tables of every layer group, group 0 (this one) first."""
        return [self, *self.more] if self.more else [self]


_EMPTY = SeqKV()


class KVManager:
    name = "kv"

    def __init__(self, pool: BlockPool, cache: KVCache | None, swap: SwapSpace | None,
                 stats: StopStats, *, prefix_caching: bool = True,
                 keep_aborted_prefix: bool = True, window: int = 0,
                 more: Sequence[tuple[BlockPool, int]] = ()) -> None:
        """pool, window: layer group 0's pool and sliding window (0 for none: blocks it has
        passed go back while their request runs); more: (pool, window) of groups 1 .., each
        pool numbering its blocks in that group's layers (`cache` by group)."""
        self.pool = pool
        self.pools = [pool, *(p for p, _ in more)]
        self.windows = [window, *(w for _, w in more)]
        self._windowed = any(self.windows)
        self.cache = cache
        self.swap = swap
        self.stats = stats
        self.prefix_caching = prefix_caching
        self.keep_aborted_prefix = keep_aborted_prefix
        self.block_size = pool.block_size
        self.window = window
        self.deferred: list[_Deferred] = []
        self.last_processed_step = -1
        # Every request with KV state, from its first lookup or admission to its release.
        self.seqs: dict[Request, SeqKV] = {}
        # What a request's K/V depends on besides its tokens (its LoRA adapter's load): blocks
        # are shared only within one salt. The engine sets it; None for every request here.
        self.salt: Callable[[Request], Hashable] = lambda req: None

    # ---- a request's state, read through the manager ------------------------------------
    def _seq(self, req: Request) -> SeqKV:
        s = self.seqs.get(req)
        if s is None:
            s = self.seqs[req] = SeqKV(more=[GroupTable() for _ in self.pools[1:]])
        return s

    def seq(self, req: Request) -> SeqKV:
        """req's state (an empty one if it has none); for reading only."""
        return self.seqs.get(req, _EMPTY)

    def table(self, req: Request) -> Sequence[int]:
        """req's block table, for reading only: entry i holds positions i * block_size on,
        HOLE where the window passed them."""
        return self.seq(req).block_ids

    def group_tables(self, req: Request, n: int) -> list[list[int]]:
        """Copies of the first n entries of req's tables in groups 1 .. (for a step's plan)."""
        return [list(t.block_ids[:n]) for t in self.seq(req).more]

    def live_blocks(self, req: Request) -> list[int]:
        """req's blocks in group 0's pool, in table order (its table without the holes)."""
        return list(self.seq(req).live())

    def computed(self, req: Request) -> int:
        return self.seq(req).computed

    def cached(self, req: Request) -> int:
        return self.seq(req).cached

    def swap_slots(self, req: Request) -> Sequence[int]:
        return self.seq(req).swap_slots

    def prefilling(self, req: Request) -> bool:
        """A decode step computes exactly the last sampled token; anything more is (re)prefill."""
        return not (req.output_token_ids and self.seq(req).computed == req.num_tokens - 1)

    def was_prefilling(self, req: Request) -> bool:
        """prefilling(req) as of before the step in flight (which already counts in computed)."""
        s = self.seq(req)
        return not (req.output_token_ids and s.computed - s.inflight == req.num_tokens - 1)

    def freeable(self, req: Request, group: int = 0) -> int:
        """Blocks that would return to a group's pool if req let go (shared ones would not)."""
        rc = self.pools[group].refcount
        tabs = self.seq(req).groups()
        return sum(1 for b in tabs[group].live() if rc[b] == 1) if group < len(tabs) else 0

    # ---- the step's counts ----------------------------------------------------------------
    def advance(self, req: Request, n: int) -> None:
        """The step being planned computes req's next n tokens (its table covers them)."""
        s = self._seq(req)
        s.computed += n
        s.inflight = n

    def landed(self, req: Request) -> None:
        """The step that computed req's in-flight tokens is processed."""
        s = self.seqs.get(req)
        if s is not None:
            s.inflight = 0

    def slide(self, req: Request, upto: int) -> int:
        """req's next query is at position `upto` or later (a step up to there landed): the
        blocks every layer's window has passed go back to the pool, behind the fence (a step
        in flight may still read them), kept findable in the prefix cache. Their entries
        become HOLE. Returns how many blocks were given back."""
        s = self.seqs.get(req)
        if not self._windowed or s is None:
            return 0
        freed = 0
        for g, t in enumerate(s.groups()):
            dead = min(self._dead(upto, self.windows[g]), len(t.block_ids))
            if dead <= t.dropped:
                continue
            gone = [b for b in t.block_ids[t.dropped:dead] if b != HOLE]
            t.block_ids[t.dropped:dead] = [HOLE] * (dead - t.dropped)
            t.dropped = dead
            if gone:
                self.stats.window_freed_blocks += len(gone)
                self._free(s, gone, keep_cached=True, aborted_at=None, group=g)
                freed += len(gone)
        return freed

    def _dead(self, upto: int, window: int) -> int:
        """Leading blocks no query at position >= upto reads under the window (a query at
        p reads the keys at p - window + 1 .. p)."""
        return max(0, (upto - window + 1) // self.block_size) if window else 0

    def accept(self, req: Request, computed: int) -> None:
        """Only the first `computed` tokens hold valid K/V (speculative decoding rejected the
        rest): rewind to them and give back the blocks only the rejected ones opened."""
        self._seq(req).computed = computed
        self.trim(req)


    # ---- counts -------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def span(self, positions: int) -> int:
        """The most blocks that many consecutive positions can touch."""
        return (positions + self.block_size - 2) // self.block_size + 1 if positions > 0 else 0

    def _chunked(self, g: int) -> bool:
        """Group g's table grows chunk by chunk: it has a window, beside a global group 0
        (whose pool, of num_blocks, is the one admission keeps its headroom in). A model of
        windowed groups only (Mistral) keeps whole tables: its pools are num_blocks each
        (kv_cache.pool_sizes)."""
        return bool(self.windows[g]) and not self.windows[0]

    def covered(self, req: Request) -> int:
        """Tokens from the start that every group's table covers (a windowed group's
        only as far as the chunks allocated so far)."""
        return min(len(t.block_ids) for t in self.seq(req).groups()) * self.block_size

    @property
    def num_available(self) -> int:
        """Blocks every group's pool can hand out now (a table grows in all at once)."""
        if len(self.pools) == 1:
            return self.pool.num_available
        return min(p.num_available for p in self.pools)

    @property
    def num_used(self) -> int:
        """Blocks owned in all groups' pools."""
        return sum(p.num_used for p in self.pools)

    def reset_prefix_cache(self) -> int:
        """Forget every cached (unowned) block's hash, in every group. Returns how many."""
        return sum(p.reset_prefix_cache() for p in self.pools)

    def in_flight(self, req: Request) -> bool:
        """A step that may write req's blocks has not been processed yet."""
        return self.seq(req).fence > self.last_processed_step

    def fence_at(self, req: Request, step_id: int) -> None:
        """Step step_id, being planned, may write req's blocks: none goes back before it is
        processed."""
        self._seq(req).fence = step_id

    # ---- allocation ---------------------------------------------------------------------
    def _lookup(self, req: Request, n_blocks: int) -> list[list[int]]:
        """The longest prefix hit within req's first n_blocks full blocks, as table entries
        of each group (all of one length). Under a window a group needs only the blocks its
        window reads (HOLE before them): a hit whose window blocks are not all present in
        every group is never reported; a group without a window needs all n."""
        hashes = self.block_hashes(req, n_blocks)
        if not self._windowed:
            hit = self.pool.lookup(hashes)
            if len(self.pools) == 1:
                return [hit]
            n = min(len(p.lookup(hashes[:len(hit)])) for p in self.pools)
            return [[p.hash_to_block[h] for h in hashes[:n]] for p in self.pools]
        # Groups without a window bound the hit by their run of leading blocks.
        top = min([len(p.lookup(hashes)) for p, w in zip(self.pools, self.windows, strict=True) if not w]
                  or [len(hashes)])
        indexes = [p.hash_to_block for p in self.pools]
        for n in range(top, 0, -1):
            firsts = [self._dead(n * self.block_size, w) for w in self.windows]
            if all(all(h in ix for h in hashes[f:n]) for ix, f in zip(indexes, firsts, strict=True)):
                return [[HOLE] * f + [ix[h] for h in hashes[f:n]] for ix, f in zip(indexes, firsts, strict=True)]
        return [[] for _ in self.pools]

    def block_hashes(self, req: Request, n_blocks: int) -> list[int]:
        """Chained hashes of req's first n_blocks full blocks (prompt, then output), each
        computed once per request: a request at the head of the queue is looked up again at
        every step until it fits."""
        hashes = self._seq(req).hashes
        if len(hashes) < n_blocks:
            extend_hashes(hashes, req.all_token_ids, self.block_size, n_blocks, self.salt(req))
        return hashes[:n_blocks]

    def admit(self, req: Request, reserve: int, chunk: int | None = None) -> bool:
        """Blocks for every token req has (its prompt, or for a preempted request everything
        it must recompute), prefix hits first, and for a family leader its waiting samples'
        tables too (the shared full prompt blocks plus an own copy of the partial last one).
        chunk: the most tokens its first step computes. A windowed group takes blocks for that
        chunk only (fewer if its pool lacks them, one token's at the least; `covered` says how
        far), and grows as the chunks come; a family takes the whole prompt in every group
        (its samples share it until they fork). All or nothing: False, with nothing taken,
        unless that fits, plus `reserve` blocks in group 0's pool.
        A first admission counts its prefix hits as req's cached tokens."""
        bs = self.block_size
        samples = req.forks_pending
        total = self.blocks_for(req.num_tokens)
        hits: list[list[int]] = [[] for _ in self.pools]
        if self.prefix_caching and not req.scores_prompt:
            # Never cover the last token: its logits must be computed. A preempted request
            # also finds its own generated blocks, if nobody has needed their room since.
            # A prompt still being scored computes every position: no logits are cached.
            hits = self._lookup(req, (req.num_tokens - 1) // bs)
        n_hit = len(hits[0])
        live_hits = [[b for b in h if b != HOLE] for h in hits]
        partial = 1 if req.prompt_len % bs else 0
        ends = []  # each group's table length after admission
        for g, (pool, live) in enumerate(zip(self.pools, live_hits, strict=True)):
            hits_free = sum(1 for b in live if pool.refcount[b] == 0)
            room = pool.num_available - hits_free - len(samples) * partial - (reserve if g == 0 else 0)
            end = total
            if chunk is not None and not samples and self._chunked(g):
                end = min(total, self.blocks_for(n_hit * bs + chunk), n_hit + room)
                if end <= n_hit:  # not even one token's block
                    return False
            if end - n_hit > room:
                return False
            ends.append(end)
        s = self._seq(req)
        for t, pool, h, live, end in zip(s.groups(), self.pools, hits, live_hits, ends, strict=True):
            pool.touch(live)
            t.block_ids = h + pool.allocate(end - n_hit)
            t.dropped = n_hit - len(live)
        s.computed = n_hit * bs
        s.hashed = n_hit
        if req.status is RequestStatus.WAITING:
            s.cached = s.computed
        for m in samples:
            for t, mt, pool in zip(s.groups(), self._seq(m).groups(), self.pools, strict=True):
                shared = t.block_ids[: req.prompt_len // bs]
                pool.touch(b for b in shared if b != HOLE)
                mt.block_ids = list(shared) + (pool.allocate(1) if partial else [])
                mt.dropped = min(t.dropped, len(shared))
        return True

    def export_prefix(self, req: Request, n_blocks: int) -> list[tuple[int, list[int]]]:
        """What a prefill engine ships of req's first n_blocks blocks (stopline/disagg): for
        each layer group, (first, blocks first .. n_blocks - 1), first being the leading
        blocks no query at n_blocks * block_size or later reads under the group's window
        (0 for a group without one), or the holes if more. Those are the blocks a prefix hit
        of n_blocks needs in that group (`_lookup`)."""
        out = []
        for t, w in zip(self.seq(req).groups(), self.windows, strict=True):
            first = max(t.dropped, self._dead(n_blocks * self.block_size, w))
            out.append((first, list(t.block_ids[first:n_blocks])))
        return out

    def import_prefix(self, token_ids: Sequence[int], n_blocks: int,
                      write: Callable[[list[list[int]]], None], firsts: Sequence[int] = (),
                      salt: Hashable = None) -> list[int]:
        """Blocks computed elsewhere (a prefill engine, stopline/disagg) enter the prefix
        cache: in each layer group allocate blocks firsts[g] .. n_blocks - 1, `write` fills
        them (each group's new blocks, in group order), register their chained hashes, drop
        the reference (cached, refcount 0). The request is admitted at the same step boundary
        and finds them as prefix hits (each group's window blocks: `export_prefix`). Returns
        the blocks imported per group: all 0 when some group's pool has no room (the request
        then computes its prompt here). If `write` raises, the blocks go back to the free
        pools unhashed and the error propagates. firsts: each group's leading blocks a sliding
        window passed, not shipped (() : none); a group's first past what its window reads is
        refused (ValueError), as that import could never be a hit. salt: the request's
        (self.salt(req), its adapter's load), so the blocks are found only under it."""
        if not self.prefix_caching:
            raise ValueError("importing a prefix needs prefix caching")
        firsts = list(firsts) or [0] * len(self.pools)
        if len(firsts) != len(self.pools):
            raise ValueError(f"blocks of {len(firsts)} KV layer groups for a model of {len(self.pools)}")
        for g, (f, w) in enumerate(zip(firsts, self.windows, strict=True)):
            need = self._dead(n_blocks * self.block_size, w)
            if not 0 <= f <= need:
                raise ValueError(f"layer group {g} (window {w}) sent from block {f}: its window "
                                 f"reads blocks {need} .. {n_blocks - 1}")
        counts = [n_blocks - f for f in firsts]
        if not any(counts) or not all(p.can_allocate(c) for p, c in zip(self.pools, counts, strict=True)):
            return [0] * len(self.pools)
        hashes = extend_hashes([], token_ids, self.block_size, n_blocks, salt)
        blocks = [p.allocate(c) for p, c in zip(self.pools, counts, strict=True)]
        try:
            write(blocks)
        except BaseException:
            for p, b in zip(self.pools, blocks, strict=True):
                p.release(b, keep_cached=False)
            raise
        for p, b, f in zip(self.pools, blocks, firsts, strict=True):
            for blk, h in zip(b, hashes[f:], strict=True):
                p.register(blk, h)
            p.release(b)
        return counts

    def admit_need(self, num_tokens: int, forks: int = 0, group: int = 0) -> int:
        """Blocks a request of num_tokens tokens (and `forks` samples waiting to fork) takes
        at the least in a group's pool to compute one more token: its table plus a partial
        block per sample; under a window (no samples) the blocks the window of the next query
        and of one in flight (async scheduling) read, at most."""
        need = self.blocks_for(num_tokens + 1)
        if self._chunked(group) and not forks:
            need = min(need, self.span(self.windows[group] + 1))
        return need + forks

    def short(self, num_tokens: int, forks: int = 0) -> tuple[int, int] | None:
        """The first group whose pool can never hold such a request: (blocks it needs, blocks
        the pool has); None if every group's can (the one never-fits rule)."""
        for g, pool in enumerate(self.pools):
            need = self.admit_need(num_tokens, forks, g)
            if need > pool.num_blocks:
                return need, pool.num_blocks
        return None

    def fits(self, num_tokens: int, forks: int = 0) -> bool:
        """Whether such a request could ever fit every group's pool (the one never-fits rule)."""
        return self.short(num_tokens, forks) is None

    def grow(self, req: Request, upto: int) -> bool:
        """Make req's tables cover `upto` tokens (a windowed group's from the blocks it
        holds: those before the window of the first position computed are already holes or
        behind the fence); False (nothing taken) if a pool can't."""
        if len(self.pools) == 1:
            need = self.need(req, upto)
            if need <= 0:
                return True
            if not self.pool.can_allocate(need):
                return False
            self._seq(req).block_ids += self.pool.allocate(need)
            return True
        needs = self.needs(req, upto)
        if not all(p.can_allocate(n) for p, n in zip(self.pools, needs, strict=True)):
            return False
        for t, p, n in zip(self._seq(req).groups(), self.pools, needs, strict=True):
            if n > 0:
                t.block_ids += p.allocate(n)
        return True

    def needs(self, req: Request, upto: int) -> list[int]:
        """Blocks each group's table lacks to cover `upto` tokens. A table always covers the
        tokens computed, so a windowed group's growth never opens holes: the positions it
        passed are in its table already."""
        end = self.blocks_for(upto)
        return [max(0, end - len(t.block_ids)) for t in self.seq(req).groups()]

    def need(self, req: Request, upto: int) -> int:
        """Blocks req's table lacks to cover `upto` tokens, in the group that lacks most."""
        if len(self.pools) == 1:
            return self.blocks_for(upto) - len(self.seq(req).block_ids)
        return max(self.needs(req, upto))

    def can_grow(self, req: Request, upto: int, spare: int = 0) -> bool:
        """Whether every group that must grow for `upto` can, with `spare` blocks left."""
        return all(n <= 0 or p.num_available - n >= spare
                   for p, n in zip(self.pools, self.needs(req, upto), strict=True))

    def deficit(self, req: Request, upto: int) -> tuple[int, int]:
        """The shortage that stops req's growth to `upto`, as (group, blocks): the group
        whose pool lacks the most (preemption frees that group's blocks; the one rule for
        global and windowed pools alike)."""
        short = [(n - p.num_available, g) for g, (p, n) in enumerate(zip(self.pools, self.needs(req, upto), strict=True))]
        blocks, group = max(short, key=lambda x: (x[0], -x[1]))
        return group, blocks

    def room(self, req: Request, start: int, n: int) -> int:
        """The most of n tokens from `start` on that every windowed group could take blocks
        for now (at least one: a shortage of one token's is grow's, which preempts). A chunk
        shrinks rather than preempting others for a windowed pool."""
        tabs = self.seq(req).groups()
        for g, (t, pool) in enumerate(zip(tabs, self.pools, strict=True)):
            if self._chunked(g):
                n = min(n, max(1, (len(t.block_ids) + pool.num_available) * self.block_size - start))
        return n

    def trim(self, req: Request) -> None:
        """Give back the blocks past req's computed tokens: those that only rejected drafts
        opened (speculative decoding). Behind the fence, like any free: the step that wrote
        them is the one being processed. They were never registered, so never cached."""
        s = self._seq(req)
        keep = self.blocks_for(s.computed)
        for g, t in enumerate(s.groups()):
            if len(t.block_ids) > keep:
                extra, t.block_ids = t.block_ids[keep:], t.block_ids[:keep]
                t.dropped = min(t.dropped, keep)
                self._free(s, [b for b in extra if b != HOLE], keep_cached=False, aborted_at=None, group=g)

    def fork(self, sample: Request, leader: Request) -> None:
        """A family sample takes its own copy of the leader's last, partial prompt block;
        its prompt is computed, and cached as much as the leader's."""
        bs = self.block_size
        s, lead = self._seq(sample), self.seq(leader)
        s.stale = lead.stale  # it shares the leader's prompt KV, of the leader's weights
        if sample.prompt_len % bs and self.cache is not None:
            last = sample.prompt_len // bs  # never slid past: the window reaches the prompt's end
            for g, (t, lt) in enumerate(zip(s.groups(), lead.groups(), strict=True)):
                self.cache.copy_block(lt.block_ids[last], t.block_ids[last], group=g)
        s.computed = sample.prompt_len
        s.cached = lead.cached
        s.fence = lead.fence
        self.slide(sample, sample.prompt_len)

    def register(self, req: Request) -> None:
        """Make req's fully computed blocks findable in the prefix cache. Generated blocks
        too: a preempted request finds them again when it resumes, as does any request that
        shares the whole prefix."""
        if not self.prefix_caching:
            return
        s = self._seq(req)
        if s.stale:
            return
        n_full = s.computed // self.block_size
        if n_full <= s.hashed:
            return
        hashes = self.block_hashes(req, n_full)
        for t, pool in zip(s.groups(), self.pools, strict=True):
            for i in range(max(s.hashed, t.dropped), n_full):
                pool.register(t.block_ids[i], hashes[i])
        s.hashed = n_full

    # ---- swap ---------------------------------------------------------------------------
    def can_swap(self, req: Request) -> bool:
        return (self.swap is not None and self.cache is not None and not self.in_flight(req)
                and self.swap.can_hold(sum(len(t.live()) for t in self.seq(req).groups())))

    def swap_in(self, req: Request, reserve: int) -> bool:
        """Bring a swapped request's blocks back if they (and room for what it computes next:
        its last sampled token may open a block) fit, with `reserve` blocks left in group 0's
        pool. A windowed group of several takes back its live blocks only (its table covers
        what it covered; it grows as the chunks come)."""
        assert self.swap is not None and self.cache is not None  # only SWAPPED requests come here
        s = self._seq(req)
        counts = s.swapped or [len(s.swap_slots)]
        tabs = s.groups()
        totals = [max(n, self.blocks_for(req.num_tokens) - t.dropped) for n, t in zip(counts, tabs, strict=True)]
        # A windowed group: its live blocks and the one block its next token may open (a
        # request swapped mid-prefill grows chunk by chunk again).
        totals = [min(total, n + 1) if self._chunked(g) else total
                  for g, (n, total) in enumerate(zip(counts, totals, strict=True))]
        if not all(p.can_allocate(n + (reserve if g == 0 else 0))
                   for g, (p, n) in enumerate(zip(self.pools, totals, strict=True))):
            return False
        data = self.swap.load(s.swap_slots)
        at = 0
        for g, (t, pool, n, total) in enumerate(zip(tabs, self.pools, counts, totals, strict=True)):
            blocks = pool.allocate(total)
            width = self.cache.kinds * len(self.cache.groups[g])  # K and V (and scales) of each layer
            self.cache.write_blocks(blocks[:n], data[at:at + width], group=g)
            at += width
            t.block_ids = [HOLE] * t.dropped + blocks  # the window's holes stay holes
        self.swap.free(s.swap_slots)
        s.swap_slots = []
        s.swapped = []
        s.hashed = 0  # re-registered: the new blocks' contents are identical
        return True

    def calibrate_swap(self) -> tuple[float, float] | None:
        """Time blocks out to the swap space and back before any request holds them (a few
        ms): (fixed ms per swap, ms per block). The copies are one op per layer and kind
        whatever the block count, hence the split."""
        if self.cache is None or self.swap is None or self.num_used:
            return None
        cache = self.cache
        n = min(8, *(p.num_blocks for p in self.pools))  # blocks 0 .. n - 1 of every group

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
        s = self._seq(req)
        tabs = s.groups()
        lives = [list(t.live()) for t in tabs]  # only live blocks go out; the holes' count stays
        if req.status is RequestStatus.SWAPPED:
            assert self.swap is not None and self.cache is not None  # lifecycle checked can_swap
            data = [x for g, blocks in enumerate(lives) for x in self.cache.read_blocks(blocks, group=g)]
            n = sum(map(len, lives))
            s.swap_slots = self.swap.store(data, n)
            s.swapped = [len(blocks) for blocks in lives] if len(tabs) > 1 else []
            self.stats.swapped_blocks += n
        else:
            s.computed = 0
            s.hashed = 0
            for t in tabs:
                t.dropped = 0
        for g, (t, blocks) in enumerate(zip(tabs, lives, strict=True)):
            t.block_ids = []
            self._free(s, blocks, keep_cached=True, aborted_at=None, group=g)

    def release(self, req: Request) -> None:
        """req ended: its swap slots go back, and its blocks, behind the fence. A finished
        request's prefix stays cached; an aborted one's as configured; a failed one's never
        (its KV may be bad). Its state goes with them."""
        s = self.seqs.pop(req, None)
        if s is None:
            return
        if s.swap_slots and self.swap is not None:
            self.swap.free(s.swap_slots)
        reason = req.finish_reason
        keep = (reason in (FinishReason.STOP, FinishReason.LENGTH)
                or (reason in (FinishReason.ABORT, FinishReason.TIMEOUT) and self.keep_aborted_prefix))
        at = req.aborted_at  # the reclaim is timed once, with the first group's blocks
        for g, t in enumerate(s.groups()):
            if t.live():
                self._free(s, list(t.live()), keep_cached=keep, aborted_at=at, group=g)
                at = None

    def holds(self, req: Request) -> bool:
        return req in self.seqs

    def new_weights(self) -> int:
        """The weights changed between steps: forget every hash (of cached and of owned
        blocks), and keep every request with KV now, whose KV is from the old weights, out of
        the cache for good. Returns how many hashes were dropped."""
        for d in self.deferred:
            d.keep_cached = False
        for s in self.seqs.values():
            s.stale = True
        return sum(p.forget_hashes() for p in self.pools)

    def _free(self, s: SeqKV, blocks: list[int], keep_cached: bool,
              aborted_at: float | None, group: int = 0) -> None:
        """Give back blocks (of group `group`'s pool) of the request whose state is s,
        behind its fence."""
        keep = keep_cached and self.prefix_caching
        if s.fence > self.last_processed_step:
            self.deferred.append(_Deferred(s.fence, blocks, keep, aborted_at, group))
            return
        self.pools[group].release(blocks, keep_cached=keep)
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
            self.pools[d.group].release(d.blocks, keep_cached=d.keep_cached)
            if d.aborted_at is not None:
                self.stats.abort_to_reclaim_steps.observe(1)
                self.stats.reclaim_seconds.observe(now - d.aborted_at)
        self.deferred = still

    # ---- the ledger -----------------------------------------------------------------------
    def tables(self, live: Iterable[Request], group: int = 0) -> Iterator[Sequence[int]]:
        """Every holder of references to group's blocks: live block tables and the fence's
        holds."""
        for r in live:
            tabs = self.seq(r).groups()
            if group < len(tabs):  # a request without KV state has one empty table
                yield tabs[group].live()
        for d in self.deferred:
            if d.group == group:
                yield d.blocks

    def audit(self, live: Sequence[Request]) -> None:
        """The pool's ledger against every table, and the swap space against every swapped
        request. Raises LedgerError naming the first discrepancy."""
        live_set = set(live)
        for r in self.seqs:
            if r not in live_set:
                raise LedgerError(f"request {r.incarnation!r} ({r.status.value}) is not live "
                                  "but has KV state")
        for r, s in self.seqs.items():
            for g, t in enumerate(s.groups()):
                if any(b == HOLE for b in t.live()) or any(b != HOLE for b in t.block_ids[:t.dropped]):
                    raise LedgerError(f"request {r.incarnation!r}: group {g}'s holes not exactly its "
                                      f"{t.dropped} leading entries")
                if not self._chunked(g):
                    if len(t.block_ids) != len(s.block_ids):
                        raise LedgerError(f"request {r.incarnation!r}: group {g}'s table covers "
                                          f"{len(t.block_ids)} blocks, group 0's {len(s.block_ids)}")
                elif t.block_ids and len(t.block_ids) < self.blocks_for(s.computed):
                    raise LedgerError(f"request {r.incarnation!r}: group {g}'s table covers "
                                      f"{len(t.block_ids)} blocks, fewer than its {s.computed} tokens")
                elif not self._chunked(0) and len(t.block_ids) > len(s.block_ids):
                    raise LedgerError(f"request {r.incarnation!r}: group {g}'s table covers "
                                      f"{len(t.block_ids)} blocks, more than group 0's {len(s.block_ids)}")
                if t.dropped and not self.windows[g]:
                    raise LedgerError(f"request {r.incarnation!r}: group {g} has no window but holes")
        for g, pool in enumerate(self.pools):
            pool.audit(self.tables(live, g))
        if self.swap is None:
            return
        held: set[int] = set()
        for r in live:
            slots = self.swap_slots(r)
            if slots and r.status is not RequestStatus.SWAPPED:
                raise LedgerError(f"request {r.incarnation!r} ({r.status.value}) holds swap slots")
            if held.intersection(slots):
                raise LedgerError(f"swap slots {sorted(held.intersection(slots))} held twice")
            held.update(slots)
        if len(held) != self.swap.num_used:
            raise LedgerError(f"swap space: {self.swap.num_used} slots used, {len(held)} held by requests")
