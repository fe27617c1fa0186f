"""Checks of the Ray replicas that need a Ray cluster; tests/test_cluster.py runs this module
inside a network namespace of its own (Ray's services listen on every interface), so nothing
here can reach beyond loopback. One Ray instance serves the whole module.

Not collected by a plain `pytest tests/` (the name has no test_ prefix): only through
test_cluster.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest

from stopline.cluster.cores import ReplicaState
from stopline.cluster.frontend import ray_engine
from stopline.config import EngineConfig
from stopline.engine.streams import EngineDead, EngineStopped
from stopline.model.loaders.loader import load_model
from stopline.request import AbortSource, SamplingParams
from stopline.server.metrics import ServerMetrics
from tests.chaos_support import (
    check_storm,
    make_workload,
    run_async_storm,
    run_reference,
    storm_config,
)
from tests.ray_support import ray_cluster  # noqa: F401 - the autouse fixture
from tests.tiny_model import make_tiny_llama_dir

pytestmark = pytest.mark.timeout(300)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_chaos_storm_through_the_router(tmp_path):
    """The async storm (random aborts in every state, n up to 4, deadlines) through two
    replicas: outputs equal the undisturbed reference, every replica's pool at baseline and
    its audit clean (run_async_storm checks each replica)."""
    tiny_dir = make_tiny_llama_dir(tmp_path / "tiny", seed=7, init_std=0.1, vocab_size=384, layers=2)
    tiny = load_model(str(tiny_dir), progress=False)
    work = [j for j in make_workload(seed=11, count=120, vocab=tiny.config.vocab_size)
            if not (j.race or j.resubmit)]
    ref = run_reference(tiny, work)
    config = dataclasses.replace(storm_config("auto", True), num_blocks=60)
    used: list[list[int]] = []

    def make(model_dir, cfg, progress, **streams):
        engine = ray_engine(model_dir, cfg, replicas=2, **streams)
        used.append(engine)
        return engine

    res = run_async_storm(str(tiny_dir), work, config, seed=21, make=make, slow=0.25, max_buffered=2,
                          freeze=0.5)
    assert check_storm(work, ref, res) > 10
    assert res.pauses > 0 and res.freezes > 0  # slow readers; replicas stopped and continued
    steps = [s.steps for s in used[0].backend.snapshots().values()]
    assert all(n > 0 for n in steps), f"a replica took no step: {steps}"


async def _stream(engine, rid: str, prompt: list[int], max_tokens: int, log: dict) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    stream = await engine.add(rid, prompt, params)
    log[rid] = {"replica": engine.backend.owners.live[stream.incarnation].replica, "tokens": 0}
    try:
        async for out in stream:
            log[rid]["tokens"] += len(out.new_token_ids)
            if out.finished:
                log[rid]["reason"] = out.finish_reason.value
    except EngineDead as exc:
        log[rid]["error"] = str(exc)
        log[rid]["error_at"] = time.monotonic()


def test_kill_a_replica_during_16_streams_then_it_rejoins(tiny_long_model_dir):
    """SIGKILL one replica's process while 16 streams run (8 on each): its streams end with
    EngineDead (not retried), the other's finish intact, new requests go to the survivor,
    Ray restarts the dead one and it serves again. Then an idle cluster spends no CPU."""
    max_tokens = 600

    async def main() -> dict:
        engine = ray_engine(str(tiny_long_model_dir), EngineConfig(num_blocks=1024), replicas=2)
        await engine.start()
        backend = engine.backend
        try:
            log: dict = {}
            tasks = [asyncio.ensure_future(_stream(engine, f"r{i}", [5 + i, 6, 7], max_tokens, log))
                     for i in range(16)]
            while sum(1 for v in log.values() if v["tokens"] > 0) < 16:
                await asyncio.sleep(0.01)
            victim = backend.slots[0]
            old_pid = victim.pid
            killed_at = time.monotonic()
            os.kill(old_pid, signal.SIGKILL)
            await asyncio.gather(*tasks)
            # While it is down, the router sends nothing its way.
            during = []
            if victim.state is ReplicaState.DEAD:
                s = await engine.add("during", [9, 9, 9], SamplingParams(max_tokens=200, ignore_eos=True))
                during.append(backend.owners.live[s.incarnation].replica
                              if s.incarnation in backend.owners.live else None)
                async for _ in s:
                    pass
            t0 = time.monotonic()
            while victim.state is not ReplicaState.HEALTHY:
                assert time.monotonic() - t0 < 120, "the killed replica never rejoined"
                await asyncio.sleep(0.1)
            # Both idle: the least loaded with the lowest index is the rejoined replica.
            s = await engine.add("after", [9, 9, 9], SamplingParams(max_tokens=200, ignore_eos=True))
            after_replica = backend.owners.live[s.incarnation].replica
            after = [o async for o in s]
            await asyncio.sleep(0.5)
            pids = [sl.pid for sl in backend.slots]
            t_cpu = time.process_time()
            r_cpu = [cpu_seconds(p) for p in pids]
            await asyncio.sleep(5.0)
            idle = {"frontend": time.process_time() - t_cpu,
                    "replicas": [cpu_seconds(p) - c for p, c in zip(pids, r_cpu, strict=True)]}
            return dict(log=log, killed_at=killed_at, old_pid=old_pid, new_pid=victim.pid,
                        deaths=victim.deaths, during=during, after_replica=after_replica,
                        after=after, idle=idle)
        finally:
            await engine.close()

    r = asyncio.run(main())
    log = r["log"]
    on0 = [v for v in log.values() if v["replica"] == 0]
    on1 = [v for v in log.values() if v["replica"] == 1]
    assert len(on0) == len(on1) == 8, {k: v["replica"] for k, v in log.items()}
    for v in on0:
        assert "error" in v and "reason" not in v, v
        assert v["tokens"] < max_tokens
        # The issue asks for 1 s; this host is shared, so the test allows more and the
        # benchmark (`stopline bench replicas`) measures it.
        assert v["error_at"] - r["killed_at"] < 5.0, v
    for v in on1:
        assert "error" not in v and v["reason"] == "length" and v["tokens"] == max_tokens, v
    assert r["during"] in ([], [1]), r["during"]
    assert r["deaths"] == 1 and r["new_pid"] != r["old_pid"]
    assert r["after_replica"] == 0 and sum(len(o.new_token_ids) for o in r["after"]) == 200
    assert r["after"][-1].finish_reason.value == "length"
    # No idle spin: 5 idle seconds cost the front end and each replica well under 5% of a core.
    assert r["idle"]["frontend"] < 0.25, r["idle"]
    assert all(c < 0.25 for c in r["idle"]["replicas"]), r["idle"]


def test_bulk_cancel_fans_out_and_answers_when_every_replica_confirmed(tiny_long_model_dir):
    """abort_and_wait over requests on both replicas: each abort goes to its owner only and
    the call returns when all ended with 'abort'; an abort of an ended or unknown request
    changes nothing; one that arrives before the add was answered is held and applied."""

    async def main() -> dict:
        engine = ray_engine(str(tiny_long_model_dir), EngineConfig(num_blocks=1024), replicas=2)
        await engine.start()
        backend = engine.backend
        try:
            long = SamplingParams(max_tokens=4000, ignore_eos=True)
            streams = [await engine.add(f"b{i}", [3 + i, 4, 5], long) for i in range(6)]
            owners = {s.incarnation: backend.owners.live[s.incarnation].replica for s in streams}
            done = await engine.abort_and_wait(None, AbortSource.CANCEL, timeout=30)
            for s in streams:
                async for _ in s:
                    pass
            # Abort before the add is answered: issued while the add is in flight.
            adding = asyncio.ensure_future(engine.add("early", [7, 7, 7], long, incarnation="early#1"))
            await asyncio.sleep(0)
            engine.abort(["early#1"], AbortSource.CANCEL, time.monotonic())
            early = await adding
            early_out = [o async for o in early]
            # After the end: a tombstone; nothing is sent, nothing changes.
            engine.abort([s.incarnation for s in streams] + ["nobody"], AbortSource.CANCEL, time.monotonic())
            await asyncio.sleep(0.3)
            snaps = await engine.utility("snapshot")
            metrics = ServerMetrics()
            metrics.bind(engine)
            text = metrics.render()[0].decode()
            # Shutdown travels the same way: a drain aborts what is left, source "shutdown".
            # A caller gone while its add is in flight: the replica must not keep running it.
            gone = asyncio.ensure_future(engine.add("gone", [8, 8, 8], long))
            await asyncio.sleep(0)
            gone.cancel()
            left = [await engine.add(f"d{i}", [3 + i, 4, 5], long) for i in range(2)]
            aborted = await engine.drain(0.2)
            drained = []  # an engine-initiated end is an error the consumer raises (issue 46)
            for s in left:
                try:
                    drained.append([o.finish_reason.value async for o in s if o.finished])
                except EngineStopped as e:
                    drained.append([e.source.value])
            await asyncio.sleep(0.3)
            after = await engine.utility("snapshot")
            return dict(owners=owners, done=done, early=early_out, snaps=snaps, text=text,
                        live=dict(backend.owners.live), aborted=aborted, drained=drained,
                        after=after)
        finally:
            await engine.close()

    r = asyncio.run(main())
    assert set(r["owners"].values()) == {0, 1}
    assert r["done"] == {inc: ["abort"] for inc in r["owners"]}
    assert r["early"][-1].finish_reason.value == "abort"
    assert r["live"] == {}
    for snap in r["snaps"]:
        assert snap.kv_blocks_used == 0 and snap.running == snap.waiting == 0
        total_cancel = sum(n for src, _, n in snap.aborts if src == "cancel")
        assert total_cancel >= 3, snap.aborts
    # /metrics: one family, a series per replica, their counts as the replicas report them.
    for rep, snap in enumerate(r["snaps"]):
        assert f'stopline_kv_blocks_total{{replica="{rep}"}} {float(snap.kv_blocks_total)}' in r["text"]
        n = sum(k for src, st, k in snap.aborts if src == "cancel" and st == "running")
        assert (f'stopline_aborts_total{{replica="{rep}",source="cancel",state="running"}} {float(n)}'
                in r["text"])
        assert f'stopline_preemptions_total{{mode="recompute",replica="{rep}"}}' in r["text"] or \
            f'stopline_preemptions_total{{replica="{rep}",mode="recompute"}}' in r["text"]
    assert r["aborted"] == 2 and r["drained"] == [["shutdown"], ["shutdown"]]
    assert sum(sum(n for src, _, n in s.aborts if src == "shutdown") for s in r["after"]) == 2
    for snap in r["after"]:
        assert snap.kv_blocks_used == 0 and snap.running == snap.waiting == 0, snap
