"""The real model: SmolLM2-135M-Instruct from the embedded GGUF, against HF transformers on the
same weights (exported as an HF directory), 32 greedy tokens per prompt.

16 prompts of 1 to ~100 tokens (raw text, code, chat-templated questions, a repeated one) run
alone, as one batch of 16, among 24, with a budget of 64 tokens per step (prefills are chunked;
chat prompts hit the blocks of the shared system prompt, the repeat hits all its full blocks),
and (8 of them) in a pool so small that requests are preempted and recomputed. SmolLM2 is
loaded once per session and the HF reference computed once per module; an engine run over
the batch takes 10-20 s of one core.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stopline import LLM, FinishReason
from stopline.request import SamplingParams
from tests.engine_support import (
    MIN_MARGIN_SMOLLM2,
    Reference,
    greedy,
    hf_greedy,
    load_hf,
    record_plans,
)

MAX_NEW = 32
EOS = 2  # <|im_end|>
PARAGRAPH = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century and spread to "
    "continental Europe and North America. It marked a shift from hand production to machines, new "
    "chemical and iron production processes, the increasing use of steam power and water power, the "
    "development of machine tools and the rise of the mechanised factory system. ")
RAW = ["The", "Once upon a time", "def fibonacci(n):", "The three laws of robotics are",
       "import numpy as np\n\n# Compute the mean of", PARAGRAPH + "In summary,"]
CHAT = ["What is the capital of France?", "Write a haiku about the sea.",
        "Explain photosynthesis in simple terms.", "List three prime numbers.",
        "Translate 'good morning' into Spanish.", "What is 12 times 7?",
        "Summarize this text:\n" + PARAGRAPH, "Give me a recipe for pancakes.",
        "Why is the sky blue?", "What is the capital of France?"]  # the last one repeats
SOLO = [0, 12]  # the shortest prompt and the longest
PREEMPT = [0, 2, 5, 6, 7, 12, 13, 15]
EXTRA = ["Name a color.", "Tell me a joke about cats.", "How do airplanes fly?",
         "What is the boiling point of water?", "Write a limerick.", "What is DNA?",
         "def quicksort(arr):", "In 1492,"]


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    tok = smollm2.tokenizer

    def chat(q: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    return [tok.encode(t) for t in RAW] + [chat(q) for q in CHAT]


@pytest.fixture(scope="module")
def hf(smollm2_hf_dir: Path):
    return load_hf(smollm2_hf_dir)


@pytest.fixture(scope="module")
def reference(hf, prompts) -> Reference:
    ref = hf_greedy(hf, prompts, MAX_NEW, batch_size=8)
    ref.check_meaningful(MIN_MARGIN_SMOLLM2)
    return ref


def _llm(smollm2, **kw) -> LLM:
    kw.setdefault("num_blocks", 512)
    return LLM(model=smollm2, progress=False, **kw)


def _params() -> SamplingParams:
    return greedy(MAX_NEW, logprobs=1)


def _signature(c) -> list[tuple[int, float]]:
    return [(lp.token_id, lp.logprob) for lp in c.logprobs]


def _assert_matches(res, reference: Reference, ids: list[int]) -> None:
    bad = [i for i, r in zip(ids, res, strict=True) if r.outputs[0].token_ids != reference.tokens[i]]
    assert bad == [], f"prompts {bad} differ from HF transformers"


def test_prompt_set(prompts) -> None:
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] == 1 and lengths[-1] > 90 and len(set(lengths)) >= 10


@pytest.fixture(scope="module")
def alone(smollm2, prompts, reference) -> dict[int, list[tuple[int, float]]]:
    llm = _llm(smollm2, enable_prefix_caching=False)
    out = {}
    for i in SOLO:
        res = llm.generate([prompts[i]], _params())
        _assert_matches(res, reference, [i])
        out[i] = _signature(res[0].outputs[0])
    return out


def test_alone_matches_hf(alone) -> None:
    assert sorted(alone) == SOLO


def test_batch_of_16_matches_hf(smollm2, prompts, reference, alone) -> None:
    llm = _llm(smollm2, enable_prefix_caching=False, debug=True)
    plans = record_plans(llm.engine)
    res = llm.generate(prompts, _params())
    assert max(len(p) for p in plans) == 16
    _assert_matches(res, reference, list(range(16)))
    assert {i: _signature(res[i].outputs[0]) for i in SOLO} == alone


def test_alone_vs_24_concurrent_is_bitwise_equal(smollm2, prompts, reference, alone) -> None:
    # 16 tokens (not 32) keep this run short; the logprobs must be equal bit for bit.
    n = MAX_NEW // 2
    tok = smollm2.tokenizer
    extra = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in EXTRA]
    llm = _llm(smollm2)
    plans = record_plans(llm.engine)
    res = llm.generate(prompts + extra, greedy(n, logprobs=1))
    assert max(len(p) for p in plans) == 24
    bad = [i for i in range(16) if res[i].outputs[0].token_ids != reference.tokens[i][:n]]
    assert bad == [], f"prompts {bad} differ from HF transformers among 24"
    differ = [i for i in SOLO if _signature(res[i].outputs[0]) != alone[i][:n]]
    assert differ == [], f"logprobs of prompts {differ} changed among 24 requests"


def test_chunked_prefill_with_prefix_hits(smollm2, prompts, reference) -> None:
    llm = _llm(smollm2, max_num_batched_tokens=64, target_step_ms=None, debug=True)
    plans = record_plans(llm.engine)
    res = llm.generate(prompts, _params())
    _assert_matches(res, reference, list(range(16)))
    longest = max(range(16), key=lambda i: len(prompts[i]))
    assert sum(1 for p in plans for c in p if c[0] == res[longest].request_id and c[2] > 1) >= 2
    cached = [r.outputs[0].usage.cached_tokens for r in res]
    # The repeated question hits all its full blocks; other chats hit the system prompt.
    assert cached[15] == (len(prompts[15]) - 1) // 16 * 16
    assert sum(1 for c in cached[6:15] if c > 0) >= 5


def test_after_forced_preemption(smollm2, prompts, reference) -> None:
    # 16 blocks of 16 tokens: the longest request (~100 + 32 tokens, 9 blocks) fits alone,
    # the 8 together (~35 blocks) do not.
    llm = _llm(smollm2, num_blocks=16, max_preemptions=1000, debug=True)
    res = llm.generate([prompts[i] for i in PREEMPT], _params())
    _assert_matches(res, reference, PREEMPT)
    assert sum(llm.engine.lifecycle.stats.preemptions.values()) > 0
    assert llm.engine.pool.num_used == 0


def test_eos_and_stop_string_on_real_text(smollm2, prompts, reference) -> None:
    """EOS ends a chat answer; a stop string spanning three tokens is cut from the text."""
    tok = smollm2.tokenizer
    ans = reference.tokens[6]  # "The capital of France is Paris." then EOS
    k = ans.index(EOS)
    text = tok.decode(ans[:k])
    # From the middle of token 2 to the middle of token 4.
    a = len(tok.decode(ans[:2])) - 2
    b = len(tok.decode(ans[:4])) + 2
    stop = text[a:b]
    assert text.find(stop) == a and len(tok.decode(ans[:5])) >= b
    llm = _llm(smollm2, num_blocks=64)
    eos, cut = llm.generate([prompts[6]] * 2, [SamplingParams(temperature=0, max_tokens=MAX_NEW),
                                               greedy(MAX_NEW, stop=[stop])])
    assert eos.outputs[0].finish_reason is FinishReason.STOP and eos.outputs[0].stop_detail == "eos"
    assert eos.outputs[0].token_ids == ans[:k + 1] and eos.outputs[0].text == text
    assert cut.outputs[0].finish_reason is FinishReason.STOP and cut.outputs[0].stop_detail == stop
    assert cut.outputs[0].text == text[:a] and cut.outputs[0].token_ids == ans[:5]
