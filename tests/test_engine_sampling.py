"""Sampling on the tiny model: seeds, temperature, top-k/top-p/min-p, penalties, logprobs.

Each check that a filter holds comes with a control run without the filter that breaks the
same check, so a check that can't fail (say, because the model is too peaked for sampling to
ever leave the top-k) fails the test instead of passing it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from stopline import LLM
from stopline.request import SamplingParams
from tests.engine_support import (
    MIN_MARGIN_TINY,
    drive,
    greedy,
    hf_greedy,
    hf_log_softmax,
    load_hf,
    random_prompts,
    sharp_tiny_dir,
)

MAX_NEW = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharp_tiny_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(8, [5, 17, 33, 2, 64, 9, 40, 80], seed=3)


def _llm(model_dir: Path, **kw) -> LLM:
    kw.setdefault("num_blocks", 1024)
    kw.setdefault("block_size", 8)
    kw.setdefault("target_step_ms", None)
    return LLM(model=str(model_dir), progress=False, **kw)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return _llm(model_dir)


def _sampled(seed: int | None = 1234, **kw) -> SamplingParams:
    kw.setdefault("temperature", 1.0)
    kw.setdefault("max_tokens", MAX_NEW)
    return SamplingParams(seed=seed, ignore_eos=True, **kw)


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


# ---- seeds ----------------------------------------------------------------------------------

def test_seed_reproducible_regardless_of_batch(model_dir: Path, prompts, llm: LLM) -> None:
    target = prompts[1]
    params = _sampled(seed=1234, top_p=0.95, top_k=100)
    alone = _tokens(llm, [target], params)[0]
    assert _tokens(llm, [target], params) == [alone]  # same engine, again

    # Among 23 others (seeded, unseeded, greedy, penalized), chunked, on a fresh engine.
    others = random_prompts(23, [3, 30, 70, 11], seed=99)
    mix = [_sampled(seed=None), _sampled(seed=5, temperature=0.7), greedy(MAX_NEW),
           _sampled(seed=None, frequency_penalty=0.5, top_k=10)]
    batch_params = [mix[i % len(mix)] for i in range(23)]
    busy = _llm(model_dir, max_num_batched_tokens=24)
    res = busy.generate([*others[:11], target, *others[11:]], [*batch_params[:11], params, *batch_params[11:]])
    assert res[11].outputs[0].token_ids == alone

    # Preempted and recomputed mid-generation: the draw for the k-th token is still the same.
    tight = _llm(model_dir, num_blocks=40, block_size=4, max_preemptions=1000)
    res = tight.generate([*others[:8], target], [*batch_params[:8], params])
    assert sum(tight.engine.lifecycle.stats.preemptions.values()) > 0
    assert res[-1].outputs[0].token_ids == alone

    # A different seed gives a different sample (the seed is really used).
    assert _tokens(llm, [target], _sampled(seed=1235, top_p=0.95, top_k=100))[0] != alone


def test_unseeded_samples_differ(llm: LLM, prompts) -> None:
    a, b = _tokens(llm, [prompts[0], prompts[0]], _sampled(seed=None))
    assert a != b


# ---- filters --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def greedy_tokens(llm: LLM, prompts) -> list[list[int]]:
    return _tokens(llm, prompts, greedy(MAX_NEW))


@pytest.mark.parametrize("filt", [dict(top_k=1), dict(top_p=1e-9), dict(min_p=1.0)])
def test_filters_that_leave_one_token_are_greedy(llm: LLM, prompts, greedy_tokens, filt) -> None:
    params = [_sampled(seed=s, temperature=1.5, **filt) for s in range(len(prompts))]
    assert _tokens(llm, prompts, params) == greedy_tokens
    # Control: the same seeds without the filter do sample something else.
    assert _tokens(llm, prompts, [_sampled(seed=s, temperature=1.5) for s in range(len(prompts))]) != greedy_tokens


def _steps(llm: LLM, prompts, **kw):
    """(sampled token, its logprob, top-20 alternatives) for every generated token."""
    params = [_sampled(seed=100 + s, logprobs=20, **kw) for s in range(len(prompts))]
    return [lp for r in llm.generate(prompts, params) for lp in r.outputs[0].logprobs]


def test_top_k(llm: LLM, prompts) -> None:
    def outside(steps, k):
        return sum(lp.token_id not in [t for t, _ in lp.top[:k]] for lp in steps)

    assert outside(_steps(llm, prompts, top_k=3, temperature=2.0), 3) == 0
    assert outside(_steps(llm, prompts, temperature=2.0), 3) > 0  # control


def test_top_p(llm: LLM, prompts) -> None:
    def mass_before(lp) -> float:
        """Probability of the tokens more likely than the sampled one (from the top 20)."""
        mass = 0.0
        for t, v in lp.top:
            if t == lp.token_id:
                return mass
            mass += math.exp(v)
        return mass  # not even in the top 20: at least this much came before it

    # The nucleus is the smallest set of most likely tokens whose mass reaches top_p.
    assert max(mass_before(lp) for lp in _steps(llm, prompts, top_p=0.5)) < 0.5
    assert max(mass_before(lp) for lp in _steps(llm, prompts)) >= 0.5  # control


def test_min_p(llm: LLM, prompts) -> None:
    def below(steps, min_p) -> int:
        return sum(lp.logprob < math.log(min_p) + lp.top[0][1] - 1e-9 for lp in steps)

    assert below(_steps(llm, prompts, min_p=0.2), 0.2) == 0
    assert below(_steps(llm, prompts), 0.2) > 0  # control


def test_temperature_orders_likelihood(llm: LLM, prompts) -> None:
    def mean_logprob(t: float) -> float:
        steps = _steps(llm, prompts, temperature=t)
        return sum(lp.logprob for lp in steps) / len(steps)

    cold, warm, hot = mean_logprob(0.3), mean_logprob(1.0), mean_logprob(2.0)
    assert cold > warm > hot


# ---- penalties ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flat_llm(tiny_model_dir: Path) -> LLM:
    # The default tiny model (init_std 0.02) loops on a few tokens: the penalties' target.
    return LLM(model=str(tiny_model_dir), progress=False, num_blocks=1024, block_size=8,
               target_step_ms=None)


def _repeats(outputs: list[list[int]]) -> int:
    return sum(len(o) - len(set(o)) for o in outputs)


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=1.5), dict(frequency_penalty=1.0),
                                     dict(presence_penalty=1.0)])
def test_penalties_reduce_repetition(flat_llm: LLM, prompts, penalty) -> None:
    base = _repeats(_tokens(flat_llm, prompts, greedy(MAX_NEW)))
    assert base >= len(prompts) * MAX_NEW // 4, "the baseline doesn't repeat: nothing to reduce"
    assert _repeats(_tokens(flat_llm, prompts, greedy(MAX_NEW, **penalty))) < base / 2
    # And the opposite sign encourages it.
    if "repetition_penalty" not in penalty:
        ((name, value),) = penalty.items()
        assert _repeats(_tokens(flat_llm, prompts, greedy(MAX_NEW, **{name: -value}))) > base


def test_repetition_penalty_matches_hf(llm: LLM, model_dir: Path, prompts, greedy_tokens) -> None:
    """HF's RepetitionPenaltyLogitsProcessor is the same rule (prompt and output tokens,
    divide positive logits, multiply negative ones): greedy outputs must agree."""
    ref = hf_greedy(load_hf(model_dir), prompts, MAX_NEW, repetition_penalty=1.3)
    ref.check_meaningful(MIN_MARGIN_TINY)
    got = _tokens(llm, prompts, greedy(MAX_NEW, repetition_penalty=1.3))
    assert got == ref.tokens
    assert got != greedy_tokens  # control: the penalty changed something


@torch.inference_mode()
def test_frequency_and_presence_penalty_match_hand_rule(llm: LLM, model_dir: Path, prompts,
                                                        greedy_tokens) -> None:
    """OpenAI's rule on HF logits: logit -= frequency * count + presence * (count > 0), counts
    over generated tokens only."""
    hf = load_hf(model_dir)
    freq, pres = 1.5, 1.0
    changed = 0
    for i, p in enumerate(prompts[:4]):
        ids, out = list(p), []
        for _ in range(MAX_NEW):
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0])
            logits -= freq * counts + pres * (counts > 0)
            top2 = logits.topk(2)
            assert float(top2.values[0] - top2.values[1]) > MIN_MARGIN_TINY
            out.append(int(top2.indices[0]))
            ids.append(out[-1])
        got = _tokens(llm, [p], greedy(MAX_NEW, frequency_penalty=freq, presence_penalty=pres))[0]
        assert got == out
        changed += got != greedy_tokens[i]
    assert changed  # control: the penalties changed something


# ---- logprobs -------------------------------------------------------------------------------

def test_logprobs_match_hf_log_softmax(llm: LLM, model_dir: Path, prompts) -> None:
    hf = load_hf(model_dir)
    params = [_sampled(seed=s, logprobs=5, temperature=1.0) for s in range(4)] + \
             [greedy(MAX_NEW, logprobs=5)] * 2
    res = llm.generate(prompts[:6], params)
    worst = 0.0
    for r in res:
        c = r.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == MAX_NEW
        ref = hf_log_softmax(hf, r.prompt_token_ids + c.token_ids)[len(r.prompt_token_ids) - 1:-1]
        for step, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            assert lp.token_id == tok
            worst = max(worst, abs(lp.logprob - float(ref[step, tok])))
            # Alternatives: the top 5 of the distribution, best first.
            want = torch.topk(ref[step], 5)
            assert [t for t, _ in lp.top] == want.indices.tolist()
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
            for (_, v), w in zip(lp.top, want.values.tolist(), strict=True):
                assert abs(v - w) < 1e-4
    assert worst < 1e-4, f"sampled-token logprob differs from HF by {worst:.2e}"


def test_logprobs_counts(llm: LLM, prompts) -> None:
    none, zero, three = llm.generate([prompts[0]] * 3, [greedy(8), greedy(8, logprobs=0), greedy(8, logprobs=3)])
    assert none.outputs[0].logprobs == []
    assert [lp.top for lp in zero.outputs[0].logprobs] == [[]] * 8
    assert all(len(lp.top) == 3 for lp in three.outputs[0].logprobs)
    # Greedy: the sampled token is the best alternative, with the same logprob.
    assert all(lp.top[0] == (lp.token_id, lp.logprob) for lp in three.outputs[0].logprobs)


def test_sampling_params_survive_engine_core(model_dir: Path, prompts) -> None:
    """The same seeded requests through EngineCore with audits: same tokens as via LLM."""
    via_llm = _tokens(_llm(model_dir), prompts[:3], _sampled(seed=9, top_k=20))
    llm = _llm(model_dir, debug=True)
    res = drive(llm.engine, [(f"s{i}", p, _sampled(seed=9, top_k=20)) for i, p in enumerate(prompts[:3])])
    assert [res[(f"s{i}", 0)].token_ids for i in range(3)] == via_llm


@pytest.mark.parametrize("vocab", [5, 16, 17, 384, 49152])
def test_greedy_argmax_is_torchs_argmax(vocab):
    """The C argmax of greedy rows (sampler.argmax_rows) gives torch.argmax's index on ties,
    -inf rows, inf and NaN, for vocabularies with and without a 16-lane tail."""
    from stopline.worker.sampler import argmax_rows

    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab, generator=gen)
    x[1, 1] = x[1, 2] = x[1, vocab - 1] = 50.0  # a tie: the first wins
    x[2, vocab // 2] = x[2, vocab - 1] = float("nan")  # NaN wins, the first one
    x[3, :] = float("-inf")
    x[4, :] = 1.0
    x[5, vocab - 1] = float("inf")
    x[6, 0] = float("inf")
    rows = [11, 1, 2, 3, 4, 5, 6, 0, 1]
    assert argmax_rows(x, rows) == torch.argmax(x[rows], dim=-1).tolist()
    with pytest.raises(IndexError):
        argmax_rows(x, [12])


def _keys(n: int, seed: int) -> list[tuple[int, int]]:
    from stopline.worker.sampler import mix_seed

    return [(z & 0xFFFFFFFF, z >> 32) for z in (mix_seed(seed, k) for k in range(n))]


@pytest.mark.parametrize("path", ["c", "torch"])
def test_draw_follows_softmax_at_temperature(path):
    """The exponential race (sampler.draw_rows, and its torch twin) picks token v with
    probability softmax(x / T)_v: a chi-square test over 20,000 draws of one row, each with its
    own key, at two temperatures. A draw that ignored T, or favoured low indices, fails it."""
    from stopline.model.kernels.native import try_kernels
    from stopline.worker.sampler import draw_rows, race_torch

    if path == "c" and try_kernels() is None:
        pytest.skip("the C kernels are off here")
    n = 20_000
    x = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf"), 1.5, -3.0] * 3)  # 24: a tail past 16
    for temp in (1.0, 0.5):
        keys = _keys(n, seed=int(temp * 10))
        if path == "c":
            got = draw_rows(x.expand(n, -1).contiguous(), list(range(n)), [1 / temp] * n, keys)
        else:
            got = race_torch(x.expand(n, -1), torch.full((n,), 1 / temp), torch.tensor(keys)).tolist()
        counts = torch.bincount(torch.tensor(got), minlength=x.numel()).double()
        p = torch.softmax(x.double() / temp, dim=0)
        assert counts[p == 0].sum() == 0  # -inf is never drawn
        expected = p * n
        live = expected > 0
        chi2 = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
        # 20 degrees of freedom: P(chi2 > 50) ~ 2e-4.
        assert chi2 < 50, (temp, chi2)


def test_draw_c_equals_torch_and_ignores_other_rows():
    """The C draw and the torch one give the same tokens, and a row's token does not depend on
    which other rows are drawn beside it (batch invariance of random sampling)."""
    from stopline.model.kernels.native import try_kernels
    from stopline.worker.sampler import draw_rows, race_torch

    if try_kernels() is None:
        pytest.skip("the C kernels are off here")
    gen = torch.Generator().manual_seed(3)
    for vocab in (49152, 1007):
        x = torch.randn(40, vocab, generator=gen) * 4
        x[5, : vocab // 2] = float("-inf")
        keys = _keys(40, seed=vocab)
        inv = [1 / (0.3 + 0.05 * i) for i in range(40)]
        c = draw_rows(x, list(range(40)), inv, keys)
        assert c == race_torch(x, torch.tensor(inv), torch.tensor(keys)).tolist()
        assert c[5] >= vocab // 2
        alone = [draw_rows(x, [i], [inv[i]], [keys[i]])[0] for i in (0, 17, 39)]
        assert alone == [c[0], c[17], c[39]]
        assert len(set(c)) > 20  # different keys and rows: different tokens


# ---- logit_bias -----------------------------------------------------------------------------

def test_logit_bias_forces_and_bans(llm: LLM, prompts, greedy_tokens) -> None:
    forced = _tokens(llm, prompts[:2], greedy(8, logit_bias={7: 100.0}))
    assert forced == [[7] * 8, [7] * 8]
    first = greedy_tokens[0][0]
    banned = _tokens(llm, prompts[:1], greedy(1, logit_bias={first: -100.0}))[0]
    assert banned != [first]


def test_logit_bias_is_per_row(model_dir: Path, prompts, llm: LLM) -> None:
    """A request's tokens don't depend on what shares its step, biased or not."""
    target = prompts[1]
    params = _sampled(seed=77, logit_bias={3: 5.0, 9: -3.0})
    alone = _tokens(llm, [target], params)[0]
    plain_alone = _tokens(llm, [target], _sampled(seed=77))[0]
    assert alone != plain_alone  # the bias is really used
    others = random_prompts(6, [3, 30, 11], seed=5)
    mix = [_sampled(seed=None, logit_bias={1: 50.0}), greedy(MAX_NEW, logit_bias={2: 100.0}),
           _sampled(seed=4)]
    other_params = [mix[i % 3] for i in range(6)]
    res = llm.generate([*others[:3], target, *others[3:]], [*other_params[:3], params, *other_params[3:]])
    assert res[3].outputs[0].token_ids == alone
    res = llm.generate([*others[:3], target, *others[3:]],
                       [*other_params[:3], _sampled(seed=77), *other_params[3:]])
    assert res[3].outputs[0].token_ids == plain_alone


def test_logit_bias_under_speculation(model_dir: Path) -> None:
    """Verify samples from the same biased distribution: speculation changes no token."""
    loop = [[5, 6, 7, 8] * 12, [9, 10, 11] * 15]  # repetitive: the n-gram index drafts
    out = []
    for params in (greedy(MAX_NEW, logit_bias={6: 3.0, 10: -2.0}),
                   _sampled(seed=11, temperature=0.3, logit_bias={6: 3.0, 10: -2.0})):
        plain = _tokens(_llm(model_dir), loop, params)
        spec = _llm(model_dir, speculative="on")
        assert _tokens(spec, loop, params) == plain
        out.append(spec.engine.lifecycle.stats.spec_verify_steps)
    assert sum(out) > 0, out  # drafts were really verified


@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("vocab", [5, 16, 17, 49152])
def test_nonfinite_rows_are_torchs(vocab, path, monkeypatch):
    """sampler.nonfinite_rows (in C, or torch without the kernels) flags exactly the rows
    whose torch amax is not finite: a NaN or +inf anywhere, all -inf; a -inf among finite
    values is fine."""
    from stopline.worker import sampler

    if path == "torch":
        monkeypatch.setattr(sampler, "try_kernels", lambda: None)
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(20, vocab, generator=gen)
    x[1, vocab - 1] = float("nan")
    x[2, 0] = float("inf")
    x[3, :] = float("-inf")
    x[4, 0] = float("-inf")
    x[5, vocab // 2] = float("nan")
    x[5, 0] = float("inf")
    x[6, vocab - 1] = float("-inf")
    want = {i for i, ok in enumerate(torch.isfinite(x.amax(dim=-1)).tolist()) if not ok}
    assert want == {1, 2, 3, 5}
    assert sampler.nonfinite_rows(x) == want
    assert sampler.nonfinite_rows(x[:3]) == {1, 2}  # fewer rows than the parallel threshold
    assert sampler.nonfinite_rows(x[:, :0]) == set()
