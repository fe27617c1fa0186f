"""`stopline serve --disagg` over real HTTP on loopback: output equal to one engine's
(greedy, seeded, n > 1, echo with prompt logprobs), cancels reaching both roles, /health per
role, and both fault cases (a role killed mid-flight: its streams end with an error within
1 s, the survivor's pool is back to baseline within the reclaim deadline, /health names the
dead role until it is restarted)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.server_harness import ServerProcess, split_and_single, started

pytestmark = pytest.mark.timeout(180)

RECLAIM_S = 2.0
ARGS = ("--served-model-name", "tiny", "--block-size", "4", "--num-blocks", "4096",
        "--max-num-batched-tokens", "64")


def _start(model_dir, *extra: str) -> ServerProcess:
    return started("--model", str(model_dir), *ARGS, *extra)


@pytest.fixture(scope="module")
def servers(tiny_long_model_dir):
    with split_and_single("--model", str(tiny_long_model_dir), *ARGS, reclaim_s=RECLAIM_S) as pair:
        yield pair


def _client(srv: ServerProcess) -> openai.OpenAI:
    return srv.openai()


def _roles(srv: ServerProcess) -> dict[str, dict]:
    return {r["role"]: r for r in httpx.get(srv.base + "/health", timeout=5).json()["roles"]}


def _used(srv: ServerProcess, role: str) -> float:
    return srv.metrics()[f'stopline_kv_blocks_used{{replica="{role}"}}']


def _restarted(srv: ServerProcess, role: str, old_pid: int) -> bool:
    """After a kill of `role`: False while it is dead or restarting, True once a new process
    serves (the restart may win a race with a check made right after the kill)."""
    r = _roles(srv)[role]
    if r["state"] in ("dead", "restarting"):
        return False
    assert r["state"] == "healthy" and r["pid"] != old_pid, r
    return True


def test_health_reports_each_role(servers):
    split, _ = servers
    r = httpx.get(split.base + "/health", timeout=5)
    assert r.status_code == 200
    roles = _roles(split)
    assert set(roles) == {"prefill", "decode"}
    assert all(x["state"] == "healthy" and x["pid"] for x in roles.values())


CASES = [
    dict(prompt="the quick brown fox jumps over the lazy dog " * 6, max_tokens=24, temperature=0.0),
    dict(prompt="a b c d e f g", max_tokens=16, temperature=0.8, seed=11),
    dict(prompt="once upon a time there was a little model " * 3, max_tokens=12, temperature=1.0,
         seed=5, n=2),
    dict(prompt="hello there general kenobi " * 4, max_tokens=0, echo=True, logprobs=2),
    dict(prompt="x", max_tokens=5, temperature=0.0),  # under one block: decode alone
]


@pytest.mark.parametrize("case", CASES, ids=["greedy", "seeded", "n2", "echo-logprobs", "short"])
def test_output_equals_one_engine(servers, case):
    split, single = servers
    got, want = (_client(s).completions.create(model="tiny", extra_body={"ignore_eos": True}, **case)
                 for s in (split, single))
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    assert [c.finish_reason for c in got.choices] == [c.finish_reason for c in want.choices]
    if case.get("logprobs"):
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(
            want.choices[0].logprobs.token_logprobs, abs=1e-4)


def test_streamed_cancel_reaches_both_roles(servers):
    split, _ = servers
    client = _client(split)
    streams = [client.completions.create(model="tiny", prompt=f"story {i} " * 300, max_tokens=2000,
                                         stream=True, extra_body={"ignore_eos": True}) for i in range(3)]
    for s in streams[:2]:
        next(iter(s))  # decoding
        s.close()
    streams[2].close()  # may still be in prefill or in transfer
    deadline = time.monotonic() + RECLAIM_S
    while not (_used(split, "decode") == 0 and _used(split, "prefill") == 0):
        assert time.monotonic() < deadline, split.metrics()
        time.sleep(0.02)
    assert httpx.get(split.base + "/health", timeout=5).status_code == 200


def _storm(srv: ServerProcess, n: int, prompt_words: int, max_tokens: int):
    client = _client(srv)
    started = threading.Barrier(n + 1)
    ended: list[tuple[float, BaseException | None]] = [(0.0, None)] * n

    def one(i: int) -> None:
        first = False
        try:
            for ch in client.completions.create(model="tiny", prompt=f"tale {i} " * prompt_words,
                                                max_tokens=max_tokens, stream=True,
                                                extra_body={"ignore_eos": True}):
                if not first and ch.choices and ch.choices[0].text:
                    first = True
                    started.wait(60)
            ended[i] = (time.monotonic(), None)
        except Exception as exc:  # the error event surfaces as an exception
            if not first:
                started.wait(60)
            ended[i] = (time.monotonic(), exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, started, ended


def test_decode_killed_mid_decode(tiny_long_model_dir):
    srv = _start(tiny_long_model_dir, "--disagg", "--reclaim-s", str(RECLAIM_S))
    try:
        threads, started, ended = _storm(srv, 4, 100, 7500)
        started.wait(60)  # every stream is receiving tokens
        t_kill = time.monotonic()
        decode_pid = _roles(srv)["decode"]["pid"]
        os.kill(decode_pid, signal.SIGKILL)
        for t in threads:
            t.join(10)
        for t_end, exc in ended:
            assert isinstance(exc, openai.APIError), exc
            assert "decode engine died" in str(exc)
            assert t_end - t_kill < 1.0, t_end - t_kill
        # The role is restarted (tests/test_disagg_restart.py); until it is up, it is named.
        health = httpx.get(srv.base + "/health", timeout=5)
        if _restarted(srv, "decode", decode_pid):
            assert health.status_code == 200
        else:
            assert health.status_code == 503 and "decode" in health.json()["detail"]
        assert _roles(srv)["prefill"]["state"] == "healthy"
        while _used(srv, "prefill") != 0:
            assert time.monotonic() - t_kill < RECLAIM_S, srv.metrics()
            time.sleep(0.02)
        try:
            _client(srv).completions.create(model="tiny", prompt="hi", max_tokens=2)
            assert _restarted(srv, "decode", decode_pid)
        except openai.APIStatusError as refused:
            assert refused.status_code == 503
    finally:
        srv.stop()


def test_prefill_killed_mid_transfer(tiny_long_model_dir):
    srv = _start(tiny_long_model_dir, "--disagg", "--reclaim-s", str(RECLAIM_S))
    try:
        client = _client(srv)
        prefill_pid = _roles(srv)["prefill"]["pid"]
        # One stream decoding already, then long prompts in prefill when the kill lands.
        threads, started, ended = _storm(srv, 1, 50, 7500)
        started.wait(60)
        late: list[tuple[float, BaseException | None, str]] = []

        def long_one(i: int) -> None:
            try:
                r = client.completions.create(model="tiny", prompt=f"epic {i} " * 600, max_tokens=4,
                                              extra_body={"ignore_eos": True})
                late.append((time.monotonic(), None, r.choices[0].finish_reason))
            except Exception as exc:
                late.append((time.monotonic(), exc, ""))

        longs = [threading.Thread(target=long_one, args=(i,)) for i in range(3)]
        for t in longs:
            t.start()
        deadline = time.monotonic() + 30
        while srv.metrics()['stopline_requests_running{replica="prefill"}'] == 0:
            assert time.monotonic() < deadline, (late, {k: v for k, v in srv.metrics().items() if "replica" in k})
            time.sleep(0.005)
        t_kill = time.monotonic()
        os.kill(prefill_pid, signal.SIGKILL)
        for t in longs:
            t.join(10)
        assert len(late) == 3
        # A prompt whose KV reached the decode side before the kill is not affected: it
        # completes. Every other one (at least the one prefilling when it landed) errors.
        failed = [(t_end, exc) for t_end, exc, _ in late if exc is not None]
        assert failed, late
        assert all(reason == "length" for _, exc, reason in late if exc is None), late
        for t_end, exc in failed:
            assert isinstance(exc, openai.APIError), exc
            # Its stream ended by the death, or (a thread that came late) its add refused with a
            # 503 while the role was dead or restarting: either names the role.
            assert re.search(r"the prefill engine (died|is (dead|restarting))", str(exc)), exc
            assert t_end - t_kill < 1.0, t_end - t_kill
        health = httpx.get(srv.base + "/health", timeout=5)
        if not _restarted(srv, "prefill", prefill_pid):
            assert health.status_code == 503 and "prefill" in health.json()["detail"]
        # The stream already decoding does not depend on the prefill side: it goes on.
        assert threads[0].is_alive()
        # Within the reclaim deadline the decode side holds the surviving stream alone.
        while True:
            m = srv.metrics()
            if (m['stopline_requests_waiting{replica="decode"}'] == 0
                    and m['stopline_requests_running{replica="decode"}'] == 1):
                break
            assert time.monotonic() - t_kill < RECLAIM_S, m
            time.sleep(0.02)
    finally:
        srv.stop()
        for t in threads:
            t.join(10)



def test_bench_harness_runs_on_a_tiny_model(tiny_long_model_dir):
    """`stopline bench disagg`'s harness end to end (its figures are for the real model)."""
    from stopline.bench import disagg
    from stopline.config import EngineConfig

    cfg = EngineConfig(block_size=4, num_blocks=2048, max_num_batched_tokens=64)
    r = disagg.run(str(tiny_long_model_dir), cfg, rounds=1, long_len=60)
    assert r["transfer_mb"] > 0 and r["transfer_mb_s"] > 0  # KV really crossed the link
    assert 0 < r["transfer_share_of_ttft"] < 1
    assert r["short_alone_s"] > 0 and r["short_after_cancelled_s"] > 0
    assert "| head-of-line ratio" in disagg.render(r, "stopline bench disagg", "tiny")
