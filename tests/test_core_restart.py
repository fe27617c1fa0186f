"""`stopline serve --restart-core N` (engine/proc/restart.py, issue 47 item 2): a dead engine
core is started again; its open streams end with an error (never a success, never `abort`),
/health says `restarting` (503) meanwhile, and the fresh core serves new requests. A core
stuck past --stuck-kill-s is killed and restarted the same way; past N deaths the server
exits as without the flag.
"""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from tests.server_harness import ServerProcess
from tests.test_liveness import ARGS, _client, _health, _Stream, _wait

pytestmark = pytest.mark.timeout(240)


def _core(srv: ServerProcess) -> dict:
    return _health(srv).json()["roles"][0]


def _serves(srv: ServerProcess) -> str | None:
    out = _client(srv).completions.create(model="tiny", prompt="after", max_tokens=4,
                                          extra_body={"ignore_eos": True})
    return out.choices[0].finish_reason


def test_a_killed_core_is_restarted_its_streams_fail_and_new_ones_are_served(tiny_long_model_dir):
    srv = ServerProcess("--model", str(tiny_long_model_dir), *ARGS, "--restart-core", "3")
    try:
        srv.wait_ready()
        a, b = _Stream(srv, "alpha " * 5), _Stream(srv, "beta " * 5)
        assert a.started.wait(30) and b.started.wait(30) and a.error is None and b.error is None
        pid = srv.core_pid()
        assert _core(srv)["pid"] == pid and _core(srv)["restarts"] == 0
        os.kill(pid, signal.SIGKILL)
        assert a.done.wait(10) and b.done.wait(10)
        for s in (a, b):
            assert s.finish is None and isinstance(s.error, openai.APIError), (s.finish, s.error)
            assert "engine core died" in str(s.error), s.error
        # Until the fresh core is up: 503, and /health names the state and the death.
        while (h := _health(srv)).json()["roles"][0]["state"] == "restarting":
            assert h.status_code == 503
            assert "exited" in (h.json()["roles"][0]["last_error"] or ""), h.json()
            time.sleep(0.05)
        _wait(lambda: _health(srv).status_code == 200, 120, f"never back: {srv.output()}")
        core = _core(srv)
        assert core["state"] == "healthy" and core["restarts"] == 1, core
        assert core["pid"] != pid and srv.core_pid() == core["pid"]
        assert srv.proc.poll() is None
        assert _serves(srv) == "length"
        c = _Stream(srv, "gamma " * 5, max_tokens=30)
        assert c.done.wait(60) and c.error is None and c.finish == "length"
    finally:
        srv.stop()


def test_a_core_stuck_past_the_kill_bound_is_killed_and_restarted(tiny_long_model_dir):
    srv = ServerProcess("--model", str(tiny_long_model_dir), *ARGS, "--stuck-kill-s", "3",
                        "--restart-core", "3")
    pid = None
    try:
        srv.wait_ready()
        a = _Stream(srv, "alpha " * 5)
        assert a.started.wait(30) and a.error is None
        pid = srv.core_pid()
        os.kill(pid, signal.SIGSTOP)
        _wait(lambda: _core(srv)["state"] == "stuck", 5, "never stuck")
        assert a.done.wait(15), "the stuck core was never killed"
        assert isinstance(a.error, openai.APIError) and "killed" in str(a.error), a.error
        _wait(lambda: _health(srv).status_code == 200, 120, f"never back: {srv.output()}")
        assert _core(srv)["pid"] != pid and _core(srv)["restarts"] == 1
        assert _serves(srv) == "length"
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        srv.stop()


def test_past_the_limit_the_core_stays_dead_and_the_server_exits(tiny_long_model_dir):
    srv = ServerProcess("--model", str(tiny_long_model_dir), *ARGS, "--restart-core", "2")
    try:
        srv.wait_ready()
        first = srv.core_pid()
        os.kill(first, signal.SIGKILL)
        _wait(lambda: _health(srv).status_code == 200 and _core(srv)["pid"] != first, 120,
              f"never back: {srv.output()}")
        os.kill(_core(srv)["pid"], signal.SIGKILL)  # the second death within the window
        assert srv.proc.wait(30) == 3, srv.output()  # server/state.py's EXIT_CORE_DIED
        assert "not restarted again" in srv.output()
    finally:
        srv.stop()


def test_restart_core_is_refused_beside_replicas_and_the_split():
    import subprocess
    import sys

    from tests.server_harness import REPO

    for extra in (["--disagg"], ["--in-process"]):
        r = subprocess.run([sys.executable, "-m", "stopline.cli", "serve", "--restart-core", "2", *extra],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "--restart-core" in r.stderr, r.stderr
