"""Per-layer-group KV on a tiny Gemma 3 (two local layers of window 16, one global layer;
blocks of 4), past its window (issue 43, item 4): the local group's pool use is bounded by
the window while the global group's grows with the context, greedy output stays HF's, alone
equals 24 at once, and cancels mid-prefill, n > 1, swap and recompute leave the audit clean
(the split of this model: tests/test_disagg_groups.py).
The figures are in docs/sliding-window.md."""

from __future__ import annotations

import time

import pytest

from stopline import LLM
from stopline.model.kernels.paged_attention import supports as native_attention
from stopline.request import AbortSource, FinishReason
from tests.engine_support import drive, greedy, hf_greedy, load_hf, random_prompts
from tests.tiny_families import make_family_dir

MAX_NEW = 80
BS = 4
BACKENDS = ["torch"] + (["native"] if native_attention(16, "cpu") is None else [])


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return make_family_dir(tmp_path_factory.mktemp("gemma_groups"), "gemma3")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, [6, 23, 40], seed=11)


@pytest.fixture(scope="module")
def oracle(gemma, prompts):
    return hf_greedy(load_hf(gemma), prompts, MAX_NEW).tokens


def engine(gemma, **kw: object) -> LLM:
    cfg = dict(progress=False, debug=True, target_step_ms=None, num_blocks=64, block_size=BS)
    cfg.update(kw)
    return LLM(model=str(gemma), **cfg)


@pytest.mark.parametrize("backend", BACKENDS)
def test_local_pool_bounded_by_the_window_global_by_the_context(gemma, prompts, oracle, backend):
    e = engine(gemma, attention_backend=backend).engine
    kv = e.kv_manager
    assert kv.windows == [0, 16] and len(e.pools) == 2
    e.add_request("long", prompts[0], greedy(MAX_NEW))
    peak, toks = [0, 0], []
    while e.has_unfinished():
        for o in e.step():
            toks += o.new_token_ids
        peak = [max(p, pool.num_used) for p, pool in zip(peak, e.pools, strict=True)]
        e.audit()
    assert toks == oracle[0]
    if backend == "torch":  # the decodes ran from DecodeRows holding both groups' K/V (checked: debug)
        assert e.runner.rows is not None and e.runner.rows.relayouts > 0
    context = -(-(len(prompts[0]) + MAX_NEW) // BS)  # 22 blocks
    assert peak[0] >= context - 1  # the global layers read every position
    assert peak[1] <= 16 // BS + 2 < context  # the window's 16 keys, and the block the next opens
    assert e.lifecycle.stats.window_freed_blocks >= context - peak[1]
    assert kv.num_used == 0


@pytest.mark.parametrize("backend,async_scheduling", [(b, a) for b in BACKENDS for a in (False, True)])
def test_a_local_pool_sized_by_the_window(gemma, prompts, oracle, backend, async_scheduling):
    """num_blocks is the global group's; the local pool is what the window needs for three
    requests (22 blocks of 4: fewer than one long prompt's 50). Long prompts, chunked
    prefill over the small pool, 80 tokens each past the window: HF's greedy tokens, the same
    as an engine with equal pools, the audit clean after every step (both pools)."""
    long = random_prompts(2, [200, 120], seed=5)
    ref = hf_greedy(load_hf(gemma), long, MAX_NEW).tokens
    work = [*prompts, *long]
    want = [*oracle, *ref]
    kw = dict(attention_backend=backend, num_blocks=160, max_num_seqs=3, max_num_batched_tokens=8,
              async_scheduling=async_scheduling, preemption_mode="swap")
    e = engine(gemma, **kw).engine
    assert [p.num_blocks for p in e.pools] == [160, 22] and e.kv.nulls == [160, 22]
    peak = [0, 0]

    def watch(eng, step):
        for i, pool in enumerate(eng.pools):
            peak[i] = max(peak[i], pool.num_used)

    res = drive(e, [(f"r{i}", p, greedy(MAX_NEW)) for i, p in enumerate(work)], after_step=watch)
    assert [res[f"r{i}", 0].token_ids for i in range(len(work))] == want
    assert peak[1] <= 22 < -(-len(long[0]) // BS) and peak[0] > 22
    assert e.lifecycle.stats.window_freed_blocks > 100
    equal = engine(gemma, **kw, window_pool_blocks=160).engine
    assert [p.num_blocks for p in equal.pools] == [160, 160]
    res_eq = drive(equal, [(f"r{i}", p, greedy(MAX_NEW)) for i, p in enumerate(work)])
    assert [res_eq[f"r{i}", 0].token_ids for i in range(len(work))] == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_alone_equals_24_concurrent_past_the_window(gemma, prompts, oracle, backend):
    many = [prompts[i % 3] for i in range(24)]
    llm = engine(gemma, attention_backend=backend, num_blocks=600, max_num_seqs=24,
                 max_num_batched_tokens=4096, enable_prefix_caching=False)
    got = [r.outputs[0].token_ids for r in llm.generate(many, greedy(MAX_NEW))]
    assert got == [oracle[i % 3] for i in range(24)]
    assert llm.engine.lifecycle.stats.window_freed_blocks > 24 * 10
    assert llm.engine.kv_manager.num_used == 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_on_both_groups_resumes_exactly(gemma, prompts, oracle, mode):
    """A pool too small for all three: requests are preempted (by swap: each group's live
    blocks go out and come back with the local holes; by recompute: both tables dropped)
    and still give HF's tokens; the audit checks both pools after every step."""
    e = engine(gemma, num_blocks=40, preemption_mode=mode, max_num_batched_tokens=7,
               max_preemptions=1000, admission_lookahead=0).engine
    res = drive(e, [(f"r{i}", p, greedy(MAX_NEW)) for i, p in enumerate(prompts)])
    assert [res[f"r{i}", 0].token_ids for i in range(3)] == oracle
    assert e.lifecycle.stats.preemptions[mode] > 0, e.lifecycle.stats.preemptions
    assert e.lifecycle.stats.window_freed_blocks > 0 and len(e.pools) == 2


def test_cancel_mid_prefill_and_families(gemma, prompts, oracle):
    """A long prompt cancelled between its chunks (after the local group slid), and an n = 3
    family past the window: every sample is the prompt's greedy continuation."""
    e = engine(gemma, max_num_batched_tokens=8).engine
    e.add_request("long", list(prompts[2]) * 2, greedy(4))

    def cancel(eng, step):
        if step == 5:
            req = next(r for r in eng.live_requests() if r.request_id == "long")
            kv = eng.kv_manager
            assert kv.prefilling(req) and kv.seq(req).more[0].dropped > 0, kv.computed(req)
            eng.abort([req.incarnation], AbortSource.CANCEL, time.monotonic())

    res = drive(e, [("fam", prompts[1], greedy(MAX_NEW, n=3))], after_step=cancel)
    assert res["long", 0].finish_reason is FinishReason.ABORT and not res["long", 0].token_ids
    assert [res["fam", i].token_ids for i in range(3)] == [oracle[1]] * 3


def test_a_prefix_hit_past_the_window(gemma, prompts, oracle):
    """A second request on the first's finished long prompt hits its global blocks and the
    local group's window blocks (the local blocks before the window need not be cached)."""
    e = engine(gemma).engine
    long = list(prompts[2]) + oracle[2][:30]
    first = drive(e, [("a", long, greedy(8))])
    again = drive(e, [("b", long, greedy(8, logprobs=0))])
    assert again["b", 0].token_ids == first["a", 0].token_ids
    assert again["b", 0].usage.cached_tokens >= len(long) - 2 * BS
    assert e.lifecycle.stats.window_freed_blocks > 0
