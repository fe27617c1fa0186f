"""Holes in the prefill/decode split (issue 49, items 1-3), each over the real role
processes (`disagg_engine`, as `serve --disagg` runs them) or the real core loop:

1. an abort that lands while decode's add is in flight, read by a busy front end together
   with decode's add reply and abort terminal, reaches prefill: prefill computes nothing;
2. a request whose KV decode took, still queued there, survives prefill's death;
3. with a transfer pending, neither role steps empty: each sleeps on its link and its
   nearest deadline, and the link wakes it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from stopline.config import EngineConfig
from stopline.disagg.frontend import disagg_engine
from stopline.engine.async_engine import AsyncEngine
from stopline.engine.core_loop import CoreLoop
from stopline.engine.messages import Batch
from stopline.model.loaders.loader import load_model
from stopline.request import AbortSource, FinishReason, SamplingParams
from tests.disagg_support import make_pair

pytestmark = pytest.mark.timeout(180)


def _config(**kw: object) -> EngineConfig:
    base: dict = dict(block_size=4, num_blocks=4096, max_num_batched_tokens=64)
    return EngineConfig(**(base | kw))


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [10 + (i * 7 + seed) % 480 for i in range(n)]


async def _snap(engine: AsyncEngine, role: str):
    prefill, decode = await engine.utility("snapshot")
    return prefill if role == "prefill" else decode


def test_an_abort_racing_the_add_reaches_prefill(tiny_long_model_dir):
    """The front end is busy (0.2 s) while decode answers the add and ends the request on
    the abort that raced it: both arrive together. Prefill must not compute the prompt nor
    hold a block for it (on main it computed 3,000 tokens and held their blocks until its
    send deadline, then ended them `error`)."""
    reclaim_s = 1.0

    async def run() -> None:
        engine = disagg_engine(str(tiny_long_model_dir), _config(), reclaim_s=reclaim_s, progress=False)
        await engine.start()
        try:
            add = asyncio.create_task(engine.add("r", _prompt(3000), SamplingParams(max_tokens=4),
                                                 incarnation="race"))
            await asyncio.sleep(0)  # the add is sent to decode; its reply is awaited
            assert engine.abort(["race"], AbortSource.CANCEL, time.monotonic()) == ["race"]
            time.sleep(0.2)  # busy: decode's add reply and abort terminal are both waiting
            stream = await add
            outs = [o async for o in stream]
            assert outs[-1].finish_reason is FinishReason.ABORT and not any(o.new_token_ids for o in outs)
            # Watch prefill past its send deadline: it never holds a block, never errors.
            most = 0
            end = time.monotonic() + reclaim_s + 0.5
            while time.monotonic() < end:
                snap = await _snap(engine, "prefill")
                most = max(most, snap.kv_blocks_used)
                await asyncio.sleep(0.01)
            assert most == 0, f"prefill held {most} blocks of a cancelled request"
            assert snap.finished.get("error", 0) == 0, snap.finished
            await engine.utility("audit")
        finally:
            await engine.close()

    asyncio.run(run())


def test_prefill_death_spares_a_request_whose_kv_decode_took(tiny_long_model_dir):
    """B's KV is handed off and acked, but B waits on decode behind max_num_seqs (A holds the
    one slot, paused: its client reads nothing). Prefill is killed: B does not depend on it
    any more, so it must not end; once A goes, B runs to its end."""

    async def run() -> None:
        engine = disagg_engine(str(tiny_long_model_dir), _config(max_num_seqs=1), reclaim_s=2.0,
                               progress=False, max_buffered=2)
        await engine.start()
        backend = engine.backend
        try:
            a = await engine.add("a", _prompt(3), SamplingParams(max_tokens=5000, ignore_eos=True))
            while (await _snap(engine, "decode")).running == 0:  # A runs (and pauses, unread)
                await asyncio.sleep(0.01)
            b = await engine.add("b", _prompt(40, seed=1), SamplingParams(max_tokens=4, ignore_eos=True))
            end = time.monotonic() + 30
            while (await _snap(engine, "prefill")).finished.get("stop", 0) == 0:  # handed off
                assert time.monotonic() < end, "prefill never handed B off"
                await asyncio.sleep(0.01)
            snap = await _snap(engine, "decode")
            assert snap.waiting == 1 and snap.running == 1  # B queued behind A
            os.kill(backend.cores["prefill"].pid, signal.SIGKILL)
            while backend.state["prefill"] not in ("dead", "restarting"):  # a restart may follow
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            assert not b.finished, "B ended with the prefill engine though decode had its KV"
            engine.abort([a.incarnation], AbortSource.CANCEL, time.monotonic())
            outs = [o async for o in b]
            assert outs[-1].finish_reason is FinishReason.LENGTH
            assert sum(len(o.new_token_ids) for o in outs) == 4
        finally:
            await engine.close()

    asyncio.run(run())


def test_roles_do_not_step_empty_while_a_transfer_is_pending(tiny_long_model_dir):
    """One 6,000-token prompt through the split: decode's own work is a step or two, plus
    one per prefill heartbeat; prefill's is its chunks. On main decode stepped thousands of
    times while prefill computed, each step a snapshot to the front end."""

    async def run() -> None:
        engine = disagg_engine(str(tiny_long_model_dir), _config(), reclaim_s=2.0, progress=False)
        await engine.start()
        try:
            p0, d0 = await engine.utility("snapshot")
            batches = {"n": 0}
            on_batch = engine.backend._on_batch

            def counting(batch: Batch) -> None:
                batches["n"] += 1
                on_batch(batch)

            engine.backend._on_batch = counting  # what reaches the front end from decode
            t0 = time.monotonic()
            s = await engine.add("long", _prompt(6000), SamplingParams(max_tokens=1, ignore_eos=True))
            outs = [o async for o in s]
            took = time.monotonic() - t0
            assert outs[-1].finish_reason is FinishReason.LENGTH
            p1, d1 = await engine.utility("snapshot")
            chunks = -(-(5996) // 64)
            beats = took / (2.0 / 4) + 2  # a Progress per quarter deadline wakes decode once
            assert d1.steps - d0.steps <= 4 + beats, (d1.steps - d0.steps, took)
            assert batches["n"] <= 8 + beats, (batches["n"], took)
            assert p1.steps - p0.steps <= chunks + 4, (p1.steps - p0.steps, chunks)
        finally:
            await engine.close()

    asyncio.run(run())


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


def test_prefill_waiting_for_an_ack_sleeps_until_its_deadline(loaded):
    """Prefill under its real core loop, its decode side never reading: after its chunks it
    waits for the ack without stepping, and the reclaim deadline still ends the transfer on
    time (the loop wakes for it)."""
    reclaim_s = 0.5
    pr = make_pair(loaded, reclaim_s=reclaim_s)
    batches: list[Batch] = []
    loop = CoreLoop(pr.p, batches.append)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        loop.add("a", list(range(5, 45)), SamplingParams(max_tokens=1))  # 40 tokens: 5 chunks of 8
        # The loop emits a step's outputs after the step: wait for the end to be sent too.
        while pr.p.has_unfinished() or not any(o.finished for b in list(batches) for o in b.outputs):
            assert time.monotonic() - t0 < 5, "the send deadline never ended the transfer"
            time.sleep(0.01)
        took = time.monotonic() - t0
        ends = [o for b in batches for o in b.outputs if o.finished]
        assert ends[0].finish_reason is FinishReason.ERROR and "reclaim deadline" in ends[0].stop_detail
        assert pr.p.steps <= 5 + 3, pr.p.steps  # its chunks, the deadline, a spare
        assert took < reclaim_s + 0.5, took
        assert pr.p.pool.num_used == 0
    finally:
        loop.stop()
        thread.join(5)
        pr.close()


def test_decode_waiting_for_kv_sleeps_and_the_link_wakes_it(loaded):
    """Decode under its real core loop waits for a prompt's KV without stepping; when
    prefill (stepped here by hand) ships it, the link wakes decode at once: no poll, no
    wait for the next deadline."""
    pr = make_pair(loaded, reclaim_s=3.0)
    batches: list[Batch] = []
    loop = CoreLoop(pr.d, batches.append)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        inc = loop.add("a", list(range(5, 45)), SamplingParams(max_tokens=2, ignore_eos=True))
        pr.p.add_request("a", list(range(5, 41)), SamplingParams(max_tokens=1), incarnation=inc)
        time.sleep(0.3)
        idle_steps = pr.d.steps
        assert idle_steps <= 3, idle_steps  # the add; maybe a heartbeat
        while not len(pr.p.role.sending):
            pr.step_p()
        shipped = time.monotonic()
        while not any(o.finished for b in batches for o in b.outputs):
            assert time.monotonic() - shipped < 0.5, "decode was not woken by the KV"
            time.sleep(0.002)
        assert [i for b in batches for i in b.taken] == [inc]  # reported to the front end
        while pr.p.has_unfinished():  # prefill gets its ack (decode is the loop's alone)
            assert time.monotonic() - shipped < 5, "prefill never got its ack"
            pr.step_p()
        assert pr.d.steps - idle_steps <= 6, pr.d.steps
    finally:
        loop.stop()
        thread.join(5)
        pr.close()


def test_the_link_may_wake_a_core_still_being_built(loaded, monkeypatch):
    """The link's receiver thread starts when the role binds, in the middle of the core's
    construction; a message already waiting (a restarted role's peer was sending all along)
    wakes the core at once. That wake raised AttributeError on the half-built core, which
    killed the receiver thread: the restarted decode role never received a block again.
    Here every link wakes its core the moment it is made."""
    from stopline.disagg import link as link_mod

    made = link_mod.Link.__init__

    def waking(self, *args, **kw):
        made(self, *args, **kw)
        self._wake()  # as the receiver thread does after each message

    monkeypatch.setattr(link_mod.Link, "__init__", waking)
    pair = make_pair(loaded)
    try:
        pair.add("r", _prompt(20), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        pair.settle()
        assert len(pair.out[("r", 0)].token_ids) == 3
    finally:
        pair.close()
