"""Liveness of Ray replicas (engine/liveness.py, issue 49 item 5); tests/test_liveness.py runs
this module inside a network namespace of its own, as tests/test_cluster.py runs
cluster_checks.py (Ray's services listen on every interface).

Not collected by a plain `pytest tests/` (the name has no test_ prefix).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from stopline.cluster.cores import ReplicaState
from stopline.cluster.frontend import ray_engine
from stopline.config import EngineConfig
from stopline.engine.liveness import Bounds
from stopline.engine.streams import EngineDead, EngineUnavailable
from stopline.request import AbortSource, SamplingParams
from tests.ray_support import ray_cluster, until  # noqa: F401 - the autouse fixture

pytestmark = pytest.mark.timeout(400)

STUCK_S, KILL_S = 1.0, 8.0


async def _drain(stream, log: dict) -> None:
    try:
        async for out in stream:
            log["tokens"] = log.get("tokens", 0) + len(out.new_token_ids)
            if out.finished:
                log.setdefault("reasons", []).append(out.finish_reason.value)
    except EngineDead as exc:
        log["error"] = str(exc)


def test_a_stuck_replica_is_skipped_its_cancels_confirmed_and_killed_past_the_bound(tiny_long_model_dir):
    """Replica 0 stopped (SIGSTOP): the add the router sent it before it was marked fails
    with 503 within the stuck bound; marked stuck in health(), the router sends new work to
    replica 1; a confirmed cancel of its stream answers at once with 'abort'; resumed, it is
    healthy again and its pool is back (the late abort applied there, its terminal dropped).
    Stopped again past the kill bound: killed, its stream ends with an error, Ray restarts it
    and it serves again."""
    long = SamplingParams(max_tokens=7000, ignore_eos=True)

    async def main() -> dict:
        engine = ray_engine(str(tiny_long_model_dir), EngineConfig(num_blocks=1024), replicas=2,
                            liveness=Bounds(STUCK_S, KILL_S))
        await engine.start()
        backend = engine.backend
        r: dict = {}
        try:
            streams = [await engine.add(f"a{i}", [5 + i, 6, 7], long) for i in range(2)]
            owner = {backend.owners.live[s.incarnation].replica: s for s in streams}
            assert set(owner) == {0, 1}
            logs = {i: {} for i in owner}
            tasks = [asyncio.ensure_future(_drain(owner[i], logs[i])) for i in owner]
            await until(lambda: all(v.get("tokens") for v in logs.values()), 30, "no tokens")
            victim = backend.slots[0]
            pid = victim.pid
            os.kill(pid, signal.SIGSTOP)
            t_stop = time.monotonic()
            try:
                # Open counts tie: before it is marked, the router picks replica 0.
                t0 = time.monotonic()
                try:
                    await asyncio.wait_for(engine.add("tie", [9, 9, 9], long), STUCK_S + 4)
                    r["tie"] = "admitted"
                except EngineUnavailable as exc:
                    r["tie"] = str(exc)
                except TimeoutError:
                    r["tie"] = "no answer"  # waits for the stopped replica
                r["tie_s"] = time.monotonic() - t0
                r["marked_s"] = await until(lambda: victim.state.value == "stuck", 5,
                                             f"never stuck; the tie add: {r['tie']}")
                r["health"] = backend.health()
                s = await engine.add("new", [8, 8, 8], SamplingParams(max_tokens=50, ignore_eos=True))
                r["new_replica"] = backend.owners.live[s.incarnation].replica
                r["new"] = [o.finish_reason.value async for o in s if o.finished]
                t0 = time.monotonic()
                r["cancel"] = await engine.abort_and_wait([owner[0].incarnation], AbortSource.CANCEL,
                                                          timeout=10)
                r["cancel_s"] = time.monotonic() - t0
                r["stuck_for"] = time.monotonic() - t_stop
            finally:
                os.kill(pid, signal.SIGCONT)
            await until(lambda: victim.state is ReplicaState.HEALTHY, 5, "never healthy again")
            await asyncio.sleep(0.5)
            r["after"] = await engine.utility("snapshot")
            await tasks[0]
            r["log0"] = logs[0]
            # Stopped past the kill bound: killed and restarted.
            s = await engine.add("b", [4, 4, 4], long)
            assert backend.owners.live[s.incarnation].replica == 0
            log_b: dict = {}
            task_b = asyncio.ensure_future(_drain(s, log_b))
            await until(lambda: log_b.get("tokens"), 30, "b got no token")
            os.kill(pid, signal.SIGSTOP)
            t_stop = time.monotonic()
            await until(lambda: victim.state is ReplicaState.DEAD, KILL_S + 5, "never killed")
            r["killed_s"] = time.monotonic() - t_stop
            await task_b
            r["log_b"] = log_b
            await until(lambda: victim.state is ReplicaState.HEALTHY, 120, "never restarted")
            r["deaths"], r["new_pid"], r["old_pid"] = victim.deaths, victim.pid, pid
            s = await engine.add("c", [3, 3, 3], SamplingParams(max_tokens=20, ignore_eos=True))
            r["c_replica"] = backend.owners.live[s.incarnation].replica
            r["c"] = [o.finish_reason.value async for o in s if o.finished]
            engine.abort([owner[1].incarnation], AbortSource.CANCEL, time.monotonic())
            await tasks[1]
            return r
        finally:
            await engine.close()

    r = asyncio.run(main())
    assert "did not answer the add" in r["tie"] or "stuck" in r["tie"], r["tie"]
    assert r["tie_s"] < STUCK_S + 1.0, r["tie_s"]
    assert r["stuck_for"] < KILL_S - 1, r["stuck_for"]  # the checks above ran before the kill bound
    states = {h["replica"]: h["state"] for h in r["health"]}
    assert states == {0: "stuck", 1: "healthy"}, r["health"]
    assert r["new_replica"] == 1 and r["new"] == ["length"]
    assert r["cancel"] == {"a0#0": ["abort"]} or list(r["cancel"].values()) == [["abort"]], r["cancel"]
    assert r["cancel_s"] < 0.5, r["cancel_s"]
    assert r["log0"]["reasons"] == ["abort"] and "error" not in r["log0"], r["log0"]
    # Back: replica 0 applied the abort it got while stopped; only replica 1's stream holds blocks.
    assert [s.running for s in r["after"]] == [0, 1], r["after"]
    assert r["after"][0].kv_blocks_used == 0
    assert r["killed_s"] < KILL_S + 2, r["killed_s"]
    assert "killed" in r["log_b"].get("error", ""), r["log_b"]
    assert r["deaths"] == 1 and r["new_pid"] != r["old_pid"]
    assert r["c"] == ["length"]
