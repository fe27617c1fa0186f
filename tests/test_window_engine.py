"""A long request of a sliding-window model (tiny Mistral, window 16) holds blocks for its
window, not its context, while its greedy output stays HF's token for token (issue 43,
item 4). The figures are in docs/sliding-window.md."""

from __future__ import annotations

import pytest

from stopline import LLM
from stopline.model.kernels.paged_attention import supports as native_attention
from tests.engine_support import greedy, hf_greedy, load_hf, random_prompts
from tests.tiny_families import make_family_dir

MAX_NEW = 80
BS = 4


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return make_family_dir(tmp_path_factory.mktemp("mistral_window"), "mistral_window")


def peak_blocks(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    e = llm.engine
    e.add_request("long", prompt, greedy(MAX_NEW))
    peak, toks = 0, []
    while e.has_unfinished():
        for o in e.step():
            toks += o.new_token_ids
        peak = max(peak, e.pool.num_used)
        e.audit()
    assert e.pool.num_used == 0
    return toks, peak


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_pool_use_is_bounded_by_the_window_not_the_context(mistral, backend) -> None:
    if backend == "native" and native_attention(16, "cpu") is not None:
        pytest.skip("the C attention does not build here")
    prompt = random_prompts(1, [6], seed=5)[0]
    ref = hf_greedy(load_hf(mistral), [prompt], MAX_NEW).tokens[0]
    llm = LLM(model=str(mistral), progress=False, debug=True, target_step_ms=None, num_blocks=64,
              block_size=BS, attention_backend=backend)
    assert llm.engine.kv_manager.window == 16
    toks, peak = peak_blocks(llm, prompt)
    assert toks == ref
    context = -(-(len(prompt) + MAX_NEW) // BS)  # 22 blocks
    # The window's 16 keys span at most 5 blocks, plus the one the next token opens.
    assert peak <= 16 // BS + 2 < context
    assert llm.engine.lifecycle.stats.window_freed_blocks >= context - peak
