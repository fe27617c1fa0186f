"""Engine-wide stops through Ray replicas (issue 46, docs/engine-stops.md): pause (keep,
abort), resume and a weight update reach every replica; a replica that dies ends its streams
as an engine-initiated end (source replica); when Ray restarts it, it comes back paused and
serving the current weights before it serves.

Needs a Ray cluster: tests/test_cluster.py runs this module inside a network namespace of
its own (loopback only). Not collected by a plain `pytest tests/` (no test_ prefix).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest

from stopline.cluster.cores import ReplicaState
from stopline.cluster.frontend import ray_engine
from stopline.config import EngineConfig
from stopline.engine.async_engine import EngineObserver
from stopline.engine.streams import EngineStopped
from stopline.request import AbortSource, SamplingParams
from tests.ray_support import ray_cluster, until  # noqa: F401 - the autouse fixture
from tests.tiny_model import make_tiny_llama_dir

pytestmark = pytest.mark.timeout(300)


def test_pause_resume_update_and_a_dead_replica_through_ray(tiny_long_model_dir, tmp_path):
    other = make_tiny_llama_dir(tmp_path / "b", seed=1, max_position=8192)
    aborted: list[str] = []

    class Seen(EngineObserver):
        def on_aborted(self, source: str) -> None:
            aborted.append(source)

    greedy = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)

    async def solo(engine, rid: str) -> tuple[int, list[int], set[int]]:
        s = await engine.add(rid, [7 + i % 300 for i in range(23)], greedy)
        replica = engine.backend.owners.live[s.incarnation].replica
        toks, versions = [], set()
        async for out in s:
            toks += out.new_token_ids
            versions.add(out.weight_version)
        return replica, toks, versions

    async def main() -> None:
        engine = ray_engine(str(tiny_long_model_dir), EngineConfig(num_blocks=1024), replicas=2,
                            policy="round-robin", observer=Seen())
        await engine.start()
        backend = engine.backend
        try:
            streams = [await engine.add(f"s{i}", [5 + i, 6, 7],
                                        SamplingParams(max_tokens=6000, ignore_eos=True))
                       for i in range(2)]
            owners = {backend.owners.live[s.incarnation].replica for s in streams}
            assert owners == {0, 1}, owners  # one on each replica
            got: dict[int, list[int]] = {0: [], 1: []}
            ended: dict[int, Exception] = {}

            async def read(i: int) -> None:
                try:
                    async for out in streams[i]:
                        got[i].extend([out.weight_version] * len(out.new_token_ids))
                except Exception as exc:  # noqa: BLE001 - the test looks at what it is
                    ended[i] = exc
            readers = [asyncio.ensure_future(read(i)) for i in range(2)]
            await until(lambda: all(len(v) > 3 for v in got.values()), 60, "no tokens")
            # keep: both replicas halt, no token comes; resume: they come again.
            answer = await engine.pause("keep")
            assert answer["unreached"] == [] and answer["paused"] == "keep", answer
            assert [s.halted for s in await engine.utility("snapshot")] == [True, True]
            n = {i: len(v) for i, v in got.items()}
            await asyncio.sleep(0.5)
            assert {i: len(v) for i, v in got.items()} == n
            await engine.resume()
            await until(lambda: all(len(got[i]) > n[i] for i in got), 30, "no tokens after resume")
            # A weight update (keep) reaches both; the streams go on under version 1.
            answer = await engine.update_weights(str(other), "keep")
            assert answer["weight_version"] == 1 and answer["unreached"] == [], answer
            assert [s.weight_version for s in await engine.utility("snapshot")] == [1, 1]
            await until(lambda: all(v[-1] == 1 for v in got.values()), 30, "no new-weight token")
            # A dead replica while paused (keep): its stream ends as an engine stop, source replica.
            await engine.pause("keep")
            victim = backend.slots[0]
            dead = next(i for i, s in enumerate(streams)
                        if backend.owners.live[s.incarnation].replica == 0)
            os.kill(victim.pid, signal.SIGKILL)
            await asyncio.wait_for(readers[dead], 30)
            assert isinstance(ended[dead], EngineStopped) and ended[dead].source.value == "replica", ended
            assert aborted == ["replica"]
            # Ray restarts it: it catches up (halted, version 1) before it serves.
            await until(lambda: victim.state is ReplicaState.HEALTHY, 120, "never rejoined")
            snaps = await engine.utility("snapshot")
            assert [(s.halted, s.weight_version) for s in snaps] == [(True, 1), (True, 1)], snaps
            # abort: the survivor's stream ends as a pause; resume admits again.
            answer = await engine.pause("abort")
            assert answer["aborted"] == 1 and answer["unreached"] == [], answer
            await asyncio.wait_for(asyncio.gather(*readers), 30)
            live = 1 - dead
            assert isinstance(ended[live], EngineStopped) and ended[live].source.value == "pause"
            await engine.resume()
            # Both replicas serve the new weights: the same greedy tokens, version 1.
            runs = [await solo(engine, f"x{i}") for i in range(2)]
            assert {r[0] for r in runs} == {0, 1}, runs
            assert runs[0][1] == runs[1][1] and runs[0][2] == runs[1][2] == {1}, runs
        finally:
            await engine.close()

    asyncio.run(main())


def test_adapters_on_every_replica_and_a_rejoining_one(tiny_long_model_dir, tmp_path):
    """A LoRA load reaches both replicas with one load id; an unload `refuse`d by the replica
    whose request holds the adapter is undone on the other (both still serve it); a replica
    that Ray restarts loads the adapters before it serves (the same tokens under it)."""
    from stopline.engine.messages import Utility
    from tests.lora_support import make_adapter

    path = str(make_adapter(tiny_long_model_dir, tmp_path / "a", seed=1, std=0.3))
    under_a = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, lora="a")

    async def solo(engine, rid: str) -> tuple[int, list[int]]:
        s = await engine.add(rid, [7 + i % 300 for i in range(23)], under_a)
        replica = engine.backend.owners.live[s.incarnation].replica
        return replica, [t async for out in s for t in out.new_token_ids]

    async def main() -> None:
        engine = ray_engine(str(tiny_long_model_dir), EngineConfig(num_blocks=1024), replicas=2,
                            policy="round-robin")
        await engine.start()
        backend = engine.backend
        try:
            got = await engine.utility(Utility.LOAD_LORA, "a", path)
            assert [g["status"] for g in got] == [200, 200] and {g["load_id"] for g in got} == {1}, got
            runs = [await solo(engine, f"x{i}") for i in range(2)]
            assert {r[0] for r in runs} == {0, 1} and runs[0][1] == runs[1][1], runs
            # refuse while replica r's request holds it: 409 there, and the other loads it again.
            long = await engine.add("long", [5, 6, 7], dataclasses.replace(under_a, max_tokens=6000))
            busy = backend.owners.live[long.incarnation].replica
            got = await engine.utility(Utility.UNLOAD_LORA, "a", "refuse")
            assert got[busy]["status"] == 409 and got[1 - busy]["status"] == 200, got
            assert [set(x) for x in await engine.utility(Utility.LORAS)] == [{"a"}, {"a"}]
            engine.abort([long.incarnation], AbortSource.CANCEL, time.monotonic())
            async for _ in long:
                pass
            # A replica killed and restarted by Ray loads `a` again before it serves.
            victim = backend.slots[0]
            os.kill(victim.pid, signal.SIGKILL)
            await until(lambda: victim.state is not ReplicaState.HEALTHY, 30, "never seen dead")
            await until(lambda: victim.state is ReplicaState.HEALTHY, 120, "never rejoined")
            assert [set(x) for x in await engine.utility(Utility.LORAS)] == [{"a"}, {"a"}]
            again = [await solo(engine, f"y{i}") for i in range(2)]
            assert {r[0] for r in again} == {0, 1} and all(r[1] == runs[0][1] for r in again), again
        finally:
            await engine.close()

    asyncio.run(main())
