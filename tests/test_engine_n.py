"""n > 1 samples per prompt on the tiny model: shared prompt blocks, greedy copies, seeds."""

from __future__ import annotations

from pathlib import Path

import pytest

from stopline import LLM, FinishReason
from stopline.request import SamplingParams
from tests.engine_support import drive, greedy, random_prompts, sharp_tiny_dir

BS = 4
MAX_NEW = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharp_tiny_dir(tmp_path_factory)


def _llm(model_dir: Path, **kw) -> LLM:
    kw.setdefault("num_blocks", 512)
    return LLM(model=str(model_dir), progress=False, block_size=BS, target_step_ms=None,
               debug=True, **kw)


@pytest.mark.parametrize("prompt_len", [10, 12])  # a partial last block, and none
def test_family_shares_prompt_blocks(model_dir: Path, prompt_len: int) -> None:
    llm = _llm(model_dir)
    engine = llm.engine
    prompt = random_prompts(1, [prompt_len], seed=5)[0]
    n = 4
    seen: dict[str, object] = {}

    def inspect(e, step: int) -> None:
        fam = e.families.find("f")
        if fam is None or "tables" in seen or any(m.fork_leader is not None for m in fam.members):
            return
        # First step after the fork: every sample has its own table.
        tables = [list(e.kv_manager.table(m)) for m in fam.members]
        seen["tables"] = tables
        seen["used"] = e.pool.num_used
        seen["refcounts"] = [[e.pool.refcount[b] for b in t] for t in tables]

    res = drive(engine, [("f", prompt, greedy(MAX_NEW, n=n))], after_step=inspect)
    tables = seen["tables"]
    full = prompt_len // BS
    shared = tables[0][:full]
    assert all(t[:full] == shared for t in tables), "full prompt blocks must be shared"
    assert all(rc == n for rc in seen["refcounts"][0][:full]), seen["refcounts"]
    # Everything past the full prompt blocks is private to each sample.
    private = [b for t in tables for b in t[full:]]
    assert len(private) == len(set(private))
    assert all(engine.pool.refcount[b] == 0 for b in shared)  # all returned at the end
    # The pool holds one copy of the prompt, not n.
    assert seen["used"] == full + len(private)
    assert seen["used"] < n * len(tables[0])
    # Greedy samples are n copies of the single greedy output.
    single = llm.generate([prompt], greedy(MAX_NEW))[0].outputs[0].token_ids
    assert [res[("f", i)].token_ids for i in range(n)] == [single] * n
    assert {res[("f", i)].finish_reason for i in range(n)} == {FinishReason.LENGTH}


def test_greedy_family_matches_single_in_a_busy_batch(model_dir: Path) -> None:
    prompts = random_prompts(6, [3, 17, 40], seed=8)
    llm = _llm(model_dir, num_blocks=64, max_num_batched_tokens=12, max_preemptions=1000)
    singles = [r.outputs[0].token_ids for r in _llm(model_dir).generate(prompts, greedy(MAX_NEW))]
    res = llm.generate(prompts, [greedy(MAX_NEW, n=3)] * len(prompts))
    for r, single in zip(res, singles, strict=True):
        assert [c.token_ids for c in r.outputs] == [single] * 3
        assert [c.index for c in r.outputs] == [0, 1, 2]


def test_seeded_family_samples_differ_and_reproduce(model_dir: Path) -> None:
    prompt = random_prompts(1, [9], seed=6)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=77, max_tokens=MAX_NEW, ignore_eos=True)
    first = [c.token_ids for c in _llm(model_dir).generate([prompt], params)[0].outputs]
    assert len({tuple(t) for t in first}) == 4, "samples of one family must differ"
    # Again, on another engine with other requests around and a small budget: same samples.
    busy = _llm(model_dir, max_num_batched_tokens=8)
    others = random_prompts(5, [30, 2], seed=1)
    res = busy.generate([*others, prompt], [greedy(MAX_NEW)] * 5 + [params])
    assert [c.token_ids for c in res[-1].outputs] == first
    # Another seed, other samples.
    params.seed = 78
    assert [c.token_ids for c in _llm(model_dir).generate([prompt], params)[0].outputs] != first


def test_family_usage(model_dir: Path) -> None:
    prompt = random_prompts(1, [13], seed=2)[0]
    r = _llm(model_dir).generate([prompt], greedy(5, n=3))[0]
    assert r.usage.prompt_tokens == 13
    assert r.usage.completion_tokens == 15
    assert [c.usage.completion_tokens for c in r.outputs] == [5, 5, 5]


@pytest.mark.parametrize("stop", ["length", "stop token"])
def test_samples_keep_their_token_when_the_leader_stops_on_its_first(model_dir: Path, stop: str) -> None:
    """A leader that ends on its first token (max_tokens 1, or a stop token) ended the samples
    waiting to fork with it, before they took their own token of that step: they ended with
    no token at all. Every sample forks first now and keeps its token."""
    prompt = random_prompts(1, [7], seed=3)[0]
    first = _llm(model_dir).generate([prompt], greedy(1))[0].outputs[0].token_ids
    if stop == "length":
        params = greedy(1, n=3, prompt_logprobs=0)
    else:
        params = SamplingParams(n=3, temperature=0.0, max_tokens=8, stop_token_ids=(first[0],),
                                prompt_logprobs=0)
    r = _llm(model_dir).generate([prompt], params)[0]
    assert [c.token_ids for c in r.outputs] == [first] * 3
    want = FinishReason.LENGTH if stop == "length" else FinishReason.STOP
    assert [c.finish_reason for c in r.outputs] == [want] * 3
    assert r.prompt_logprobs is not None and len(r.prompt_logprobs) == len(prompt) - 1
    assert r.usage.completion_tokens == 3
