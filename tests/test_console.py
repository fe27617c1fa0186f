"""The web console in a real browser (headless Chromium driven by Playwright), against a real
`stopline serve` on a loopback port, engine core in its own process, with an API key.

The browser tests do what a user does: type a prompt, watch tokens arrive and the request's
blocks appear in the pool picture, press Stop, see the answer end with `abort` and the pool
return to its baseline in the live view; and two tabs streaming at once, where one stops and
the other finishes. Screenshots go to test-artifacts/console/ (STOPLINE_TEST_ARTIFACTS
overrides). The snapshot endpoint's auth and shape are checked over plain HTTP on the same
server.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.server_harness import REPO, ServerProcess
from tests.tiny_model import make_tiny_llama_dir

KEY = "console-key"
NUM_BLOCKS = 8192  # 131,072 tokens: a long and a short answer fit together, nobody is preempted
# A long answer, always cut by Stop: the tiny model writes thousands of tokens a second on a
# fast host, so the console's model has a 64k context and this answer never ends by itself
# in time (each step also attends over more keys as it grows).
LONG = 60_000
# The other tab's answer ends by itself (length) while the first stops: long enough to
# outlast the stop by some seconds at this machine's measured pace, no longer.
SHORT_SECONDS = 6.0
ARTIFACTS = Path(os.environ.get("STOPLINE_TEST_ARTIFACTS", REPO / "test-artifacts")) / "console"
CHROMIUM = os.environ.get("STOPLINE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def console_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny_console") / "model", seed=0,
                               max_position=65_536)


@pytest.fixture(scope="module")
def server(console_model_dir):
    srv = ServerProcess("--model", str(console_model_dir), "--served-model-name", "tiny",
                        "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "4", api_key=KEY)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def browser(server):
    # Chromium starts while the server loads its model.
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        try:
            server.wait_ready()
            yield b
        finally:
            b.close()


def snapshot(server: ServerProcess) -> dict:
    r = httpx.get(server.base + "/v1/console/snapshot", headers=server.headers, timeout=10)
    r.raise_for_status()
    return r.json()


def wait_idle(server: ServerProcess, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = snapshot(server)
        if not s["live"] and s["open_streams"] == 0:
            return s
        assert time.monotonic() < deadline, f"server not idle: {s['live']}"
        time.sleep(0.05)


# ---- the page in a browser -----------------------------------------------------------------
def open_console(page: Page, server: ServerProcess, errors: list[str], ask_key: bool) -> None:
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.base + "/")
    if ask_key:
        page.wait_for_selector("#key-dialog:not([hidden])")  # the snapshot said 401
        page.fill("#key-input", KEY)
        page.click("#key-save")
    page.wait_for_function("window.stopline.polls > 0 && window.stopline.snapshot.engine === 'ready'")


def ask(page: Page, prompt: str, max_tokens: int) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.fill("#extra", json.dumps({"ignore_eos": True}))  # random weights: EOS could come early
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")


def last_answer(page: Page) -> str:
    return page.inner_text(".msg.assistant:last-child .body")


def wait_streaming(page: Page, min_chars: int) -> None:
    """Tokens arrive and the live view shows this tab's request running, with blocks."""
    page.wait_for_function(
        f"""() => {{
            const body = document.querySelector('.msg.assistant:last-child .body');
            const row = document.querySelector('#requests tr.mine');
            return body.textContent.length >= {min_chars} && row && row.dataset.state === 'running'
                && Number(document.getElementById('pool').dataset.mine) > 0;
        }}""")


def finish_of(page: Page) -> str:
    meta = page.wait_for_selector(".msg.assistant:last-child .meta[data-finish]", timeout=60_000)
    return meta.get_attribute("data-finish")


def test_stop_returns_the_blocks(server, browser: Browser):
    base = wait_idle(server)
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    page = ctx.new_page()
    errors: list[str] = []
    open_console(page, server, errors, ask_key=True)
    baseline = base["pool"]["used"]
    page.wait_for_function(f"window.stopline.snapshot.pool.used === {baseline}")

    ask(page, "Tell me a very long story about a robot.", LONG)
    wait_streaming(page, 40)
    rid = page.evaluate("[...window.stopline.mine][0]")
    assert rid.startswith("chatcmpl-")
    page.screenshot(path=ARTIFACTS / "streaming.png")

    polls = page.evaluate("window.stopline.polls")
    aborts = int(page.get_attribute("#aborts", "data-total"))
    page.click("#stop")
    assert finish_of(page) == "abort"
    # The live view: the request gone, the pool back to its baseline, the abort counted.
    page.wait_for_function(
        f"""() => {{ const s = window.stopline.snapshot;
            return s.pool.used === {baseline} && !s.live.length
                && Number(document.getElementById('aborts').dataset.total) === {aborts + 1}; }}""",
        timeout=5000)
    updates = page.evaluate("window.stopline.polls") - polls
    # The abort takes one step (ms); the view polls every 250 ms and the answer's footer waits
    # for the server's word on how the request ended (~0.3 s), so the picture is back by then.
    # 8 polls (2 s) leaves room for a loaded 2-core host (5 seen with other work running);
    # a reclaim that waited on a timer or a sweep would take longer.
    assert updates <= 8, f"{updates} live-view updates before the pool showed the blocks back"
    sources = page.eval_on_selector_all("#aborts tr[data-source]", "rows => rows.map(r => r.dataset.source)")
    assert set(sources) & {"disconnect", "cancel"}, sources
    meta = page.inner_text(".msg.assistant:last-child .meta")
    assert "tokens received" in meta and "stopped" in meta
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    # The live view agrees with the server's own metrics.
    m = server.metrics()
    assert m["stopline_kv_blocks_used"] == baseline and m["stopline_requests_running"] == 0
    page.screenshot(path=ARTIFACTS / "stopped.png")
    assert errors == []
    ctx.close()


def test_two_tabs_one_stops(server, browser: Browser):
    base = wait_idle(server)
    baseline = base["pool"]["used"]
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    errors: list[str] = []
    a, b = ctx.new_page(), ctx.new_page()
    open_console(a, server, errors, ask_key=True)
    open_console(b, server, errors, ask_key=False)  # the key is remembered for this browser

    ask(a, "Write a long poem about the sea.", LONG)
    wait_streaming(a, 20)
    time.sleep(1.5)  # the server's tokens/s (a 2 s window) now reads this machine's pace
    short = min(30_000, max(100, int(snapshot(server)["tokens_per_s"] * SHORT_SECONDS)))
    ask(b, "Write a short note.", short)
    wait_streaming(b, 5)
    a_id = a.evaluate("[...window.stopline.mine][0]")
    b_id = b.evaluate("[...window.stopline.mine][0]")
    assert a_id != b_id

    a.click("#stop")
    assert finish_of(a) == "abort"
    assert b.get_attribute(".msg.assistant:last-child .meta", "data-finish") is None, \
        "B ended before A's stop was over: the test would prove nothing"
    # B's live view: A's request gone, B's still running with its blocks.
    b.wait_for_function(
        f"""() => {{ const live = window.stopline.snapshot.live;
            return !live.some(q => q.id === '{a_id}') && live.some(q => q.id === '{b_id}'); }}""",
        timeout=10_000)
    a.wait_for_function(f"window.stopline.snapshot.live.some(q => q.id === '{b_id}')", timeout=10_000)
    a.screenshot(path=ARTIFACTS / "two-tabs.png")  # A stopped; B's blocks still in the pool
    text_a = last_answer(a)

    assert finish_of(b) == "length"
    meta = b.query_selector(".msg.assistant:last-child .meta")
    assert meta.get_attribute("data-completion-tokens") == str(short)  # the server's usage
    assert "prompt +" in meta.inner_text()
    assert last_answer(a) == text_a  # nothing reached A after its stop
    b.wait_for_function(f"window.stopline.snapshot.pool.used === {baseline} && !window.stopline.snapshot.live.length")
    s = snapshot(server)
    assert s["finished"].get("length", 0) >= 1 and s["finished"].get("abort", 0) >= 1
    assert errors == []
    ctx.close()


# ---- the endpoint, over plain HTTP (`browser` only because its fixture waits for the server)
def test_page_is_public_and_the_rest_wants_the_key(server, browser):
    page = httpx.get(server.base + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for asset in ("console.js", "console.css"):
        assert httpx.get(f"{server.base}/static/{asset}").status_code == 200
    assert httpx.get(server.base + "/static/../state.py").status_code == 404
    url = server.base + "/v1/console/snapshot"
    assert httpx.get(url).status_code == 401
    bad = httpx.get(url, headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    chat = httpx.post(server.base + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 401


def test_snapshot_shape(server, browser):
    s = wait_idle(server)
    assert s["model"] == "tiny" and s["engine"] == "ready"
    p = s["pool"]
    assert p["total"] == NUM_BLOCKS and p["block_size"] == 16 and p["complete_map"]
    assert p["free"] + p["cached"] + p["used"] == p["total"] and len(p["cached_ids"]) == p["cached"]
    assert set(s["counts"]) == {"running", "waiting", "preempted"}
    for key in ("ttft_s", "itl_s"):
        assert set(s[key]) == {"n", "p50", "p90", "p99"}
    assert isinstance(s["tokens_per_s"], float) and s["age_s"] is not None

    # A request in flight shows up with its blocks; gone once its client leaves.
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, headers=server.headers,
                      timeout=30) as r:
        rid = r.headers["x-request-id"]
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        deadline = time.monotonic() + 10
        while True:
            s = snapshot(server)
            mine = [q for q in s["live"] if q["id"] == rid]
            if mine and mine[0]["state"] == "running":
                break
            assert time.monotonic() < deadline, s["live"]
            time.sleep(0.05)
        q = mine[0]
        assert q["index"] == 0 and q["blocks"] == len(q["block_ids"]) > 0
        # tokens counts the one just sampled, which enters the KV cache at the next step
        assert q["tokens"] <= q["blocks"] * 16 + 1 and len(set(q["block_ids"])) == q["blocks"]
        assert all(0 <= b < NUM_BLOCKS for b in q["block_ids"])
        assert s["pool"]["used"] >= q["blocks"] and s["open_streams"] == 1
    s = wait_idle(server)
    assert s["pool"]["used"] == 0 and s["last_aborts"][0]["id"] == rid
    assert s["last_aborts"][0]["source"] == "disconnect"


def test_the_pool_lists_every_layer_group(browser: Browser, tmp_path_factory: pytest.TempPathFactory):
    """A model of two KV layer groups (the tests' tiny Gemma 3: global layers, local ones of
    window 16): the pool view lists each group's used, cached and free blocks, as the
    snapshot has them, not group 0's alone."""
    from tests.tiny_families import make_family_dir

    gemma = make_family_dir(tmp_path_factory.mktemp("console_gemma"), "gemma3")
    srv = ServerProcess("--model", str(gemma), "--served-model-name", "gemma", "--num-blocks", "128",
                        "--block-size", "4", api_key=KEY)
    try:
        srv.wait_ready()
        ctx = browser.new_context(viewport={"width": 1280, "height": 800})
        page = ctx.new_page()
        errors: list[str] = []
        open_console(page, srv, errors, ask_key=True)
        page.wait_for_selector("#pool-group-1")
        assert page.inner_text("#pool-group-0") == "group 0 (global): used 0 · cached 0 · free 128 of 128"
        assert page.inner_text("#pool-group-1").startswith("group 1 (window 16): used 0")
        assert "2 layer groups" in page.text_content("#pool-title")
        r = httpx.post(srv.base + "/v1/completions", headers=srv.headers, timeout=30,
                       json={"model": "gemma", "prompt": list(range(5, 65)), "max_tokens": 4})
        assert r.status_code == 200
        # The finished prompt stays cached in both groups, each group's count drawn as its own.
        page.wait_for_function("""() => { const g = window.stopline.snapshot.pool.groups;
            return g[0].cached > 0 && g[1].cached > 0; }""", timeout=5000)
        g = page.evaluate("window.stopline.snapshot.pool.groups")
        for i, name in ((0, "global"), (1, "window 16")):
            assert page.inner_text(f"#pool-group-{i}") == (
                f"group {i} ({name}): used 0 · cached {g[i]['cached']} · free {g[i]['free']} of 128")
        page.screenshot(path=ARTIFACTS / "groups.png")
        assert errors == []
        ctx.close()
    finally:
        srv.stop()
