"""The stop path with the features users combine: each test is one bug of the old stop path
(issue: "The stop path holds for every per-request resource"), and fails on the code before
the KV manager, the release over holders and incarnations."""

from __future__ import annotations

import asyncio
import time

import pytest

from stopline.config import EngineConfig
from stopline.engine import inbox as inbox_mod
from stopline.engine.async_engine import AsyncEngine
from stopline.engine.core import EngineCore
from stopline.model.loaders.loader import load_model
from stopline.request import (
    AbortSource,
    FinishReason,
    InvalidRequest,
    RequestStatus,
    SamplingParams,
)
from tests.scripted import scripted_engine
from tests.test_stop_targeted import collect, drain
from tests.tiny_model import make_tiny_llama_dir

GREEDY = dict(temperature=0.0)
PROMPT = [5, 17, 99, 23, 42, 7, 300, 12, 9, 81]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_llama_dir(tmp_path_factory.mktemp("bugs") / "tiny", seed=3, init_std=0.1,
                               vocab_size=384)
    return load_model(str(path), progress=False)


def engine(tiny, **kw) -> EngineCore:
    cfg = dict(num_blocks=64, block_size=4, max_num_seqs=16, max_num_batched_tokens=64,
               debug=True, target_step_ms=None)
    cfg.update(kw)
    return EngineCore(tiny, EngineConfig(**cfg))


def solo(tiny, prompt, params, **kw) -> dict:
    eng = engine(tiny, **kw)
    eng.add_request("solo", prompt, params)
    return drain(eng)[("solo", 0)]


def text_of(tiny, tokens) -> str:
    return tiny.tokenizer.decode(tokens)


def test_async_stop_string_ends_only_its_own_request(tiny):
    """Bug 1: the text phase finished a request on a stop string while the worker thread
    prepared the next step from its (emptied) block table; the IndexError failed the whole
    step, and the innocent request beside it ended `error`."""
    free = SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY)
    ref = solo(tiny, PROMPT, free)
    text = text_of(tiny, ref["tokens"])
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), f"no usable stop string in {text!r}"
    stopped = SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop], **GREEDY)
    want_stop = solo(tiny, PROMPT, stopped)
    innocent = SamplingParams(max_tokens=20, ignore_eos=True, **GREEDY)
    want_innocent = solo(tiny, PROMPT[:6], innocent)
    eng = engine(tiny, async_scheduling=True)
    eng.add_request("s", PROMPT, stopped)
    eng.add_request("i", PROMPT[:6], innocent)
    res = drain(eng)
    assert res[("i", 0)]["terminal"][0].finish_reason is FinishReason.LENGTH
    assert res[("i", 0)]["tokens"] == want_innocent["tokens"]
    term = res[("s", 0)]["terminal"][0]
    assert term.finish_reason is FinishReason.STOP and term.stop_detail == stop
    assert res[("s", 0)]["tokens"] == want_stop["tokens"]


def test_queue_timeout_applies_to_a_family_as_a_whole(tiny):
    """Bug 2: only the first sample is scheduled before the fork, so the others never got
    first_scheduled; a chunked prefill longer than queue_timeout ended them `timeout`
    while the first sample ended `length`."""
    eng = engine(tiny, max_num_batched_tokens=4)
    params = SamplingParams(n=3, max_tokens=3, ignore_eos=True, queue_timeout=0.05, **GREEDY)
    eng.add_request("fam", list(range(3, 43)), params)  # 40 prompt tokens: 10 chunks
    res = collect(eng.step(), {})  # the first chunk: the family left the queue in time
    time.sleep(0.1)  # the prefill outlasts the queue timeout
    res = collect(eng.step(), res)
    while eng.has_unfinished():
        collect(eng.step(), res)
    reasons = {res[("fam", i)]["terminal"][0].finish_reason for i in range(3)}
    assert reasons == {FinishReason.LENGTH}


def test_a_late_abort_does_not_touch_a_newer_request_with_the_same_id(tiny):
    """Bug 4: adds were registered before aborts, and aborts named caller ids, so a cancel
    that raced X's natural finish aborted the X resubmitted right after."""
    eng = scripted_engine(tiny)
    old = eng.add_request("X", PROMPT, SamplingParams(max_tokens=2, **GREEDY))
    res = drain(eng)
    assert res[("X", 0)]["terminal"][0].finish_reason is FinishReason.LENGTH
    eng.abort([old], AbortSource.CANCEL, time.monotonic())  # the client's cancel arrives after the natural finish...
    new = eng.add_request("X", PROMPT, SamplingParams(max_tokens=3, **GREEDY))  # ...and it resubmits
    assert new != old
    res = drain(eng)
    assert res[("X", 0)]["terminal"][0].finish_reason is FinishReason.LENGTH
    assert len(res[("X", 0)]["tokens"]) == 3


def test_an_early_abort_waits_for_its_own_add_only_and_expires_by_age(tiny, monkeypatch):
    """Bug 5: an abort that overtook the add of a reused id was dropped when a step ran
    between them, and stale ones expired only past 64 entries (so one could abort a later
    request with that id)."""
    eng = scripted_engine(tiny)
    eng.abort(["X#late"], AbortSource.DISCONNECT, time.monotonic())  # overtakes its add (another socket)
    eng.add_request("busy", PROMPT, SamplingParams(max_tokens=3, **GREEDY))
    eng.step()
    eng.step()  # steps run between the abort and its add: it is kept
    eng.add_request("X", PROMPT, SamplingParams(max_tokens=30, **GREEDY))  # another incarnation
    eng.add_request("X", PROMPT, SamplingParams(max_tokens=30, **GREEDY), incarnation="X#late")
    res = drain(eng)
    finals = [o for o in res[("X", 0)]["terminal"]]
    assert sorted(o.finish_reason.value for o in finals) == ["abort", "length"]
    (aborted,) = [o for o in finals if o.finish_reason is FinishReason.ABORT]
    assert aborted.incarnation == "X#late" and aborted.stop_detail == "disconnect"
    assert eng.inbox.num_early == 0
    # Expiry by age: an abort kept past the TTL no longer touches its incarnation.
    monkeypatch.setattr(inbox_mod, "EARLY_TTL", 0.01)
    eng.abort(["Y#1"], AbortSource.CANCEL, time.monotonic())
    eng.step()
    time.sleep(0.05)
    eng.add_request("Y", PROMPT, SamplingParams(max_tokens=2, **GREEDY), incarnation="Y#1")
    res = drain(eng)
    assert res[("Y", 0)]["terminal"][0].finish_reason is FinishReason.LENGTH


def test_an_early_abort_ages_from_when_it_was_asked(tiny, monkeypatch):
    """An abort kept for an incarnation not added yet ages from its t0 (when it was asked),
    not from when the core took it; and kept aborts expire by age in any order of arrival."""
    monkeypatch.setattr(inbox_mod, "EARLY_TTL", 5.0)
    eng = scripted_engine(tiny)
    now = time.monotonic()
    eng.abort(["old#1"], AbortSource.CANCEL, now - 10.0)  # asked 10 s ago: past the TTL
    eng.abort(["new#1"], AbortSource.CANCEL, now)
    eng.abort(["older#1"], AbortSource.CANCEL, now - 20.0)  # arrives last, oldest of all
    eng.step()
    assert eng.inbox.num_early == 1  # only the fresh one is kept
    for rid in ("old", "new", "older"):
        eng.add_request(rid, PROMPT, SamplingParams(max_tokens=2, **GREEDY), incarnation=f"{rid}#1")
    res = drain(eng)
    assert res[("old", 0)]["terminal"][0].finish_reason is FinishReason.LENGTH
    assert res[("older", 0)]["terminal"][0].finish_reason is FinishReason.LENGTH
    assert res[("new", 0)]["terminal"][0].finish_reason is FinishReason.ABORT
    assert eng.inbox.num_early == 0


def test_async_preempted_while_its_text_is_pending_stops_where_it_would_have(tiny):
    """Bug 6: a request preempted while its text phase was pending got its stop-string check
    only after it resumed, and delivered one token an unpreempted run would not."""
    free = SamplingParams(max_tokens=16, ignore_eos=True, **GREEDY)
    text = text_of(tiny, solo(tiny, PROMPT, free)["tokens"])
    stop = text[len(text) // 2: len(text) // 2 + 2]
    params = SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop], logprobs=0, **GREEDY)
    want = solo(tiny, PROMPT, params)
    eng = engine(tiny, async_scheduling=True, debug=False)  # the test holds blocks itself
    inc = eng.add_request("p", PROMPT, params)
    schedule = eng.scheduler.schedule
    preempted: list[int] = []
    held: list[int] = []

    def preempt_while_text_pending():
        if held:  # the pool pressure passes: it resumes
            eng.pool.release(held)
            held.clear()
        fam = eng.families.get(inc)
        req = fam.members[0] if fam else None
        # Preempted right when the token that completes the stop string waits for its text,
        # and kept out by a full pool for a step.
        if (req is not None and not preempted and req in eng._text_pending
                and len(req.output_token_ids) == len(want["tokens"])
                and req.status is RequestStatus.RUNNING):
            eng.lifecycle.preempt(req)
            held.extend(eng.pool.allocate(eng.pool.num_available))
            preempted.append(len(req.output_token_ids))
        return schedule()

    eng.scheduler.schedule = preempt_while_text_pending
    res: dict = {}
    while eng.has_unfinished():
        collect(eng.step(), res)
    eng.pool.release(held)
    eng.audit()
    assert preempted, "the request was never preempted with its text pending"
    got = res[("p", 0)]
    term = got["terminal"][0]
    assert term.finish_reason is FinishReason.STOP and term.stop_detail == stop
    assert got["tokens"] == want["tokens"]
    assert term.usage.completion_tokens == want["terminal"][0].usage.completion_tokens


def test_async_step_failure_waits_for_the_forward_before_freeing(tiny):
    """Bug 7: the async step's error handler did not wait for the worker's forward, so the
    fenced blocks of the failed requests went back to the pool (to be handed out or swapped
    into) while that forward still wrote them."""
    eng = scripted_engine(tiny, async_scheduling=True)
    freed_mid_forward = []

    def slow_forward(plan):
        time.sleep(0.2)  # the text phase fails meanwhile, on the engine's thread
        freed_mid_forward.extend(b for ch in plan.chunks for b in ch.block_ids
                                 if eng.pool.refcount[b] == 0)

    def failing_sink(outputs):
        raise RuntimeError("the frontend's queue broke")

    eng.runner.before = slow_forward
    eng.add_request("a", PROMPT, SamplingParams(max_tokens=8, **GREEDY))
    eng.step()  # prefill; its token's text phase runs during the next forward
    eng.output_sink = failing_sink
    res = collect(eng.step(), {})
    eng._worker.submit(lambda: None).result()  # the forward's check has run
    assert res[("a", 0)]["terminal"][0].finish_reason is FinishReason.ERROR
    assert freed_mid_forward == [], "blocks were freed while the forward could still write them"
    eng.audit()
    assert eng.pool.num_used == 0


def test_max_num_seqs_counts_every_sample(tiny):
    """Also found: max_num_seqs counted a family as one request (4 running with a limit of 2)."""
    eng = scripted_engine(tiny, max_num_seqs=2)
    eng.add_request("f", PROMPT, SamplingParams(n=2, max_tokens=4, **GREEDY))
    eng.add_request("g", PROMPT[:4], SamplingParams(n=2, max_tokens=4, **GREEDY))
    most = 0
    while eng.has_unfinished():
        eng.step()
        most = max(most, len(eng.queues.running))
    assert most == 2
    with pytest.raises(InvalidRequest, match="max_num_seqs"):
        eng.add_request("h", PROMPT, SamplingParams(n=3, **GREEDY))


def test_two_live_requests_may_share_a_caller_id(tiny):
    """Incarnations, not caller ids, name requests: aborting one leaves the other alone."""
    eng = scripted_engine(tiny)
    a = eng.add_request("same", PROMPT, SamplingParams(max_tokens=6, **GREEDY))
    b = eng.add_request("same", PROMPT[:5], SamplingParams(max_tokens=6, **GREEDY))
    eng.step()
    eng.abort([a], AbortSource.CANCEL, time.monotonic())
    outs: dict = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.incarnation, []).append(o)
    assert outs[a][-1].finish_reason is FinishReason.ABORT
    assert outs[b][-1].finish_reason is FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in outs[b]) == 5  # one came with the first step


def test_a_stream_nobody_reads_pauses_its_request_and_stalls_out(tiny_model_dir):
    """Backpressure: a stream whose client stops reading buffers a bounded number of
    outputs; its request then takes no step (the others run on); reading resumes it; a
    client that reads nothing for the stall timeout is treated as gone."""
    async def run() -> None:
        engine = AsyncEngine.in_process(str(tiny_model_dir), EngineConfig(
            num_blocks=128, block_size=4, max_num_seqs=8, target_step_ms=None, debug=True),
            progress=False, max_buffered=4, stall_timeout=30.0)
        await engine.start()
        prompt = engine.tokenizer.encode("hello there")
        long = SamplingParams(max_tokens=60, ignore_eos=True, **GREEDY)
        try:
            idle = await engine.add("idle", prompt, long, incarnation="idle")
            other = await engine.add("other", prompt, SamplingParams(max_tokens=40, ignore_eos=True,
                                                                      **GREEDY), incarnation="other")
            others = [o async for o in other]  # runs to the end while "idle" is not read
            assert others[-1].finish_reason is FinishReason.LENGTH
            # Bounded, not exact: the pause travels from the event loop to the core as a
            # message, and on a fast host the core's thread takes a few ~1 ms steps before the
            # loop (busy reading "other") sends it; unbounded would be all 60.
            assert idle.full and idle._queue.qsize() <= 4 * 3, "the unread stream kept growing"
            n_buffered = idle._queue.qsize()
            await asyncio.sleep(0.1)
            assert idle._queue.qsize() == n_buffered, "a paused request took steps"
            got = []
            async for o in idle:  # reading resumes it, to the end
                got += o.new_token_ids
                if o.finished:
                    assert o.finish_reason is FinishReason.LENGTH
            assert len(got) == 60

            engine.stall_timeout = 0.3
            stalled = await engine.add("stalled", prompt, long, incarnation="stalled")
            await asyncio.wait_for(stalled.done, 5)  # nobody reads: aborted after 0.3 s
            assert stalled.finish_reasons == [FinishReason.ABORT]
            snap = await engine.utility("snapshot")
            assert any(src == "stalled" for src, _, _ in snap.aborts)
            assert await engine.utility("audit") is None
        finally:
            await engine.close()

    asyncio.run(run())
