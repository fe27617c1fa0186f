"""The stop path's pieces without a model: block pool, KV manager, scheduler, lifecycle and
its holders, driven by hand-built step results (tests/scripted.py). Each contract of
docs/stop-path.md in milliseconds."""

from __future__ import annotations

import pytest

from stopline.config import EngineConfig
from stopline.kv.block_pool import LedgerError
from stopline.lifecycle import Lifecycle
from stopline.request import (
    AbortSource,
    Family,
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
)
from stopline.stats import StopStats
from tests.scripted import HandDriven


def run_until_idle(h: HandDriven, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not (h.queues.running or h.queues.waiting):
            return
        plan = h.plan()
        h.complete(plan)
        for ch in plan.chunks:
            r = ch.req
            if r.status is RequestStatus.RUNNING and len(r.output_token_ids) >= r.max_tokens:
                h.lifecycle.finish(r, FinishReason.LENGTH, "max_tokens")
        h.audit()
    raise AssertionError("still busy")


def test_admission_is_all_or_nothing_and_prefix_hits_are_shared():
    h = HandDriven(num_blocks=8)
    a = h.add("a", prompt_len=9)  # 3 blocks
    h.complete(h.plan())
    assert len(h.kv.table(a)) == 3 and h.pool.num_used == 3
    h.lifecycle.finish(a, FinishReason.STOP)
    assert h.pool.num_cached == 2  # its two full blocks stay findable
    b = h.add("b", prompt_len=9)  # the same prompt: two hits, one new block
    plan = h.plan()
    assert plan.chunks[0].start == 8 and h.kv.computed(b) == 9 and h.pool.num_used == 3
    big = h.add("big", prompt_len=40)  # 10 blocks: never fits, fails at admission
    h.complete(plan)
    h.plan()
    assert big.status.is_finished and big.finish_reason is FinishReason.ERROR
    assert "KV blocks" in big.stop_detail
    h.audit()


def test_fence_defers_the_free_of_a_request_in_flight():
    h = HandDriven(num_blocks=8)
    a = h.add("a", prompt_len=6)
    plan = h.plan()  # in flight: a's blocks may be written
    h.lifecycle.abort(a, AbortSource.CANCEL)
    assert not h.kv.table(a) and h.pool.num_used == 2, "freed while a step may write them"
    assert len(h.kv.deferred) == 1
    h.audit()  # the fence's hold is in the ledger
    h.complete(plan)
    assert h.pool.num_used == 0 and not h.kv.deferred
    assert h.stats.abort_to_reclaim_steps.counts[1] == 1 and h.stats.tokens_after_abort == 1


def test_queues_drop_an_ended_request_at_once():
    h = HandDriven()
    reqs = [h.add(f"r{i}", prompt_len=3) for i in range(3)]
    h.complete(h.plan())
    h.lifecycle.finish(reqs[1], FinishReason.STOP)
    waiting = h.add("w", prompt_len=3)
    h.lifecycle.abort(waiting, AbortSource.CANCEL)
    assert reqs[1] not in h.queues.running and waiting not in h.queues.waiting
    assert not h.queues.holds(reqs[1]) and not h.queues.holds(waiting)
    h.audit()


def test_swap_round_trip_and_the_swap_ledger():
    h = HandDriven(num_blocks=8, swap=True)
    a = h.add("a", prompt_len=6)
    h.complete(h.plan())
    h.lifecycle.preempt(a)
    assert a.status is RequestStatus.SWAPPED and len(h.kv.swap_slots(a)) == 2 and h.pool.num_used == 0
    h.audit()
    h.swap.free_slots.pop()  # a slot taken by nobody: the audit must see it
    with pytest.raises(LedgerError, match="swap space"):
        h.audit()
    h.swap.free_slots.append(7)
    plan = h.plan()  # swapped back in, no recompute
    assert a.status is RequestStatus.RUNNING and not h.kv.swap_slots(a) and plan.chunks[0].num_tokens == 1
    h.complete(plan)
    h.lifecycle.abort(a, AbortSource.CANCEL)
    assert h.swap.num_used == 0 and h.pool.num_used == 0
    h.audit()


def test_max_num_seqs_counts_every_sample_of_a_family():
    h = HandDriven(num_blocks=32, max_num_seqs=2)
    fam_leader = Request("f", [3, 4, 5, 6, 7], SamplingParams(n=2, max_tokens=4, temperature=0.0),
                         incarnation="f")
    sample = Request("f", list(fam_leader.prompt_token_ids), fam_leader.params, index=1,
                     incarnation="f", fork_leader=fam_leader)
    fam_leader.forks_pending = [sample]
    fam = Family("f", [fam_leader, sample], "f")
    fam_leader.family = sample.family = fam
    h.sched.add(fam_leader)
    h.live += [fam_leader, sample]
    other = h.add("o", prompt_len=3)
    plan = h.plan()
    assert [c.req for c in plan.chunks] == [fam_leader]  # the family fills both seats
    assert other.status is RequestStatus.WAITING and h.queues.num_running == 2


def test_a_family_waiting_to_fork_is_waited_for_not_declared_infeasible():
    """Issue: _grow found no victim (family members are not candidates) and failed the
    request with "KV pool cannot hold" although the family's blocks come back."""
    h = HandDriven(num_blocks=5, max_num_batched_tokens=4)
    r = h.add("r", prompt_len=3, max_tokens=8)  # decodes first: it is oldest
    h.complete(h.plan())
    # 10 prompt tokens: 3 blocks, one of them partial, so the sample holds a copy: 4 blocks,
    # and with r's one the pool is full when r needs its second.
    leader = Request("f", list(range(20, 30)), SamplingParams(n=2, max_tokens=2, temperature=0.0),
                     incarnation="f")
    s1 = Request("f", list(leader.prompt_token_ids), leader.params, index=1, incarnation="f",
                 fork_leader=leader)
    leader.forks_pending = [s1]
    leader.family = s1.family = Family("f", [leader, s1], "f")
    h.sched.add(leader)
    h.live += [leader, s1]
    for _ in range(60):
        plan = h.plan()
        h.complete(plan)
        for ch in plan.chunks:
            q = ch.req
            if ch.sample and q.fork_leader is None:
                for m in list(q.forks_pending):  # the core forks samples at the first token
                    h.kv.fork(m, q)
                    m.fork_leader = None
                    m.output_token_ids.append(7)
                    q.forks_pending.remove(m)
        for q in list(h.queues.running):
            if len(q.output_token_ids) >= q.max_tokens:
                h.lifecycle.finish(q, FinishReason.LENGTH)
        h.audit()
        if not (h.queues.running or h.queues.waiting):
            break
    assert r.finish_reason is FinishReason.LENGTH, (r.finish_reason, r.stop_detail)
    assert len(r.output_token_ids) == 8, r.stop_detail  # not failed as "cannot hold" midway
    assert r.num_preemptions >= 1  # it waited for the family's blocks
    assert leader.finish_reason is s1.finish_reason is FinishReason.LENGTH
    assert h.pool.num_used == 0


def test_preempting_a_leader_takes_its_waiting_samples_along():
    h = HandDriven(num_blocks=16, max_num_batched_tokens=4)
    leader = Request("f", list(range(20, 30)), SamplingParams(n=3, max_tokens=2, temperature=0.0),
                     incarnation="f")
    samples = [Request("f", list(leader.prompt_token_ids), leader.params, index=i,
                       incarnation="f", fork_leader=leader) for i in (1, 2)]
    leader.forks_pending = list(samples)
    leader.family = Family("f", [leader, *samples], "f")
    for s in samples:
        s.family = leader.family
    h.sched.add(leader)
    h.live += [leader, *samples]
    h.complete(h.plan())  # first chunk of the prompt: the samples hold the shared blocks
    assert all(h.kv.table(s) for s in samples)
    h.lifecycle.preempt(leader)
    assert leader.status is RequestStatus.PREEMPTED
    assert all(s.status is RequestStatus.PREEMPTED and not h.kv.table(s) for s in samples)
    assert h.pool.num_used == 0 and list(h.queues.waiting) == [leader]
    h.audit()
    h.complete(h.plan())  # re-admitted together, all or nothing
    assert all(r.status is RequestStatus.RUNNING and h.kv.table(r) for r in (leader, *samples))
    h.lifecycle.abort(leader, AbortSource.CANCEL)  # before the fork: the samples end with it
    assert all(r.finish_reason is FinishReason.ABORT for r in (leader, *samples))
    assert h.stats.aborts[("cancel", "waiting")] == 2
    h.audit()


class _Recorder:
    def __init__(self, name: str, log: list[str], keep: bool = False) -> None:
        self.name, self.log, self.keep = name, log, keep

    def release(self, req: Request) -> None:
        self.log.append(self.name)

    def preempt(self, req: Request) -> None:
        self.log.append("preempt " + self.name)

    def holds(self, req: Request) -> bool:
        return self.keep


def test_release_walks_the_holders_in_declared_order_kv_last():
    h = HandDriven()
    log: list[str] = []
    holders = [_Recorder("grammar", log), _Recorder("outputs", log), h.queues, h.kv]
    lc = Lifecycle(EngineConfig(debug=True), h.kv, holders, StopStats())
    req = Request("x", [1, 2, 3], SamplingParams(), incarnation="x")
    lc.abort(req, AbortSource.CANCEL)
    assert log == ["grammar", "outputs"] and req.status.is_finished
    lc.audit([])
    with pytest.raises(ValueError, match="last holder"):
        Lifecycle(EngineConfig(), h.kv, [h.kv, h.queues], StopStats())


def test_audit_names_a_holder_that_keeps_a_finished_request():
    h = HandDriven()
    leaky = _Recorder("leaky", [], keep=True)
    lc = Lifecycle(EngineConfig(debug=True), h.kv, [leaky, h.kv], StopStats())
    lc.finish(Request("x", [1], SamplingParams(), incarnation="x"), FinishReason.STOP)
    with pytest.raises(LedgerError, match="still held by leaky"):
        lc.audit([])


def test_stats_stay_the_same_size_however_many_aborts():
    h = HandDriven(num_blocks=64)
    for i in range(1000):
        r = h.add(f"r{i}", prompt_len=2)
        h.lifecycle.abort(r, AbortSource.CANCEL)
    st = h.stats
    assert st.abort_to_quiet_steps.count == 1000 and st.aborts[("cancel", "waiting")] == 1000
    assert len(st.abort_to_quiet_steps.counts) == len(st.abort_to_quiet_steps.bounds) + 1
    assert not any(isinstance(v, list) and len(v) > 20 for v in vars(st).values())


def test_runs_to_completion_with_the_ledger_after_every_step():
    h = HandDriven(num_blocks=10)
    reqs = [h.add(f"r{i}", prompt_len=3 + i, max_tokens=6, first_token=3 + 10 * i) for i in range(4)]
    run_until_idle(h)
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert h.pool.num_used == 0 and sum(h.stats.preemptions.values()) > 0
