"""The prefill/decode split on a model of several KV layer groups (issue 43, item 4): the tiny
Gemma 3 (two local layers of window 16, one global layer; blocks of 4). The prefill side
ships, in one transfer, every group's blocks its window still reads (the global group's all,
the local group's last few), the decode side imports each group's at its offset and finds
them as a prefix hit in every group, and the output is one engine's. Cancels mid-transfer
and a decode side that refuses leave both roles' pools (every group) clean.
docs/sliding-window.md ("P/D split"), docs/disagg.md."""

from __future__ import annotations

import time

import pytest
import torch

from stopline.disagg.epochs import BlockEpochs
from stopline.disagg.wire import BadTransfer, pack_groups, unpack, write_groups
from stopline.engine.core import EngineCore
from stopline.kv.block_pool import BlockPool
from stopline.kv.kv_cache import KVCache
from stopline.kv.manager import HOLE, KVManager
from stopline.model.loaders.loader import load_model
from stopline.request import AbortSource, FinishReason, Request, RequestStatus, SamplingParams
from stopline.stats import StopStats
from tests.disagg_support import config, make_pair
from tests.engine_support import drive, greedy, random_prompts
from tests.tiny_families import make_family_dir

BS = 4
WINDOW = 16


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    d = make_family_dir(tmp_path_factory.mktemp("split_gemma"), "gemma3")
    return load_model(str(d), progress=False)


@pytest.fixture
def pair(gemma):
    pr = make_pair(gemma)
    yield pr
    pr.close()


def _single(loaded, reqs):
    return drive(EngineCore(loaded, config()), reqs)


def _until_sent(pair) -> None:
    for _ in range(200):
        if len(pair.p.role.sending):
            return
        pair.step_p()
    raise AssertionError("the prefill side never shipped the KV")


def test_greedy_over_the_split_equals_one_engine_shorter_and_longer_than_the_window(gemma, pair):
    """Prompts of 6 to 61 tokens (the window is 16) and an n = 3 family: outputs equal one
    engine's; the decode side computed only the last partial block (a hit in both groups);
    the local group shipped fewer blocks than the global one, only those its window reads."""
    prompts = random_prompts(5, [6, 12, 23, 40, 61], seed=5)
    reqs = [(f"g{i}", p, greedy(12)) for i, p in enumerate(prompts)]
    reqs.append(("fam", prompts[3], greedy(12, n=3)))
    reqs.append(("seeded", prompts[4], SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=12)))
    want = _single(gemma, reqs)
    assert len(pair.p.kv_manager.pools) == 2 and pair.d.kv_manager.windows == [0, WINDOW]
    for rid, prompt, params in reqs:
        pair.add(rid, prompt, params)
    pair.settle()
    pair.assert_idle()
    for key, r in want.items():
        assert pair.out[key].token_ids == r.token_ids, key
        assert pair.out[key].finish_reason is r.finish_reason
    for rid, prompt, _ in reqs:  # every full block but the last token's was a hit
        assert pair.out[rid, 0].usage.cached_tokens == (len(prompt) - 1) // BS * BS, rid
    # Per group, the blocks each prompt ships: all of them in the global group; in the local
    # one from the first block a query at the prompt's cut still reads.
    full = [(len(p) - 1) // BS for _, p, _ in reqs]
    local = [n - max(0, (n * BS - WINDOW + 1) // BS) for n in full]
    sent, got = pair.p.lifecycle.stats.transfer_blocks, pair.d.lifecycle.stats.transfer_blocks
    assert (sent["sent", 0], sent["sent", 1]) == (sum(full), sum(local))
    assert (got["received", 0], got["received", 1]) == (sum(full), sum(local))
    assert sum(local) < sum(full) and pair.d.role.imported_blocks == sum(full) + sum(local)
    assert pair.p.lifecycle.stats.window_freed_blocks > 0  # the prefill side slid as chunks landed


def test_a_prompt_longer_than_the_window_ships_fewer_local_blocks(gemma, pair):
    """One 61-token prompt: 15 full blocks go in the global group, the 4 the window reads (and
    a 5th it straddles: 16 keys before position 60 start in block 11) in the local one."""
    prompt = random_prompts(1, [61], seed=9)[0]
    pair.add("long", prompt, greedy(4))
    pair.settle()
    pair.assert_idle()
    stats = pair.d.lifecycle.stats.transfer_blocks
    assert stats["received", 0] == 15 and stats["received", 1] == 15 - (60 - WINDOW + 1) // BS == 4
    assert pair.out["long", 0].usage.cached_tokens == 60


@pytest.mark.parametrize("family", ["qwen2_window", "gemma3_gguf"])
def test_other_models_of_two_groups(family, tmp_path_factory):
    """Qwen2 with use_sliding_window (the layer below max_window_layers global, the rest of
    window 16) and the llama.cpp Gemma 3 layout (five local layers, one global): the split's
    greedy output equals one engine's, the local group shipping fewer blocks."""
    loaded = load_model(str(make_family_dir(tmp_path_factory.mktemp(f"split_{family}"), family)),
                        progress=False)
    prompts = random_prompts(2, [12, 49], seed=21)
    reqs = [(f"g{i}", p, greedy(10)) for i, p in enumerate(prompts)]
    want = _single(loaded, reqs)
    pr = make_pair(loaded)
    try:
        assert pr.d.kv_manager.windows == [0, WINDOW]
        for rid, prompt, params in reqs:
            pr.add(rid, prompt, params)
        pr.settle()
        pr.assert_idle()
        assert {k: r.token_ids for k, r in pr.out.items()} == {k: r.token_ids for k, r in want.items()}
        got = pr.d.lifecycle.stats.transfer_blocks
        assert (got["received", 0], got["received", 1]) == (2 + 12, 2 + 4)
    finally:
        pr.close()


@pytest.mark.parametrize("first", ["decode", "prefill"])
def test_cancel_mid_transfer_leaves_every_group_clean(pair, first):
    """The KV is on the link; the abort reaches one side first, then the other: the decode
    side refuses or drops the late KV, nothing is written, both pools of both roles are back."""
    inc = pair.add("a", random_prompts(1, [45], seed=2)[0], greedy(4))
    _until_sent(pair)
    assert all(p.num_used for p in pair.p.kv_manager.pools)  # both groups' blocks held for the ack
    if first == "decode":  # the KV arrives after the abort: refused, nothing written
        pair.d.abort([inc], AbortSource.CANCEL, time.monotonic())
        pair.settle(until=lambda pr: not pr.d.has_unfinished())
        assert pair.d.role.imported_blocks == 0
        pair.p.abort([inc], AbortSource.CANCEL, time.monotonic())
    else:  # released at once on prefill, both groups; decode may still take the KV, then ends
        pair.p.abort([inc], AbortSource.CANCEL, time.monotonic())
        pair.step_p()
        assert not len(pair.p.role.sending) and all(p.num_used == 0 for p in pair.p.kv_manager.pools)
        pair.d.abort([inc], AbortSource.CANCEL, time.monotonic())
    pair.settle()
    pair.assert_idle()
    assert all(p.num_used == 0 for c in (pair.p, pair.d) for p in c.kv_manager.pools)
    assert pair.out["a", 0].finish_reason is FinishReason.ABORT and pair.out["a", 0].token_ids == []


def test_cancel_after_import_before_admission(gemma):
    """The KV is imported and the request queued behind max_num_seqs on decode: cancelled
    there, it ends once, and the imported blocks stay only as cached prefix (no owner)."""
    pair = make_pair(gemma, max_num_seqs=1)
    try:
        _cancel_queued(pair)
    finally:
        pair.close()


def _cancel_queued(pair) -> None:
    busy = pair.add("busy", random_prompts(1, [9], seed=4)[0], greedy(40))
    inc = pair.add("queued", random_prompts(1, [45], seed=6)[0], greedy(4))
    pair.settle(until=lambda pr: pr.d.role.imported_blocks > 0 and not pr.p.has_unfinished()
                and ("busy", 0) in pr.out)
    assert not pair.d.role._waiting
    queued = next(r for r in pair.d.live_requests() if r.incarnation == inc)
    assert queued.status is RequestStatus.WAITING  # imported, not admitted: behind max_num_seqs
    pair.d.abort([inc], AbortSource.CANCEL, time.monotonic())
    pair.abort(busy)
    pair.settle()
    pair.assert_idle()
    assert pair.out["queued", 0].finish_reason is FinishReason.ABORT
    assert pair.d.kv_manager.pools[1].num_cached > 0  # the local group's import, unowned


def test_decode_refuses_kv_of_another_grouping_for_that_request_only(gemma, pair):
    """A transfer whose header names other layer groups than the decode model's ends that
    request with an error naming both (and acks the refusal, which errors the prefill copy);
    another request through the split is served as one engine."""
    good = random_prompts(1, [30], seed=8)[0]
    want = _single(gemma, [("ok", good, greedy(6))])
    inc = pair.add("bad", random_prompts(1, [30], seed=7)[0], greedy(4))
    pair.add("ok", good, greedy(6))
    _until_sent(pair)
    real = pair.d.role._receive

    def as_one_group(head, data):
        if head.request_id == inc:  # as a prefill model of one group would have sent it
            head = type(head)(**{f: getattr(head, f) for f in head.__struct_fields__} |
                              {"windows": [0], "firsts": [0], "counts": [sum(head.counts)]})
        real(head, data)

    pair.d.role._receive = as_one_group
    pair.settle()
    pair.assert_idle()
    bad = pair.out["bad", 0]
    assert bad.finish_reason is FinishReason.ERROR
    assert "1 layer groups of windows [0]; this model's are [0, 16]" in bad.stop_detail
    assert any(o.finish_reason is FinishReason.ERROR and "decode engine refused" in o.stop_detail
               for o in pair.p_out)
    assert pair.out["ok", 0].token_ids == want["ok", 0].token_ids


# ---- the per-group header and import, model-free -----------------------------------------

def _groups_side(num_blocks=16):
    """A cache of three layers: 0 and 2 global (group 0), 1 local (group 1)."""
    cache = KVCache(3, num_blocks, BS, 2, 3, layer_group=[0, 1, 0])
    pools = [BlockPool(num_blocks, BS) for _ in cache.groups]
    for g, p in enumerate(pools):
        p.on_allocate = lambda blocks, g=g: cache.zero(blocks, group=g)
    return pools, cache, [BlockEpochs(p) for p in pools]


def test_each_group_arrives_at_its_blocks_bit_for_bit():
    spools, scache, seps = _groups_side()
    rpools, rcache, reps = _groups_side()
    src = [spools[0].allocate(5), spools[1].allocate(2)]  # global: 5 blocks; local: its last 2
    for t in scache.k + scache.v:
        t.copy_(torch.randn_like(t))
    rpools[1].allocate(3)  # the receiver's ids differ from the sender's, per group
    dst = [rpools[0].allocate(5), rpools[1].allocate(2)]
    frames = pack_groups("r", scache, seps, [(0, 0, seps[0].refs(src[0])), (8, 3, seps[1].refs(src[1]))])
    head, data = unpack(frames)
    assert (head.windows, head.firsts, head.counts) == ([0, 8], [0, 3], [5, 2])
    assert [r.block for r in head.refs] == src[0] + src[1]
    assert len(data) == 6  # K and V of the two global layers, then of the local one
    write_groups(rcache, reps, [reps[0].refs(dst[0]), reps[1].refs(dst[1])], head, data)
    for g in (0, 1):
        for a, b in zip(scache.read_blocks(src[g], group=g), rcache.read_blocks(dst[g], group=g), strict=True):
            assert torch.equal(a, b)
    with pytest.raises(BadTransfer, match="in layer group 1"):
        write_groups(rcache, reps, [reps[0].refs(dst[0]), reps[1].refs(dst[1][:1])], head, data)
    with pytest.raises(BadTransfer, match="1 reserved"):
        write_groups(rcache, reps, [reps[0].refs(dst[0])], head, data)
    bad = head.__class__(**{f: getattr(head, f) for f in head.__struct_fields__} | {"counts": [5, 1]})
    import msgspec

    with pytest.raises(BadTransfer, match="groups"):
        unpack([msgspec.msgpack.encode(bad)] + frames[1:])


def _manager():
    pools = [BlockPool(32, BS), BlockPool(32, BS)]
    return KVManager(pools[0], None, None, StopStats(), window=0, more=[(pools[1], 8)])


def test_import_per_group_is_a_window_hit_in_every_group():
    """Six blocks in the global group, the local group's (window 8) last two from block 4:
    a request on that prompt is admitted with a hit of six blocks, the local table holes
    before its window; a first past what the window reads is refused; no room in one pool
    imports nothing in any."""
    kv = _manager()
    prompt = list(range(3, 3 + 6 * BS + 1))
    with pytest.raises(ValueError, match="layer group 1 .window 8. sent from block 5"):
        kv.import_prefix(prompt, 6, lambda blocks: None, firsts=[0, 5])
    with pytest.raises(ValueError, match="1 KV layer groups for a model of 2"):
        kv.import_prefix(prompt, 6, lambda blocks: None, firsts=[0])
    seen = []
    assert kv.import_prefix(prompt, 6, seen.append, firsts=[0, 4]) == [6, 2]
    assert [len(b) for b in seen[0]] == [6, 2]
    assert [p.num_used for p in kv.pools] == [0, 0] and [p.num_cached for p in kv.pools] == [6, 2]
    req = Request("r", prompt, SamplingParams(max_tokens=4), incarnation="r")
    assert kv.admit(req, 0)
    s = kv.seq(req)
    assert kv.computed(req) == 6 * BS and s.more[0].dropped == 4
    assert s.block_ids[:6] == seen[0][0] and s.more[0].block_ids[:6] == [HOLE] * 4 + seen[0][1]
    # What its prefill engine would ship: the same split.
    assert kv.export_prefix(req, 6) == [(0, seen[0][0]), (4, seen[0][1])]
    kv.pools[1].allocate(kv.pools[1].num_available - 1)  # the local pool has room for 1 block
    used = kv.pools[0].num_used
    assert kv.import_prefix(list(range(100, 130)), 6, seen.append, firsts=[0, 4]) == [0, 0]
    assert len(seen) == 1 and kv.pools[0].num_used == used  # nothing taken in the global pool either
