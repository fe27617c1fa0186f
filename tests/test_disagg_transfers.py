"""Transfers in flight as holders in the one release, with the reclaim deadline
(issue 25): no model, hand-driven scheduler (tests/scripted.py)."""

import pytest

from stopline.disagg.epochs import BlockEpochs, StaleBlock
from stopline.disagg.transfers import Side, Transfers
from stopline.disagg.wire import pack
from stopline.kv.block_pool import LedgerError
from stopline.kv.kv_cache import KVCache
from stopline.request import AbortSource, FinishReason
from tests.scripted import HandDriven


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _prefilled(side: Side, declared: bool = True):
    h = HandDriven()
    epochs = BlockEpochs(h.pool)
    clock = Clock()
    tr = Transfers(side, reclaim_s=2.0, clock=clock)
    if declared:
        h.lifecycle.holders.insert(0, tr)
    req = h.add("r", prompt_len=10, max_tokens=4)
    h.complete(h.plan())
    assert h.kv.table(req)
    tr.start(req, epochs.refs(list(h.kv.table(req))))
    return h, epochs, clock, tr, req


@pytest.mark.parametrize("side", list(Side))
def test_reclaim_deadline_frees_the_blocks_and_errors_the_request(side):
    h, epochs, clock, tr, req = _prefilled(side)
    refs = list(tr.get(req).refs)
    clock.t += 1.9
    assert tr.expired() == []
    clock.t += 0.2
    assert tr.expired() == [req]
    h.lifecycle.fail(req, FinishReason.ERROR, f"{side.value} transfer not done within 2.0 s")
    h.audit()
    assert req.finish_reason is FinishReason.ERROR and "within 2.0 s" in req.stop_detail
    assert h.pool.num_used == 0 and len(tr) == 0
    assert tr.done(req) is None  # a late ack changes nothing
    with pytest.raises(StaleBlock):
        pack("r", KVCache(1, 16, 4, 1, 2), epochs, refs)  # nor does a late pull


def test_abort_during_a_transfer_releases_it():
    h, _, _, tr, req = _prefilled(Side.SEND)
    h.lifecycle.abort(req, AbortSource.CANCEL)
    h.audit()
    assert len(tr) == 0 and h.pool.num_used == 0 and tr.expired() == []


def test_done_ends_only_the_transfer():
    h, _, clock, tr, req = _prefilled(Side.RECV)
    assert tr.done(req).req is req
    clock.t += 10
    assert tr.expired() == [] and not req.status.is_finished and h.pool.num_used > 0
    tr.start(req, [])  # done freed the slot: a second transfer may start
    with pytest.raises(ValueError, match="already"):
        tr.start(req, [])


def test_the_audit_sees_a_transfer_outside_the_release():
    h, _, _, tr, req = _prefilled(Side.SEND, declared=False)
    h.lifecycle.holders.insert(0, _Leaky(tr))
    h.lifecycle.abort(req, AbortSource.CANCEL)
    with pytest.raises(LedgerError, match="send_transfer"):
        h.audit()


class _Leaky:
    """The transfers holder with its release skipped: the audit must notice."""

    def __init__(self, tr: Transfers) -> None:
        self.tr, self.name = tr, tr.name

    def release(self, req) -> None:
        pass

    def preempt(self, req) -> None:
        pass

    def holds(self, req) -> bool:
        return self.tr.holds(req)


def test_bad_deadline_is_refused():
    with pytest.raises(ValueError, match="reclaim"):
        Transfers(Side.SEND, reclaim_s=0)


@pytest.mark.parametrize("side", list(Side))
def test_audit_names_a_transfer_that_outlives_its_request(side):
    _, _, _, tr, req = _prefilled(side)
    tr.audit([req])  # its request is live: nothing to report
    with pytest.raises(LedgerError, match=f"{side.value} transfer of .* outlives its request"):
        tr.audit([])
