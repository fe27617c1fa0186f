"""`stopline serve --disagg` over real HTTP on a model of two KV layer groups (the tests' tiny
Gemma 3: local layers of window 16, a global layer; blocks of 4): greedy output and n = 2
equal to one engine's for prompts shorter and longer than the window; /metrics counts the
blocks each group shipped (the local group fewer once a prompt passes the window); the
console's snapshot lists both groups' pools; a stream cut mid-answer leaves every group's
pool of both roles empty."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.engine_support import random_prompts
from tests.server_harness import ServerProcess
from tests.tiny_families import make_family_dir

pytestmark = pytest.mark.timeout(180)

ARGS = ("--served-model-name", "gemma", "--block-size", "4", "--num-blocks", "256",
        "--max-num-batched-tokens", "16")


def _start(model_dir, *extra: str) -> ServerProcess:
    srv = ServerProcess("--model", str(model_dir), *ARGS, *extra)
    srv.wait_ready()
    return srv


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    gemma = make_family_dir(tmp_path_factory.mktemp("serve_gemma"), "gemma3")
    split = single = None
    try:
        split = _start(gemma, "--disagg", "--reclaim-s", "2")
        single = _start(gemma, "--in-process")
        yield split, single
    finally:
        for s in (split, single):
            if s is not None:
                s.stop()


def _complete(srv: ServerProcess, prompt: list[int], **kw) -> list[str]:
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=60)
    r = client.completions.create(model="gemma", prompt=prompt, temperature=0.0, **kw)
    return [c.text for c in sorted(r.choices, key=lambda c: c.index)]


def _moved(srv: ServerProcess) -> dict[tuple[str, str], float]:
    m = srv.metrics()
    return {(d, g): m.get(f'stopline_kv_transfer_blocks_total{{direction="{d}",group="{g}",replica="{r}"}}', 0.0)
            for d, r in (("sent", "prefill"), ("received", "decode")) for g in ("0", "1")}


def _group_used(srv: ServerProcess) -> list[float]:
    m = srv.metrics()
    return [m[f'stopline_kv_group_blocks{{group="{g}",replica="{r}",state="used",window="{w}"}}']
            for r in ("prefill", "decode") for g, w in (("0", "0"), ("1", "16"))]


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
    deadline = time.monotonic() + 10
    while any(_group_used(split)):  # the client left: both roles' pools, every group
        assert time.monotonic() < deadline, _group_used(split)
        time.sleep(0.05)
    groups = httpx.get(split.base + "/v1/console/snapshot", timeout=5).json()["pool"]["groups"]
    assert [g["used"] for g in groups] == [0, 0]
