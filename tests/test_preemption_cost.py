"""What a preemption costs, and what keeps it from happening: admission that keeps room for
the running requests' next tokens, a resumed request finding its own generated blocks in the
prefix cache, and AUTO choosing between recompute and swap by measured cost."""

from __future__ import annotations

import pytest

from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.model.loaders.loader import load_model
from stopline.request import Request, RequestStatus, SamplingParams
from tests.tiny_model import make_tiny_llama_dir

PROMPT = [5, 17, 99, 23, 42, 7, 300]  # 7 tokens: two blocks of 4, the second one short


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_llama_dir(tmp_path_factory.mktemp("preempt_cost") / "tiny", seed=4, init_std=0.1,
                               vocab_size=384)
    return load_model(str(path), progress=False)


def engine(tiny, **kw) -> EngineCore:
    cfg = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, debug=True, target_step_ms=None)
    cfg.update(kw)
    return EngineCore(tiny, EngineConfig(**cfg))


def run(eng: EngineCore, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    for rid, p in prompts.items():
        eng.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    eng.audit()
    assert eng.pool.num_used == 0
    return out


@pytest.mark.parametrize("lookahead,preempts", [(0, True), (8, False)])
def test_admission_keeps_room_for_the_running_requests_next_tokens(tiny, lookahead, preempts):
    """Six blocks: "a" runs (two blocks, a third within two tokens); "b" arrives one step later
    and fits the free room right now. Admitted into it (lookahead 0), "a" soon needs a block,
    and one of them is preempted and recomputed. With a lookahead of 8 tokens, "b" waits until
    the room is really free, and nothing is thrown away."""
    eng = engine(tiny, num_blocks=6, admission_lookahead=lookahead)
    eng.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    out = {"a": [], "b": []}
    for o in eng.step():
        out[o.request_id] += o.new_token_ids
    eng.add_request("b", PROMPT[::-1], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    stats = eng.lifecycle.stats
    assert (sum(stats.preemptions.values()) > 0) is preempts
    assert (stats.recomputed_tokens > 0) is preempts
    # Either way, each request gets what it gets alone.
    for rid, prompt in (("a", PROMPT), ("b", PROMPT[::-1])):
        assert out[rid] == run(engine(tiny, num_blocks=64), {rid: prompt}, 14)[rid]


def test_lookahead_never_holds_back_a_request_when_nothing_runs(tiny):
    """The reserve is for running requests: alone, a request is admitted however large the
    lookahead (progress)."""
    eng = engine(tiny, num_blocks=4, admission_lookahead=1000)
    out = run(eng, {"only": PROMPT}, 6)
    assert len(out["only"]) == 6


def test_resumed_request_finds_its_generated_blocks_in_the_prefix_cache(tiny):
    """Preempted for recompute while nobody needs its room, a request resumes from the prefix
    cache, generated blocks included: it recomputes only its last, unfilled block."""
    alone = run(engine(tiny, num_blocks=64), {"r": PROMPT}, 20)["r"]
    eng = engine(tiny, num_blocks=64)
    eng.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    got: list[int] = []
    req: Request | None = None
    tokens = 0
    while eng.has_unfinished():
        for o in eng.step():
            got += o.new_token_ids
        req = req or eng.families.find("r").members[0]
        if len(got) == 10 and req.status is RequestStatus.RUNNING:
            eng.lifecycle.preempt(req)  # between steps: nothing in flight
            assert req.status is RequestStatus.PREEMPTED
            tokens = req.num_tokens
    assert got == alone
    # 17 tokens at the preemption, 16 of them computed: four full blocks found again, and
    # only the last sampled token computed (before, the prompt's one full block was found and
    # 13 tokens recomputed).
    assert tokens == len(PROMPT) + 10
    assert eng.lifecycle.stats.recomputed_tokens == 1


def test_generated_blocks_are_found_by_a_request_with_the_same_text(tiny):
    """The chain of hashes goes on through the generated tokens: a new request whose prompt
    is an earlier request's prompt plus its output hits those blocks too."""
    eng = engine(tiny, num_blocks=64)
    first = run(eng, {"first": PROMPT}, 13)["first"]
    follow = PROMPT + first  # 20 tokens: five full blocks, all cached
    eng.add_request("follow", follow, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    (term,) = [o for o in outs if o.finished]
    # Four of the five blocks: the last token's logits must be computed, so its block is not
    # taken from the cache. Before, only the first request's prompt block (4 tokens) was.
    assert term.usage.cached_tokens == 16


def auto_engine(tiny, **costs) -> EngineCore:
    eng = engine(tiny, num_blocks=32, preemption_mode="auto")
    for k, v in costs.items():
        setattr(eng.lifecycle, k, v)
    return eng


def victim(eng: EngineCore, tokens: int) -> Request:
    eng.add_request("v", list(range(3, 3 + tokens)), SamplingParams(temperature=0.0, max_tokens=5))
    eng.step()
    req = eng.families.find("v").members[0]
    assert req.status is RequestStatus.RUNNING and eng.kv_manager.computed(req) == tokens
    return req


def test_auto_swaps_when_copying_the_blocks_costs_less_than_recomputing_them(tiny):
    eng = auto_engine(tiny)
    # Measured when the engine started: a fixed cost per swap and one per block.
    assert eng.lifecycle.ms_per_swap is not None and eng.lifecycle.ms_per_swapped_block is not None
    req = victim(eng, 24)  # 6 blocks
    lc = eng.lifecycle
    lc.ms_per_recomputed_token, lc.ms_per_swap, lc.ms_per_swapped_block = 1.0, 0.5, 0.25  # 24 ms against 2 ms
    lc.preempt(req)
    assert req.status is RequestStatus.SWAPPED and lc.stats.preemptions == {"swap": 1}


def test_auto_recomputes_when_the_forward_is_cheaper_than_the_copy(tiny):
    eng = auto_engine(tiny)
    req = victim(eng, 24)
    lc = eng.lifecycle
    lc.ms_per_recomputed_token, lc.ms_per_swap, lc.ms_per_swapped_block = 0.01, 0.5, 0.25  # 0.24 ms against 2 ms
    lc.preempt(req)
    assert req.status is RequestStatus.PREEMPTED and lc.stats.preemptions == {"recompute": 1}
