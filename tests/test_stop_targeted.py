"""One test per state and race of the stop path (docs/design.md, contracts 2-8), on a tiny model."""

from __future__ import annotations

import time

import pytest
import torch

from stopline.config import EngineConfig, VictimPolicy
from stopline.engine.core import EngineCore
from stopline.kv.block_pool import BlockPool
from stopline.kv.manager import KVManager, SeqKV
from stopline.model.loaders.loader import load_model
from stopline.request import (
    AbortSource,
    FinishReason,
    InvalidRequest,
    Request,
    RequestStatus,
    SamplingParams,
)
from stopline.sched.victims import pick_victim
from stopline.stats import StopStats
from tests.tiny_model import make_tiny_llama_dir

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_llama_dir(tmp_path_factory.mktemp("targeted") / "tiny", seed=3, init_std=0.1,
                               vocab_size=384)
    return load_model(str(path), progress=False)


def engine(tiny, **kw) -> EngineCore:
    cfg = dict(num_blocks=64, block_size=4, max_num_seqs=16, max_num_batched_tokens=64,
               debug=True, target_step_ms=None)
    cfg.update(kw)
    return EngineCore(tiny, EngineConfig(**cfg))


def drain(eng: EngineCore, max_steps: int = 10_000) -> dict:
    """Run to idle; returns {(id, index): {"tokens": [...], "terminal": [outputs]}}."""
    res: dict = {}
    for _ in range(max_steps):
        if not eng.has_unfinished():
            break
        collect(eng.step(), res)
    assert not eng.has_unfinished(), "engine did not go idle"
    eng.audit()
    assert eng.pool.num_used == 0
    return res


def collect(outs, res):
    for o in outs:
        r = res.setdefault((o.request_id, o.index), {"tokens": [], "terminal": []})
        r["tokens"] += o.new_token_ids
        if o.finished:
            r["terminal"].append(o)
    return res


def solo(tiny, prompt, params, **kw):
    eng = engine(tiny, **kw)
    eng.add_request("solo", prompt, params)
    return drain(eng)[("solo", 0)]["tokens"]


PROMPT = [5, 17, 99, 23, 42, 7, 300, 12, 9, 81]


def abort_during_forward(eng: EngineCore, inc: str, on_step: int) -> None:
    """Make engine.abort(inc) arrive while step `on_step`'s forward is running."""
    execute = eng.runner.execute

    def hooked(plan, interrupt=None):
        result = execute(plan, interrupt)
        if plan.step_id == on_step:
            eng.abort([inc], AbortSource.CANCEL, time.monotonic())
        return result

    eng.runner.execute = hooked


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_on_last_step_is_abort_not_length(tiny, async_scheduling):
    eng = engine(tiny, async_scheduling=async_scheduling)
    a = eng.add_request("a", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True, **GREEDY))
    abort_during_forward(eng, a, on_step=2)  # step 0 prefill, 1 and 2 decode: 2 is the last
    res = drain(eng)[("a", 0)]
    (term,) = res["terminal"]
    assert term.finish_reason is FinishReason.ABORT
    assert term.stop_detail == "cancel"
    assert eng.lifecycle.stats.tokens_after_abort == 1
    assert term.usage.completion_tokens == len(res["tokens"])
    assert term.usage.completion_tokens + term.usage.undelivered_tokens == 3
    if not async_scheduling:
        # the token computed by the aborted step is not delivered
        assert len(res["tokens"]) == 2 and term.usage.undelivered_tokens == 1
    assert res["tokens"] == solo(tiny, PROMPT, SamplingParams(max_tokens=3, ignore_eos=True, **GREEDY))[: len(res["tokens"])]


def test_abort_between_forward_and_processing_releases_through_fence(tiny):
    eng = engine(tiny)
    a = eng.add_request("a", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True, **GREEDY))
    eng.add_request("b", PROMPT[:4], SamplingParams(max_tokens=5, ignore_eos=True, **GREEDY))
    abort_during_forward(eng, a, on_step=3)
    res = drain(eng)
    assert res[("a", 0)]["terminal"][0].finish_reason is FinishReason.ABORT
    assert eng.lifecycle.stats.aborts[("cancel", "running")] == 1  # a decode, not a prefill
    assert len(res[("a", 0)]["tokens"]) == 3
    # reclaimed when the step that could write its blocks was processed: the same step
    assert eng.lifecycle.stats.abort_to_reclaim_steps.counts[:3] == [0, 1, 0]  # 1 step, once
    assert eng.lifecycle.stats.abort_to_quiet_steps.counts[:3] == [0, 1, 0]
    assert res[("b", 0)]["tokens"] == solo(tiny, PROMPT[:4], SamplingParams(max_tokens=5, ignore_eos=True, **GREEDY))


def test_abort_waiting_unknown_twice(tiny):
    eng = engine(tiny)
    w = eng.add_request("w", PROMPT, SamplingParams(max_tokens=4, **GREEDY))
    eng.abort([w], AbortSource.CANCEL, time.monotonic())
    eng.abort([w], AbortSource.CANCEL, time.monotonic())
    eng.abort(["nobody"], AbortSource.CANCEL, time.monotonic())
    outs = eng.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("w", True, FinishReason.ABORT)]
    assert outs[0].new_token_ids == [] and outs[0].usage.completion_tokens == 0
    assert eng.steps == 1 and not eng.has_unfinished()
    assert eng.lifecycle.stats.aborts[("cancel", "waiting")] == 1
    assert eng.lifecycle.stats.abort_to_quiet_steps.counts[:2] == [1, 0]  # 0 steps, once
    eng.abort([w], AbortSource.CANCEL, time.monotonic())  # already finished: no-op, no second terminal output
    assert eng.step() == []


def test_abort_mid_chunked_prefill_stops_at_chunk_boundary(tiny):
    eng = engine(tiny, max_num_batched_tokens=8)
    long_prompt = list(range(3, 3 + 60))
    inc = eng.add_request("long", long_prompt, SamplingParams(max_tokens=4, **GREEDY))
    eng.step()
    req = eng.families.get(inc).members[0]
    assert 0 < eng.kv_manager.computed(req) < len(long_prompt)  # mid-prefill
    assert eng.kv_manager.computed(req) == 8
    eng.abort([inc], AbortSource.CANCEL, time.monotonic())
    outs = eng.step()
    assert outs[0].finish_reason is FinishReason.ABORT
    assert eng.lifecycle.stats.aborts[("cancel", "prefilling")] == 1
    # Its KV state went with it; quiet at once: it took part in no other chunk.
    assert not eng.kv_manager.holds(req)
    assert eng.lifecycle.stats.abort_to_quiet_steps.counts[:2] == [1, 0], \
        "the aborted request took part in another chunk"
    assert eng.pool.num_used == 0
    assert eng.pool.num_cached == 2  # its computed full blocks stay in the prefix cache


def test_cancelled_prefix_not_kept_when_disabled(tiny):
    eng = engine(tiny, max_num_batched_tokens=8, keep_aborted_prefix=False)
    inc = eng.add_request("long", list(range(3, 63)), SamplingParams(max_tokens=4, **GREEDY))
    eng.step()
    eng.abort([inc], AbortSource.CANCEL, time.monotonic())
    eng.step()
    assert eng.pool.num_cached == 0 and eng.pool.num_used == 0


def test_layer_boundary_interrupt_and_next_step_unaffected(tiny):
    eng = engine(tiny, max_num_batched_tokens=256)
    x = eng.add_request("x", PROMPT * 3, SamplingParams(max_tokens=8, **GREEDY))
    y = eng.add_request("y", PROMPT[:5], SamplingParams(max_tokens=8, **GREEDY))
    calls = {"n": 0}
    projections = [layer["o"] for layer in eng.model.layers]

    def hooked(proj):  # the attention's output projection: once in each layer, either backend
        def run(*args):
            calls["n"] += 1
            if calls["n"] == 1:
                eng.abort([x, y], AbortSource.CANCEL, time.monotonic())  # every request of the step in flight: stop at next layer
            return proj(*args)
        return run

    for layer, proj in zip(eng.model.layers, projections, strict=True):
        layer["o"] = hooked(proj)
    res = drain(eng)
    assert len(eng.model.layers) > 1
    assert eng.interrupted_steps == 1
    assert calls["n"] == 1, "the forward went past the next layer boundary"
    assert {k: v["terminal"][0].finish_reason for k, v in res.items()} == {
        ("x", 0): FinishReason.ABORT, ("y", 0): FinishReason.ABORT}
    for layer, proj in zip(eng.model.layers, projections, strict=True):
        layer["o"] = proj
    # The interrupted step wrote into the aborted requests' blocks (released, poisoned in debug
    # mode); a new request with the same prompt must not see any of it.
    params = SamplingParams(max_tokens=8, **GREEDY)
    eng.add_request("z", PROMPT * 3, params)
    assert drain(eng)[("z", 0)]["tokens"] == solo(tiny, PROMPT * 3, params)


def test_family_abort_and_id_reuse(tiny):
    eng = engine(tiny)
    params = SamplingParams(n=3, max_tokens=30, ignore_eos=True, temperature=1.0, seed=1)
    fam = eng.add_request("fam", PROMPT, params)
    with pytest.raises(InvalidRequest, match="already in use"):
        eng.add_request("fam", PROMPT, params, incarnation=fam)  # an incarnation is unique
    res = {}
    for _ in range(4):
        collect(eng.step(), res)
    members = eng.families.get(fam).members
    kv = eng.kv_manager
    shared = set(kv.table(members[0])[: len(PROMPT) // 4])
    assert all(shared <= set(kv.table(m)) for m in members)  # prompt blocks shared
    assert all(eng.pool.refcount[b] == 3 for b in shared)
    eng.abort([fam], AbortSource.CANCEL, time.monotonic())
    collect(eng.step(), res)
    assert sorted(k[1] for k in res) == [0, 1, 2]
    assert all(len(v["terminal"]) == 1 and v["terminal"][0].finish_reason is FinishReason.ABORT
               for v in res.values())
    assert eng.families.find("fam") is None and eng.pool.num_used == 0
    eng.add_request("fam", PROMPT, SamplingParams(max_tokens=2, **GREEDY))  # id reusable
    assert drain(eng)[("fam", 0)]["terminal"][0].finish_reason is FinishReason.LENGTH


def test_family_abort_before_fork(tiny):
    eng = engine(tiny, max_num_batched_tokens=4)
    fam = eng.add_request("fam", list(range(3, 23)), SamplingParams(n=2, max_tokens=5, **GREEDY))
    eng.step()
    assert eng.families.get(fam).members[1].fork_leader is not None
    eng.abort([fam], AbortSource.CANCEL, time.monotonic())
    res = drain(eng)
    assert len(res) == 2 and all(v["terminal"][0].finish_reason is FinishReason.ABORT for v in res.values())


def test_abort_while_swapped_frees_swap_space(tiny):
    eng = engine(tiny, num_blocks=12, preemption_mode="swap", max_preemptions=100)
    for i in range(4):
        eng.add_request(f"r{i}", PROMPT, SamplingParams(max_tokens=20, ignore_eos=True, **GREEDY))
    swapped = None
    res = {}
    for _ in range(200):
        collect(eng.step(), res)
        swapped = next((r for r in eng.live_requests() if r.status is RequestStatus.SWAPPED), None)
        if swapped:
            break
    assert swapped is not None, "the pool never forced a swap"
    assert eng.kv_manager.swap.num_used > 0
    eng.abort([swapped.incarnation], AbortSource.CANCEL, time.monotonic())
    collect(eng.step(), res)
    assert swapped.status is RequestStatus.FINISHED
    assert eng.lifecycle.stats.aborts[("cancel", "swapped")] == 1
    res = collect([], res)
    drain(eng)
    assert eng.kv_manager.swap.num_used == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_resumes_exactly_with_penalties_logprobs_seed(tiny, mode):
    params = [
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=i, logprobs=2,
                       repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3)
        for i in range(6)
    ]
    def run(**kw):
        eng = engine(tiny, **kw)
        for i, p in enumerate(params):
            eng.add_request(f"r{i}", PROMPT[: 4 + i], p)
        res = {}
        while eng.has_unfinished():
            for o in eng.step():
                r = res.setdefault(o.request_id, {"tokens": [], "lp": []})
                r["tokens"] += o.new_token_ids
                r["lp"] += [(x.token_id, round(x.logprob, 5), [t for t, _ in x.top]) for x in o.new_logprobs]
        return res, eng
    free, _ = run()
    tight, eng = run(num_blocks=14, preemption_mode=mode, max_preemptions=100)
    assert sum(eng.lifecycle.stats.preemptions.values()) > 0
    assert tight == free


def test_too_many_preemptions_ends_with_preempted(tiny):
    eng = engine(tiny, num_blocks=10, max_preemptions=0, admission_lookahead=0)
    for i in range(3):
        eng.add_request(f"r{i}", PROMPT, SamplingParams(max_tokens=20, ignore_eos=True, **GREEDY))
    res = drain(eng)
    reasons = {k[0]: v["terminal"][0] for k, v in res.items()}
    preempted = [o for o in reasons.values() if o.finish_reason is FinishReason.PREEMPTED]
    assert preempted and "preempted" in preempted[0].stop_detail
    assert any(o.finish_reason is FinishReason.LENGTH for o in reasons.values())


def test_request_outgrowing_the_pool_ends_cleanly(tiny):
    eng = engine(tiny, num_blocks=4)
    eng.add_request("big", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY))
    (res,) = drain(eng).values()
    (term,) = res["terminal"]
    assert term.finish_reason is FinishReason.LENGTH and "cannot hold" in term.stop_detail
    # 16 slots hold positions 0..15; the token sampled from position 15 needs no slot.
    assert len(res["tokens"]) == 16 - len(PROMPT) + 1


def test_deadline_and_queue_timeout(tiny):
    eng = engine(tiny, max_num_seqs=1)
    eng.add_request("slow", PROMPT, SamplingParams(max_tokens=10_000 // 100, ignore_eos=True, deadline=0.05, **GREEDY))
    eng.add_request("queued", PROMPT, SamplingParams(max_tokens=2, queue_timeout=0.01, **GREEDY))
    import time
    time.sleep(0.02)
    res = drain(eng)
    assert res[("queued", 0)]["terminal"][0].finish_reason is FinishReason.TIMEOUT
    assert res[("queued", 0)]["terminal"][0].stop_detail == "deadline"
    slow = res[("slow", 0)]["terminal"][0]
    assert slow.finish_reason in (FinishReason.TIMEOUT, FinishReason.LENGTH)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_or_infinite_logits_fail_one_request_only(tiny, bad, temperature):
    """A NaN or +inf anywhere in a row, or a row all -inf, has no token to draw (the C race
    drew token 0 from a row with +inf): that request ends with an error, the other runs on."""
    eng = engine(tiny)
    forward = eng.model.forward
    eng.add_request("bad", PROMPT, SamplingParams(max_tokens=6, ignore_eos=True, temperature=temperature, seed=1))
    eng.add_request("good", PROMPT[:6], SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY))

    def poisoned(inp, kv, interrupt=None, decode_rows=None):
        logits = forward(inp, kv, interrupt, decode_rows)
        if bad == float("-inf"):
            logits[0] = bad  # the first sampling row belongs to "bad"
        else:
            logits[0, 7] = bad
        return logits

    eng.model.forward = poisoned
    res = collect(eng.step(), {})
    eng.model.forward = forward
    while eng.has_unfinished():
        collect(eng.step(), res)
    assert res[("bad", 0)]["terminal"][0].finish_reason is FinishReason.ERROR
    assert res[("bad", 0)]["terminal"][0].stop_detail == "the model produced NaN or infinite logits"
    assert res[("bad", 0)]["tokens"] == []
    assert res[("good", 0)]["tokens"] == solo(tiny, PROMPT[:6], SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY))


def test_engine_wide_failure_ends_every_request(tiny):
    eng = engine(tiny)
    for i in range(3):
        eng.add_request(f"r{i}", PROMPT, SamplingParams(max_tokens=6, **GREEDY))
    eng.runner.execute = lambda plan, interrupt=None: (_ for _ in ()).throw(RuntimeError("boom"))
    res = drain(eng)
    assert len(res) == 3
    assert all(v["terminal"][0].finish_reason is FinishReason.ERROR and "boom" in v["terminal"][0].stop_detail
               for v in res.values())


def test_stop_check_exception_fails_only_its_request(tiny):
    eng = engine(tiny)
    eng.add_request("bad", PROMPT, SamplingParams(max_tokens=4, **GREEDY))
    eng.add_request("good", PROMPT[:6], SamplingParams(max_tokens=4, **GREEDY))
    check = eng.outputs.append

    def flaky(req, token, logprob):
        if req.request_id == "bad":
            raise RuntimeError("stop check exploded")
        return check(req, token, logprob)

    eng.outputs.append = flaky
    res = drain(eng)
    assert res[("bad", 0)]["terminal"][0].finish_reason is FinishReason.ERROR
    assert res[("good", 0)]["terminal"][0].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


def _req(kv, arrival, computed, out, prompt=8, priority=0, blocks=()):
    r = Request("x", list(range(prompt)), SamplingParams(priority=priority), arrival=arrival)
    r.output_token_ids = list(range(out))
    kv.seqs[r] = SeqKV(block_ids=list(blocks), computed=computed)  # as if admitted so
    kv.pool.touch(blocks)
    return r


def test_victim_policies():
    refc = KVManager(BlockPool(32, 4), None, None, StopStats())
    a = _req(refc, 1.0, computed=40, out=30, prompt=10, blocks=range(0, 10))
    b = _req(refc, 2.0, computed=12, out=2, prompt=10, blocks=range(10, 13), priority=5)
    c = _req(refc, 3.0, computed=20, out=2, prompt=18, blocks=range(13, 18))
    assert pick_victim(VictimPolicy.NEWEST, [a, b, c], 1, refc) is c
    assert pick_victim(VictimPolicy.FEWEST_OUTPUT, [a, b, c], 1, refc) is c  # tie on outputs: longest prompt
    assert pick_victim(VictimPolicy.LONGEST_OUTPUT, [a, b, c], 1, refc) is a
    assert pick_victim(VictimPolicy.LEAST_COMPUTED, [a, b, c], 1, refc) is b
    assert pick_victim(VictimPolicy.PRIORITY, [a, b, c], 1, refc) is b
    # cost: b frees 3 blocks for 12 tokens of work, enough for a deficit of 3
    assert pick_victim(VictimPolicy.COST, [a, b, c], 3, refc) is b
    # a deficit of 6: only a covers it alone
    assert pick_victim(VictimPolicy.COST, [a, b, c], 6, refc) is a
    assert pick_victim(VictimPolicy.COST, [], 1, refc) is None


def test_debug_mode_poisons_freed_blocks(tiny):
    eng = engine(tiny, enable_prefix_caching=False)
    eng.add_request("a", PROMPT, SamplingParams(max_tokens=2, **GREEDY))
    drain(eng)
    assert torch.isnan(eng.kv.k[0]).any(), "freed blocks were not poisoned"


def test_prefill_budget_shrinks_beside_decodes(tiny):
    """Interruptible steps, lever 1: with decodes running, a long prompt's chunk is capped so the
    decodes' step time stays short; alone, it gets the whole budget."""
    eng = engine(tiny, max_num_batched_tokens=64)
    short = eng.add_request("short", PROMPT[:3], SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY))
    eng.step()  # "short" is decoding from now on
    eng.scheduler.prefill_cap = 8
    eng.add_request("long", list(range(3, 63)), SamplingParams(max_tokens=2, **GREEDY))
    eng.step()
    long_req = eng.families.find("long").members[0]
    assert eng.kv_manager.computed(long_req) == 8
    eng.abort([short], AbortSource.CANCEL, time.monotonic())
    eng.step()  # the abort frees the step of decodes: the cap no longer applies
    assert eng.kv_manager.computed(long_req) == 8 + 52
    drain(eng)


def test_prefill_cap_recovers_after_one_slow_step(tiny):
    """One slow step (a hiccup of the host) must not pin the cap at its floor: the estimate
    keeps learning from the small chunks the cap allows."""
    eng = engine(tiny, max_num_batched_tokens=256, target_step_ms=50.0, num_blocks=256)
    eng.add_request("d", PROMPT[:3], SamplingParams(max_tokens=60, ignore_eos=True, **GREEDY))
    eng.step()  # "d" decodes from now on
    eng.scheduler.ms_per_prefill_token = 1e4  # as if a step had taken seconds
    eng.add_request("long", list(range(3, 250)), SamplingParams(max_tokens=2, **GREEDY))
    caps = []
    for _ in range(30):
        eng.step()
        caps.append(eng.scheduler.prefill_cap)
    assert caps[0] == eng.config.block_size  # pinned at the floor by the slow step
    assert eng.scheduler.ms_per_prefill_token < 100 and caps[-1] > eng.config.block_size
    drain(eng)


def test_prefill_cap_follows_measured_cost(tiny):
    eng = engine(tiny, max_num_batched_tokens=256, target_step_ms=50.0)
    eng.add_request("a", list(range(3, 200)), SamplingParams(max_tokens=2, **GREEDY))
    drain(eng)
    assert eng.scheduler.ms_per_prefill_token is not None
    eng.add_request("b", PROMPT, SamplingParams(max_tokens=2, **GREEDY))
    eng.step()
    expected = max(eng.config.block_size, int(50.0 / eng.scheduler.ms_per_prefill_token))
    assert eng.scheduler.prefill_cap == expected
    drain(eng)
