"""A windowed layer group's pool sized by its window, model-free (issue 43, item 4): the
local table grows chunk by chunk (to compute [start, end) it holds the blocks from the first
one the window of `start` reads to the block of end - 1), so a prompt longer than the local
pool runs; a prompt longer than the global pool is still refused; when the local pool is
the short one, the scheduler preempts for it; the budget gives the global group the bytes
the local one no longer takes (docs/sliding-window.md, the budget)."""

from __future__ import annotations

import pytest
import torch

from stopline.config import EngineConfig
from stopline.kv.block_pool import LedgerError
from stopline.kv.kv_cache import KVCache, make_cache, pool_sizes, window_blocks
from stopline.kv.manager import HOLE
from stopline.request import AbortSource, FinishReason, Request, RequestStatus
from tests.scripted import HandDriven

BS, W = 4, 8  # a query at p reads the keys at p - 7 .. p: at most three blocks


def hybrid(**kw: object) -> HandDriven:
    return HandDriven(window=0, more=(W,), **kw)


def blocks(n: int) -> int:
    return -(-n // BS)


def dead(p: int) -> int:
    """Leading blocks no query at p or later reads."""
    return max(0, (p - W + 1) // BS)


def used(h: HandDriven) -> tuple[int, int]:
    return h.pools[0].num_used, h.pools[1].num_used


def local(h: HandDriven, req: Request) -> list[int]:
    return h.kv.seq(req).more[0].block_ids


def test_the_local_table_grows_chunk_by_chunk_exact_counts():
    """A 40-token prompt (10 blocks) and 20 more on a local pool of 5 blocks (20 tokens):
    at every chunk the local table holds exactly the blocks from the first one the chunk's
    window reads to the chunk's last; the global one holds every block from admission."""
    h = hybrid(num_blocks=32, local_blocks=5, max_num_batched_tokens=8)
    req = h.add("a", prompt_len=40, max_tokens=20)
    peak = 0
    for _ in range(30):
        plan = h.plan()
        if not plan.chunks:
            break
        (ch,) = plan.chunks
        start, end = ch.start, ch.start + ch.num_tokens
        t = local(h, req)
        # Holes before the window of `start`, live blocks up to the chunk's last.
        assert len(t) == blocks(end) and t[:dead(start)] == [HOLE] * dead(start), (start, end, t)
        assert HOLE not in t[dead(start):]
        assert used(h) == (max(10, blocks(end)), blocks(end) - dead(start)), (start, end)
        assert ch.group_tables == [t[:blocks(end)]]
        peak = max(peak, h.pools[1].num_used)
        h.complete(plan)
        h.audit()
        assert used(h)[1] == blocks(end) - dead(end)
        if h.kv.computed(req) == req.prompt_len + req.params.max_tokens - 1:
            h.lifecycle.finish(req, FinishReason.LENGTH)
            break
    assert len(req.output_token_ids) == 20 and peak <= 5
    assert h.stats.window_freed_blocks == dead(59) and not h.stats.preemptions
    h.audit()
    assert used(h) == (0, 0)


def test_cancel_mid_prefill_on_the_small_local_pool_behind_the_fence_once():
    h = hybrid(num_blocks=32, local_blocks=5, max_num_batched_tokens=8)
    req = h.add("a", prompt_len=40, max_tokens=4)
    for _ in range(3):
        h.complete(h.plan())
    plan = h.plan()  # the fourth chunk [24, 32) in flight: local blocks 4 .. 7
    live = [b for b in local(h, req) if b != HOLE]
    assert len(live) == 4 and used(h) == (10, 4)
    h.lifecycle.abort(req, AbortSource.CANCEL)
    # Behind the fence: the step in flight may still write every one of them.
    assert used(h) == (10, 4) and {d.group for d in h.kv.deferred} == {0, 1}
    h.audit()
    h.complete(plan)
    h.audit()
    assert used(h) == (0, 0) and not h.kv.deferred and h.stats.window_freed_blocks == dead(24)
    with pytest.raises(LedgerError, match="double free"):
        h.pools[1].release(live[:1])


def test_a_prompt_longer_than_the_global_pool_is_still_refused():
    h = hybrid(num_blocks=8, local_blocks=4)
    req = h.add("a", prompt_len=40)  # 11 blocks to compute a token: the global pool has 8
    h.plan()
    assert req.finish_reason is FinishReason.ERROR
    assert not h.kv.fits(40) and h.kv.short(40) == (11, 8)
    assert h.kv.fits(31) and h.kv.short(40, forks=1) == (12, 8)
    h.audit()
    assert used(h) == (0, 0)


def test_a_family_still_takes_its_whole_prompt_in_the_local_pool():
    """Samples share the prompt until they fork: a family's local table covers the prompt at
    admission, and one whose prompt the local pool can't hold is refused."""
    h = hybrid(num_blocks=32, local_blocks=6)
    assert h.kv.fits(40) and not h.kv.fits(40, forks=1)
    assert h.kv.short(40, forks=1) == (12, 6)


def test_the_local_pool_short_preempts_for_it_and_both_finish():
    """Two requests past the window on a local pool of four blocks (each needs up to three
    while decoding): the growth that lacks local blocks preempts (the shortage is the local
    group's), the victim resumes, and both finish with every block back."""
    for swap in (False, True):
        h = hybrid(num_blocks=64, local_blocks=4, swap=swap)
        reqs = [h.add(r, prompt_len=6, max_tokens=30) for r in ("a", "b")]
        seen_short = False
        for _ in range(200):
            if all(r.status.is_finished for r in reqs):
                break
            for r in reqs:
                if r.status is RequestStatus.RUNNING and not h.kv.in_flight(r):
                    g, d = h.kv.deficit(r, h.kv.computed(r) + 1)
                    seen_short |= g == 1 and d > 0
            h.complete(h.plan())
            h.audit()
            for r in reqs:
                if not r.status.is_finished and len(r.output_token_ids) == 30:
                    h.lifecycle.finish(r, FinishReason.LENGTH)
        assert all(len(r.output_token_ids) == 30 for r in reqs)
        assert sum(h.stats.preemptions.values()) > 0 and seen_short, (swap, h.stats.preemptions)
        assert h.stats.preemptions["swap" if swap else "recompute"] > 0
        h.audit()
        assert used(h) == (0, 0) and (not swap or h.swap.num_used == 0)


def test_a_prefill_chunk_shrinks_to_the_local_room_beside_a_decode():
    """A 60-token prompt admitted beside a decoding request on a local pool of 7 blocks: its
    chunks (budget 17 tokens) shrink to what the local pool has (KVManager.room) instead of
    preempting the decode, which runs every step."""
    h = hybrid(num_blocks=64, local_blocks=7, max_num_batched_tokens=17)
    a = h.add("a", prompt_len=6, max_tokens=60)
    for _ in range(4):
        h.complete(h.plan())
    b = h.add("b", prompt_len=60, max_tokens=4, first_token=100)
    shrunk = False
    while h.kv.computed(b) < 60:
        plan = h.plan()
        ids = [c.req.request_id for c in plan.chunks]
        assert ids == ["a", "b"], ids
        ch = plan.chunks[1]
        shrunk |= 1 < ch.num_tokens < min(17 - 1, 60 - ch.start)
        assert h.pools[1].num_used <= 7
        h.complete(plan)
        h.audit()
    assert shrunk and not h.stats.preemptions
    for r in (a, b):
        h.lifecycle.finish(r, FinishReason.LENGTH)
    h.audit()
    assert used(h) == (0, 0)


def test_a_long_prompt_swapped_mid_prefill_comes_back_with_its_holes():
    h = hybrid(num_blocks=32, local_blocks=5, swap=True, max_num_batched_tokens=8)
    req = h.add("a", prompt_len=40, max_tokens=4)
    for _ in range(3):  # 24 tokens in: local blocks 4, 5 live
        h.complete(h.plan())
    s = h.kv.seq(req)
    assert s.more[0].dropped == dead(24) == 4 and used(h) == (10, 2)
    h.lifecycle.preempt(req)
    assert req.status is RequestStatus.SWAPPED and s.swapped == [10, 2] and used(h) == (0, 0)
    h.audit()
    plan = h.plan()  # swapped in, the next chunk
    assert plan.chunks[0].start == 24 and local(h, req)[:4] == [HOLE] * 4
    h.complete(plan)
    h.audit()
    for _ in range(6):
        h.complete(h.plan())
        h.audit()
        if len(req.output_token_ids) == 4:
            h.lifecycle.finish(req, FinishReason.LENGTH)
            break
    assert req.status.is_finished and len(req.output_token_ids) == 4
    assert h.pools[1].num_used == 0 and h.swap.num_used == 0
    h.audit()


def test_a_prefix_hit_on_the_small_local_pool_then_chunks():
    h = hybrid(num_blocks=32, local_blocks=5, max_num_batched_tokens=8)
    a = h.add("a", prompt_len=40, max_tokens=1)
    for _ in range(5):  # five chunks of 8
        h.complete(h.plan())
    assert a.output_token_ids
    h.lifecycle.finish(a, FinishReason.LENGTH)
    h.audit()
    b = h.add("b", prompt_len=40, max_tokens=1)
    plan = h.plan()
    # 9 full blocks hit: the local group needs blocks 7 and 8 (the window of position 36)
    # and one for the last token.
    assert plan.chunks[0].start == 36 and h.kv.cached(b) == 36
    assert local(h, b) == [HOLE] * 7 + local(h, b)[7:] and len(local(h, b)) == 10
    assert used(h)[1] == 3
    h.complete(plan)
    h.audit()


def test_the_audit_sees_a_local_table_short_of_its_computed_tokens():
    h = hybrid(num_blocks=32, local_blocks=8, max_num_batched_tokens=8)
    req = h.add("a", prompt_len=30)
    h.complete(h.plan())
    h.audit()
    t = h.kv.seq(req).more[0]
    h.pools[1].release([t.block_ids.pop()])  # the chunk's last block lost: the ledger agrees
    with pytest.raises(LedgerError, match="fewer than its 8 tokens"):
        h.audit()


def test_the_budget_gives_the_global_group_what_the_window_does_not_need():
    per_layer = KVCache.bytes_per_block(1, 4, 1, 8)  # 256 bytes
    cfg = EngineConfig(block_size=4, kv_cache_memory_gb=3 * 1000 * per_layer / 2**30, max_num_seqs=4,
                       max_num_batched_tokens=16)
    need = window_blocks(16, 4, 4, 16)
    assert need == 4 * (19 // 4 + 2) + 2 * 4 == 32
    # One global layer, two local ones: 3000 layer-blocks of bytes. Equal counts held 1000
    # of each; now the local pool has the 32 its window needs, the global one the rest.
    assert pool_sizes(cfg, [1, 2], [0, 16], per_layer) == [3000 - 2 * 32, 32]
    assert pool_sizes(cfg, [1], [0], per_layer) == [3000]
    assert pool_sizes(cfg, [2, 1], [8, 16], per_layer) == [1000, 1000]  # no global group
    # num_blocks is the global group's; the local one takes at most as many.
    for n, local_n in ((200, 32), (20, 20)):
        sized = EngineConfig(block_size=4, num_blocks=n, max_num_seqs=4, max_num_batched_tokens=16)
        assert pool_sizes(sized, [1, 2], [0, 16], per_layer) == [n, local_n]
    tight = EngineConfig(block_size=4, kv_cache_memory_gb=3 * 20 * per_layer / 2**30, max_num_seqs=4,
                         max_num_batched_tokens=16)
    assert pool_sizes(tight, [1, 2], [0, 16], per_layer) == [20, 20]  # the window's share can't fit


def test_each_group_has_its_own_tensors_and_zero_block():
    cfg = EngineConfig(block_size=4, num_blocks=50, window_pool_blocks=6, debug=True,
                       preemption_mode="swap")
    pools, kv, swap = make_cache(cfg, 3, 1, 8, [1, 0, 1], [0, 16])
    assert [p.num_blocks for p in pools] == [50, 6] and kv.nulls == [50, 6] and kv.null_block == 50
    assert [t.shape[1] for t in kv.k] == [7 * 4, 51 * 4, 7 * 4]
    assert swap is not None and swap.num_blocks == 56
    assert kv.nbytes == 2 * 4 * 8 * 4 * (51 + 2 * 7)
    kv.write_blocks([5], [torch.ones(1, 4, 8)] * 4, group=1)  # the local pool's last block
    assert kv.k[0][:, 20:24].eq(1).all() and kv.k[0][:, 24:].eq(0).all()  # its zero block stays
