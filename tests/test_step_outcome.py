"""The one step contract, without a model: the core driven by hand-built `StepOutcome`s
(tests/scripted.py `OutcomeWorker`). The worker says what each row drew or that it broke;
the core alone decides stops, voids the rows of requests aborted during the step, and ends
only the request whose row failed."""

from __future__ import annotations

import time

import pytest

from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.engine.role import Role
from stopline.lifecycle import Holder, Lifecycle
from stopline.model.loaders.loader import load_model
from stopline.request import (
    AbortSource,
    Family,
    FinishReason,
    Request,
    SamplingParams,
    TokenLogprob,
)
from stopline.sched.plan import ScheduledChunk, StepPlan
from stopline.worker.sampler import Sampled
from stopline.worker.step import BROKEN, ChunkOutcome
from tests.engine_support import collect, drive
from tests.scripted import OutcomeWorker, outcome_engine

PROMPT = [5, 6, 7, 8, 9, 10, 11]
OTHER = [40, 41, 42, 43, 44]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def counting(ch: ScheduledChunk) -> int:
    return 100 + len(ch.req.output_token_ids)


def test_stop_and_length_are_decided_by_the_core(tiny):
    eos = tiny.config.eos_token_ids[0]

    def outcome(ch: ScheduledChunk) -> int:
        if ch.req.request_id == "eos" and len(ch.req.output_token_ids) == 2:
            return eos
        if ch.req.request_id == "stop-id" and len(ch.req.output_token_ids) == 1:
            return 77
        return counting(ch)

    eng = outcome_engine(tiny, outcome)
    res = drive(eng, [("eos", PROMPT, greedy(8)), ("len", OTHER, greedy(4)),
                      ("stop-id", OTHER, greedy(8, stop_token_ids=[77])), ("fam", PROMPT, greedy(3, n=2))])
    assert res[("eos", 0)].finish_reason is FinishReason.STOP and res[("eos", 0)].stop_detail == "eos"
    assert res[("eos", 0)].token_ids == [100, 101, eos]
    assert res[("len", 0)].finish_reason is FinishReason.LENGTH
    assert res[("len", 0)].token_ids == [100, 101, 102, 103]
    assert res[("stop-id", 0)].finish_reason is FinishReason.STOP
    assert res[("stop-id", 0)].token_ids == [100, 77]
    for i in (0, 1):  # a family's samples fork at their first token: each gets its own draw
        assert res[("fam", i)].finish_reason is FinishReason.LENGTH
        assert res[("fam", i)].token_ids == [100, 101, 102]


def test_an_abort_during_the_step_voids_that_rows_token(tiny):
    eng = outcome_engine(tiny, counting)
    a = eng.add_request("a", PROMPT, greedy(8))
    eng.add_request("b", OTHER, greedy(6))

    def abort_mid_step(plan: StepPlan) -> None:
        for ch in plan.chunks:
            if ch.req.incarnation == a and len(ch.req.output_token_ids) == 2:
                eng.abort([a], AbortSource.CANCEL, time.monotonic())  # lands while the worker runs: its row is in the outcome

    eng.worker.before = abort_mid_step
    res = drive(eng)
    assert res[("a", 0)].finish_reason is FinishReason.ABORT
    assert res[("a", 0)].token_ids == [100, 101]  # nothing of the step in flight
    assert res[("b", 0)].finish_reason is FinishReason.LENGTH
    assert res[("b", 0)].token_ids == [100, 101, 102, 103, 104, 105]
    assert eng.stats.tokens_after_abort == 1


def test_an_abort_during_a_family_step_counts_its_tokens_as_undelivered(tiny):
    """A family before its fork is one request: its leader's step samples for every sample.
    Aborted while that step runs, the family gets none of those tokens, and the leader's
    usage counts them as undelivered (the lifecycle's in-flight count)."""
    eng = outcome_engine(tiny, counting)
    fam = eng.add_request("fam", PROMPT, greedy(4, n=3))

    def abort_mid_prefill(plan: StepPlan) -> None:
        if any(ch.req.incarnation == fam and ch.sample for ch in plan.chunks):
            eng.abort([fam], AbortSource.CANCEL, time.monotonic())

    eng.worker.before = abort_mid_prefill
    res = drive(eng)
    for i in (0, 1, 2):
        assert res[("fam", i)].finish_reason is FinishReason.ABORT and res[("fam", i)].token_ids == []
    assert res[("fam", 0)].usage.undelivered_tokens == 3  # one per sample, on the leader
    assert eng.stats.tokens_after_abort == 3


def test_scoring_only_family_forks_and_ends_with_the_prompt_scores(tiny):
    """max_tokens 0 with prompt logprobs: the outcome's scores go to the leader, every sample
    forks from it with the same scores and ends at once with no token."""
    scores = [TokenLogprob(t, -1.0, []) for t in PROMPT[1:]]

    def outcome(ch: ScheduledChunk) -> ChunkOutcome:
        return ChunkOutcome(prompt_logprobs=list(scores))

    eng = outcome_engine(tiny, outcome)
    res = drive(eng, [("score", PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=0, n=2))])
    for i in (0, 1):
        r = res[("score", i)]
        assert r.finish_reason is FinishReason.LENGTH and r.token_ids == []
        assert [lp.token_id for lp in r.deltas[-1].prompt_logprobs] == PROMPT[1:]


def test_a_failed_row_ends_only_its_request(tiny):
    def outcome(ch: ScheduledChunk) -> int | ChunkOutcome:
        n = len(ch.req.output_token_ids)
        if ch.req.request_id == "nan" and n == 3:
            return ChunkOutcome(bad=True)
        if ch.req.request_id == "stuck" and n == 1:
            return ChunkOutcome(samples=[(ch.req, "no token is allowed next")])
        return counting(ch)

    eng = outcome_engine(tiny, outcome)
    res = drive(eng, [("nan", PROMPT, greedy(8)), ("stuck", OTHER, greedy(8)), ("ok", PROMPT, greedy(6))])
    assert res[("nan", 0)].finish_reason is FinishReason.ERROR
    assert res[("nan", 0)].stop_detail == BROKEN and res[("nan", 0)].token_ids == [100, 101, 102]
    assert res[("stuck", 0)].finish_reason is FinishReason.ERROR
    assert res[("stuck", 0)].stop_detail == "grammar: no token is allowed next"
    assert res[("stuck", 0)].token_ids == [100]
    assert res[("ok", 0)].finish_reason is FinishReason.LENGTH
    assert res[("ok", 0)].token_ids == [100, 101, 102, 103, 104, 105]


def test_a_verify_run_gives_plain_decodings_tokens(tiny):
    """A verify chunk's outcome is its run: row j drawn after the history and the drafts
    before it, up to the first miss. The core accepts, rewinds and settles the drafts."""
    def f(history: list[int]) -> int:
        return 20 + len(history) % 3 if len(history) != 7 else 99  # a loop the drafts follow, one miss

    def outcome(ch: ScheduledChunk) -> int | ChunkOutcome:
        hist = list(ch.req.output_token_ids)
        if not ch.drafts:
            return f(hist)
        run = []
        for j in range(len(ch.drafts) + 1):
            run.append(Sampled(f(hist + ch.drafts[:j]), None))
            if j == len(ch.drafts) or run[-1].token_id != ch.drafts[j]:
                break
        return ChunkOutcome(run=run)

    reqs = [("a", [20, 21, 22, 20, 21, 22, 20, 21], greedy(12))]
    plain = drive(outcome_engine(tiny, outcome), reqs)
    eng = outcome_engine(tiny, outcome, speculative="on", speculative_tokens=3)
    spec = drive(eng, reqs)
    assert spec[("a", 0)].token_ids == plain[("a", 0)].token_ids
    assert 99 in spec[("a", 0)].token_ids
    s = eng.stats
    assert s.spec_verify_steps > 0 and s.spec_accepted > 0 and s.spec_rejected > 0
    assert s.spec_drafted == s.spec_accepted + s.spec_rejected + sum(s.spec_discarded.values())
    assert eng.worker.steps < plain_steps(tiny, outcome, reqs)


def plain_steps(tiny, outcome, reqs) -> int:
    eng = outcome_engine(tiny, outcome)
    drive(eng, reqs)
    return eng.worker.steps


class HoldBack(Role):
    """A role that keeps every family back until `release_all`, holds it meanwhile, and
    takes a request once its prompt is computed (as a split's prefill side does)."""

    name = "hold-back"

    def __init__(self) -> None:
        self.held: dict[str, Family] = {}
        self.taken: list[str] = []
        self.starts = 0

    def bind(self, core: EngineCore) -> list[Holder]:
        self.core = core
        return [self]

    def admit(self, fam: Family) -> bool:
        self.held[fam.incarnation] = fam
        return True

    def release_all(self) -> None:
        for fam in self.held.values():
            self.core.admit(fam)
        self.held = {}

    def step_start(self) -> None:
        self.starts += 1

    def prefilled(self, req: Request) -> bool:
        if req.request_id != "taken":
            return False
        self.taken.append(req.incarnation)
        self.core.lifecycle.finish(req, FinishReason.STOP, "taken")
        return True

    def holding(self) -> bool:
        return bool(self.held)

    def idle(self, req: Request) -> bool:
        return req.incarnation in self.held

    # a holder of the one release
    def release(self, req: Request) -> None:
        self.held.pop(req.incarnation, None)

    def preempt(self, req: Request) -> None:
        pass

    def holds(self, req: Request) -> bool:
        return req.incarnation in self.held


def test_a_role_is_called_at_fixed_points_and_its_holders_go_before_the_blocks(tiny):
    role = HoldBack()
    eng = EngineCore(tiny, EngineConfig(block_size=4, num_blocks=64, target_step_ms=None, debug=True,
                                        speculative="off"),
                     worker=OutcomeWorker(counting), role=role)
    holders = eng.lifecycle.holders
    assert holders[-1] is eng.kv_manager and holders[-2] is role  # under the lifecycle's order check
    with pytest.raises(ValueError, match="last holder"):
        Lifecycle(eng.config, eng.kv_manager, [eng.kv_manager, role], eng.stats)
    taken = eng.add_request("taken", PROMPT, greedy(4))
    served = eng.add_request("served", OTHER, greedy(3))
    gone = eng.add_request("gone", OTHER, greedy(3))
    res: dict = {}
    collect(res, eng.step())
    assert set(role.held) == {taken, served, gone}  # kept back before admission
    assert eng.all_paused() and eng.has_unfinished() and eng.worker.steps == 0
    eng.abort([gone], AbortSource.CANCEL, time.monotonic())  # released through the role's holder, never admitted
    collect(res, eng.step())
    assert gone not in role.held and res[("gone", 0)].finish_reason is FinishReason.ABORT
    role.release_all()
    while eng.has_unfinished():
        collect(res, eng.step())
    assert role.taken == [taken] and res[("taken", 0)].token_ids == []  # taken before sampling
    assert res[("served", 0)].token_ids == [100, 101, 102]
    assert role.starts == eng.steps
    eng.audit()
