"""AsyncEngine without HTTP: the frontend cancel fence, confirmed aborts, the two-process
transport (acknowledged adds, aborts held until their add is acknowledged, core death)."""

from __future__ import annotations

import asyncio
import time

import pytest

from stopline.config import EngineConfig
from stopline.engine.async_engine import AsyncEngine
from stopline.engine.streams import EngineDead, EngineUnavailable
from stopline.request import AbortSource, FinishReason, InvalidRequest, SamplingParams

pytestmark = pytest.mark.timeout(120)

CFG = dict(num_blocks=128, max_num_seqs=8)


def long_params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=500, ignore_eos=True, **kw)


async def wait_until(cond, timeout: float = 2.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not met")
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_cancel_fence_and_confirmed_abort(tiny_model_dir, async_scheduling):
    async def run() -> None:
        engine = AsyncEngine.in_process(str(tiny_model_dir), EngineConfig(
            **CFG, async_scheduling=async_scheduling), progress=False)
        await engine.start()
        prompt = engine.tokenizer.encode("hello there")
        try:
            stream = await engine.add("a", prompt, long_params(), incarnation="a")
            got = 0
            outs = []
            async for out in stream:
                outs.append(out)
                got += len(out.new_token_ids)
                if len(outs) == 3:
                    engine.abort(["a"], AbortSource.CANCEL, time.monotonic())
            # Nothing but the terminal after the cancel, and it says what the client got.
            assert len(outs) == 4 and outs[-1].finished and not outs[-1].new_token_ids
            assert outs[-1].finish_reason is FinishReason.ABORT
            assert outs[-1].usage.completion_tokens == got == stream.delivered[0]
            assert engine.status("a") == ["abort"]

            streams = [await engine.add(f"b{i}", prompt, long_params(n=2 if i % 2 else 1),
                                        incarnation=f"b{i}")
                       for i in range(6)]
            await wait_until(lambda: engine.snapshot.running > 0)
            ended = await engine.abort_and_wait(None, AbortSource.SHUTDOWN)
            # Confirmed: every stream has its terminals when abort_and_wait returns.
            assert all(s.finished for s in streams) and engine.num_open == 0
            assert set(ended) == {f"b{i}" for i in range(6)}
            assert all(r == ["abort"] * len(r) for r in ended.values())
            await wait_until(lambda: engine.snapshot.running == 0 and engine.snapshot.kv_blocks_used == 0)
            assert await engine.utility("audit") is None
            assert sum(n for s, _, n in engine.snapshot.aborts if s == "shutdown") == 9  # sequences
        finally:
            await engine.close()

    asyncio.run(run())


def test_generate_leaving_early_aborts(tiny_model_dir):
    async def run() -> None:
        engine = AsyncEngine.in_process(str(tiny_model_dir), EngineConfig(**CFG), progress=False)
        await engine.start()
        try:
            gen = engine.generate("g", engine.tokenizer.encode("x"), long_params(), incarnation="g")
            async for _ in gen:
                break
            await gen.aclose()
            await wait_until(lambda: engine.status("g") == ["abort"])
            await wait_until(lambda: engine.snapshot.running == 0)
        finally:
            await engine.close()

    asyncio.run(run())


def test_two_process_transport(tiny_model_dir):
    async def run() -> None:
        engine = AsyncEngine.in_subprocess(str(tiny_model_dir), EngineConfig(**CFG), progress=False)
        info = await engine.start()
        assert info.num_blocks == 128 and engine.tokenizer is not None
        prompt = engine.tokenizer.encode("hello")
        try:
            # The core validates: a bad request is refused and nothing is queued.
            with pytest.raises(InvalidRequest, match="outside the vocabulary"):
                await engine.add("bad", [1, 10**6], SamplingParams())
            assert engine.num_open == 0

            # An abort sent before the core acknowledged the add goes out at once on the
            # priority socket; if it overtakes its add, the core keeps it until the add comes.
            adding = asyncio.create_task(engine.add("early", prompt, long_params(), incarnation="early"))
            await asyncio.sleep(0)  # the add is on its way, its acknowledgement is not back
            assert "early" in engine.backend._acks
            engine.abort(["early"], AbortSource.DISCONNECT, time.monotonic())
            stream = await adding
            outs = [o async for o in stream]
            assert outs[-1].finish_reason is FinishReason.ABORT and not any(o.new_token_ids for o in outs)

            # Many adds, then one abort: it is accepted long before the adds are through.
            flood = [asyncio.create_task(engine.add(f"f{i}", prompt, SamplingParams(max_tokens=2), incarnation=f"f{i}"))
                     for i in range(200)]
            victim = await engine.add("victim", prompt, long_params(), incarnation="victim")
            engine.abort(["victim"], AbortSource.CANCEL, time.monotonic())
            await asyncio.wait_for(victim.done, 10)
            assert victim.finish_reasons == [FinishReason.ABORT]
            for f in flood:
                s = await f
                await asyncio.wait_for(s.done, 60)

            # The core dies: open streams end with EngineDead at once, new adds are refused.
            stream = await engine.add("doomed", prompt, long_params(), incarnation="doomed")
            await wait_until(lambda: stream.started)
            t0 = time.monotonic()
            engine.backend.proc.kill()
            with pytest.raises(EngineDead):
                async for _ in stream:
                    pass
            assert time.monotonic() - t0 < 1.0
            assert engine.state == "dead" and "exited" in engine.dead_reason
            with pytest.raises(EngineUnavailable):
                await engine.add("after", prompt, SamplingParams(), incarnation="after")
        finally:
            await engine.close()

    asyncio.run(run())
