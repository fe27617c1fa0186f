"""Prompt logprobs (echo + logprobs on completions): every prompt token after the first gets
its log-probability given the tokens before it, and its top-k alternatives, equal to HF
transformers' log-softmax on the same weights within 1e-4 — whether the prompt is prefilled
at once or in chunks, shares a cached prefix, is preempted and recomputed, runs beside other
requests with async scheduling, or has n samples. `max_tokens=0` scores without generating.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from stopline.config import EngineConfig, PreemptionMode
from stopline.engine.core import EngineCore
from stopline.model.loaders.loader import load_model
from stopline.request import AbortSource, FinishReason, InvalidRequest, SamplingParams
from tests.engine_support import drive, hf_log_softmax, load_hf, random_prompts, sharp_tiny_dir

TOL = 1e-4
TOP = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharp_tiny_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def loaded(model_dir: Path):
    return load_model(model_dir, progress=False)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return load_hf(model_dir)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    ps = random_prompts(6, [1, 2, 17, 40, 65, 130], seed=7)
    ps.append(ps[5][:48] + ps[3][:20])  # shares 48 tokens (3 full blocks) with prompt 5
    return ps


def _engine(loaded, **kw: object) -> EngineCore:
    return EngineCore(loaded, EngineConfig(debug=True, **kw), progress=False)


def _scored(max_tokens: int = 4, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          prompt_logprobs=TOP, **kw)  # type: ignore[arg-type]


def _run(engine: EngineCore, prompts: list[list[int]], params: SamplingParams) -> dict:
    """prompt index -> (prompt logprobs of sample 0, [results by sample])"""
    res = drive(engine, [(f"p{i}", p, params) for i, p in enumerate(prompts)])
    out = {}
    for i in range(len(prompts)):
        samples = [res[(f"p{i}", k)] for k in range(params.n)]
        got = [d.prompt_logprobs for d in samples[0].deltas if d.prompt_logprobs is not None]
        assert len(got) == 1, f"prompt {i}: prompt logprobs delivered {len(got)} times"
        out[i] = (got[0], samples)
    return out


def _check_against_hf(hf, prompt: list[int], lps) -> None:
    assert len(lps) == len(prompt) - 1
    if len(prompt) < 2:
        return
    ref = hf_log_softmax(hf, prompt)[:-1]  # row q scores token q + 1
    for q, lp in enumerate(lps):
        assert lp.token_id == prompt[q + 1]
        assert abs(lp.logprob - float(ref[q, prompt[q + 1]])) < TOL, f"position {q + 1}"
        vals, ids = torch.topk(ref[q], TOP)
        assert [t for t, _ in lp.top] == ids.tolist(), f"position {q + 1}: top-{TOP} ids"
        assert max(abs(v - float(r)) for (_, v), r in zip(lp.top, vals, strict=True)) < TOL


def test_prompt_logprobs_match_hf(loaded, hf, prompts) -> None:
    for i, (lps, _) in _run(_engine(loaded), prompts, _scored()).items():
        _check_against_hf(hf, prompts[i], lps)


def test_chunked_cached_preempted_async_n2_all_match_hf(loaded, hf, prompts) -> None:
    """Chunks of 16 tokens, a cached prefix that must not be used (prompt 6 after 5), a pool
    small enough to preempt and recompute, async scheduling, two samples each."""
    engine = _engine(loaded, max_num_batched_tokens=16, num_blocks=16, async_scheduling=True,
                     preemption_mode=PreemptionMode.RECOMPUTE, max_preemptions=1000)
    drive(engine, [("warm", prompts[5], SamplingParams(temperature=0.0, max_tokens=2))])
    got = _run(engine, prompts, _scored(max_tokens=40, n=2))
    assert engine.stats.preemptions, "the scenario must preempt"
    for i, (lps, samples) in got.items():
        _check_against_hf(hf, prompts[i], lps)
        assert all(len(s.token_ids) == 40 for s in samples)
    plain = _run(_engine(loaded), prompts, _scored(max_tokens=40))
    for i in got:  # scoring the prompt changes nothing of what is generated
        assert got[i][1][0].token_ids == plain[i][1][0].token_ids


def test_max_tokens_zero_scores_without_generating(loaded, hf, prompts) -> None:
    engine = _engine(loaded, max_num_batched_tokens=32)
    for i, (lps, samples) in _run(engine, prompts, _scored(max_tokens=0, n=2)).items():
        _check_against_hf(hf, prompts[i], lps)
        for s in samples:
            assert s.token_ids == [] and s.text == ""
            assert s.finish_reason is FinishReason.LENGTH
            assert s.usage is not None and s.usage.completion_tokens == 0


def test_max_tokens_zero_needs_prompt_logprobs(loaded) -> None:
    engine = _engine(loaded)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        engine.add_request("y", [5, 6, 7], SamplingParams(prompt_logprobs=21))
    assert not engine.has_unfinished()


def test_abort_while_scoring_releases_everything(loaded, prompts) -> None:
    engine = _engine(loaded, max_num_batched_tokens=16)
    inc = engine.add_request("long", prompts[5], _scored())
    res = drive(engine, after_step=lambda e, step: e.abort([inc], AbortSource.CANCEL, time.monotonic()) if step == 2 else None)
    r = res[("long", 0)]
    assert r.finish_reason is FinishReason.ABORT
    assert all(d.prompt_logprobs is None for d in r.deltas), "nothing after the abort"
