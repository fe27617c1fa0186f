"""Reasoning in the engine (issue 45, item 1): a thinking request's output is split into its
thinking and its answer by the one output check, exactly, with the core driven by hand-built
outcomes (tests/scripted.py) on a tiny model whose template thinks (<think> 3, </think> 4).
Stop strings apply to the answer only; a budget ends the thinking with the end marker, which
reaches neither the thinking nor the answer; cancels, preemption (recompute and swap), async
scheduling and verify runs keep the phase exactly."""

from __future__ import annotations

import time

import pytest

from stopline.model.loaders.loader import load_model
from stopline.request import AbortSource, FinishReason, ReasoningSpec, SamplingParams
from stopline.sched.plan import ScheduledChunk
from stopline.worker.sampler import Sampled
from stopline.worker.step import ChunkOutcome
from tests.engine_support import collect, drive
from tests.scripted import outcome_engine

START, END = 3, 4
THE, WORLD, A, CAT = [268], [283, 287, 465], [262], [289, 294]  # " the", " world", " a", " cat"
PROMPT = [1, 90, 91, 92, 2, 1, 93, 3]


@pytest.fixture(scope="module")
def think(tiny_think_model_dir):
    return load_model(str(tiny_think_model_dir), progress=False)


def params(max_tokens: int = 40, budget: int | None = None, opened: bool = True, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0,
                          reasoning=ReasoningSpec([START], [END], opened, budget), **kw)


def script(tokens: list[int], then: int = 300):
    """The outcome: `tokens` in order, then `then` forever."""
    def pick(ch: ScheduledChunk) -> int:
        n = len(ch.req.output_token_ids)
        return tokens[n] if n < len(tokens) else then
    return pick


def text(think, ids: list[int]) -> str:
    return think.tokenizer.decode(ids)


def reasoning(res) -> str:
    return "".join(d.new_reasoning for d in res.deltas)


def test_thinking_and_answer_are_apart(think):
    out = [*THE, *WORLD, END, *A, *CAT, think.config.eos_token_ids[0]]
    eng = outcome_engine(think, script(out))
    res = drive(eng, [("r", PROMPT, params(ignore_eos=False))])[("r", 0)]
    assert reasoning(res) == text(think, [*THE, *WORLD])
    assert res.text == text(think, [*A, *CAT])
    assert res.finish_reason is FinishReason.STOP
    assert res.usage.reasoning_tokens == 5  # four of thinking and the end marker
    assert res.usage.completion_tokens == len(out)
    # streamed as deltas: thinking first, then the answer, never both in one
    kinds = [("r" if d.new_reasoning else "") + ("t" if d.new_text else "") for d in res.deltas]
    assert "rt" not in kinds and kinds.index("t") > kinds.index("r")


def test_a_stop_string_inside_the_thinking_does_not_end_it(think):
    """vllm#52393: the client's stop string seen in the thinking ended the request with no
    answer. It applies to the answer only."""
    out = [*A, *CAT, *THE, END, *A, *THE, *CAT]
    eng = outcome_engine(think, script(out))
    res = drive(eng, [("r", PROMPT, params(stop=[" the"]))])[("r", 0)]
    assert reasoning(res) == text(think, [*A, *CAT, *THE])
    assert res.text == " a"
    assert res.finish_reason is FinishReason.STOP and res.stop_detail == " the"
    assert res.token_ids == out[:-len(CAT)]


def test_a_budget_ends_the_thinking_with_the_marker_and_the_answer_follows(think):
    """The model would think forever; after 3 tokens the engine writes </think>, and the
    marker reaches neither part (llama.cpp#28182 leaked it into the content)."""
    eng = outcome_engine(think, script([], then=A[0]))
    res = drive(eng, [("r", PROMPT, params(max_tokens=6, budget=3, skip_special_tokens=False))])[("r", 0)]
    assert res.token_ids == [A[0]] * 3 + [END] + [A[0]] * 2
    assert reasoning(res) == " a a a"
    assert res.text == " a a" and "think>" not in res.text
    assert res.finish_reason is FinishReason.LENGTH
    assert res.usage.reasoning_tokens == 4


def test_a_budget_of_zero_answers_at_once(think):
    eng = outcome_engine(think, script([], then=A[0]))
    res = drive(eng, [("r", PROMPT, params(max_tokens=3, budget=0))])[("r", 0)]
    assert res.token_ids == [END, A[0], A[0]] and reasoning(res) == "" and res.text == " a a"
    assert res.usage.reasoning_tokens == 1


def test_a_budget_finishes_a_marker_the_model_began(think):
    """A two-token end marker whose first token the model wrote as the budget ran out: the
    engine writes the rest, not a second marker."""
    spec = ReasoningSpec([START], [END, 5], True, 2)
    eng = outcome_engine(think, script([A[0], END], then=A[0]))
    p = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, reasoning=spec)
    res = drive(eng, [("r", PROMPT, p)])[("r", 0)]
    assert res.token_ids == [A[0], END, 5, A[0], A[0]]
    assert reasoning(res) == " a" and res.text == " a a"


def test_max_tokens_inside_the_thinking_is_length_with_no_answer(think):
    eng = outcome_engine(think, script([], then=A[0]))
    res = drive(eng, [("r", PROMPT, params(max_tokens=4))])[("r", 0)]
    assert reasoning(res) == " a a a a" and res.text == ""
    assert res.finish_reason is FinishReason.LENGTH and res.usage.reasoning_tokens == 4


def test_the_output_may_open_the_thinking_itself(think):
    eng = outcome_engine(think, script([START, *A, END, *CAT]))
    res = drive(eng, [("r", PROMPT[:-1], params(max_tokens=5, opened=False))])[("r", 0)]
    assert reasoning(res) == " a" and res.text == " cat" and res.usage.reasoning_tokens == 3
    eng = outcome_engine(think, script([*A, END, *CAT]))  # not opened: all answer, markers too
    res = drive(eng, [("r", PROMPT[:-1], params(max_tokens=4, opened=False,
                                                   skip_special_tokens=False))])[("r", 0)]
    assert reasoning(res) == "" and res.text == " a</think> cat" and res.usage.reasoning_tokens == 0


def test_a_cancel_while_thinking_ends_it_with_the_thinking_so_far(think):
    eng = outcome_engine(think, script([], then=A[0]))
    rid = eng.add_request("r", PROMPT, params(max_tokens=30, budget=10))
    res: dict = {}
    for _ in range(4):
        collect(res, eng.step())
    eng.abort([rid], AbortSource.CANCEL, time.monotonic())
    while eng.has_unfinished():
        collect(res, eng.step())
    eng.audit()
    r = res[("r", 0)]
    assert r.finish_reason is FinishReason.ABORT and r.text == ""
    assert reasoning(r) == " a" * len(r.token_ids) and r.usage.reasoning_tokens == len(r.token_ids)


def _solo(think, rid, prompt, p, outcome):
    return drive(outcome_engine(think, outcome), [(rid, prompt, p)])[(rid, 0)]


@pytest.mark.parametrize("mode,async_scheduling", [("recompute", False), ("swap", False),
                                                   ("recompute", True), ("swap", True)])
def test_preempted_thinking_requests_resume_in_their_phase(think, mode, async_scheduling):
    """A pool too small for all: thinking requests are preempted in every phase and resume
    where they were (the phase is the output's, which preemption keeps)."""
    def outcome(ch: ScheduledChunk) -> int:  # depends on the request's own tokens only
        req = ch.req
        n = len(req.output_token_ids)
        k = int(req.request_id[1:])
        if req.request_id.startswith("e") and n == 3 + k % 5:
            return END
        return (A[0], THE[0], 300 + k)[(n + k) % 3]

    work = []
    for k in range(8):
        prompt = [1, 90 + k, 91, 92 + k, 2, 1, 93, 3]
        budget = 2 + k % 4 if k % 2 else None
        stop = [" the"] if k % 3 == 0 else []
        work.append((f"{'e' if k < 4 else 'b'}{k}", prompt, params(max_tokens=14 + k, budget=budget, stop=stop)))
    eng = outcome_engine(think, outcome, num_blocks=14, block_size=4, preemption_mode=mode,
                         async_scheduling=async_scheduling, admission_lookahead=0,
                         max_preemptions=1000)
    res = drive(eng, work)
    assert sum(eng.stats.preemptions.values()) > 0, eng.stats.preemptions
    for rid, prompt, p in work:
        alone = _solo(think, rid, prompt, p, outcome)
        got = res[(rid, 0)]
        assert (got.token_ids, got.text, reasoning(got), got.finish_reason) == \
            (alone.token_ids, alone.text, reasoning(alone), alone.finish_reason), rid
        assert got.usage.reasoning_tokens == alone.usage.reasoning_tokens


def test_a_verify_run_stops_where_the_budget_writes_the_marker(think):
    """Speculation: the drafts after the budget's end are void, whatever the sampler drew."""
    def outcome(ch: ScheduledChunk):
        if ch.drafts:  # the sampler draws " a" at every row: drafts of " a" are accepted
            return ChunkOutcome(run=[Sampled(A[0], None)] * (len(ch.drafts) + 1))
        return A[0]

    eng = outcome_engine(think, outcome, speculative="on")
    res = drive(eng, [("r", PROMPT, params(max_tokens=12, budget=5))])[("r", 0)]
    assert eng.stats.spec_accepted > 0
    assert res.token_ids == [A[0]] * 5 + [END] + [A[0]] * 6
    assert reasoning(res) == " a" * 5 and res.text == " a" * 6


def test_a_grammar_holds_the_answer_only(think):
    """The thinking is free; the grammar (response_format, tools) starts with the answer."""
    from stopline.grammar.formats import regex_grammar

    out = [*THE, *WORLD, END, *A, *A]
    eng = outcome_engine(think, script(out))
    p = params(max_tokens=20, grammar=regex_grammar(" a a"))
    res = drive(eng, [("r", PROMPT, p)])[("r", 0)]
    assert res.finish_reason is FinishReason.STOP and res.stop_detail == "grammar complete"
    assert reasoning(res) == text(think, [*THE, *WORLD]) and res.text == " a a"


def test_a_grammar_keeps_an_unopened_thinking_closed(think):
    """The prompt did not open the thinking and a grammar holds the output from its first
    token: the output is all answer, each token the grammar's."""
    from stopline.grammar.formats import regex_grammar

    eng = outcome_engine(think, script([*A, *A]))
    p = params(max_tokens=20, opened=False, grammar=regex_grammar(" a a"))
    res = drive(eng, [("r", PROMPT[:-1], p)])[("r", 0)]
    assert res.stop_detail == "grammar complete" and res.text == " a a" and reasoning(res) == ""
