"""Liveness of the processes the front end depends on (engine/liveness.py, issue 49 items
4-5): a process stopped with SIGSTOP is marked stuck in /health, gets no new work (the split
fails new requests at once with 503, the router skips a stuck replica), its requests'
cancels are confirmed by the front end at once, it rejoins when it resumes (its late
terminals dropped, its KV freed there), and past the longer bound it is killed.

Real processes: `stopline serve` as tests/test_disagg_serve.py starts it; the Ray replicas
in a network namespace of their own as tests/test_cluster.py runs them
(tests/liveness_checks.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from stopline.request import FinishReason
from tests.disagg_support import make_pair
from tests.engine_support import greedy
from tests.server_harness import REPO, ServerProcess, serving
from tests.test_cluster import _can_unshare

pytestmark = pytest.mark.timeout(180)

STUCK_S = 1.0
KILL_S = 12.0  # the split's: longer than any stop of the tests before its own kill test
ARGS = ("--served-model-name", "tiny", "--block-size", "4", "--num-blocks", "4096",
        "--max-num-batched-tokens", "64", "--stuck-s", str(STUCK_S))


def _client(srv: ServerProcess, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=timeout)


def _health(srv: ServerProcess) -> httpx.Response:
    return httpx.get(srv.base + "/health", timeout=5)


def _roles(srv: ServerProcess) -> dict[str, dict]:
    return {r["role"]: r for r in _health(srv).json()["roles"]}


def _wait(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.05)
    return time.monotonic() - t0


class _Stream:
    """A streaming completion read on a thread: its id, tokens, how it ended."""

    def __init__(self, srv: ServerProcess, prompt: str, max_tokens: int = 7000) -> None:
        self.id: str | None = None
        self.chunks = 0
        self.finish: str | None = None
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.done = threading.Event()
        client = _client(srv)

        def run() -> None:
            try:
                for ch in client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                    stream=True, extra_body={"ignore_eos": True}):
                    self.id = ch.id
                    if ch.choices and ch.choices[0].text:
                        self.chunks += 1
                        self.started.set()
                    if ch.choices and ch.choices[0].finish_reason:
                        self.finish = ch.choices[0].finish_reason
            except Exception as exc:  # the error event surfaces as an exception
                self.error = exc
            finally:
                self.started.set()
                self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()


@pytest.fixture(scope="module")
def split(tiny_long_model_dir):
    with serving(ServerProcess("--model", str(tiny_long_model_dir), *ARGS, "--disagg", "--reclaim-s", "2",
                               "--stuck-kill-s", str(KILL_S))) as srv:
        yield srv


def test_stuck_prefill_fails_new_requests_fast_and_rejoins(split):
    """Item 4: prefill stopped; a request that needs it gets 503 within the stuck bound
    (not when prefill resumes), /health names the stuck role, and it serves again after."""
    pid = _roles(split)["prefill"]["pid"]
    long_prompt = "the quick brown fox " * 20
    _client(split).completions.create(model="tiny", prompt=long_prompt, max_tokens=2)  # warm
    os.kill(pid, signal.SIGSTOP)
    try:
        # At once: not marked yet, so the add reaches the stopped role, whose reply never comes.
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as first:
            _client(split, timeout=8).completions.create(model="tiny", prompt=long_prompt, max_tokens=4)
        assert first.value.status_code == 503, first.value
        # Within the stuck bound and some slack for a shared host; not the whole stop.
        assert time.monotonic() - t0 < STUCK_S + 3, time.monotonic() - t0
        _wait(lambda: _health(split).status_code == 503, 3, "/health never said the prefill role is stuck")
        body = _health(split).json()
        assert "prefill" in body["detail"] and "stuck" in body["detail"], body
        roles = {r["role"]: r for r in body["roles"]}
        assert roles["prefill"]["state"] == "stuck" and roles["decode"]["state"] == "healthy", roles
        # Marked: new requests fail at once with a clear 503.
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as second:
            _client(split, timeout=8).completions.create(model="tiny", prompt=long_prompt, max_tokens=4)
        assert second.value.status_code == 503 and "stuck" in str(second.value), second.value
        assert time.monotonic() - t0 < 0.5
        snap = httpx.get(split.base + "/v1/console/snapshot", timeout=5).json()
        assert {p["role"]: p["state"] for p in snap["processes"]}["prefill"] == "stuck"
    finally:
        os.kill(pid, signal.SIGCONT)
    _wait(lambda: _health(split).status_code == 200, 5, "the prefill role never rejoined")
    r = _client(split).completions.create(model="tiny", prompt=long_prompt, max_tokens=4,
                                          extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    # What the stopped role had admitted was aborted when it came back: it holds nothing.
    _wait(lambda: split.metrics()['stopline_kv_blocks_used{replica="prefill"}'] == 0, 5,
          "the prefill role kept blocks of a request the front end gave up")


def test_stuck_decode_cancel_is_confirmed_at_once(split):
    """Item 5 for the split: decode (whose outputs are the streams) stopped; a confirmed
    cancel of its stream answers within the stuck bound with 'abort', the stream ends with
    'abort'; when decode resumes its late terminal is dropped and its KV freed."""
    s = _Stream(split, "once upon a time " * 10)
    assert s.started.wait(30) and s.error is None, s.error
    pid = _roles(split)["decode"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(0.1)
        t0 = time.monotonic()
        r = httpx.post(f"{split.base}/v1/requests/{s.id}/cancel", timeout=8)
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["cancelled"] is True, r.text
        assert r.json()["finish_reasons"] == ["abort"]
        assert took < STUCK_S + 3, took
        assert s.done.wait(5) and s.error is None and s.finish == "abort", (s.error, s.finish)
        assert _health(split).status_code == 503 and _roles(split)["decode"]["state"] == "stuck"
    finally:
        os.kill(pid, signal.SIGCONT)
    _wait(lambda: _health(split).status_code == 200, 5, "the decode role never rejoined")
    _wait(lambda: split.metrics()['stopline_kv_blocks_used{replica="decode"}'] == 0, 5,
          "decode kept the cancelled request's blocks")
    r = _client(split).completions.create(model="tiny", prompt="x y z", max_tokens=3,
                                          extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"


def test_stuck_role_past_the_kill_bound_is_killed(split):
    """Last on this server: decode stopped past --stuck-kill-s is killed; its stream ends with
    an error that says so (not a success, not 'abort'), and /health names it (503) until its
    restart is up."""
    s = _Stream(split, "in a hole in the ground " * 4)
    assert s.started.wait(30) and s.error is None, s.error
    pid = _roles(split)["decode"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        assert s.done.wait(KILL_S + 10), "the stuck decode role was never killed"
        assert time.monotonic() - t_stop >= KILL_S - 0.5
        assert isinstance(s.error, openai.APIError) and "killed" in str(s.error), s.error
        roles = _roles(split)
        # Dead, then restarted (tests/test_disagg_restart.py): until a new process serves, 503.
        assert "killed" in roles["decode"]["last_error"], roles
        assert roles["prefill"]["state"] == "healthy"
        if roles["decode"]["state"] in ("dead", "restarting"):
            assert _health(split).status_code == 503
        else:
            assert roles["decode"]["state"] == "healthy" and roles["decode"]["pid"] != pid, roles
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_core_stuck_past_the_kill_bound_is_killed(tiny_long_model_dir):
    """The engine-core process of a plain serve: stuck -> /health 503 naming it, new requests
    503 at once, a cancel confirmed by the front end; past --stuck-kill-s it is killed, its
    open streams end with an error, and the server exits EXIT_CORE_DIED (3) for its
    supervisor to restart."""
    srv = ServerProcess("--model", str(tiny_long_model_dir), *ARGS, "--stuck-kill-s", "4")
    try:
        srv.wait_ready()
        a, b = _Stream(srv, "alpha " * 5), _Stream(srv, "beta " * 5)
        assert a.started.wait(30) and b.started.wait(30) and a.error is None and b.error is None
        pid = srv.core_pid()
        os.kill(pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        _wait(lambda: _health(srv).status_code == 503, 3, "/health never said the core is stuck")
        body = _health(srv).json()
        assert body["roles"][0]["state"] == "stuck" and "stuck" in body["detail"], body
        with pytest.raises(openai.APIStatusError) as refused:
            _client(srv, timeout=5).completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert refused.value.status_code == 503
        r = httpx.post(f"{srv.base}/v1/requests/{a.id}/cancel", timeout=5)
        assert r.json()["cancelled"] is True and r.json()["finish_reasons"] == ["abort"], r.text
        assert a.done.wait(5) and a.finish == "abort"
        # b stays open until the kill: then it ends with an error, not a success.
        assert b.done.wait(15), "the stuck core was never killed"
        assert isinstance(b.error, openai.APIError) and "killed" in str(b.error), b.error
        assert srv.proc.wait(15) == 3
        assert time.monotonic() - t_stop < 4 + 2 + 5
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except (OSError, NameError):
            pass
        srv.stop()


def test_watch_marks_silence_and_long_steps_and_says_when_to_kill():
    from stopline.engine.liveness import Bounds, Watch

    now = [0.0]
    w = Watch("replica 0", Bounds(1.0, 3.0), clock=lambda: now[0])
    assert Bounds(1.0, 3.0).beat_s == 0.25
    with pytest.raises(ValueError):
        Bounds(2.0, 1.0)
    now[0] = 0.9
    assert w.check() is None
    now[0] = 1.2  # no answer since 0
    assert w.check() == "replica 0 answered no heartbeat for 1.2 s" and not w.overdue()
    w.answer(0.0)
    assert w.check() is None
    w.answer(0.5)  # answers, but has been in one step for 0.5 s
    now[0] = 1.9
    assert w.check() == "replica 0 has been in one step for 1.2 s"
    now[0] = 4.3
    assert w.check() == "replica 0 answered no heartbeat for 3.1 s" and w.overdue()
    w.reset()
    assert w.check() is None and w.stuck is None


def test_decode_reclaims_a_wait_the_prefill_side_never_took(tiny_model_dir):
    """Item 4's second cause: decode armed its reclaim clock only at prefill's first
    heartbeat, so a request prefill never took (stopped before it) waited on decode forever.
    The clock now runs from the moment it waits."""
    from stopline.model.loaders.loader import load_model

    pr = make_pair(load_model(str(tiny_model_dir), progress=False), reclaim_s=0.3)
    try:
        inc = pr.d.add_request("a", list(range(5, 45)), greedy(4))  # decode only: prefill never hears of it
        t0 = time.monotonic()
        while pr.d.has_unfinished():
            pr.step_d()
            assert time.monotonic() - t0 < 3, "decode waits for a transfer nobody will send"
            time.sleep(0.005)
        r = pr.out[("a", 0)]
        assert r.finish_reason is FinishReason.ERROR and "reclaim deadline" in r.stop_detail, r
        assert inc and pr.d.pool.num_used == 0
    finally:
        pr.close()


@pytest.mark.timeout(600)
@pytest.mark.skipif(not _can_unshare(), reason="needs `unshare -n` (root) to keep Ray on loopback")
def test_replicas_liveness_in_a_network_namespace():
    pytest.importorskip("ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    inner = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
             "tests/liveness_checks.py"]
    cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *inner]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=580)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    m = re.search(r"(\d+) passed", proc.stdout)
    assert m and int(m.group(1)) >= 1 and "failed" not in proc.stdout, tail


def test_a_loop_stuck_outside_a_step_reports_its_age(tiny_model_dir):
    """Liveness is progress (issue 47 item 2): the age a heartbeat reports grows while the
    loop is held anywhere in an iteration (here a utility call that never returns), not only
    inside a step; it is 0 while the loop waits idle."""
    from stopline import LLM
    from stopline.engine.core_loop import CoreLoop

    core = LLM(model=str(tiny_model_dir), progress=False).engine
    held, release = threading.Event(), threading.Event()

    def wedged_audit() -> None:
        held.set()
        release.wait(10)

    core.audit = wedged_audit
    loop = CoreLoop(core, lambda batch: None)
    t = threading.Thread(target=loop.run, daemon=True)
    t.start()
    try:
        _wait(lambda: loop._busy_since is None, 5, "the loop never went idle")
        assert loop.step_age() == 0.0
        fut = loop.call("audit")
        assert held.wait(5)
        time.sleep(0.3)
        assert loop.step_age() >= 0.25  # held between steps: the heartbeat says so
        release.set()
        fut.result(5)
        _wait(lambda: loop.step_age() == 0.0, 5, "idle again, age 0")
    finally:
        release.set()
        loop.stop()
        t.join(5)


def test_a_sleeping_or_halted_loop_is_not_in_a_step(tiny_model_dir):
    """A core held on purpose (asleep, or halted by a keep pause) waits like an idle one: its
    heartbeat's age is 0, so it is never marked stuck or killed for it (a sleeping standby
    core, engine/proc/restart.py, would be)."""
    from stopline import LLM
    from stopline.engine.core_loop import CoreLoop

    core = LLM(model=str(tiny_model_dir), progress=False).engine
    loop = CoreLoop(core, lambda batch: None)
    t = threading.Thread(target=loop.run, daemon=True)
    t.start()
    try:
        for method, arg in (("sleep", {"level": 1}), ("wake", None), ("halt", {"on": True})):
            loop.call(method, *([arg] if arg else [])).result(5)
            _wait(lambda: loop._busy_since is None, 5, f"{method}: the loop never waited")
            time.sleep(0.3)
            assert loop.step_age() == 0.0, method
    finally:
        loop.stop()
        t.join(5)
