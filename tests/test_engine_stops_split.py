"""Engine-wide stops through the prefill/decode split (issue 46): a pause, resume and weight
update reach both roles; a role that cannot be reached (dead) is named in the answer."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from stopline.config import EngineConfig
from stopline.disagg.frontend import Restarts, disagg_engine
from stopline.engine.streams import EngineStopped
from stopline.request import SamplingParams
from tests.tiny_model import make_tiny_llama_dir

pytestmark = pytest.mark.timeout(300)


async def _until(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(what)
        await asyncio.sleep(0.02)


def test_split_pause_update_and_a_dead_role_named(tiny_long_model_dir, tmp_path):
    other = make_tiny_llama_dir(tmp_path / "b", seed=1, max_position=8192)

    async def run() -> None:
        engine = disagg_engine(str(tiny_long_model_dir), EngineConfig(block_size=4, num_blocks=4096),
                               reclaim_s=2.0, progress=False,
                               restarts=Restarts(limit=1, window_s=600, first_s=0.5))
        await engine.start()
        backend = engine.backend
        prompt = [10 + i % 400 for i in range(41)]
        try:
            stream = await engine.add("a", prompt, SamplingParams(max_tokens=6000, ignore_eos=True))
            got: list[int] = []
            stopped: list[Exception] = []

            async def read() -> None:
                try:
                    async for out in stream:
                        got.extend([out.weight_version] * len(out.new_token_ids))
                except EngineStopped as exc:
                    stopped.append(exc)
            reader = asyncio.ensure_future(read())
            await _until(lambda: len(got) > 3, 60, "no tokens")
            answer = await engine.pause("keep")
            assert answer["unreached"] == [] and answer["paused"] == "keep"
            snaps = await engine.utility("snapshot")
            assert [s.halted for s in snaps] == [True, True]  # both roles halted
            n = len(got)
            await asyncio.sleep(0.3)
            assert len(got) == n
            await engine.resume()
            await _until(lambda: len(got) > n, 30, "no tokens after the resume")
            answer = await engine.update_weights(str(other), "keep")
            assert answer["weight_version"] == 1 and answer["unreached"] == []
            assert [s.weight_version for s in await engine.utility("snapshot")] == [1, 1]
            await _until(lambda: got[-1] == 1, 30, "no token from the new weights")
            assert got[0] == 0
            # A dead role: the pause reaches the other one and names it.
            os.kill(backend.cores["prefill"].pid, signal.SIGKILL)
            await _until(lambda: backend.state["prefill"] != "healthy", 10, "the death not seen")
            await _until(lambda: backend.state["prefill"] == "dead", 120, "restarted past its limit")
            answer = await engine.pause("abort")
            assert answer["unreached"] == ["prefill"], answer
            await reader
            assert len(stopped) == 1 and stopped[0].source.value == "pause"
            assert (await engine.resume())["unreached"] == ["prefill"]
        finally:
            await engine.close()

    asyncio.run(run())


def test_split_dead_role_is_an_engine_stop_and_its_restart_catches_up(tiny_long_model_dir, tmp_path):
    """A role that dies ends its streams as an engine-initiated end (source replica, counted by
    source); restarted after a weight update and a keep pause, it comes back paused and
    serving the new weights (their version, their tokens) before it serves."""
    from stopline.engine.async_engine import EngineObserver

    other = make_tiny_llama_dir(tmp_path / "b", seed=1, max_position=8192)
    aborted: list[str] = []

    class Seen(EngineObserver):
        def on_aborted(self, source: str) -> None:
            aborted.append(source)

    async def solo(engine, rid: str) -> tuple[list[int], set[int]]:
        toks, versions = [], set()
        async for out in await engine.add(rid, [7 + i % 300 for i in range(23)],
                                          SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)):
            toks += out.new_token_ids
            versions.add(out.weight_version)
        return toks, versions

    async def run() -> None:
        engine = disagg_engine(str(tiny_long_model_dir), EngineConfig(block_size=4, num_blocks=4096),
                               reclaim_s=2.0, progress=False, observer=Seen(),
                               restarts=Restarts(limit=3, window_s=600, first_s=0.2))
        await engine.start()
        backend = engine.backend
        try:
            before, _ = await solo(engine, "old")
            await engine.update_weights(str(other), "keep")
            new, versions = await solo(engine, "new")
            assert versions == {1} and new != before
            new2, _ = await solo(engine, "new2")
            assert new2 == new, (before, new, new2)
            stream = await engine.add("a", [10 + i % 400 for i in range(41)],
                                      SamplingParams(max_tokens=6000, ignore_eos=True))
            got: list[int] = []
            ended: list[Exception] = []

            async def read() -> None:
                try:
                    async for out in stream:
                        got.extend(out.new_token_ids)
                except Exception as exc:  # noqa: BLE001 - the test looks at what it is
                    ended.append(exc)
            reader = asyncio.ensure_future(read())
            await _until(lambda: len(got) > 3, 60, "no tokens")
            assert (await engine.pause("keep"))["unreached"] == []
            os.kill(backend.cores["decode"].pid, signal.SIGKILL)
            await asyncio.wait_for(reader, 30)
            assert len(ended) == 1 and isinstance(ended[0], EngineStopped), ended
            assert ended[0].source.value == "replica" and "decode engine died" in str(ended[0])
            assert aborted == ["replica"]
            await _until(lambda: backend.state["decode"] == "healthy", 120, "decode not restarted")
            snaps = await engine.utility("snapshot")
            assert [(s.halted, s.weight_version) for s in snaps] == [(True, 1), (True, 1)], snaps
            await engine.resume()
            again, versions = await solo(engine, "new-again")
            assert versions == {1} and again == new, (before, new, again)
        finally:
            await engine.close()

    asyncio.run(run())


def test_a_dead_replica_on_the_wire_is_a_503_naming_it():
    """What the server makes of a stream its replica or role's death ended (serving.stopped):
    a 503 (an SSE error event when streaming) whose code names the source, not engine_dead."""
    from stopline.request import AbortSource
    from stopline.server.serving import stopped

    err = stopped(EngineStopped(AbortSource.REPLICA, "the decode engine died: exit -9"))
    assert err.status == 503 and err.code == "engine_replica", vars(err)
    assert "replica serving the request died" in str(err) and "decode engine died" in str(err)


def test_a_restarted_core_catches_up_and_its_death_stays_engine_dead(tiny_long_model_dir, tmp_path):
    """--restart-core: the one core's death still ends its streams as EngineDead (not an
    engine stop: the engine itself died), and the fresh core gets the weights, version and
    keep pause it missed before it serves."""
    from stopline.engine.proc.restart import restarting_engine
    from stopline.engine.streams import EngineDead

    other = make_tiny_llama_dir(tmp_path / "b", seed=1, max_position=8192)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    prompt = [7 + i % 300 for i in range(23)]

    async def solo(engine, rid: str) -> list[int]:
        return [t async for out in await engine.add(rid, prompt, greedy) for t in out.new_token_ids]

    async def run() -> None:
        engine = restarting_engine(str(tiny_long_model_dir), EngineConfig(num_blocks=1024), progress=False,
                                   restarts=Restarts(limit=3, window_s=600, first_s=0.2))
        await engine.start()
        backend = engine.backend
        try:
            await engine.update_weights(str(other), "keep")
            new = await solo(engine, "new")
            stream = await engine.add("a", [5, 6, 7], SamplingParams(max_tokens=6000, ignore_eos=True))
            await engine.pause("keep")
            os.kill(backend.pid, signal.SIGKILL)
            with pytest.raises(EngineDead) as err:
                async for _ in stream:
                    pass
            assert not isinstance(err.value, EngineStopped)
            await _until(lambda: backend.state == "healthy" and backend.restarted == 1, 120, "no restart")
            snap = await engine.utility("snapshot")
            assert (snap.halted, snap.weight_version) == (True, 1), snap
            await engine.resume()
            assert await solo(engine, "again") == new
        finally:
            await engine.close()

    asyncio.run(run())
