"""`stopline serve --restart-core N` (engine/proc/restart.py, issue 47 item 2): a dead engine
core is started again; its open streams end with an error (never a success, never `abort`),
/health says `restarting` (503) meanwhile, and the fresh core serves new requests. A core
stuck past --stuck-kill-s is killed and restarted the same way; past N deaths the server
exits as without the flag.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import openai
import pytest

from tests.server_harness import ServerProcess
from tests.test_liveness import ARGS, _client, _health, _Stream, _wait

pytestmark = pytest.mark.timeout(240)


def _core(srv: ServerProcess) -> dict:
    return _health(srv).json()["roles"][0]


def _back_from(srv: ServerProcess, dead: int) -> bool:
    """Serving again on another core, from one /health read (two reads can straddle the
    death: a 200 from the old core, then a restarting answer with no pid)."""
    h = _health(srv)
    return h.status_code == 200 and h.json()["roles"][0]["pid"] not in (None, dead)


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

        _wait(lambda: _back_from(srv, first), 120, f"never back: {srv.output()}")
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


class _RawStream:
    """A streamed completion read raw off the SSE wire on a thread: how many terminal messages
    it got (a chunk with a finish_reason, or an error event), and the errors' text."""

    def __init__(self, srv: ServerProcess, prompt: str) -> None:
        import threading

        self.terminals: list[str] = []
        self.started, self.done = threading.Event(), threading.Event()

        def run() -> None:
            import httpx

            body = {"model": "tiny", "prompt": prompt, "max_tokens": 7000, "stream": True,
                    "ignore_eos": True}
            try:
                with httpx.stream("POST", srv.base + "/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        data = json.loads(line[6:])
                        if "error" in data:
                            self.terminals.append(f"error: {data['error'].get('message')}")
                        elif data["choices"][0].get("finish_reason"):
                            self.terminals.append(data["choices"][0]["finish_reason"])
                        self.started.set()
            finally:
                self.started.set()
                self.done.set()

        threading.Thread(target=run, daemon=True).start()


def _promoted_after_kill(srv: ServerProcess) -> dict:
    """Kill the serving core under two open streams; returns /health's core once it serves
    again, after checking what the streams and the new core say."""
    before = _core(srv)
    spare = before["standby"]
    assert spare["state"] == "ready" and spare["pid"] not in (None, before["pid"]), before
    a, b = _RawStream(srv, "alpha " * 5), _RawStream(srv, "beta " * 5)
    assert a.started.wait(30) and b.started.wait(30)
    os.kill(before["pid"], signal.SIGKILL)
    assert a.done.wait(30) and b.done.wait(30)
    for s in (a, b):  # the engine's own stop, exactly once: never a success, never `abort`
        assert len(s.terminals) == 1 and "engine core died" in s.terminals[0], s.terminals
    _wait(lambda: _health(srv).status_code == 200, 60, f"never back: {srv.output()}")
    core = _core(srv)
    # The spare itself serves: no model was loaded in between.
    assert core["state"] == "healthy" and core["pid"] == spare["pid"], (before, core)
    assert core["restarts"] == before["restarts"] + 1 and core["promoted"] == before["promoted"] + 1
    assert _serves(srv) == "length"
    return core


def test_a_standby_core_takes_over_a_killed_core_twice(tiny_long_model_dir):
    """--standby-core (issue 47 item 2, recovery under 30 s): a spare core loaded and asleep
    is promoted when the core is killed under load; its streams end with the engine's error
    exactly once, the next request is served by the spare, a new spare is loaded, and a second
    kill is survived the same way; the ownership audit is clean throughout."""
    srv = ServerProcess("--model", str(tiny_long_model_dir), *ARGS, "--restart-core", "5",
                        "--standby-core", "--audit-every", "1")
    try:
        srv.wait_ready()
        _wait(lambda: (_core(srv).get("standby") or {}).get("state") == "ready", 120,
              f"no standby: {srv.output()}")
        first = _core(srv)
        assert first["promoted"] == 0 and first["restarts"] == 0
        seen = {first["pid"], first["standby"]["pid"]}
        for kill in (1, 2):
            core = _promoted_after_kill(srv)
            assert core["promoted"] == kill
            _wait(lambda: (_core(srv).get("standby") or {}).get("state") == "ready", 120,
                  f"no new standby after kill {kill}: {srv.output()}")
            fresh = _core(srv)["standby"]["pid"]
            assert fresh not in seen, (fresh, seen)  # a new process, not the one that died
            seen.add(fresh)
        c = _Stream(srv, "gamma " * 5, max_tokens=30)
        assert c.done.wait(60) and c.error is None and c.finish == "length"
        m = httpx.get(srv.base + "/metrics", timeout=5).text
        audits = re.search(r"^stopline_audits_total (\S+)", m, re.M)
        failed = re.search(r"^stopline_audit_failures_total (\S+)", m, re.M)
        assert audits and float(audits.group(1)) > 0, m[-2000:]
        assert failed and float(failed.group(1)) == 0, m[-2000:]
        out = srv.output()
        assert "Traceback" not in out and "standby engine core died" not in out, out
    finally:
        srv.stop()


def test_standby_core_needs_restart_core():
    import subprocess
    import sys

    from tests.server_harness import REPO

    r = subprocess.run([sys.executable, "-m", "stopline.cli", "serve", "--standby-core"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--standby-core needs --restart-core" in r.stderr, r.stderr


def test_a_promoted_standby_serves_the_loaded_adapters(tiny_long_model_dir, tmp_path):
    """The promoted standby is caught up with the LoRA adapters loaded (at start or over HTTP,
    less the ones unloaded): each gives the same greedy text as before the kill."""
    from tests.lora_support import make_adapter

    ad = {n: make_adapter(tiny_long_model_dir, tmp_path / n, seed=s, std=0.3)
          for n, s in (("one", 1), ("two", 2), ("three", 3))}
    srv = ServerProcess("--model", str(tiny_long_model_dir), *ARGS, "--restart-core", "3",
                        "--standby-core", "--lora", f"one={ad['one']}", "--max-lora-rank", "8")

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(srv.base + path, json=body, timeout=60)

    def text(model: str) -> str:
        r = post("/v1/completions", {"model": model, "prompt": "The capital", "max_tokens": 12,
                                     "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    try:
        srv.wait_ready()
        for name in ("two", "three"):
            assert post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(ad[name])}
                        ).status_code == 200
        assert post("/v1/unload_lora_adapter", {"lora_name": "three"}).status_code == 200
        before = {m: text(m) for m in ("tiny", "one", "two")}
        assert len(set(before.values())) == 3, before  # the adapters change the text
        _wait(lambda: (_core(srv).get("standby") or {}).get("state") == "ready", 120,
              f"no standby: {srv.output()}")
        pid = _core(srv)["pid"]
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: _back_from(srv, pid), 60, f"never back: {srv.output()}")
        assert _core(srv)["promoted"] == 1
        assert {m: text(m) for m in before} == before
        r = post("/v1/completions", {"model": "three", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 404, r.text  # unloaded before the kill: not loaded again
    finally:
        srv.stop()


def test_a_dead_standby_is_replaced_and_a_kill_during_its_load_waits_for_it(tiny_long_model_dir):
    """The standby's own death costs the serving core nothing: another standby loads. A kill of
    the core while the next standby still loads is answered by that standby once loaded (no
    third process)."""
    srv = ServerProcess("--model", str(tiny_long_model_dir), *ARGS, "--restart-core", "5",
                        "--standby-core")

    def standby() -> dict:
        return _core(srv).get("standby") or {}

    try:
        srv.wait_ready()
        _wait(lambda: standby().get("state") == "ready", 120, f"no standby: {srv.output()}")
        core, spare = _core(srv)["pid"], standby()["pid"]
        os.kill(spare, signal.SIGKILL)
        _wait(lambda: standby().get("pid") not in (None, spare), 60, f"not replaced: {srv.output()}")
        assert _health(srv).status_code == 200 and _core(srv)["pid"] == core
        assert _core(srv)["restarts"] == 0 and _serves(srv) == "length"
        assert "the standby engine core died" in srv.output()
        _wait(lambda: standby().get("state") == "ready", 120, f"no standby: {srv.output()}")
        # Kill the core, then the promoted one at once, while the next standby loads.
        os.kill(_core(srv)["pid"], signal.SIGKILL)
        _wait(lambda: _health(srv).status_code == 200 and _core(srv)["promoted"] == 1, 60,
              f"never back: {srv.output()}")
        loading = standby()
        assert loading.get("pid"), loading  # named while it loads (or already ready)
        os.kill(_core(srv)["pid"], signal.SIGKILL)
        _wait(lambda: _health(srv).status_code == 200 and _core(srv)["promoted"] == 2, 120,
              f"never back: {srv.output()}")
        assert _core(srv)["pid"] == loading["pid"]  # that standby, not a fresh process
        assert _serves(srv) == "length"
        assert "Traceback" not in srv.output()
    finally:
        srv.stop()
