"""Engine-wide stops (issue 46, docs/engine-stops.md): pause in every mode, resume, sleep and
wake (the core process's RSS), weight updates in place (versions, the prefix cache, a
mismatch), over real HTTP with the official openai client for what an engine-initiated end
raises; and the prefix cache under new weights on the core alone."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.request import AbortSource, SamplingParams
from tests.server_harness import ServerProcess, serving
from tests.tiny_model import make_tiny_llama_dir

pytestmark = pytest.mark.timeout(300)

LONG = {"max_tokens": 6000, "ignore_eos": True}


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory) -> Path:
    """The same architecture as tiny_long_model_dir, other random weights."""
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny_b") / "model", seed=1, max_position=8192)


@pytest.fixture(scope="module")
def other_arch(tmp_path_factory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny_c") / "model", seed=0, layers=3,
                               max_position=8192)


def _client(srv: ServerProcess) -> openai.OpenAI:
    return srv.openai()


class _Reader(threading.Thread):
    """Reads a streaming completion with the openai client; keeps its chunks and what it raised."""

    def __init__(self, srv: ServerProcess, prompt: str = "a", **kw) -> None:
        super().__init__(daemon=True)
        self.srv, self.prompt, self.kw = srv, prompt, {**LONG, **kw}
        self.chunks: list = []
        self.error: Exception | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            stream = _client(self.srv).completions.create(
                model="tiny", prompt=self.prompt, stream=True, max_tokens=self.kw.pop("max_tokens"),
                extra_body=self.kw)
            for c in stream:
                self.chunks.append(c)
                self.started.set()
        except Exception as exc:  # noqa: BLE001 - what the client raised is the result
            self.error = exc
            self.started.set()

    def tokens(self) -> int:
        return len(self.chunks)


def _post(srv: ServerProcess, path: str, **kw) -> httpx.Response:
    return httpx.post(srv.base + path, timeout=60, **kw)


@pytest.fixture(scope="module")
def core_proc(tiny_long_model_dir):
    """The engine core in its own process (the default)."""
    with serving(ServerProcess("--model", str(tiny_long_model_dir), "--served-model-name", "tiny",
                               "--num-blocks", "512", "--max-num-seqs", "8")) as srv:
        yield srv


def test_pause_modes_resume_and_what_the_client_raises(core_proc):
    srv = core_proc
    r = _Reader(srv)
    r.start()
    assert r.started.wait(30)
    # keep: no step runs, the stream stays open, nothing more arrives; idempotent.
    for _ in range(2):
        got = _post(srv, "/pause?mode=keep")
        assert got.status_code == 200 and got.json()["paused"] == "keep", got.text
    health = httpx.get(srv.base + "/health").json()
    assert health["status"] == "paused" and health["paused"] == "keep"
    n = r.tokens()
    time.sleep(0.5)
    assert r.tokens() == n and r.is_alive()
    # A request that arrives while paused queues (the default admission) and is served after.
    late: dict = {}
    t = threading.Thread(target=lambda: late.update(r=_client(srv).completions.create(
        model="tiny", prompt="q", max_tokens=4)))
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and not late
    got = _post(srv, "/resume")
    assert got.status_code == 200 and got.json()["paused"] is None
    t.join(30)
    assert late["r"].choices[0].finish_reason == "length"
    deadline = time.monotonic() + 10
    while r.tokens() <= n + 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert r.tokens() > n + 3 and r.is_alive()  # it went on where it was
    # abort: the stream's client raises APIError naming the reason (not a success), and a
    # non-streaming call gets a 503 with the API's error body.
    whole: dict = {}

    def call() -> None:
        try:
            _client(srv).completions.create(model="tiny", prompt="w", max_tokens=6000,
                                            extra_body={"ignore_eos": True})
        except Exception as exc:  # noqa: BLE001
            whole["exc"] = exc
    t = threading.Thread(target=call)
    t.start()
    srv.wait_for(lambda m: m["stopline_requests_running"] == 2)
    got = _post(srv, "/pause?mode=abort")
    assert got.status_code == 200 and got.json()["aborted"] == 2, got.text
    r.join(10)
    t.join(10)
    assert isinstance(r.error, openai.APIError) and not isinstance(r.error, openai.APIStatusError)
    assert r.error.code == "engine_pause", r.error.body
    assert isinstance(whole["exc"], openai.InternalServerError)
    assert whole["exc"].status_code == 503 and whole["exc"].code == "engine_pause"
    assert whole["exc"].response.headers["Retry-After"] == "1"
    m = srv.metrics()
    assert m['stopline_aborted_sequences_total{engine_initiated="true",source="pause"}'] == 2
    assert _post(srv, "/resume").status_code == 200
    # wait: the one in flight finishes (a success), nothing new runs meanwhile.
    short = _Reader(srv, max_tokens=400)
    short.start()
    assert short.started.wait(30)
    got = _post(srv, "/pause?mode=wait")
    assert got.status_code == 200 and got.json()["open"] == 0, got.text
    short.join(10)
    assert short.error is None and short.chunks[-1].choices[0].finish_reason == "length"
    assert _post(srv, "/resume").status_code == 200
    # Bad input: a 400 with the API's error body, nothing changes.
    bad = _post(srv, "/pause?mode=later")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode"
    assert httpx.get(srv.base + "/health").json()["status"] == "ok"
    srv.wait_idle(timeout=5)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_sleep_frees_the_pool_and_wake_up_restores_it(tiny_long_model_dir):
    # A pool of 16,384 blocks (+ the null block): 2 layers x K,V x 16 tokens x 2 heads x 16
    # x 4 bytes = 8 KiB a block, 128 MiB in all, far above what the core's RSS moves by else.
    srv = ServerProcess("--model", str(tiny_long_model_dir), "--served-model-name", "tiny",
                        "--num-blocks", "16384", "--max-num-seqs", "8", "--queue-timeout", "60")
    try:
        srv.wait_ready()
        pid = srv.core_pid()
        pool = 16385 * 16 * 2 * 16 * 4 * 2 * 2
        r = _Reader(srv)
        r.start()
        assert r.started.wait(30)
        before = _rss(pid)
        got = _post(srv, "/sleep?level=1")  # mode abort by default
        assert got.status_code == 200 and got.json()["freed_bytes"] == pool, got.text
        r.join(10)
        assert isinstance(r.error, openai.APIError) and r.error.code == "engine_sleep"
        asleep = _rss(pid)
        # Slack: 10% of the pool (the allocator may keep a little; the process's other memory moves).
        assert before - asleep > 0.9 * pool, (before, asleep, pool)
        assert httpx.get(srv.base + "/health").json()["status"] == "asleep"
        assert _post(srv, "/sleep?level=1").json()["freed_bytes"] == 0  # idempotent
        bad = _post(srv, "/sleep?level=1&mode=keep")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode"
        # A request that arrives while asleep waits (queue admission) and is served on wake.
        late: dict = {}
        t = threading.Thread(target=lambda: late.update(r=_client(srv).completions.create(
            model="tiny", prompt="q", max_tokens=4)))
        t.start()
        time.sleep(0.5)
        assert t.is_alive()
        assert _post(srv, "/wake_up").status_code == 200
        t.join(30)
        assert late["r"].choices[0].finish_reason == "length"
        awake = _rss(pid)
        assert awake - asleep > 0.9 * pool, (asleep, awake)
        # Level 2: the weights go too and come back from their path; same tokens after.
        first = _client(srv).completions.create(model="tiny", prompt="hello", max_tokens=12,
                                                temperature=0)
        got = _post(srv, "/sleep?level=2")
        assert got.status_code == 200 and got.json()["freed_bytes"] > pool
        assert _rss(pid) < awake - pool
        assert _post(srv, "/wake_up").status_code == 200
        again = _client(srv).completions.create(model="tiny", prompt="hello", max_tokens=12,
                                                temperature=0)
        assert again.choices[0].text == first.choices[0].text
    finally:
        srv.stop()


def test_paused_admission_reject_in_process(tiny_long_model_dir):
    srv = ServerProcess("--model", str(tiny_long_model_dir), "--served-model-name", "tiny",
                        "--in-process", "--num-blocks", "512", "--paused-admission", "reject")
    try:
        srv.wait_ready()
        r = _Reader(srv)
        r.start()
        assert r.started.wait(30)
        assert _post(srv, "/pause?mode=keep").status_code == 200
        refused = httpx.post(srv.base + "/v1/completions", json={"prompt": "z", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
        assert "paused" in refused.json()["error"]["message"]
        health = httpx.get(srv.base + "/health")
        assert health.status_code == 503 and health.json()["status"] == "paused"
        assert _post(srv, "/sleep?level=1").status_code == 200  # aborts the kept one
        r.join(10)
        assert isinstance(r.error, openai.APIError) and r.error.code == "engine_sleep"
        refused = httpx.post(srv.base + "/v1/completions", json={"prompt": "z", "max_tokens": 2})
        assert refused.status_code == 503 and "asleep" in refused.json()["error"]["message"]
        assert _post(srv, "/wake_up").status_code == 200
        ok = httpx.post(srv.base + "/v1/completions", json={"prompt": "z", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    finally:
        srv.stop()


def _solo(model: Path, prompt: list[int], n: int) -> tuple[list[int], str]:
    """Greedy tokens and text of `prompt` alone on a fresh engine over `model`."""
    core = EngineCore(str(model), EngineConfig(num_blocks=64), progress=False)
    core.add_request("s", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    toks: list[int] = []
    text = ""
    while core.has_unfinished():
        for o in core.step():
            toks += o.new_token_ids
            text += o.new_text
    return toks, text


def test_update_weights_versions_and_mismatch(core_proc, tiny_long_model_dir, other_weights, other_arch):
    srv = core_proc
    cli = _client(srv)
    v0 = httpx.get(srv.base + "/health").json()["weight_version"]
    prompt = list(range(3, 3 + 40))  # 2.5 blocks: the prefix cache keeps 2
    raw = cli.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    before = raw.parse()
    assert raw.headers["X-Weight-Version"] == str(v0)
    assert json.loads(raw.text)["weight_version"] == v0
    # A mismatch is a 400 that names it; nothing changes.
    bad = _post(srv, "/update_weights", json={"path": str(other_arch)})
    assert bad.status_code == 400 and "num_layers 3 (serving 2)" in bad.json()["error"]["message"]
    assert _post(srv, "/update_weights", json={"path": "/nonexistent"}).status_code == 400
    assert _post(srv, "/update_weights", json={"path": str(other_weights), "mode": "x"}).status_code == 400
    assert _post(srv, "/update_weights", json={"path": str(other_weights), "recompute": "yes"}).status_code == 400
    assert httpx.get(srv.base + "/health").json()["weight_version"] == v0
    # keep, with a stream in flight: its tokens carry both versions, split where the update fell.
    r = _Reader(srv, max_tokens=3000)
    r.start()
    assert r.started.wait(30)
    while r.tokens() < 5:
        time.sleep(0.01)
    got = _post(srv, "/update_weights", json={"path": str(other_weights), "mode": "keep"})
    assert got.status_code == 200 and got.json()["weight_version"] == v0 + 1, got.text
    r.join(60)
    assert r.error is None
    last = r.chunks[-1].choices[0].model_extra
    assert last["weight_version"] == v0 + 1
    spans = last["weight_versions"]
    assert [v for v, _ in spans] == [v0, v0 + 1] and spans[0][1] == 0 and spans[1][1] >= 5
    # The same prompt under the new weights: no block computed under the old ones is used
    # (no cached prompt tokens), and its tokens are the new weights' solo run.
    after = cli.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert after.usage.prompt_tokens_details is None or not after.usage.prompt_tokens_details.cached_tokens
    assert after.model_extra["weight_version"] == v0 + 1
    assert after.choices[0].text == _solo(other_weights, prompt, 8)[1]
    # abort mode: what is in flight ends as an engine-initiated error.
    r = _Reader(srv)
    r.start()
    assert r.started.wait(30)
    got = _post(srv, "/update_weights", json={"path": str(tiny_long_model_dir), "mode": "abort"})
    assert got.status_code == 200 and got.json()["aborted"] == 1
    r.join(10)
    assert isinstance(r.error, openai.APIError) and r.error.code == "engine_update"
    again = cli.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert again.choices[0].text == before.choices[0].text  # the first weights, back again
    srv.wait_idle(timeout=5)


@pytest.mark.parametrize("keep_live", [False, True])
def test_prefix_cache_never_serves_old_weights(tiny_model_dir, other_weights_small, keep_live):
    """Blocks cached (or owned by a request still running) under the old weights are never a
    prefix hit for a request under the new ones; its tokens are the new weights' solo run."""
    prompt = list(range(5, 5 + 50))
    core = EngineCore(str(tiny_model_dir), EngineConfig(num_blocks=64, enable_prefix_caching=True),
                      progress=False)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    inc_a = core.add_request("a", prompt, SamplingParams(max_tokens=200 if keep_live else 6, temperature=0,
                                                 ignore_eos=True))
    for _ in range(4):
        core.step()
    core.residency.stage_weights(str(other_weights_small))
    assert core.residency.commit_weights() == 1
    core.add_request("b", prompt, greedy)
    out: dict[str, list[int]] = {"a": [], "b": []}
    cached = None
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
            if o.finished and o.request_id == "b":
                cached = o.usage.cached_tokens
                core.abort([inc_a], AbortSource.CANCEL, time.monotonic())
        core.audit()
    assert cached == 0
    assert out["b"] == _solo(other_weights_small, prompt, 6)[0]
    assert not core.kv_manager.seqs and core.pool.num_used == 0


@pytest.fixture(scope="module")
def other_weights_small(tmp_path_factory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny_b_small") / "model", seed=1)


@pytest.mark.parametrize("how", ["setting", "call", "off"])
def test_keep_update_with_recompute_continues_as_the_new_weights_solo_run(tiny_long_model_dir,
                                                                         other_weights, how):
    """A keep update with recompute (--update-recompute, or the call's `recompute`) preempts
    the requests in flight by recompute at the swap: their KV is computed again under the new
    weights, so their later tokens are the new weights' solo run of the prompt and the tokens
    they had. Without it, the old KV stays and the later tokens differ."""
    import asyncio

    from stopline.engine.async_engine import AsyncEngine

    prompt = list(range(3, 3 + 37))

    async def run() -> tuple[list[int], list[int], dict]:
        engine = AsyncEngine.in_process(str(tiny_long_model_dir), EngineConfig(num_blocks=512),
                                        progress=False)
        engine.update_recompute = how == "setting"
        await engine.start()
        try:
            stream = await engine.add("a", prompt, SamplingParams(max_tokens=40, temperature=0,
                                                                  ignore_eos=True))
            by_version: dict[int, list[int]] = {0: [], 1: []}
            answer: dict = {}
            async for out in stream:
                by_version[out.weight_version] += out.new_token_ids
                if not answer and len(by_version[0]) >= 6:
                    await engine.pause("keep")  # the update falls at a known token
                    answer = await engine.update_weights(str(other_weights), "keep",
                                                         recompute=True if how == "call" else None)
                    await engine.resume()
            snap = await engine.utility("snapshot")
            await engine.utility("audit")
            return by_version[0], by_version[1], {"answer": answer, "snap": snap}
        finally:
            await engine.close()

    before, after, seen = asyncio.run(run())
    assert seen["answer"]["recompute"] is (how != "off") and seen["answer"]["weight_version"] == 1
    assert len(before) >= 6 and len(before) + len(after) == 40 and after
    solo = _solo(other_weights, prompt + before, len(after))[0]
    if how == "off":
        assert after != solo  # the old weights' KV under the new weights: another run
    else:
        assert after == solo
