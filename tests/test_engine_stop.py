"""Stop conditions on the tiny model: EOS, stop_token_ids, stop strings, max_tokens, the
context limit, ignore_eos, min_tokens.

Expected outputs are cut from the request's own greedy continuation (max_tokens, EOS ignored),
so each case knows exactly which token should be the last and which text the client sees.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stopline import LLM, FinishReason
from stopline.engine.core import EngineCore
from stopline.request import SamplingParams
from tests.engine_support import (
    MIN_MARGIN_TINY,
    Result,
    drive,
    greedy,
    hf_greedy,
    load_hf,
    random_prompts,
    sharp_tiny_dir,
)

MAX_NEW = 32
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharp_tiny_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), progress=False, num_blocks=4096, block_size=8,
               target_step_ms=None, debug=True)


@pytest.fixture(scope="module")
def continuations(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy continuation with EOS ignored) for 128 random prompts."""
    prompts = random_prompts(128, [4, 9, 20, 33], seed=11)
    res = llm.generate(prompts, greedy(MAX_NEW))
    return [(p, r.outputs[0].token_ids) for p, r in zip(prompts, res, strict=True)]


def _run(engine: EngineCore, prompt: list[int], params: SamplingParams) -> Result:
    """One request through EngineCore (audited every step); the assembled client view."""
    return drive(engine, [("q", prompt, params)])[("q", 0)]


def _streamed(res: Result) -> str:
    return "".join(d.new_text for d in res.deltas)


# ---- EOS ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eos_case(continuations) -> tuple[list[int], list[int], int]:
    """A prompt whose greedy continuation emits EOS at position k >= 1."""
    cases = [(p, c, c.index(EOS)) for p, c in continuations if EOS in c[1:MAX_NEW - 8]]
    assert cases, "no greedy continuation reaches EOS: the EOS tests would test nothing"
    return cases[0]


def test_eos_stops_and_is_not_in_the_text(llm: LLM, eos_case) -> None:
    prompt, cont, k = eos_case
    res = _run(llm.engine, prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert res.finish_reason is FinishReason.STOP and res.stop_detail == "eos"
    assert res.token_ids == cont[:k + 1]  # the EOS token itself is reported, like vLLM
    assert res.text == llm.tokenizer.decode(cont[:k]) == _streamed(res)
    assert "<|im_end|>" not in res.text


def test_ignore_eos_runs_to_max_tokens(llm: LLM, eos_case) -> None:
    prompt, cont, _ = eos_case
    res = _run(llm.engine, prompt, greedy(MAX_NEW))
    assert res.finish_reason is FinishReason.LENGTH and res.stop_detail == "max_tokens"
    assert res.token_ids == cont


def test_min_tokens_suppresses_eos(llm: LLM, model_dir: Path, eos_case) -> None:
    """Below min_tokens, EOS can't be generated (vLLM and HF mask it): the request neither
    stops at the EOS nor reports it, and continues with the next best token."""
    prompt, cont, k = eos_case
    min_tokens = k + 4
    res = _run(llm.engine, prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=min_tokens))
    assert len(res.token_ids) >= min_tokens
    assert EOS not in res.token_ids[:min_tokens], "EOS was generated before min_tokens"
    # HF's MinNewTokensLengthLogitsProcessor is the oracle; it stops at the first later EOS.
    ref = hf_greedy(load_hf(model_dir), [prompt], MAX_NEW, eos_token_id=EOS, min_new_tokens=min_tokens)
    ref.check_meaningful(MIN_MARGIN_TINY)
    want = ref.tokens[0]
    if EOS in want:
        want = want[:want.index(EOS) + 1]
    assert res.token_ids == want
    assert res.finish_reason is (FinishReason.STOP if want[-1] == EOS else FinishReason.LENGTH)


def test_min_tokens_defers_stop_token_ids(llm: LLM, continuations) -> None:
    prompt, cont = continuations[0]
    tok = cont[2]
    res = _run(llm.engine, prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                                   min_tokens=6, stop_token_ids=[tok]))
    assert len(res.token_ids) >= 6
    assert tok not in res.token_ids[:5], "a stop token was generated before min_tokens"


# ---- stop tokens ----------------------------------------------------------------------------

def test_stop_token_ids(llm: LLM, continuations) -> None:
    for prompt, cont in continuations[:8]:
        k = next(i for i in range(3, MAX_NEW) if cont[i] not in cont[:i])
        res = _run(llm.engine, prompt, greedy(MAX_NEW, stop_token_ids=[cont[k], 100_000]))
        assert res.finish_reason is FinishReason.STOP
        assert res.stop_detail == f"stop_token_id:{cont[k]}"
        assert res.token_ids == cont[:k + 1]
        # like a stop string, the stop token's own text is not output
        assert res.text == _streamed(res)
        assert res.text == llm.tokenizer.decode(cont[:k])


# ---- stop strings ---------------------------------------------------------------------------

def _clean_boundaries(llm: LLM, cont: list[int]) -> list[int]:
    """Character offsets of the token boundaries in the decoded text, up to the first token
    that leaves a character unfinished (the random model emits lone UTF-8 bytes; past one,
    which text a boundary falls in depends on bytes still to come)."""
    text = llm.tokenizer.decode(cont)
    offs = [0]
    for j in range(1, len(cont) + 1):
        head = llm.tokenizer.decode(cont[:j])
        if "\ufffd" in head or not text.startswith(head):
            break
        offs.append(len(head))
    return offs


@pytest.fixture(scope="module")
def text_cases(llm: LLM, continuations) -> list[tuple[list[int], list[int], str, list[int]]]:
    """(prompt, continuation, its text, clean token boundaries) with >= 6 clean tokens."""
    out = []
    for p, c in continuations:
        offs = _clean_boundaries(llm, c)
        if EOS not in c and len(offs) > 6:
            out.append((p, c, llm.tokenizer.decode(c), offs))
    assert len(out) >= 4, "too few clean continuations for the stop string tests"
    return out


def _spanning_stops(text: str, offs: list[int], pieces: int):
    """Stop strings that start inside one token and end inside the token `pieces` later,
    occurring first where they are taken from. Yields (stop, start offset, last token)."""
    for j in range(1, len(offs) - pieces):
        a, b = offs[j] - 1, offs[j + pieces - 1] + 1
        if offs[j - 1] <= a and b <= offs[j + pieces]:
            s = text[a:b]
            if text.find(s) == a:
                yield s, a, j + pieces - 1


@pytest.mark.parametrize("pieces", [1, 2])
def test_stop_string_across_token_boundaries(llm: LLM, text_cases, pieces: int) -> None:
    checked = 0
    for prompt, cont, text, offs in text_cases:
        for stop, start, last in list(_spanning_stops(text, offs, pieces))[:2]:
            res = _run(llm.engine, prompt, greedy(MAX_NEW, stop=[stop]))
            assert res.finish_reason is FinishReason.STOP and res.stop_detail == stop
            assert res.text == text[:start], "the stop string must be cut from the output"
            assert res.token_ids == cont[:last + 1], "generation must end on the completing token"
            assert _streamed(res) == res.text, "streamed deltas leaked (part of) the stop string"
            checked += 1
    assert checked >= 4


def test_earliest_stop_string_wins(llm: LLM, text_cases) -> None:
    for prompt, _cont, text, offs in text_cases:
        early, late = text[offs[1] - 1:offs[1] + 1], text[offs[4]:offs[5]]
        if not 0 <= text.find(early) < text.find(late):
            continue
        res = _run(llm.engine, prompt, greedy(MAX_NEW, stop=[late, early]))
        assert res.stop_detail == early and res.text == text[:text.find(early)]
        return
    pytest.fail("no case with two ordered stop strings")


def test_stop_string_only_in_the_prompt_does_not_stop(llm: LLM, text_cases) -> None:
    for prompt, cont, text, _ in text_cases:
        ptext = llm.tokenizer.decode(prompt)
        stop = next((ptext[i:i + 3] for i in range(len(ptext) - 2)
                     if "\ufffd" not in ptext[i:i + 3] and ptext[i:i + 3] not in text), None)
        if stop is None:
            continue
        res = _run(llm.engine, prompt, greedy(MAX_NEW, stop=[stop]))
        assert res.finish_reason is FinishReason.LENGTH and res.token_ids == cont
        return
    pytest.fail("no prompt with a stop string absent from its output")


def test_stop_string_on_the_first_token(llm: LLM, text_cases) -> None:
    prompt, cont, text, offs = text_cases[0]
    stop = text[:offs[1]]
    assert text.find(stop) == 0
    res = _run(llm.engine, prompt, greedy(MAX_NEW, stop=[stop]))
    assert res.token_ids == cont[:1] and res.text == "" and res.finish_reason is FinishReason.STOP


def test_min_tokens_defers_stop_strings(llm: LLM, text_cases) -> None:
    for prompt, cont, text, offs in text_cases:
        stop = text[offs[1] - 1:offs[1] + 1]
        if text.count(stop) != 1:
            continue
        assert _run(llm.engine, prompt, greedy(MAX_NEW, stop=[stop])).finish_reason is FinishReason.STOP
        res = _run(llm.engine, prompt, greedy(MAX_NEW, stop=[stop], min_tokens=8))
        assert res.finish_reason is FinishReason.LENGTH and res.token_ids == cont
        return
    pytest.fail("no stop string that occurs once")


# ---- lengths --------------------------------------------------------------------------------

@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens(llm: LLM, continuations, max_tokens: int) -> None:
    prompt, cont = continuations[3]
    res = _run(llm.engine, prompt, greedy(max_tokens))
    assert res.finish_reason is FinishReason.LENGTH and res.stop_detail == "max_tokens"
    assert res.token_ids == cont[:max_tokens]
    assert res.usage is not None and res.usage.completion_tokens == max_tokens


def test_context_limit_ends_with_length(model_dir: Path, continuations) -> None:
    llm = LLM(model=str(model_dir), progress=False, num_blocks=256, block_size=8, max_model_len=24,
              debug=True)
    prompt, cont = continuations[2]  # 20 tokens
    assert len(prompt) == 20
    res = _run(llm.engine, prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert res.finish_reason is FinishReason.LENGTH and res.stop_detail == "max_model_len"
    assert res.token_ids == cont[:4]


def test_finish_reasons_through_llm_generate(llm: LLM, eos_case, continuations) -> None:
    prompt, cont, k = eos_case
    p2, c2 = continuations[5]
    res = llm.generate([prompt, p2, p2], [SamplingParams(temperature=0, max_tokens=MAX_NEW),
                                          greedy(5), greedy(MAX_NEW, stop_token_ids=[c2[4]])])
    got = [(r.outputs[0].finish_reason.value, len(r.outputs[0].token_ids)) for r in res]
    k2 = c2.index(c2[4])
    assert got == [("stop", k + 1), ("length", 5), ("stop", k2 + 1)]
