"""Batch invariance on the tiny model: a request's output never depends on what shares its steps.

Exact: token ids equal, and the logprobs (floats computed from the logits) equal bit for bit,
which is much stronger than greedy agreeing: any change of summation order in a linear layer,
a norm or attention shows up in the last bits of the logprobs even when the argmax holds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stopline import LLM
from stopline.model.batch_invariant import onednn_available
from stopline.request import SamplingParams
from tests.engine_support import drive, greedy, random_prompts, record_plans, sharp_tiny_dir

MAX_NEW = 32
LENGTHS = [1, 3, 5, 8, 12, 16, 17, 20, 24, 31, 32, 33, 40, 47, 50, 63, 64, 65, 70, 80, 96, 100, 120, 150]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharp_tiny_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(len(LENGTHS), LENGTHS, seed=7)


def _engine(model_dir: Path, **kw) -> LLM:
    kw.setdefault("num_blocks", 2048)
    kw.setdefault("block_size", 16)
    kw.setdefault("target_step_ms", None)
    return LLM(model=str(model_dir), progress=False, **kw)


def _params() -> SamplingParams:
    return greedy(MAX_NEW, logprobs=3)


def _signature(completion) -> list[tuple[int, float, tuple]]:
    """Every token with its logprob and alternatives: equal only if the logits are equal."""
    return [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in completion.logprobs]


@pytest.fixture(scope="module")
def alone(model_dir: Path, prompts) -> list[list[tuple]]:
    llm = _engine(model_dir, enable_prefix_caching=False)
    out = []
    for p in prompts:
        c = llm.generate([p], _params())[0].outputs[0]
        assert len(c.logprobs) == MAX_NEW
        out.append(_signature(c))
    return out


def test_alone_vs_24_concurrent(model_dir: Path, prompts, alone) -> None:
    llm = _engine(model_dir, enable_prefix_caching=False)
    plans = record_plans(llm.engine)
    res = llm.generate(prompts, _params())
    assert max(len(p) for p in plans) == 24
    differ = [i for i, r in enumerate(res) if _signature(r.outputs[0]) != alone[i]]
    assert differ == [], f"{len(differ)} of 24 requests changed when batched: {differ}"


@pytest.mark.parametrize("budget", [5, 16, 100])
def test_staggered_arrivals_and_chunking(model_dir: Path, prompts, alone, budget: int) -> None:
    """Requests arrive while others decode, and prefills are cut into chunks of varying size:
    rows of one step come from prompts, decodes and chunk tails in every combination."""
    llm = _engine(model_dir, enable_prefix_caching=False, max_num_batched_tokens=budget)
    engine = llm.engine
    plans = record_plans(engine)
    arrivals = {step: [] for step in range(0, 48, 2)}
    for i, p in enumerate(prompts):
        arrivals[(i * 7) % 48 // 2 * 2].append((f"r{i}", p))

    def add(e, step: int) -> None:
        for rid, p in arrivals.get(step, []):
            e.add_request(rid, p, _params())

    results = drive(engine, before_step=add, max_steps=5000)
    assert any(any(c[2] == 1 for c in p) and any(c[2] > 1 for c in p) for p in plans)
    differ = [i for i in range(len(prompts))
              if [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in results[(f"r{i}", 0)].logprobs]
              != alone[i]]
    assert differ == [], f"requests {differ} changed with the batch around them"


def test_prefix_cache_hit_is_bitwise_invisible(model_dir: Path, prompts, alone) -> None:
    """K/V read from a cached block equal K/V recomputed: a hit changes no bit of the output."""
    llm = _engine(model_dir, block_size=8)
    for i in (23, 22, 20):
        llm.generate([prompts[i]], _params())
    res = llm.generate([prompts[i] for i in (23, 22, 20)], _params())
    assert all(r.outputs[0].usage.cached_tokens > 0 for r in res)
    assert [_signature(r.outputs[0]) for r in res] == [alone[23], alone[22], alone[20]]


@pytest.mark.skipif(not onednn_available("cpu"), reason="this torch has no oneDNN")
def test_onednn_linears_alone_vs_concurrent_and_chunked(model_dir: Path, prompts) -> None:
    solo = _engine(model_dir, enable_prefix_caching=False, linear_backend="onednn")
    alone = [_signature(solo.generate([p], _params())[0].outputs[0]) for p in prompts]
    llm = _engine(model_dir, enable_prefix_caching=False, linear_backend="onednn",
                  max_num_batched_tokens=16)
    res = llm.generate(prompts, _params())
    differ = [i for i, r in enumerate(res) if _signature(r.outputs[0]) != alone[i]]
    assert differ == [], f"{len(differ)} of 24 requests changed when batched: {differ}"
