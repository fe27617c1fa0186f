"""Adapters with the engine's other features, on one engine (docs/lora.md): under a LoRA
adapter, speculation (verify steps of adapter rows), n > 1 samples and prompt logprobs give
what the HF + peft oracle (the adapter merged) gives; grammars under adapters, racing cancels
and preemption, give each job's undisturbed run under its adapter."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from stopline import LLM
from stopline.model.loaders.loader import load_model
from stopline.request import SamplingParams
from tests.chaos_support import (
    check_storm,
    grammar_workload,
    run_reference,
    run_storm,
    storm_config,
)
from tests.engine_support import (
    MIN_MARGIN_TINY,
    drive,
    hf_greedy,
    hf_log_softmax,
    load_hf,
    sharp_tiny_dir,
)
from tests.lora_support import make_adapter, merged
from tests.tiny_model import make_tiny_llama_dir

MAX_NEW = 16


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """The sharp tiny Llama, one adapter of it, and the oracle (the adapter merged)."""
    d = sharp_tiny_dir(tmp_path_factory)
    path = make_adapter(d, tmp_path_factory.mktemp("feature_lora") / "a", seed=12, r=8, alpha=4.0)
    return d, path, merged(d, path)


def _llm(sharp, **kw) -> LLM:
    d, path, _ = sharp
    llm = LLM(model=str(d), progress=False, debug=True, target_step_ms=None, block_size=4,
              num_blocks=512, **kw)
    assert llm.engine.residency.load_lora("a", str(path))["status"] == 200
    return llm


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**(dict(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, lora="a") | kw))


def test_speculation_under_an_adapter_equals_the_oracle(sharp):
    """Prompts that repeat themselves, so prompt-lookup drafts come and are verified in rows
    under the adapter: lossless, the oracle's tokens."""
    prompts = [[5 + (i * 7 + k) % 13 for k in range(6)] * 5 for i in range(4)]
    prompts += [[17 + i] * 24 for i in range(8)]  # runs of one token: a loop drafts far ahead
    ref = hf_greedy(sharp[2], prompts, MAX_NEW)
    ref.check_meaningful(MIN_MARGIN_TINY)
    llm = _llm(sharp, speculative="on")
    got = [r.outputs[0].token_ids for r in llm.generate(prompts, _greedy())]
    assert got == ref.tokens
    stats = llm.engine.lifecycle.stats
    assert stats.spec_verify_steps > 0, stats


def test_n_samples_under_an_adapter_each_equal_the_oracle(sharp):
    prompts = [[3 + (i * 11 + k * 5) % 200 for k in range(9 + 4 * i)] for i in range(3)]
    ref = hf_greedy(sharp[2], prompts, MAX_NEW)
    ref.check_meaningful(MIN_MARGIN_TINY)
    llm = _llm(sharp)
    for res, want in zip(llm.generate(prompts, _greedy(n=3)), ref.tokens, strict=True):
        assert [c.token_ids for c in res.outputs] == [want] * 3


def test_prompt_logprobs_under_an_adapter_equal_the_oracle(sharp):
    prompt = [3 + (k * 37) % 250 for k in range(30)]
    llm = _llm(sharp, max_num_batched_tokens=8)  # the prompt scored in chunks
    res = drive(llm.engine, [("p", prompt, _greedy(prompt_logprobs=2, max_tokens=1))])[("p", 0)]
    lps = next(d.prompt_logprobs for d in res.deltas if d.prompt_logprobs is not None)
    ref = hf_log_softmax(sharp[2], prompt)[:-1]
    base = hf_log_softmax(load_hf(sharp[0]), prompt)[:-1]  # the adapter changes the scores
    assert len(lps) == len(prompt) - 1
    for q, lp in enumerate(lps):
        assert lp.token_id == prompt[q + 1]
        assert abs(lp.logprob - float(ref[q, prompt[q + 1]])) < 1e-4, f"position {q + 1}"
        assert [t for t, _ in lp.top] == torch.topk(ref[q], 2).indices.tolist()
    assert max(abs(float(ref[q, prompt[q + 1]] - base[q, prompt[q + 1]])) for q in range(len(lps))) > 1e-2


@pytest.fixture(scope="module")
def chaos_tiny(tmp_path_factory):
    d = make_tiny_llama_dir(tmp_path_factory.mktemp("lora_grammar") / "tiny", seed=7, init_std=0.1,
                            vocab_size=384, layers=2)
    root = tmp_path_factory.mktemp("lora_grammar_adapters")
    adapters = {n: str(make_adapter(d, root / n, seed=s, r=4)) for n, s in (("a", 1), ("b", 2))}
    return load_model(str(d), progress=False), adapters


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_grammar_storm_under_adapters(chaos_tiny, mode):
    """Structured jobs (json schema, regex, choice, tool calls) two in three under an adapter,
    aborts in every state and preemption mid-object: each survivor equals its undisturbed run
    under its adapter, the audit holds after every step, the references are zero at the end."""
    tiny, adapters = chaos_tiny
    work = grammar_workload(seed=19, count=48, vocab=tiny.config.vocab_size)
    rng = random.Random(19)
    for j in work:
        j.params = dataclasses.replace(j.params, lora=rng.choice(["a", "b", None]))
    ref = run_reference(tiny, work, adapters=adapters)
    res = run_storm(tiny, work, storm_config(mode, False), seed=21, adapters=adapters)
    assert sum(res.engine.lifecycle.stats.preemptions.values()) > 0
    assert check_storm(work, ref, res) > 3
    assert res.engine.lifecycle.stats.finished.get("error", 0) == 0
    assert not any(res.engine.adapters.counts().values())
