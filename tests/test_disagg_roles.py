"""The prefill and decode roles in one process, stepped by hand over a real loopback link:
each abort ordering (before the transfer, during it, after it), the reclaim deadline on both
sides, exactness against one engine, and the epoch guard on a late transfer."""

from __future__ import annotations

import time

import pytest

from stopline.disagg.epochs import StaleBlock
from stopline.disagg.messages import Ack
from stopline.engine.core import EngineCore
from stopline.model.loaders.loader import load_model
from stopline.request import AbortSource, FinishReason, SamplingParams
from tests.disagg_support import make_pair
from tests.engine_support import drive, greedy, random_prompts


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture
def pair(loaded):
    pr = make_pair(loaded)
    yield pr
    pr.close()


def _until_sent(pair) -> None:
    """Step the prefill side alone until it has pushed the KV: the decode side has not
    looked at it yet."""
    for _ in range(100):
        if len(pair.p.role.sending):
            return
        pair.step_p()
    raise AssertionError("the prefill side never shipped the KV")


def _single(loaded, reqs):
    from tests.disagg_support import config

    return drive(EngineCore(loaded, config()), reqs)


def test_greedy_and_seeded_output_equal_one_engine(loaded, pair):
    prompts = random_prompts(4, [3, 9, 17, 26], seed=3)
    reqs = [(f"g{i}", p, greedy(8)) for i, p in enumerate(prompts)]
    reqs += [(f"s{i}", p, SamplingParams(temperature=0.9, top_p=0.9, seed=7 + i, max_tokens=8))
             for i, p in enumerate(prompts)]
    want = _single(loaded, reqs)
    for rid, prompt, params in reqs:
        pair.add(rid, prompt, params)
    pair.settle()
    pair.assert_idle()
    assert pair.d.role.imported_blocks == sum((len(p) - 1) // 4 for p in prompts) * 2  # KV really moved
    for key, r in want.items():
        assert pair.out[key].token_ids == r.token_ids, key
        assert pair.out[key].finish_reason is r.finish_reason
    # The prefill side ended each split request by handing it off, never with a client output.
    assert all(o.finished and o.stop_detail.startswith("handed off") for o in pair.p_out)


def test_abort_before_the_transfer_reaches_prefill_at_a_chunk_boundary(pair):
    inc = pair.add("a", list(range(5, 45)), greedy(4))  # 40 tokens: 5 chunks of 8
    pair.step_p()
    pair.step_d()
    assert not pair.p.live_requests()[0].status.is_finished
    pair.abort(inc)
    pair.step_p()  # the next step start applies it: no further chunk
    assert not pair.p.live_requests()
    assert pair.p.role.sending.requests() == []
    pair.settle()
    pair.assert_idle()
    assert pair.out[("a", 0)].finish_reason is FinishReason.ABORT
    assert pair.out[("a", 0)].token_ids == []


def test_abort_during_the_transfer_refuses_the_late_kv(pair):
    inc = pair.add("a", list(range(5, 30)), greedy(4))
    _until_sent(pair)  # KV pushed, the decode side has not stepped since
    pair.d.abort([inc], AbortSource.CANCEL, time.monotonic())  # decode side first; its KV arrives after
    pair.settle(until=lambda pr: not pr.d.has_unfinished())
    # The decode side refused the late KV (nothing written, no block taken) ...
    assert pair.d.role.imported_blocks == 0
    pair.p.abort([inc], AbortSource.CANCEL, time.monotonic())
    pair.settle()
    pair.assert_idle()
    assert pair.out[("a", 0)].finish_reason is FinishReason.ABORT
    assert pair.out[("a", 0)].token_ids == []


def test_abort_during_the_transfer_prefill_first(pair):
    inc = pair.add("a", list(range(5, 30)), greedy(4))
    _until_sent(pair)
    pair.p.abort([inc], AbortSource.CANCEL, time.monotonic())
    pair.step_p()
    assert not len(pair.p.role.sending) and pair.p.pool.num_used == 0  # released at once
    pair.d.abort([inc], AbortSource.CANCEL, time.monotonic())
    pair.settle()
    pair.assert_idle()
    assert pair.out[("a", 0)].finish_reason is FinishReason.ABORT


def test_abort_after_the_transfer_ends_on_decode_only(pair):
    inc = pair.add("a", list(range(5, 30)), greedy(50))
    pair.settle(until=lambda pr: ("a", 0) in pr.out and len(pr.out[("a", 0)].token_ids) >= 2
                and not pr.p.has_unfinished())
    assert pair.p.pool.num_used == 0  # acked: prefill holds nothing while decode runs
    pair.abort(inc)
    pair.settle()
    pair.assert_idle()
    r = pair.out[("a", 0)]
    assert r.finish_reason is FinishReason.ABORT and 2 <= len(r.token_ids) < 50


def test_a_reused_request_id_is_not_hit_by_a_late_abort(pair):
    old = pair.add("same", list(range(5, 30)), greedy(3))
    pair.abort(old)
    pair.settle()
    assert pair.out.pop(("same", 0)).finish_reason is FinishReason.ABORT
    pair.add("same", list(range(5, 30)), greedy(3))
    pair.abort(old)  # late, names the old incarnation
    pair.settle()
    pair.assert_idle()
    assert pair.out[("same", 0)].finish_reason is FinishReason.LENGTH  # the new one's result


def test_send_side_reclaims_when_the_receiver_never_acks(loaded):
    pr = make_pair(loaded, reclaim_s=0.3)
    try:
        pr.p.add_request("a", list(range(5, 25)), SamplingParams(max_tokens=1))  # decode never hears
        t0 = time.monotonic()
        while not len(pr.p.role.sending):
            pr.step_p()
        assert pr.p.pool.num_used > 0
        while pr.p.has_unfinished():
            pr.step_p()
            assert time.monotonic() - t0 < 5
        err = [o for o in pr.p_out if o.finished]
        assert err[0].finish_reason is FinishReason.ERROR and "reclaim deadline" in err[0].stop_detail
        assert_back = pr.p.pool.num_used
        assert assert_back == 0
        pr.settle()  # the decode side refuses the orphan KV it got
        pr.assert_idle()
    finally:
        pr.close()


def test_kv_waiting_for_a_peer_goes_with_its_request(loaded, tmp_path):
    """A bound link with no peer yet keeps the KV frames it could not send (the local role of
    a remote split before the other has connected): the request's release drops them, so an
    aborted or reclaimed request leaves nothing on the link, and the audit would see if it did."""
    from stopline.disagg.messages import RoleSpec
    from stopline.disagg.prefill_core import PrefillCore
    from tests.disagg_support import config

    spec = RoleSpec("prefill", f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/ack", 0.3, bind_push=True)
    p = PrefillCore(loaded, config(), spec=spec, progress=False)
    try:
        for rid in ("a", "b"):
            p.add_request(rid, list(range(5, 25)), SamplingParams(max_tokens=1), incarnation=f"inc-{rid}")
        for _ in range(100):
            if len(p.role.sending) == 2:
                break
            p.step()
            p.audit()
        assert p.role.link.queued() == {"inc-a", "inc-b"}
        p.abort(["inc-a"], AbortSource.CANCEL, time.monotonic())
        p.step()
        p.audit()
        assert p.role.link.queued() == {"inc-b"}
        t0 = time.monotonic()
        while p.has_unfinished():  # b: nobody acks, the reclaim deadline ends it
            p.step()
            p.audit()
            assert time.monotonic() - t0 < 5
        assert p.role.link.queued() == set() and p.pool.num_used == 0
    finally:
        p.close()


def test_receive_side_reclaims_when_the_sender_goes_quiet(loaded):
    pr = make_pair(loaded, reclaim_s=0.3)
    try:
        pr.add("a", list(range(5, 45)), greedy(4))
        pr.step_p()  # one chunk; the heartbeat's Progress arms the decode side's clock
        pr.step_d()
        t = pr.d.role.receiving.get(pr.d.live_requests()[0])
        assert t is not None
        for _ in range(200):
            pr.step_d()
            if t.deadline != float("inf"):
                break
            time.sleep(0.005)
        assert t.deadline != float("inf")
        # The prefill side goes quiet: no step, no heartbeat (as a dead or cut-off process).
        pr.p.role._stop_beat.set()
        pr.p.role._beat_thread.join(2)
        t0 = time.monotonic()
        while pr.d.has_unfinished():
            pr.step_d()
            assert time.monotonic() - t0 < 5
        r = pr.out[("a", 0)]
        assert r.finish_reason is FinishReason.ERROR and "reclaim deadline" in r.stop_detail
        assert r.token_ids == []
        pr.settle()  # the prefill side ships, is refused, and errors its own copy
        pr.assert_idle()
        assert pr.p_out[-1].finish_reason is FinishReason.ERROR
    finally:
        pr.close()


def test_a_late_transfer_fails_on_block_epochs(pair):
    """The guard under the refusals: a ref taken before its block was freed and handed out
    again fails loudly, on either side, instead of reading or writing another request's KV."""
    pair.add("a", list(range(5, 30)), greedy(2))
    _until_sent(pair)
    req = pair.p.role.sending.requests()[0]
    refs = pair.p.role.sending.get(req).refs
    pair.p.abort([req.incarnation], AbortSource.CANCEL, time.monotonic())
    pair.step_p()
    pair.p.add_request("b", list(range(50, 80)), greedy(1))  # reuses the freed blocks
    pair.step_p()
    from stopline.disagg.wire import pack

    with pytest.raises(StaleBlock):
        pack(req.incarnation, pair.p.kv, pair.p.role.epochs, refs)
    pair.d.abort([req.incarnation], AbortSource.CANCEL, time.monotonic())
    pair.p.abort([pair.p.live_requests()[0].incarnation], AbortSource.CANCEL, time.monotonic())
    pair.settle()
    pair.assert_idle()


def test_a_refusing_ack_errors_the_prefill_copy(pair):
    inc = pair.add("a", list(range(5, 30)), greedy(2))
    _until_sent(pair)
    pair.d.role.link.send(Ack(inc, "test refusal"))  # as if the decode side had refused it
    pair.d.abort([inc], AbortSource.CANCEL, time.monotonic())
    pair.settle()
    pair.assert_idle()
    assert any(o.finish_reason is FinishReason.ERROR and "test refusal" in o.stop_detail for o in pair.p_out)


def test_a_sliding_window_split_ships_only_live_blocks(tmp_path_factory):
    """Tiny Mistral (window 16, blocks of 4): the prefill side slides past a long prompt's
    first blocks as its chunks land and ships the rest; the decode side imports them at their
    offset, finds them as a window hit, and decodes what one engine does."""
    from tests.tiny_families import make_family_dir

    windowed = load_model(str(make_family_dir(tmp_path_factory.mktemp("split_window"), "mistral_window")),
                          progress=False)
    prompts = random_prompts(3, [30, 45, 61], seed=4)
    reqs = [(f"g{i}", p, greedy(8)) for i, p in enumerate(prompts)]
    want = _single(windowed, reqs)
    pair = make_pair(windowed)
    try:
        for rid, prompt, params in reqs:
            pair.add(rid, prompt, params)
        pair.settle()
        pair.assert_idle()
        assert pair.p.kv_manager.window == 16 and pair.p.lifecycle.stats.window_freed_blocks > 0
        full = sum((len(p) - 1) // 4 for p in prompts)
        assert 0 < pair.d.role.imported_blocks < full  # live blocks only
        for key, r in want.items():
            assert pair.out[key].token_ids == r.token_ids, key
            # The decode side computed only the tail: the shipped blocks were a window hit.
            assert pair.out[key].usage.cached_tokens == (len(prompts[int(key[0][1:])]) - 1) // 4 * 4, key
    finally:
        pair.close()
