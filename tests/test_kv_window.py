"""Sliding-window KV on the KV manager, model-free (issue 43, item 4): blocks every layer's
window has passed go back to the pool while their request runs, behind the fence, exactly
once; the ledger, swap, recompute, forks, cancels and the prefix cache see live blocks only."""

from __future__ import annotations

import pytest

from stopline.kv.block_pool import BlockPool, LedgerError
from stopline.kv.manager import HOLE, KVManager, group_window
from stopline.request import (
    AbortSource,
    Family,
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
)
from stopline.stats import StopStats
from tests.scripted import HandDriven

BS, W = 4, 8  # a query at p reads the keys at p - 7 .. p: at most three blocks


def live(h: HandDriven, req: Request) -> int:
    return sum(1 for b in h.kv.table(req) if b != HOLE)


def expected_live(computed: int) -> int:
    """Blocks covering `computed` tokens, less those no later query reads."""
    return -(-computed // BS) - max(0, (computed - W + 1) // BS)


def decode(h: HandDriven, req: Request, steps: int) -> list[int]:
    """Decode `steps` tokens, auditing after each; the pool's use after each step."""
    used = []
    for _ in range(steps):
        h.complete(h.plan())
        h.audit()
        used.append(h.pool.num_used)
        assert live(h, req) == expected_live(h.kv.computed(req)), h.kv.table(req)
    return used


def test_group_window_is_the_largest_and_any_global_layer_keeps_all():
    assert group_window((16, 16, 16)) == 16
    assert group_window((8, 16)) == 16  # a block is free only when every layer passed it
    assert group_window((16, 0, 16)) == 0  # Gemma 3: its global layers read every block
    assert group_window(()) == 0


def test_window_frees_blocks_while_the_request_runs_exact_counts():
    h = HandDriven(num_blocks=16, window=W)
    req = h.add("a", prompt_len=6, max_tokens=40)
    used = decode(h, req, 30)
    # Step k has computed 6 + k - 1 tokens (the last sampled one is computed by the next).
    assert used[0] == 2  # 6 tokens: two blocks, none passed yet
    assert used[:8] == [2, 2, 2, 3, 3, 2, 2, 3]  # 6..13 tokens: opening a block, dropping the oldest
    assert max(used) == 3 and h.stats.window_freed_blocks == 7
    assert h.kv.table(req)[:7] == [HOLE] * 7
    h.lifecycle.finish(req, FinishReason.LENGTH)
    h.audit()
    assert h.pool.num_used == 0


def test_without_a_window_every_block_stays():
    h = HandDriven(num_blocks=16)
    req = h.add("a", prompt_len=6, max_tokens=40)
    for _ in range(30):
        h.complete(h.plan())
    assert h.pool.num_used == -(-h.kv.computed(req) // BS) == 9
    assert HOLE not in h.kv.table(req)


def test_the_fence_holds_passed_blocks_until_the_step_that_may_read_them_is_processed():
    h = HandDriven(num_blocks=16, window=W)
    req = h.add("a", prompt_len=14, max_tokens=4)
    plan = h.plan()  # the prefill, in flight
    h.kv.register(req)
    # Slid while the step is in flight (as async scheduling can): the passed block waits
    # behind the fence, not in the pool.
    assert h.kv.slide(req, 14) == 1
    s = h.kv.seq(req)
    assert s.dropped == (14 - W + 1) // BS == 1 and h.kv.table(req)[0] == HOLE
    assert h.pool.num_used == 4 and len(h.kv.deferred) == 1
    h.audit()  # the fence's hold is in the ledger
    h.complete(plan)
    assert h.pool.num_used == 3 and not h.kv.deferred
    h.audit()


def test_a_passed_block_is_freed_exactly_once():
    h = HandDriven(num_blocks=16, window=W)
    req = h.add("a", prompt_len=14, max_tokens=8)
    h.complete(h.plan())
    gone = h.kv.seq(req).dropped
    assert gone == 1 and h.stats.window_freed_blocks == 1
    assert h.kv.slide(req, 14) == 0 and h.kv.slide(req, 3) == 0  # again, or a rewind: nothing
    h.lifecycle.abort(req, AbortSource.CANCEL)  # the release frees live blocks only
    h.audit()
    assert h.pool.num_used == 0 and h.stats.window_freed_blocks == 1
    with pytest.raises(LedgerError, match="double free"):
        h.pool.release([0])  # the pool refuses a second free of any block


def test_cancel_mid_prefill_of_a_windowed_request():
    h = HandDriven(num_blocks=16, window=W, max_num_batched_tokens=4)
    req = h.add("a", prompt_len=30, max_tokens=4)
    for _ in range(4):  # four chunks of four: 16 tokens computed
        h.complete(h.plan())
        h.audit()
    assert h.kv.computed(req) == 16 and h.kv.seq(req).dropped == (16 - W + 1) // BS == 2
    plan = h.plan()  # the fifth chunk in flight
    h.lifecycle.abort(req, AbortSource.CANCEL)
    assert h.pool.num_used > 0 and h.kv.deferred  # behind the fence
    h.audit()
    h.complete(plan)
    h.audit()
    assert h.pool.num_used == 0 and not h.kv.holds(req)


def test_swap_ships_live_blocks_only_and_keeps_the_holes():
    h = HandDriven(num_blocks=16, window=W, swap=True)
    req = h.add("a", prompt_len=6, max_tokens=40)
    for _ in range(12):
        h.complete(h.plan())
    s = h.kv.seq(req)
    holes, n_live = s.dropped, live(h, req)
    assert holes == 2 and n_live == 3  # 17 tokens: blocks 0, 1 passed
    h.lifecycle.preempt(req)
    assert req.status is RequestStatus.SWAPPED
    assert len(h.kv.swap_slots(req)) == n_live and h.pool.num_used == 0
    h.audit()
    h.complete(h.plan())  # swapped back in, one decode
    assert req.status is RequestStatus.RUNNING and not h.kv.swap_slots(req)
    assert h.kv.table(req)[:holes] == [HOLE] * holes
    assert live(h, req) == expected_live(h.kv.computed(req))
    h.audit()
    h.lifecycle.finish(req, FinishReason.LENGTH)
    h.audit()
    assert h.pool.num_used == 0 and h.swap.num_used == 0


def test_recompute_preemption_of_a_windowed_request():
    h = HandDriven(num_blocks=16, window=W, enable_prefix_caching=False)
    req = h.add("a", prompt_len=6, max_tokens=40)
    for _ in range(12):
        h.complete(h.plan())
    h.lifecycle.preempt(req)
    assert req.status is RequestStatus.PREEMPTED and h.kv.seq(req).dropped == 0
    assert h.pool.num_used == 0 and not h.kv.table(req)
    h.audit()
    h.complete(h.plan())  # the re-prefill slides as it lands
    assert req.status is RequestStatus.RUNNING
    assert live(h, req) == expected_live(h.kv.computed(req))
    h.audit()


def test_prefix_hit_needs_only_its_window_blocks():
    h = HandDriven(num_blocks=16, window=W)
    a = h.add("a", prompt_len=21, max_tokens=1)
    h.complete(h.plan())  # the prefill: blocks 0..2 passed (cached), then a ends
    h.lifecycle.finish(a, FinishReason.LENGTH)
    h.audit()
    # Evict the passed blocks (the oldest cached): the hit of 5 blocks needs only 3 and 4.
    h.pool.release(h.pool.allocate(h.pool.num_free + 3), keep_cached=False)
    b = h.add("b", prompt_len=21, max_tokens=1)
    plan = h.plan()
    assert plan.chunks[0].start == 20 and h.kv.table(b)[:3] == [HOLE] * 3
    assert h.kv.seq(b).dropped == 3


def test_no_hit_is_reported_when_a_window_block_is_missing():
    h = HandDriven(num_blocks=16, window=W)
    a = h.add("a", prompt_len=21, max_tokens=1)
    h.complete(h.plan())
    h.lifecycle.finish(a, FinishReason.LENGTH)
    # Evict the passed blocks and block 3, which the window of every hit reads.
    h.pool.release(h.pool.allocate(h.pool.num_free + 4), keep_cached=False)
    c = h.add("c", prompt_len=21, max_tokens=1)
    plan = h.plan()
    assert plan.chunks[0].start == 0 and HOLE not in h.kv.table(c)


def test_n_samples_share_the_prompt_until_they_fork_then_slide():
    h = HandDriven(num_blocks=24, window=W)
    leader = Request("f", list(range(20, 40)), SamplingParams(n=2, max_tokens=6, temperature=0.0),
                     incarnation="f")
    s1 = Request("f", list(leader.prompt_token_ids), leader.params, index=1, incarnation="f",
                 fork_leader=leader)
    leader.forks_pending = [s1]
    leader.family = s1.family = Family("f", [leader, s1], "f")
    h.sched.add(leader)
    h.live += [leader, s1]
    plan = h.plan()
    h.complete(plan)  # the prompt (20 tokens): the leader passed blocks 0..2
    assert h.kv.seq(leader).dropped == 3
    # The sample still holds the shared prompt blocks: none went back to the pool.
    assert h.pool.num_used == 5 and all(b != HOLE for b in h.kv.table(s1))
    h.kv.fork(s1, leader)  # the core forks it at the first token: it slides too
    s1.fork_leader = None
    leader.forks_pending.remove(s1)
    for r in (leader, s1):
        r.output_token_ids.append(7)
    assert h.kv.seq(s1).dropped == 3 and h.pool.num_used == 2
    h.audit()
    for _ in range(4):
        h.complete(h.plan())
        h.audit()
    for r in (leader, s1):
        h.lifecycle.finish(r, FinishReason.LENGTH)
    h.audit()
    assert h.pool.num_used == 0


def test_the_audit_sees_a_hole_in_the_middle():
    pool = BlockPool(8, BS)
    kv = KVManager(pool, None, None, StopStats(), window=W)
    req = Request("x", list(range(6)), SamplingParams(), incarnation="x")
    assert kv.admit(req, 0)
    kv.seq(req).block_ids[1] = HOLE  # a table that lost a live block mid-way
    with pytest.raises(LedgerError):
        kv.audit([req])
