"""The OpenAI-compatible server, over real HTTP on loopback, engine core in its own process.

One server (tiny random Llama) serves the whole module. Random weights mean arbitrary text,
so tests pin lengths with ignore_eos and compare runs with each other, not with fixed text.
Every cancel scenario ends by checking that the engine is idle again within one second (no
request running or waiting, KV blocks in use back to baseline) and that the abort was counted
with the right source.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import openai
import pytest

from tests.server_harness import ServerProcess, raw_request, serving, total

KEY = "test-key"
# The model is tiny_long_model_dir (8,192-token context), so a long request outlasts a client's
# round trips.
NUM_BLOCKS = 448  # 7,168 tokens: smaller than the context, so "too big for the pool" exists
MAX_SEQS = 4  # a fifth request waits in the queue
LONG = 1600  # tokens of a "long" request: 4 of them fit the pool together
VERY_LONG = 6400  # one request that has the pool to itself
MAX_BODY = 64 * 1024

pytestmark = pytest.mark.timeout(120)
# tests/test_cluster.py runs this module's stop-path checks again through Ray replicas.
REPLICAS = os.environ.get("STOPLINE_TEST_REPLICAS")


@pytest.fixture(scope="module")
def server(tiny_long_model_dir):
    with serving(ServerProcess("--model", str(tiny_long_model_dir), "--served-model-name", "tiny",
                               "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", str(MAX_SEQS),
                               "--max-body-bytes", str(MAX_BODY),
                               *(["--replicas", REPLICAS] if REPLICAS else []), api_key=KEY)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


@pytest.fixture
def baseline(server) -> float:
    """KV blocks in use when idle (0: cached prefixes are free, not used)."""
    server.wait_idle(timeout=10)
    return server.metrics()["stopline_kv_blocks_used"]


def long_body(stream: bool, **extra) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "Once upon a time", "max_tokens": LONG,
                       "ignore_eos": True, "stream": stream} | extra).encode()


# ---- the happy paths -------------------------------------------------------------------------
def test_health_and_models(server, client):
    health = httpx.get(server.base + "/health").json()
    assert health["status"] == "ok" and ("replicas" in health) == bool(REPLICAS)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_chat_and_completions(client):
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, user="alice")
    c = chat.choices[0]
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens <= 8
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    comp = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=6,
                                     extra_body={"ignore_eos": True})
    assert comp.object == "text_completion" and comp.choices[0].finish_reason == "length"
    assert comp.usage.completion_tokens == 6
    # token ids as the prompt, and max_completion_tokens on chat
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2,
                                    extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 2
    chat2 = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                           max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert chat2.usage.completion_tokens == 3


def test_busy_step_time_is_exported(server, client, baseline):
    """The engine's side of a served token (tools/token_path.py): steps that ran a forward and
    their seconds, with the worker's run inside them; an idle engine adds none."""
    names = ("stopline_engine_busy_steps_total", "stopline_engine_busy_step_seconds_total",
             "stopline_engine_execute_seconds_total")
    before = server.metrics()
    client.completions.create(model="tiny", prompt="Once", max_tokens=6, extra_body={"ignore_eos": True})
    server.wait_idle(baseline)
    after = server.metrics()
    steps, secs, run = (after[n] - before[n] for n in names)
    assert steps >= 2  # a prefill, then decodes (drafts may take several tokens a step)
    assert secs >= run > 0
    time.sleep(0.3)  # idle: the loop waits, and no step runs a forward
    assert all(server.metrics()[n] == after[n] for n in names)


def test_streaming_matches_non_streaming_and_seed_reproduces(client):
    args = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story"}],
                max_tokens=12, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**args).choices[0].message.content
    b = client.chat.completions.create(**args).choices[0].message.content
    assert a == b  # same seed, same text
    other = client.chat.completions.create(**{**args, "seed": 99}).choices[0].message.content
    assert other != a
    chunks = list(client.chat.completions.create(**args, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == a
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert [f.choices[0].finish_reason for f in finals] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(ch.usage is None for ch in chunks[:-1])


def test_n_samples(client):
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=5, n=3, temperature=1.0,
                                  seed=5, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15
    assert len({c.text for c in r.choices}) > 1  # samples differ
    ends: dict[int, str] = {}
    for ch in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                             max_tokens=4, n=2, stream=True,
                                             extra_body={"ignore_eos": True}):
        for c in ch.choices:
            if c.finish_reason:
                assert c.index not in ends  # one terminal per sample
                ends[c.index] = c.finish_reason
    assert ends == {0: "length", 1: "length"}


def test_stop_string(client):
    base = dict(model="tiny", prompt="The quick brown fox", temperature=0.0,
                extra_body={"ignore_eos": True})
    text = client.completions.create(**base, max_tokens=24).choices[0].text
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if text[i:i + 3].strip())
    r = client.completions.create(**base, max_tokens=24, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(stop)]
    streamed = "".join(ch.choices[0].text for ch in
                       client.completions.create(**base, max_tokens=24, stop=stop, stream=True))
    assert streamed == r.choices[0].text


def test_penalties_and_logprobs(client):
    r = client.completions.create(model="tiny", prompt="a b c", max_tokens=4, logprobs=2,
                                  presence_penalty=0.5, frequency_penalty=0.5,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=3, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)


# ---- cancels and disconnects -----------------------------------------------------------------
def test_stream_closed_after_three_chunks(server, client, baseline):
    before = server.metrics()
    stream = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=LONG,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    server.wait_idle(baseline)
    after = server.metrics()
    assert total(after, 'stopline_aborts_total{source="disconnect"') == \
        total(before, 'stopline_aborts_total{source="disconnect"') + 1
    key = 'stopline_abort_accept_latency_seconds_count{source="disconnect"}'
    assert after[key] == before.get(key, 0) + 1
    assert after['stopline_request_finished_total{reason="abort"}'] == \
        before['stopline_request_finished_total{reason="abort"}'] + 1


def test_non_streaming_dropped_while_decoding(server, baseline):
    before = server.metrics()
    sock = raw_request(server.port, "/v1/completions", long_body(False), server.headers)
    server.wait_for(lambda m: m["stopline_requests_running"] >= 1 and m["stopline_engine_steps_total"]
                    > before["stopline_engine_steps_total"] + 3)
    sock.close()
    server.wait_idle(baseline)
    after = server.metrics()
    assert total(after, 'stopline_aborts_total{source="disconnect"') == \
        total(before, 'stopline_aborts_total{source="disconnect"') + 1


def test_non_streaming_dropped_while_queued(server, baseline):
    before = server.metrics()
    busy = [raw_request(server.port, "/v1/completions", long_body(True), server.headers)
            for _ in range(MAX_SEQS)]
    server.wait_for(lambda m: m["stopline_requests_running"] == MAX_SEQS)
    queued = raw_request(server.port, "/v1/completions", long_body(False), server.headers)
    server.wait_for(lambda m: m["stopline_requests_waiting"] == 1)
    queued.close()
    server.wait_for(lambda m: m["stopline_requests_waiting"] == 0, timeout=1.0)
    after = server.metrics()
    key = 'stopline_aborts_total{source="disconnect",state="waiting"}'
    assert after[key] == before[key] + 1
    assert after["stopline_requests_running"] == MAX_SEQS  # the others are untouched
    for s in busy:
        s.close()
    server.wait_idle(baseline)


def test_disconnect_while_preempted(server, baseline):
    """Four requests that outgrow the pool together: the engine preempts one, and clients
    that leave while their request is preempted still abort it at once. A victim may be
    resumed within a step or two of its preemption, so a round in which every client left
    after the victim had resumed is tried again (up to eight rounds: on the tiny model a step
    takes a few ms, about as long as a metrics scrape, and four rounds all missed once in a
    full CI run). Preempted means either way out of the pool: recomputed or swapped (the
    default, AUTO, swaps on this machine)."""
    keys = [f'stopline_aborts_total{{source="disconnect",state="{s}"}}' for s in ("preempted", "swapped")]
    seen: list[dict] = []  # each missed round's aborts, by state
    for _ in range(8):
        before = server.metrics()
        socks = [raw_request(server.port, "/v1/completions", json.dumps(
            # 1,520-token prompts: the pool is nearly full from the start, preemption comes soon.
            {"model": "tiny", "prompt": [10 + i] * 1520, "max_tokens": 3200,
             "ignore_eos": True, "stream": True}).encode(), server.headers) for i in range(MAX_SEQS)]
        server.wait_for(lambda m: m["stopline_requests_preempted"] >= 1, timeout=30)
        for s in socks:
            s.close()
        server.wait_idle(baseline)
        after = server.metrics()
        assert total(after, 'stopline_aborts_total{source="disconnect"') == \
            total(before, 'stopline_aborts_total{source="disconnect"') + MAX_SEQS
        assert total(after, "stopline_preemptions_total") > total(before, "stopline_preemptions_total")
        if sum(after.get(k, 0) for k in keys) > sum(before.get(k, 0) for k in keys):
            return
        seen.append({k: after[k] - before.get(k, 0) for k in after
                     if k.startswith("stopline_aborts_total") and after[k] != before.get(k, 0)})
    pytest.fail(f"no disconnect landed while a request was preempted in eight rounds: {seen}")


def test_cancel_endpoint_ends_open_stream(server, client, baseline):
    before = server.metrics()
    stream = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=LONG,
                                       stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    first = next(it)
    next(it)
    t0 = time.monotonic()
    r = httpx.post(f"{server.base}/v1/requests/{first.id}/cancel", headers=server.headers)
    assert r.status_code == 200, r.text
    assert r.json() == {"id": first.id, "object": "request.cancel", "cancelled": True,
                        "finish_reasons": ["abort"]}
    rest = list(it)  # what the client still reads: at most what was in flight, then the end
    assert time.monotonic() - t0 < 1.0
    assert rest[-1].choices[0].finish_reason == "abort"
    assert all(ch.choices[0].finish_reason is None for ch in rest[:-1])
    assert rest[-1].choices[0].text == ""
    server.wait_idle(baseline)
    after = server.metrics()
    assert total(after, 'stopline_aborts_total{source="cancel"') == \
        total(before, 'stopline_aborts_total{source="cancel"') + 1
    # Cancelling again: it is finished, so 200 and nothing changes.
    again = httpx.post(f"{server.base}/v1/requests/{first.id}/cancel", headers=server.headers)
    assert again.status_code == 200 and again.json()["cancelled"] is False
    assert again.json()["finish_reasons"] == ["abort"]
    assert total(server.metrics(), 'stopline_aborts_total{source="cancel"') == \
        total(after, 'stopline_aborts_total{source="cancel"')


def test_cancel_endpoint_non_streaming_returns_partial_output(server, baseline):
    result: dict = {}

    # Alone in the pool, the request may take most of it: seconds of decoding on the tiny
    # model, long enough to be seen running and cancelled (200 tokens once lost that race).
    request = long_body(False, max_tokens=VERY_LONG)

    def call() -> None:
        result["r"] = httpx.post(server.base + "/v1/completions", content=request,
                                 headers={**server.headers, "Content-Type": "application/json"},
                                 timeout=30)

    t = threading.Thread(target=call)
    t.start()
    server.wait_for(lambda m: m["stopline_requests_running"] >= 1)
    ended = httpx.post(server.base + "/v1/requests/cancel", json={}, headers=server.headers).json()
    t.join(10)
    assert len(ended["cancelled"]) == 1
    body = result["r"].json()
    assert result["r"].status_code == 200 and body["id"] == ended["cancelled"][0]
    assert body["choices"][0]["finish_reason"] == "abort"
    assert body["choices"][0]["stop_detail"] == "cancel"
    assert body["usage"]["completion_tokens"] < VERY_LONG
    server.wait_idle(baseline)


def test_admin_cancel_all_under_32_streams(server, baseline):
    before = server.metrics()
    n = 32

    async def run() -> tuple[list[str | None], dict]:
        aclient = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0,
                                     timeout=60)
        started = asyncio.Event()
        opened = 0

        async def one() -> str | None:
            nonlocal opened
            stream = await aclient.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "go"}], max_tokens=LONG,
                stream=True, extra_body={"ignore_eos": True})
            reason = None
            async for ch in stream:
                if ch.choices[0].delta.role:  # the role chunk: our request is admitted
                    opened += 1
                    if opened == n:
                        started.set()
                if ch.choices[0].finish_reason:
                    reason = ch.choices[0].finish_reason
            return reason

        tasks = [asyncio.create_task(one()) for _ in range(n)]
        await asyncio.wait_for(started.wait(), 30)
        async with httpx.AsyncClient(headers=server.headers, timeout=30) as h:
            resp = await h.post(server.base + "/v1/requests/cancel", json={})
        reasons = await asyncio.gather(*tasks)
        await aclient.close()
        return reasons, resp.json()

    reasons, answer = asyncio.run(run())
    # Opening 32 streams can take as long as the first wave of MAX_SEQS takes to finish on
    # its own; every other stream was still open (running or queued) when the cancel came.
    cancelled = len(answer["cancelled"])
    assert n - 2 * MAX_SEQS <= cancelled <= n and answer["unknown"] == [], (reasons, answer)
    assert sorted(reasons) == ["abort"] * cancelled + ["length"] * (n - cancelled)
    # The admin cancel is confirmed: when it answered, every request it cancelled had ended.
    assert all(answer["finish_reasons"][i] == ["abort"] for i in answer["cancelled"])
    server.wait_idle(baseline)
    after = server.metrics()
    assert total(after, 'stopline_aborts_total{source="cancel"') == \
        total(before, 'stopline_aborts_total{source="cancel"') + cancelled
    assert after['stopline_request_finished_total{reason="abort"}'] == \
        before['stopline_request_finished_total{reason="abort"}'] + cancelled
    assert after["stopline_requests_open"] == 0


# ---- bad input -----------------------------------------------------------------------------------
def _chat(**kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


def _comp(**kw) -> dict:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 4, **kw}


AUTH = {"Authorization": f"Bearer {KEY}"}
# (name, path, body (dict, or raw bytes), headers, status, param)
BAD = [
    ("no key", "/v1/chat/completions", _chat(), {}, 401, None),
    ("wrong key", "/v1/chat/completions", _chat(), {"Authorization": "Bearer nope"}, 401, None),
    ("unknown model", "/v1/chat/completions", _chat(model="gpt-9"), AUTH, 404, "model"),
    ("unknown route", "/v1/embeddings", {}, AUTH, 404, None),
    ("cancel unknown id", "/v1/requests/cmpl-nope/cancel", {}, AUTH, 404, "request_id"),
    ("oversized body", "/v1/completions", _comp(prompt="x" * (MAX_BODY + 1)), AUTH, 413, None),
    ("malformed json", "/v1/completions", b'{"prompt": ', AUTH, 400, None),
    ("body not an object", "/v1/completions", b"[1, 2]", AUTH, 400, None),
    ("missing messages", "/v1/chat/completions", {"model": "tiny"}, AUTH, 400, "messages"),
    ("max_tokens as string", "/v1/completions", _comp(max_tokens="5"), AUTH, 422, "max_tokens"),
    ("temperature as string", "/v1/chat/completions", _chat(temperature="hot"), AUTH, 422, "temperature"),
    ("n as float", "/v1/completions", _comp(n=1.5), AUTH, 422, "n"),
    ("messages not a list", "/v1/chat/completions", _chat(messages="hi"), AUTH, 422, "messages"),
    ("stream as string", "/v1/completions", _comp(stream="yes"), AUTH, 422, "stream"),
    ("max_tokens 0", "/v1/completions", _comp(max_tokens=0), AUTH, 400, "max_tokens"),
    ("negative temperature", "/v1/chat/completions", _chat(temperature=-1), AUTH, 400, "temperature"),
    ("top_p 0", "/v1/completions", _comp(top_p=0), AUTH, 400, "top_p"),
    ("n 0", "/v1/completions", _comp(n=0), AUTH, 400, "n"),
    ("presence_penalty 3", "/v1/completions", _comp(presence_penalty=3), AUTH, 400, "presence_penalty"),
    ("logprobs 50", "/v1/completions", _comp(logprobs=50), AUTH, 400, "logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions", _chat(top_logprobs=2), AUTH, 400, "top_logprobs"),
    ("empty stop string", "/v1/completions", _comp(stop=[""]), AUTH, 400, "stop"),
    ("empty messages", "/v1/chat/completions", _chat(messages=[]), AUTH, 400, "messages"),
    ("empty prompt", "/v1/completions", _comp(prompt=""), AUTH, 400, "prompt"),
    ("token id outside vocab", "/v1/completions", _comp(prompt=[1, 99999]), AUTH, 400, "prompt"),
    ("prompt longer than context", "/v1/completions", _comp(prompt=[5] * 8300), AUTH, 400, "prompt"),
    ("prompt larger than the pool", "/v1/completions", _comp(prompt=[5] * 7600), AUTH, 400, "prompt"),
    ("chat prompt longer than context", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "hello " * 9000}]), AUTH, 400, "messages"),
    ("batched prompt outside vocab", "/v1/completions", _comp(prompt=[[1], [99999]]), AUTH, 400, "prompt"),
    ("batched prompt empty", "/v1/completions", _comp(prompt=["a", ""]), AUTH, 400, "prompt"),
    ("echo not a bool", "/v1/completions", _comp(echo="yes"), AUTH, 422, "echo"),
    ("echo logprobs 21", "/v1/completions", _comp(echo=True, logprobs=21), AUTH, 400, "logprobs"),
    ("tools", "/v1/chat/completions", _chat(tools=[{"type": "function"}]), AUTH, 400, "tools.0.function"),  # a tool without its function
    ("stream_options without stream", "/v1/completions",
     _comp(stream_options={"include_usage": True}), AUTH, 400, "stream_options"),
    # the documented bounds (stopline/server/limits.py, docs/api.md)
    ("five stop sequences", "/v1/completions", _comp(stop=list("abcde")), AUTH, 400, "stop"),
    ("stop sequence too long", "/v1/completions", _comp(stop=["x" * 257]), AUTH, 400, "stop"),
    ("too many stop_token_ids", "/v1/completions", _comp(stop_token_ids=[1] * 257), AUTH, 400, "stop_token_ids"),
    ("logit_bias 301 entries", "/v1/completions",
     _comp(logit_bias={str(i): 1 for i in range(301)}), AUTH, 400, "logit_bias"),
    ("logit_bias value 101", "/v1/completions", _comp(logit_bias={"5": 101}), AUTH, 400, "logit_bias"),
    ("logit_bias key not a token id", "/v1/completions", _comp(logit_bias={"a": 1}), AUTH, 400, "logit_bias"),
    ("logit_bias token outside vocab", "/v1/completions", _comp(logit_bias={"99999": 1}), AUTH, 400, "logit_bias"),
    ("n 65", "/v1/completions", _comp(n=65), AUTH, 400, "n"),
    ("best_of 65", "/v1/completions", _comp(best_of=65, n=1), AUTH, 400, "best_of"),
    ("best_of above n", "/v1/completions", _comp(best_of=2), AUTH, 400, "best_of"),
    ("max_tokens 2**21", "/v1/completions", _comp(max_tokens=2**21), AUTH, 400, "max_tokens"),
    ("top_logprobs 21", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=21), AUTH, 400, "top_logprobs"),
    ("65 prompts", "/v1/completions", _comp(prompt=["a"] * 65), AUTH, 400, "prompt"),
    ("2049 messages", "/v1/chat/completions",
     json.dumps(_chat(messages=[{"role": "user", "content": "x"}] * 2049), separators=(",", ":")).encode(),
     AUTH, 400, "messages"),  # compact, to stay under MAX_BODY
    ("role wizard", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "x"}, {"role": "wizard", "content": "x"}]), AUTH, 400,
     "messages.1.role"),
    ("name too long", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "x", "name": "n" * 257}]), AUTH, 400, "messages.0.name"),
    ("user too long", "/v1/completions", _comp(user="u" * 257), AUTH, 400, "user"),
    ("suffix", "/v1/completions", _comp(suffix="!"), AUTH, 400, "suffix"),
    ("image content part", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), AUTH, 400, "messages.0.content"),
]


@pytest.mark.parametrize("name,path,body,headers,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input(server, baseline, name, path, body, headers, status, param):
    before = server.metrics()
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.base + path, content=content,
                   headers={**headers, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    after = server.metrics()
    # Nothing reached the engine: no step ran, no block moved, nothing was counted as finished.
    for key in ("stopline_engine_steps_total", "stopline_kv_blocks_used", "stopline_kv_blocks_cached",
                "stopline_requests_open"):
        assert after[key] == before[key], key
    assert total(after, "stopline_request_finished_total") == total(before, "stopline_request_finished_total")


def test_developer_role_is_system(server, baseline):
    """A developer message is rendered as a system one (OpenAI's newer name for it)."""
    def ids(role: str) -> int:
        r = httpx.post(server.base + "/v1/chat/completions", headers=server.headers, timeout=60,
                       json=_chat(messages=[{"role": role, "content": "be brief"},
                                            {"role": "user", "content": "hi"}], max_tokens=1))
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    assert ids("developer") == ids("system")
    server.wait_idle(baseline)


def test_queue_timeout_is_503(server, baseline):
    """A request that can't start within its queue_timeout is a 503 with Retry-After."""
    busy = [raw_request(server.port, "/v1/completions", long_body(True), server.headers)
            for _ in range(MAX_SEQS)]
    try:
        server.wait_for(lambda m: m["stopline_requests_running"] == MAX_SEQS)
        r = httpx.post(server.base + "/v1/completions", headers=server.headers, timeout=30,
                       json=_comp(queue_timeout=0.05))
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "queue_timeout"
    finally:
        for s in busy:
            s.close()
    server.wait_idle(baseline)
