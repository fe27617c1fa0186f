"""Bad input is refused up front with an InvalidRequest (a ValueError) that names the problem,
and leaves nothing behind: no family, no queued request, no block."""

from __future__ import annotations

import pytest

from stopline import LLM, InvalidRequest
from stopline.request import SamplingParams
from tests.engine_support import assert_idle, greedy, random_prompts, sharp_tiny_dir

BS = 4
NUM_BLOCKS = 16  # 64 tokens of KV
MAX_LEN = 48


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return LLM(model=str(sharp_tiny_dir(tmp_path_factory)), progress=False, block_size=BS,
               num_blocks=NUM_BLOCKS, max_model_len=MAX_LEN, debug=True)


@pytest.fixture(scope="module")
def good() -> list[int]:
    return random_prompts(1, [6], seed=4)[0]


@pytest.fixture(scope="module")
def expected(llm: LLM, good: list[int]) -> list[int]:
    return llm.generate([good], greedy(8))[0].outputs[0].token_ids


def _assert_nothing_left(llm: LLM) -> None:
    e = llm.engine
    assert not e.has_unfinished()
    assert_idle(e)


def _assert_still_serves(llm: LLM, good: list[int], expected: list[int]) -> None:
    assert llm.generate([good], greedy(8))[0].outputs[0].token_ids == expected
    _assert_nothing_left(llm)


BAD_PARAMS = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(n=0), "n"),
    (dict(n=-1), "n"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.2), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=9, max_tokens=8), "min_tokens"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"),
]


@pytest.mark.parametrize(("kw", "name"), BAD_PARAMS, ids=[f"{n}={kw[n]}" for kw, n in BAD_PARAMS])
def test_bad_sampling_params(llm: LLM, good, expected, kw: dict, name: str) -> None:
    params = SamplingParams(**kw)
    for submit in (lambda: llm.generate([good], params),
                   lambda: llm.engine.add_request("x", good, params)):
        with pytest.raises(InvalidRequest, match=rf"^{name}\b") as exc:
            submit()
        assert isinstance(exc.value, ValueError)
        _assert_nothing_left(llm)
    _assert_still_serves(llm, good, expected)


def test_empty_prompt(llm: LLM, good, expected) -> None:
    for submit in (lambda: llm.generate([""], greedy(4)), lambda: llm.generate([[]], greedy(4)),
                   lambda: llm.engine.add_request("x", [], greedy(4))):
        with pytest.raises(InvalidRequest, match="empty|at least one token"):
            submit()
        _assert_nothing_left(llm)
    _assert_still_serves(llm, good, expected)


@pytest.mark.parametrize("length", [MAX_LEN, MAX_LEN + 1, 500])
def test_prompt_longer_than_the_context(llm: LLM, good, expected, length: int) -> None:
    # A prompt that fills the context leaves no room for the one token it asks for.
    prompt = random_prompts(1, [length], seed=length)[0]
    with pytest.raises(InvalidRequest, match="context") as exc:
        llm.generate([prompt], greedy(4))
    assert str(length) in str(exc.value)
    _assert_nothing_left(llm)
    _assert_still_serves(llm, good, expected)


def test_prompt_larger_than_the_kv_pool(tmp_path_factory, good, expected) -> None:
    # Context 1024 tokens, pool 16 blocks of 4 = 64 tokens.
    llm = LLM(model=str(sharp_tiny_dir(tmp_path_factory)), progress=False, block_size=BS,
              num_blocks=NUM_BLOCKS, debug=True)
    for length, n in [(64, 1), (70, 1), (60, 4)]:  # 60 tokens + 3 forked partial blocks
        prompt = random_prompts(1, [length], seed=length)[0]
        with pytest.raises(InvalidRequest, match="KV blocks"):
            llm.generate([prompt], greedy(4, n=n))
        _assert_nothing_left(llm)
    # The largest prompt that does fit is served.
    assert len(llm.generate([random_prompts(1, [63], seed=0)[0]], greedy(1))[0].outputs[0].token_ids) == 1
    _assert_still_serves(llm, good, expected)


def test_token_ids_outside_the_vocabulary(llm: LLM, good, expected) -> None:
    for prompt in ([5, 512], [-1, 5]):
        with pytest.raises(InvalidRequest, match="vocabulary"):
            llm.generate([prompt], greedy(4))
        _assert_nothing_left(llm)
    _assert_still_serves(llm, good, expected)


def test_one_bad_request_in_a_batch_queues_none(llm: LLM, good, expected) -> None:
    prompts = [good, random_prompts(1, [10], seed=1)[0], random_prompts(1, [MAX_LEN + 5], seed=2)[0]]
    with pytest.raises(InvalidRequest, match="context"):
        llm.generate(prompts, greedy(4))
    _assert_nothing_left(llm)
    with pytest.raises(InvalidRequest, match="top_p"):
        llm.generate([good, good], [greedy(4), greedy(4, top_p=2.0)])
    _assert_nothing_left(llm)
    _assert_still_serves(llm, good, expected)


def test_duplicate_incarnation(llm: LLM, good, expected) -> None:
    """Caller ids may repeat (incarnations tell requests apart); an incarnation may not."""
    e = llm.engine
    inc = e.add_request("dup", good, greedy(8))
    with pytest.raises(InvalidRequest, match="already in use"):
        e.add_request("dup", good, greedy(8), incarnation=inc)
    outs = []
    while e.has_unfinished():
        outs += e.step()
    assert [t for o in outs for t in o.new_token_ids] == expected  # the first one, once
    _assert_nothing_left(llm)
