"""`stopline serve --disagg` over real HTTP on a model of two KV layer groups (the tests' tiny
Gemma 3: local layers of window 16, a global layer; blocks of 4): greedy output and n = 2
equal to one engine's for prompts shorter and longer than the window; /metrics counts the
blocks each group shipped (the local group fewer once a prompt passes the window); the
console's snapshot lists both groups' pools; a stream cut mid-answer, a prefill role killed
mid-prefill and a decode role killed mid-decode leave every group's pool empty (the restarted
role serves again)."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.engine_support import random_prompts
from tests.server_harness import ServerProcess, split_and_single
from tests.tiny_families import make_family_dir

pytestmark = pytest.mark.timeout(180)

ARGS = ("--served-model-name", "gemma", "--block-size", "4", "--num-blocks", "256",
        "--max-num-batched-tokens", "16")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    gemma = make_family_dir(tmp_path_factory.mktemp("serve_gemma"), "gemma3")
    with split_and_single("--model", str(gemma), *ARGS, reclaim_s=2) as pair:
        yield pair


def _complete(srv: ServerProcess, prompt: list[int], **kw) -> list[str]:
    client = srv.openai()
    r = client.completions.create(model="gemma", prompt=prompt, temperature=0.0, **kw)
    return [c.text for c in sorted(r.choices, key=lambda c: c.index)]


def _moved(srv: ServerProcess) -> dict[tuple[str, str], float]:
    m = srv.metrics()
    return {(d, g): m.get(f'stopline_kv_transfer_blocks_total{{direction="{d}",group="{g}",replica="{r}"}}', 0.0)
            for d, r in (("sent", "prefill"), ("received", "decode")) for g in ("0", "1")}


def _group_used(srv: ServerProcess, roles: tuple[str, ...] = ("prefill", "decode")) -> list[float]:
    m = srv.metrics()
    return [m[f'stopline_kv_group_blocks{{group="{g}",replica="{r}",state="used",window="{w}"}}']
            for r in roles for g, w in (("0", "0"), ("1", "16"))]


def _wait_empty(srv: ServerProcess, roles: tuple[str, ...] = ("prefill", "decode")) -> None:
    """Every group's pool of `roles` holds no block within 10 s."""
    deadline = time.monotonic() + 10
    while any(used := _group_used(srv, roles)):
        assert time.monotonic() < deadline, used
        time.sleep(0.05)


def test_output_equals_one_engine_and_each_group_ships_its_live_blocks(servers):
    split, single = servers
    short, long = random_prompts(2, [10, 61], seed=12)
    before = _moved(split)
    for prompt in (short, long):
        for n in (1, 2):
            got = _complete(split, prompt, max_tokens=12, n=n)
            assert got == _complete(single, prompt, max_tokens=12, n=n) and len(got) == n and all(got)
    moved = {k: v - before[k] for k, v in _moved(split).items()}
    # Per request: the short prompt ships 2 blocks in each group; the long one 15 global
    # blocks and the 4 its window still reads. Each prompt went twice (n = 1, then n = 2;
    # a prefix cached on prefill changes nothing of what it ships).
    assert moved["sent", "0"] == moved["received", "0"] == 2 * (2 + 15)
    assert moved["sent", "1"] == moved["received", "1"] == 2 * (2 + 4)


def test_console_lists_each_groups_pool_and_a_cut_stream_frees_them(servers):
    split, _ = servers
    body = {"model": "gemma", "prompt": random_prompts(1, [45], seed=13)[0], "max_tokens": 400,
            "ignore_eos": True, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", split.base + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data:"))
        groups = httpx.get(split.base + "/v1/console/snapshot", timeout=5).json()["pool"]["groups"]
        assert [(g["group"], g["window"], g["total"]) for g in groups] == [(0, 0, 256), (1, 16, 256)]
        assert all(g["used"] + g["cached"] + g["free"] == g["total"] for g in groups)
    _wait_empty(split)  # the client left: both roles' pools, every group
    groups = httpx.get(split.base + "/v1/console/snapshot", timeout=5).json()["pool"]["groups"]
    assert [g["used"] for g in groups] == [0, 0]


def test_prefill_killed_mid_prefill_frees_every_group_and_restarts(servers):
    """SIGKILL of the prefill role while long prompts prefill: each stream ends once (an
    error naming the dead role, or its length if decode had taken the KV); decode's pools of
    both groups are empty once they end; the restarted role serves one engine's output."""
    import os
    import signal
    import threading

    split, single = servers
    _wait_healthy(split)  # an earlier kill's role may still be coming back
    prefill_pid = _pid(split, "prefill")
    ended: list[tuple[BaseException | None, str]] = []

    def one(i: int) -> None:
        try:
            ended.append((None, _finish(split, random_prompts(1, [900], seed=20 + i)[0])))
        except Exception as exc:
            ended.append((exc, ""))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while split.metrics()['stopline_requests_running{replica="prefill"}'] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(prefill_pid, signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert len(ended) == 3 and any(exc is not None for exc, _ in ended), ended
    for exc, reason in ended:
        # Ended by the death, or refused (503) if its add came after it: either names the role.
        assert (reason == "length" if exc is None
                else re.search(r"the prefill engine (died|is (dead|restarting))", str(exc))), (exc, reason)
    _wait_empty(split, roles=("decode",))
    _wait_restarted(split, "prefill", prefill_pid)
    prompt = random_prompts(1, [61], seed=30)[0]
    assert _complete(split, prompt, max_tokens=8) == _complete(single, prompt, max_tokens=8)
    _wait_empty(split)


def test_decode_killed_mid_decode_frees_prefill_and_restarts(servers):
    """SIGKILL of the decode role while a long prompt's answer streams: the stream ends with an
    error naming it, the prefill role's pools of both groups are empty, and the restarted
    decode role serves one engine's output."""
    import os
    import signal

    split, single = servers
    _wait_healthy(split)
    decode_pid = _pid(split, "decode")
    body = {"model": "gemma", "prompt": random_prompts(1, [45], seed=14)[0], "max_tokens": 900,
            "ignore_eos": True, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", split.base + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data:"))
        os.kill(decode_pid, signal.SIGKILL)
        rest = "\n".join(lines)
    assert "decode engine died" in rest, rest[-500:]
    _wait_empty(split, roles=("prefill",))
    _wait_restarted(split, "decode", decode_pid)
    prompt = random_prompts(1, [61], seed=31)[0]
    assert _complete(split, prompt, max_tokens=8) == _complete(single, prompt, max_tokens=8)
    _wait_empty(split)


def _pid(srv: ServerProcess, role: str) -> int:
    return next(r["pid"] for r in httpx.get(srv.base + "/health", timeout=5).json()["roles"] if r["role"] == role)


def _wait_healthy(srv: ServerProcess) -> None:
    deadline = time.monotonic() + 60
    while not all(r["state"] == "healthy" for r in httpx.get(srv.base + "/health", timeout=5).json()["roles"]):
        assert time.monotonic() < deadline, "a role never came back"
        time.sleep(0.1)


def _wait_restarted(srv: ServerProcess, role: str, old_pid: int) -> None:
    """The killed role is restarted (tests/test_disagg_restart.py) and serves again."""
    deadline = time.monotonic() + 60
    while True:
        roles = {r["role"]: r for r in httpx.get(srv.base + "/health", timeout=5).json()["roles"]}
        if roles[role]["state"] == "healthy" and roles[role]["pid"] != old_pid:
            return
        assert time.monotonic() < deadline, roles
        time.sleep(0.1)


def _finish(srv: ServerProcess, prompt: list[int]) -> str:
    client = srv.openai()
    r = client.completions.create(model="gemma", prompt=prompt, max_tokens=4, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].finish_reason
