"""Per-layer-group block tables on the KV manager, model-free (issue 43, item 4): a model of
global layers (group 0, no window) and local layers (group 1, a window) has a pool and a
table per group; the local table slides (HOLE) while the global one keeps its blocks, and
allocation, the fence, swap, recompute, forks and the prefix cache work per group."""

from __future__ import annotations

import pytest
import torch

from stopline.kv.block_pool import BlockPool, LedgerError
from stopline.kv.kv_cache import layer_groups
from stopline.kv.manager import HOLE, KVManager
from stopline.request import AbortSource, FinishReason, Request, RequestStatus, SamplingParams
from stopline.stats import StopStats
from tests.scripted import HandDriven

BS, W = 4, 8  # the local layers' query at p reads the keys at p - 7 .. p: at most three blocks


def hybrid(**kw: object) -> HandDriven:
    return HandDriven(window=0, more=(W,), **kw)


def blocks(computed: int) -> int:
    return -(-computed // BS)


def local_live(computed: int) -> int:
    return blocks(computed) - max(0, (computed - W + 1) // BS)


def used(h: HandDriven) -> tuple[int, int]:
    return h.pools[0].num_used, h.pools[1].num_used


def tables(h: HandDriven, req: Request) -> list[list[int]]:
    return [t.block_ids for t in h.kv.seq(req).groups()]


def evict(pool: BlockPool, b: int) -> None:
    """Cached block b's hash is dropped, as when allocate() hands it out again."""
    pool._unhash(b)
    pool.num_hashed_free -= 1
    pool.free_queue.move_to_end(b, last=False)


def test_layer_groups_by_window():
    assert layer_groups([]) == ([], [0])  # every layer global: one group
    assert layer_groups([16, 16, 16]) == ([], [16])  # Mistral: one group, windowed
    assert layer_groups([16, 0, 16]) == ([1, 0, 1], [0, 16])  # Gemma 3: global first
    assert layer_groups([512] * 5 + [0]) == ([1] * 5 + [0], [0, 512])


def test_each_group_counts_its_own_blocks_at_every_step():
    h = hybrid(num_blocks=32)
    req = h.add("a", prompt_len=6, max_tokens=40)
    for step in range(30):
        h.complete(h.plan())
        h.audit()
        c = h.kv.computed(req)
        assert c == 6 + step
        # The global group keeps every block; the local one only what its window reads.
        assert used(h) == (blocks(c), local_live(c)), (step, tables(h, req))
        g, loc = tables(h, req)
        assert len(g) == len(loc) and HOLE not in g
        assert loc[:h.kv.seq(req).more[0].dropped] == [HOLE] * (blocks(c) - local_live(c))
    assert used(h) == (9, 2) and h.stats.window_freed_blocks == 7  # 35 tokens
    h.lifecycle.finish(req, FinishReason.LENGTH)
    h.audit()
    assert used(h) == (0, 0)


def test_the_fence_holds_the_local_groups_passed_blocks():
    h = hybrid(num_blocks=16)
    req = h.add("a", prompt_len=14, max_tokens=4)
    plan = h.plan()  # the prefill, in flight
    h.kv.register(req)
    assert h.kv.slide(req, 14) == 1  # one local block passed; the global group gives none
    assert h.kv.seq(req).dropped == 0 and h.kv.seq(req).more[0].dropped == 1
    assert used(h) == (4, 4) and [d.group for d in h.kv.deferred] == [1]
    h.audit()  # the fence's hold is in group 1's ledger
    h.complete(plan)
    assert used(h) == (4, 3) and not h.kv.deferred
    h.audit()


def test_no_block_of_either_group_is_freed_twice():
    h = hybrid(num_blocks=16)
    req = h.add("a", prompt_len=14, max_tokens=8)
    h.complete(h.plan())
    assert h.kv.slide(req, 14) == 0 and h.kv.slide(req, 3) == 0  # again, or a rewind: nothing
    h.lifecycle.abort(req, AbortSource.CANCEL)
    h.audit()
    assert used(h) == (0, 0) and h.stats.window_freed_blocks == 1
    for pool in h.pools:
        with pytest.raises(LedgerError, match="double free"):
            pool.release([0])


def test_a_request_fits_only_if_every_group_has_room():
    stats = StopStats()
    kv = KVManager(BlockPool(16, BS), None, None, stats, more=[(BlockPool(6, BS), W)])
    # The local group needs only what its window reads (a query's 8 keys and one in flight:
    # 3 blocks at most), the global one every block; a family shares its whole prompt.
    assert kv.fits(20) and kv.fits(24) and kv.fits(60) and not kv.fits(64)
    assert kv.fits(16, forks=1) and not kv.fits(20, forks=1)  # 6 + 1 blocks: the local pool has 6
    assert not KVManager(BlockPool(16, BS), None, None, stats, more=[(BlockPool(2, BS), W)]).fits(20)
    req = Request("a", list(range(3, 23)), SamplingParams(max_tokens=4), incarnation="a")
    kv.pools[1].allocate(2)  # someone holds two of the local pool's six
    assert kv.num_available == 4
    assert not kv.admit(req, 0)  # 5 blocks: the global pool has room, the local one not
    assert kv.pools[0].num_used == 0 and not kv.seq(req).block_ids  # nothing taken


def test_cancel_mid_prefill_frees_both_groups_behind_the_fence():
    h = hybrid(num_blocks=16, max_num_batched_tokens=4)
    req = h.add("a", prompt_len=30, max_tokens=4)
    for _ in range(4):
        h.complete(h.plan())
        h.audit()
    # Admitted with the prompt's 8 blocks in the global group, the first chunk's in the local
    # one, which grows chunk by chunk; 16 tokens in, it slid past two and holds blocks 2, 3.
    assert used(h) == (8, 2) and h.kv.seq(req).more[0].dropped == 2
    plan = h.plan()  # the fifth chunk opens block 4
    h.lifecycle.abort(req, AbortSource.CANCEL)
    assert used(h) == (8, 3) and {d.group for d in h.kv.deferred} == {0, 1}
    h.audit()
    h.complete(plan)
    h.audit()
    assert used(h) == (0, 0) and not h.kv.holds(req)


def test_swap_ships_each_groups_live_blocks_and_keeps_the_holes():
    h = hybrid(num_blocks=16, swap=True)
    req = h.add("a", prompt_len=6, max_tokens=40)
    for _ in range(12):
        h.complete(h.plan())
    s = h.kv.seq(req)
    g, loc = tables(h, req)
    assert (len(g), s.more[0].dropped, len(loc) - s.more[0].dropped) == (5, 2, 3)  # 17 tokens
    # Each group's live blocks carry their own numbers, to be found after the swap.
    h.cache.k[0][:, [b * BS for b in g]] = torch.arange(1.0, 6.0)[None, :, None]
    h.cache.k[1][:, [b * BS for b in loc[2:]]] = torch.arange(11.0, 14.0)[None, :, None]
    h.lifecycle.preempt(req)
    assert req.status is RequestStatus.SWAPPED and used(h) == (0, 0)
    assert len(h.kv.swap_slots(req)) == 5 + 3 and s.swapped == [5, 3]
    h.audit()
    h.complete(h.plan())  # swapped back in, one decode
    assert req.status is RequestStatus.RUNNING and not h.kv.swap_slots(req)
    g, loc = tables(h, req)
    assert loc[:2] == [HOLE, HOLE] and HOLE not in g
    assert h.cache.k[0][0, [b * BS for b in g[:5]], 0].tolist() == [1, 2, 3, 4, 5]
    assert h.cache.k[1][0, [b * BS for b in loc[2:5]], 0].tolist() == [11, 12, 13]
    assert used(h) == (blocks(h.kv.computed(req)), local_live(h.kv.computed(req)))
    h.audit()
    h.lifecycle.finish(req, FinishReason.LENGTH)
    h.audit()
    assert used(h) == (0, 0) and h.swap.num_used == 0


def test_recompute_drops_both_tables_and_slides_again():
    h = hybrid(num_blocks=16, enable_prefix_caching=False)
    req = h.add("a", prompt_len=6, max_tokens=40)
    for _ in range(12):
        h.complete(h.plan())
    h.lifecycle.preempt(req)
    s = h.kv.seq(req)
    assert req.status is RequestStatus.PREEMPTED and s.more[0].dropped == 0 and used(h) == (0, 0)
    h.audit()
    h.complete(h.plan())  # the whole re-prefill in one chunk: the local group slides at once
    c = h.kv.computed(req)
    assert c == 18 and used(h) == (blocks(c), local_live(c))
    h.audit()


def test_a_prefix_hit_needs_the_global_blocks_and_the_local_window_blocks():
    h = hybrid(num_blocks=32)
    a = h.add("a", prompt_len=26, max_tokens=1)
    h.complete(h.plan())
    h.lifecycle.finish(a, FinishReason.LENGTH)
    h.audit()
    kv = h.kv
    # 6 full blocks: the local group slid past blocks 0-3 (cached since), and kept 4-6.
    probe = Request("p", list(range(3, 29)), SamplingParams(max_tokens=1), incarnation="p")
    assert [len(x) for x in kv._lookup(probe, 6)] == [6, 6]
    g, loc = kv._lookup(probe, 6)
    assert loc[:4] == [HOLE] * 4 and HOLE not in g  # the local hit needs only its window's blocks
    # A local window block evicted: no hit of 6 (its window reads blocks 4 and 5), one of 5.
    evict(kv.pools[1], loc[5])
    assert [len(x) for x in kv._lookup(probe, 6)] == [5, 5]
    # The global group's block 2 evicted: the hit is the two blocks before it.
    evict(kv.pools[0], g[2])
    g2, loc2 = kv._lookup(probe, 6)
    assert g2 == g[:2] and loc2 == [kv.pools[1].hash_to_block[h] for h in kv.block_hashes(probe, 2)]
    kv.seqs.pop(probe)
    b = h.add("b", prompt_len=26, max_tokens=1)
    h.plan()
    assert kv.cached(b) == 2 * BS and kv.seq(b).more[0].dropped == 0
    h.audit()
