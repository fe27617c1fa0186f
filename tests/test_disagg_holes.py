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
import time

import pytest

from stopline.config import EngineConfig
from stopline.disagg.frontend import disagg_engine
from stopline.engine.async_engine import AsyncEngine
from stopline.request import FinishReason, SamplingParams

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
            assert engine.abort("race") == ["race"]
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
