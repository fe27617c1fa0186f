"""One role of `serve --disagg` on "another host": started on its own as `stopline role`,
reached over TCP on the address the front end listens on (loopback here). Output equals one
engine's, the KV crosses, a cancel reaches the remote role, a killed remote role is named
in /health and its streams end within 1 s, and a role that loaded another model is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest

from tests.server_harness import REPO, ServerProcess, free_ports

pytestmark = pytest.mark.timeout(180)

RECLAIM_S = 2.0
ENGINE = ("--block-size", "4", "--num-blocks", "4096", "--max-num-batched-tokens", "64")


class Role:
    """`stopline role ROLE --front 127.0.0.1:P` as its own process."""

    def __init__(self, role: str, front: str, model_dir, *extra: str) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix=f"stopline-role-{role}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stopline.cli", "role", role, "--front", front,
             "--model", str(model_dir), "--reclaim-s", str(RECLAIM_S), *ENGINE, *extra],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.log.close()


def _split(model_dir, remote: str, *role_extra: str) -> tuple[ServerProcess, Role]:
    front = f"127.0.0.1:{free_ports(5)}"
    srv = ServerProcess("--model", str(model_dir), "--served-model-name", "tiny", *ENGINE,
                        "--disagg", "--reclaim-s", str(RECLAIM_S), "--disagg-remote", remote,
                        "--disagg-listen", front)
    role = Role(remote, front, model_dir, *role_extra)
    return srv, role


def _client(srv: ServerProcess) -> openai.OpenAI:
    return srv.openai()


def _roles(srv: ServerProcess) -> dict[str, dict]:
    return {r["role"]: r for r in httpx.get(srv.base + "/health", timeout=5).json()["roles"]}


@pytest.fixture(scope="module")
def remote_prefill(tiny_long_model_dir):
    srv, role = _split(tiny_long_model_dir, "prefill")
    single = None
    try:
        srv.wait_ready()
        single = ServerProcess("--model", str(tiny_long_model_dir), "--served-model-name", "tiny",
                               *ENGINE, "--in-process")
        single.wait_ready()
        yield srv, role, single
    finally:
        for p in (srv, single, role):
            if p is not None:
                p.stop()


CASES = [
    dict(prompt="the quick brown fox jumps over the lazy dog " * 6, max_tokens=24, temperature=0.0),
    dict(prompt="a b c d e f g h i j k l m n o p", max_tokens=16, temperature=0.8, seed=11),
]


@pytest.mark.parametrize("case", CASES, ids=["greedy", "seeded"])
def test_remote_prefill_output_equals_one_engine(remote_prefill, case):
    srv, _, single = remote_prefill
    sent = srv.metrics()['stopline_engine_steps_total{replica="prefill"}']
    got, want = (_client(s).completions.create(model="tiny", extra_body={"ignore_eos": True}, **case)
                 for s in (srv, single))
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    # The prompt's blocks were computed by the remote role, not by decode on its own.
    assert srv.metrics()['stopline_engine_steps_total{replica="prefill"}'] > sent


def test_health_names_the_remote_role(remote_prefill):
    srv, role, _ = remote_prefill
    roles = _roles(srv)
    assert roles["prefill"]["remote"] and not roles["decode"]["remote"]
    assert roles["prefill"]["pid"] == role.proc.pid  # the role's own process, not a child
    assert roles["prefill"]["state"] == roles["decode"]["state"] == "healthy"


def test_cancel_reaches_the_remote_role(remote_prefill):
    srv, _, _ = remote_prefill
    client = _client(srv)
    streams = [client.completions.create(model="tiny", prompt=f"story {i} " * 300, max_tokens=2000,
                                         stream=True, extra_body={"ignore_eos": True}) for i in range(2)]
    next(iter(streams[0]))  # decoding
    for s in streams:
        s.close()  # the second may still be in prefill on the remote role
    deadline = time.monotonic() + RECLAIM_S
    while True:
        m = srv.metrics()
        if m['stopline_kv_blocks_used{replica="prefill"}'] == m['stopline_kv_blocks_used{replica="decode"}'] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.02)


def test_remote_prefill_killed(tiny_long_model_dir):
    # Small prefill chunks and a long prompt: the prefill lasts long enough (~750 steps) for
    # the poll below to see it running before it is handed to decode.
    srv, role = _split(tiny_long_model_dir, "prefill", "--max-num-batched-tokens", "8")
    try:
        srv.wait_ready()
        client = _client(srv)
        ended: list[tuple[float, BaseException | None]] = []
        stream = client.completions.create(model="tiny", prompt="epic " * 1500, max_tokens=4, stream=True)
        deadline = time.monotonic() + 30
        while srv.metrics()['stopline_requests_running{replica="prefill"}'] == 0:
            assert time.monotonic() < deadline, srv.metrics()
            time.sleep(0.005)
        t_kill = time.monotonic()
        os.kill(role.proc.pid, signal.SIGKILL)
        try:
            for _ in stream:
                pass
            ended.append((time.monotonic(), None))
        except Exception as exc:
            ended.append((time.monotonic(), exc))
        (t_end, exc), = ended
        assert isinstance(exc, openai.APIError), exc
        assert "prefill engine died" in str(exc) and "remote prefill role" in str(exc)
        assert t_end - t_kill < 1.0, t_end - t_kill
        health = httpx.get(srv.base + "/health", timeout=5)
        assert health.status_code == 503 and "prefill" in health.json()["detail"]
        # The decode side holds nothing of the ended request within the reclaim deadline.
        while srv.metrics()['stopline_kv_blocks_used{replica="decode"}'] != 0:
            assert time.monotonic() - t_kill < RECLAIM_S, srv.metrics()
            time.sleep(0.02)
    finally:
        srv.stop()
        role.stop()


def test_remote_decode_serves_and_exits_with_the_front_end(tiny_long_model_dir):
    srv, role = _split(tiny_long_model_dir, "decode")
    try:
        srv.wait_ready()
        r = _client(srv).completions.create(model="tiny", prompt="once upon a time " * 8,
                                            max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
        assert _roles(srv)["decode"]["pid"] == role.proc.pid
    finally:
        srv.stop()
    # Its front end gone, the remote role has nobody to serve: it leaves by itself.
    assert role.proc.wait(10) == 0
    role.stop()


def test_a_role_with_another_block_size_is_refused(tiny_long_model_dir):
    srv, role = _split(tiny_long_model_dir, "prefill", "--block-size", "8")
    try:
        with pytest.raises(RuntimeError) as failed:
            srv.wait_ready(timeout=120)
        assert "differ in block_size: 8 vs 4" in str(failed.value)
    finally:
        srv.stop()
        role.stop()
