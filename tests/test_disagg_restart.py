"""A role of the split that dies is restarted (issue 49): over the real role processes
(`disagg_engine`, as `serve --disagg` runs them, and `stopline serve --disagg` over HTTP).

- prefill SIGKILLed: its in-flight request whose KV decode has not taken errors, the role is
  `restarting` (new requests 503) and then `healthy` in a new process, a new request gives
  the same greedy output as before the kill, and the audit is clean on both roles;
- the same for decode (every open stream errors);
- a role stuck past the kill bound is killed and restarted;
- a role that keeps dying is restarted only up to the bound, then stays dead (503), and the
  log says why; `close()` during a restart starts nothing more;
- beside a remote role (TCP), the local one is restarted; the remote one is not.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import httpx
import openai
import pytest

from stopline.config import EngineConfig
from stopline.disagg.frontend import Restarts, disagg_engine
from stopline.engine.async_engine import AsyncEngine
from stopline.engine.liveness import Bounds
from stopline.engine.streams import EngineDead, EngineUnavailable
from stopline.request import FinishReason, SamplingParams
from tests.server_harness import ServerProcess

pytestmark = pytest.mark.timeout(300)

UP_S = 120.0  # a role loads its model in seconds, tens of seconds on a loaded machine


def _config(**kw: object) -> EngineConfig:
    base: dict = dict(block_size=4, num_blocks=4096, max_num_batched_tokens=64)
    return EngineConfig(**(base | kw))


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [10 + (i * 7 + seed) % 480 for i in range(n)]


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


async def _tokens(engine: AsyncEngine, rid: str) -> list[int]:
    """A greedy request over the split (its prompt has full blocks: prefill computes them)."""
    stream = await engine.add(rid, _prompt(41, seed=3), GREEDY)
    outs = [o async for o in stream]
    assert outs[-1].finish_reason is FinishReason.LENGTH
    return [t for o in outs for t in o.new_token_ids]


async def _until(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        await asyncio.sleep(0.02)


async def _snap(engine: AsyncEngine, role: str):
    prefill, decode = await engine.utility("snapshot")
    return prefill if role == "prefill" else decode


async def _drain(stream) -> BaseException | None:
    try:
        async for _ in stream:
            pass
    except Exception as exc:  # the death surfaces as EngineDead
        return exc
    return None


async def _back_and_clean(engine: AsyncEngine, role: str, old_pid: int) -> None:
    backend = engine.backend
    await _until(lambda: backend.state[role] == "healthy", UP_S, f"the {role} role never came back")
    assert backend.cores[role].pid not in (None, old_pid)
    assert backend.state == {"prefill": "healthy", "decode": "healthy"}
    # Both roles hold nothing of the requests the death ended (the survivor aborted its copies).
    for r in ("prefill", "decode"):
        end = time.monotonic() + 10
        while (used := (await _snap(engine, r)).kv_blocks_used) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        assert used == 0, (r, used)
    assert len(await engine.utility("audit")) == 2  # both roles audited, both clean
    # Not asserted: that prefill ended no hand-off at its send deadline. A request decode
    # served just before the kill sometimes has its ack never read by prefill, which then
    # ends it there at the deadline (decode had taken it: the client never sees it).


def test_prefill_killed_is_restarted(tiny_long_model_dir):
    async def run() -> None:
        engine = disagg_engine(str(tiny_long_model_dir), _config(), reclaim_s=2.0, progress=False)
        await engine.start()
        backend = engine.backend
        try:
            before = await _tokens(engine, "before")
            old_pid = backend.cores["prefill"].pid
            # A long prompt in prefill when the kill lands: decode has not taken its KV.
            s = await engine.add("long", _prompt(3000, seed=1), SamplingParams(max_tokens=4, ignore_eos=True))
            while (await _snap(engine, "prefill")).running == 0:
                await asyncio.sleep(0.005)
            os.kill(old_pid, signal.SIGKILL)
            exc = await asyncio.wait_for(_drain(s), 10)
            assert isinstance(exc, EngineDead) and "prefill engine died" in str(exc), exc
            assert backend.state["prefill"] in ("restarting", "healthy")
            if backend.state["prefill"] == "restarting":
                with pytest.raises(EngineUnavailable, match="prefill engine is restarting"):
                    await engine.add("refused", _prompt(41), GREEDY)
            await _back_and_clean(engine, "prefill", old_pid)
            await engine.utility("reset_prefix_cache")  # decode computes from the new KV, not its cache
            assert await _tokens(engine, "after") == before
            await _back_and_clean(engine, "prefill", old_pid)
        finally:
            await engine.close()

    asyncio.run(run())


def test_prefill_killed_while_an_add_awaits_its_reply_names_the_role(tiny_long_model_dir):
    """The prefill process dies between the add's send and its reply (CI saw this under
    `serve --disagg`): the add fails with an error that names the dead role, as the streams
    that death ends do, not the bare exit code; decode keeps nothing of it."""

    async def run() -> None:
        engine = disagg_engine(str(tiny_long_model_dir), _config(), reclaim_s=2.0, progress=False)
        await engine.start()
        backend = engine.backend
        prefill = backend.cores["prefill"]
        old_pid = prefill.pid
        real_add = prefill.add

        async def add_then_die(*args, **kw):
            os.kill(old_pid, signal.SIGKILL)
            await asyncio.sleep(0)  # the add goes out after the kill: its reply never comes
            return await real_add(*args, **kw)

        prefill.add = add_then_die
        try:
            with pytest.raises(EngineDead, match="the prefill engine died: "):
                await engine.add("mid-add", _prompt(41), GREEDY)
            assert not engine._streams  # nothing of it stays in the front end
            await _back_and_clean(engine, "prefill", old_pid)
        finally:
            await engine.close()

    asyncio.run(run())


def test_decode_killed_is_restarted(tiny_long_model_dir):
    async def run() -> None:
        engine = disagg_engine(str(tiny_long_model_dir), _config(), reclaim_s=2.0, progress=False)
        await engine.start()
        backend = engine.backend
        try:
            before = await _tokens(engine, "before")
            old_pid = backend.cores["decode"].pid
            streams = [await engine.add(f"s{i}", _prompt(30, seed=i), SamplingParams(max_tokens=7000, ignore_eos=True))
                       for i in range(2)]
            while (await _snap(engine, "decode")).running < 2:
                await asyncio.sleep(0.005)
            os.kill(old_pid, signal.SIGKILL)
            for s in streams:
                exc = await asyncio.wait_for(_drain(s), 10)
                assert isinstance(exc, EngineDead) and "decode engine died" in str(exc), exc
            assert backend.state["decode"] in ("restarting", "healthy")
            await _back_and_clean(engine, "decode", old_pid)
            await engine.utility("reset_prefix_cache")  # decode computes from the new KV, not its cache
            assert await _tokens(engine, "after") == before
            await _back_and_clean(engine, "decode", old_pid)
        finally:
            await engine.close()

    asyncio.run(run())


def test_a_role_stuck_past_the_kill_bound_is_killed_and_restarted(tiny_long_model_dir):
    """SIGSTOP on decode: stuck after 0.5 s, killed after 3 s, then restarted in a new process
    (the stopped one is gone: SIGKILL works on a stopped process)."""

    async def run() -> None:
        engine = disagg_engine(str(tiny_long_model_dir), _config(), reclaim_s=2.0, progress=False,
                               liveness=Bounds(0.5, 3.0))
        await engine.start()
        backend = engine.backend
        try:
            before = await _tokens(engine, "before")
            pid = backend.cores["decode"].pid
            os.kill(pid, signal.SIGSTOP)
            await _until(lambda: backend.state["decode"] == "stuck", 10, "never marked stuck")
            await _until(lambda: backend.state["decode"] == "restarting", 20, "never killed")
            assert "killed" in backend.errors["decode"]
            await _back_and_clean(engine, "decode", pid)
            assert await _tokens(engine, "after") == before
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            await engine.close()

    asyncio.run(run())


def test_a_role_that_keeps_dying_stays_dead(tiny_long_model_dir, caplog):
    """limit 2: the first death restarts at once, the second within the window is the last."""

    async def run() -> None:
        engine = disagg_engine(str(tiny_long_model_dir), _config(), reclaim_s=2.0, progress=False,
                               restarts=Restarts(limit=2, window_s=600, first_s=0.5))
        await engine.start()
        backend = engine.backend
        try:
            pid = backend.cores["prefill"].pid
            os.kill(pid, signal.SIGKILL)
            await _until(lambda: backend.state["prefill"] == "restarting", 10, "no restart began")
            await _until(lambda: backend.state["prefill"] == "healthy", UP_S, "never came back")
            pid2 = backend.cores["prefill"].pid
            assert pid2 != pid
            os.kill(pid2, signal.SIGKILL)
            await _until(lambda: backend.state["prefill"] == "dead", 10, "the second death not seen")
            await asyncio.sleep(1.5)  # past any back-off: still dead, no new process
            assert backend.state["prefill"] == "dead" and backend.cores["prefill"].pid == pid2
            with pytest.raises(EngineUnavailable, match="prefill engine is dead"):
                await engine.add("refused", _prompt(41), GREEDY)
            assert backend.state["decode"] == "healthy"
        finally:
            await engine.close()

    with caplog.at_level(logging.ERROR, logger="stopline.disagg"):
        asyncio.run(run())
    assert "died 2 times within 600 s" in caplog.text and "not restarted again" in caplog.text


def test_close_during_a_restart_starts_nothing(tiny_long_model_dir):
    async def run() -> None:
        engine = disagg_engine(str(tiny_long_model_dir), _config(), reclaim_s=2.0, progress=False)
        await engine.start()
        backend = engine.backend
        os.kill(backend.cores["decode"].pid, signal.SIGKILL)
        await _until(lambda: backend.state["decode"] == "restarting", 10, "no restart began")
        await engine.close()
        assert backend.state["decode"] == "closed"
        assert all(t.done() for t in backend._restarting.values())
        proc = backend.cores["decode"].proc
        assert proc is None or not proc.is_alive()
        await asyncio.sleep(0.5)
        assert backend.state["decode"] == "closed"

    asyncio.run(run())


ARGS = ("--served-model-name", "tiny", "--block-size", "4", "--num-blocks", "4096",
        "--max-num-batched-tokens", "64")


def test_health_over_http_restarting_then_healthy(tiny_long_model_dir):
    """`serve --disagg`: after a SIGKILL of prefill, /health is 503 `restarting` (with
    Retry-After), then 200 with a new pid, and the same greedy request gives the same text."""
    srv = ServerProcess("--model", str(tiny_long_model_dir), *ARGS, "--disagg", "--reclaim-s", "2")
    try:
        srv.wait_ready()
        client = srv.openai()

        def ask() -> str:
            return client.completions.create(model="tiny", prompt="the quick brown fox " * 6,
                                             max_tokens=12, temperature=0.0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        def roles() -> tuple[httpx.Response, dict[str, dict]]:
            r = httpx.get(srv.base + "/health", timeout=5)
            return r, {x["role"]: x for x in r.json()["roles"]}

        before = ask()
        pid = roles()[1]["prefill"]["pid"]
        os.kill(pid, signal.SIGKILL)
        end = time.monotonic() + 10
        while (r := roles())[0].status_code == 200:
            assert time.monotonic() < end, "/health never noticed the death"
            time.sleep(0.02)
        health, by_role = r
        assert health.status_code == 503 and health.headers.get("Retry-After")
        # The death and the start of the restart are one step of the front end: no "dead" between.
        assert by_role["prefill"]["state"] == "restarting", by_role
        assert "prefill engine is restarting" in health.json()["detail"]
        try:
            ask()
            assert roles()[1]["prefill"]["state"] == "healthy"  # the restart won the race
        except openai.APIStatusError as refused:
            assert refused.status_code == 503 and refused.response.headers.get("Retry-After")
            assert "restarting" in str(refused)
        end = time.monotonic() + UP_S
        while (r := roles())[0].status_code != 200:
            assert time.monotonic() < end, r[1]
            time.sleep(0.1)
        assert r[1]["prefill"]["state"] == "healthy" and r[1]["prefill"]["pid"] not in (None, pid)
        assert ask() == before
    finally:
        srv.stop()


def test_local_role_beside_a_remote_one_is_restarted_and_the_remote_one_is_not(tiny_long_model_dir):
    """Prefill remote (`stopline role`, TCP): the local decode role, killed, is restarted on the
    same TCP link ports and serves the same greedy text; the remote role, killed, stays dead."""
    from tests.test_disagg_remote import _split

    srv, role = _split(tiny_long_model_dir, "prefill")
    try:
        srv.wait_ready()
        client = srv.openai()

        def ask() -> str:
            return client.completions.create(model="tiny", prompt="the quick brown fox " * 6,
                                             max_tokens=12, temperature=0.0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        def roles() -> dict[str, dict]:
            return {x["role"]: x for x in httpx.get(srv.base + "/health", timeout=5).json()["roles"]}

        before = ask()
        pid = roles()["decode"]["pid"]
        os.kill(pid, signal.SIGKILL)
        end = time.monotonic() + UP_S
        while not ((r := roles())["decode"]["state"] == "healthy" and r["decode"]["pid"] != pid):
            assert time.monotonic() < end, r
            time.sleep(0.1)
        assert httpx.get(srv.base + "/health", timeout=5).status_code == 200
        assert ask() == before
        role.proc.kill()
        end = time.monotonic() + 10
        while roles()["prefill"]["state"] != "dead":
            assert time.monotonic() < end, roles()
            time.sleep(0.05)
        time.sleep(1.5)
        assert roles()["prefill"]["state"] == "dead"  # another host's process: not restarted here
        assert httpx.get(srv.base + "/health", timeout=5).status_code == 503
    finally:
        srv.stop()
        role.stop()
