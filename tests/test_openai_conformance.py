"""The OpenAI surface as users' tools drive it: the official `openai` client (and plain HTTP
for vLLM's /tokenize and /detokenize) against a real `stopline serve` on the tiny model."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server_harness import ServerProcess, serving

KEY = "k"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(ServerProcess("--model", str(tiny_model_dir), "--served-model-name", "tiny", api_key=KEY)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_retrieve(client):
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("gpt-9")
    assert exc.value.body["param"] == "model" and exc.value.body["code"] == "model_not_found"


def test_tokenize_detokenize_round_trip(server, client):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.base + "/tokenize", json={"model": "tiny", "prompt": "hello world"}, headers=h)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] > 0
    # The count is what a completion of that prompt bills as prompt tokens.
    done = client.completions.create(model="tiny", prompt="hello world", max_tokens=1)
    assert done.usage.prompt_tokens == body["count"]
    back = httpx.post(server.base + "/detokenize", json={"model": "tiny", "tokens": body["tokens"]}, headers=h)
    assert back.status_code == 200 and back.json()["prompt"].endswith("hello world")
    # With messages: the chat template, as /v1/chat/completions applies it.
    msgs = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = httpx.post(server.base + "/tokenize", json={"model": "tiny", "messages": msgs}, headers=h).json()
    done = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    assert done.usage.prompt_tokens == chat["count"]
    no_gen = httpx.post(server.base + "/tokenize", headers=h, json={
        "model": "tiny", "messages": msgs, "add_generation_prompt": False}).json()
    assert no_gen["count"] < chat["count"]
    for path, body, param in [("/tokenize", {"model": "tiny"}, "prompt"),
                              ("/tokenize", {"model": "tiny", "messages": [{"role": "wizard"}]},
                               "messages.0.role"),
                              ("/detokenize", {"model": "tiny", "tokens": [10**7]}, "tokens"),
                              ("/detokenize", {"model": "nope", "tokens": [1]}, "model")]:
        r = httpx.post(server.base + path, json=body, headers=h)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, r.text)


@pytest.mark.parametrize("stream", [False, True])
def test_request_id_is_echoed(client, stream):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=stream,
        extra_headers={"X-Request-Id": "trace-123"})
    assert raw.headers["x-request-id"] == "trace-123"
    ours = raw.headers["x-stopline-id"]
    parsed = raw.parse()
    ids = {c.id for c in parsed} if stream else {parsed.id}
    assert ids == {ours}  # the response id (what the cancel endpoint takes) stays ours
    plain = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert plain.headers["x-request-id"] == plain.headers["x-stopline-id"] == plain.parse().id


@pytest.mark.parametrize("kw,param", [
    ({"logit_bias": {"5": 300}}, "logit_bias"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bounds_are_400_naming_the_field(client, kw, param):
    args = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**args)
    assert exc.value.body["param"] == param


def test_continuous_usage_on_every_chunk(client):
    chunks = list(client.completions.create(
        model="tiny", prompt="hi", max_tokens=6, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    text_chunks, final = chunks[:-1], chunks[-1]
    assert text_chunks and all(c.usage is not None for c in text_chunks)
    counts = [c.usage.completion_tokens for c in text_chunks]
    assert counts == sorted(counts) and counts[-1] == 6  # running totals, ending at the total
    assert final.choices == [] and final.usage.completion_tokens == 6
    assert final.usage.prompt_tokens == text_chunks[0].usage.prompt_tokens > 0


def test_usage_chunk_after_a_cancel(server, client):
    """A stream cancelled by the admin endpoint still ends with its usage chunk."""
    stream = client.completions.create(model="tiny", prompt="hi", max_tokens=5000, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    r = httpx.post(server.base + f"/v1/requests/{first.id}/cancel",
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["cancelled"], r.text
    rest = list(stream)
    assert rest[-1].choices == [] and rest[-1].usage.completion_tokens >= 1
    assert any(c.choices and c.choices[0].finish_reason == "abort" for c in rest)


def test_usage_unsent_is_counted_on_disconnect(server, client):
    before = server.metrics().get("stopline_usage_unsent_total", 0.0)
    stream = client.completions.create(model="tiny", prompt="hi", max_tokens=5000, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()  # the client leaves before the end
    server.wait_for(lambda m: m.get("stopline_usage_unsent_total", 0.0) == before + 1)
    server.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_several_prompts_in_one_request(client, stream):
    prompts = ["one two", "three", "four five six"]
    args = dict(model="tiny", max_tokens=3, n=2, seed=7, temperature=1.0,
                extra_body={"ignore_eos": True})
    singles = [client.completions.create(prompt=p, **args) for p in prompts]
    if stream:
        chunks = list(client.completions.create(prompt=prompts, stream=True,
                                                stream_options={"include_usage": True}, **args))
        assert len({c.id for c in chunks}) == 1
        texts: dict[int, str] = {}
        for c in chunks:
            for ch in c.choices:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
        usage = chunks[-1].usage
    else:
        done = client.completions.create(prompt=prompts, **args)
        assert [c.index for c in done.choices] == list(range(6))
        texts = {c.index: c.text for c in done.choices}
        usage = done.usage
    # Choice i*n + j is prompt i's sample j: the same text as prompt i alone (seeded).
    assert texts == {i * 2 + j: singles[i].choices[j].text for i in range(3) for j in range(2)}
    assert usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert usage.completion_tokens == 18
    tokens = client.completions.create(prompt=[[1, 2, 3], [4, 5]], model="tiny", max_tokens=1)
    assert [c.index for c in tokens.choices] == [0, 1] and tokens.usage.prompt_tokens == 5


def test_cancel_by_response_id_ends_every_prompt(server, client):
    stream = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=5000, stream=True,
                                       extra_body={"ignore_eos": True})
    it = iter(stream)
    first = next(it)
    r = httpx.post(server.base + f"/v1/requests/{first.id}/cancel",
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["cancelled"], r.text
    reasons = {ch.index: ch.finish_reason for c in it for ch in c.choices if ch.finish_reason}
    assert reasons == {0: "abort", 1: "abort"}
    server.wait_idle()


def test_logit_bias(client):
    """Forcing through the API; banning and batch invariance: tests/test_engine_sampling.py."""
    args = dict(model="tiny", prompt="hi", max_tokens=4, temperature=0.0, logprobs=0,
                extra_body={"ignore_eos": True})
    plain = client.completions.create(**args)
    forced = client.completions.create(logit_bias={"42": 100}, **args)
    assert forced.choices[0].logprobs.tokens == [client_token(client, 42)] * 4
    assert plain.choices[0].logprobs.tokens != forced.choices[0].logprobs.tokens


def client_token(client, tid: int) -> str:
    base = str(client.base_url).removesuffix("/v1/")
    r = httpx.post(base + "/detokenize", json={"tokens": [tid]}, headers={"Authorization": f"Bearer {KEY}"})
    return r.json()["prompt"]


def _hf_scores(tiny_model_dir, ids: list[int]):
    from tests.engine_support import hf_log_softmax, load_hf

    return hf_log_softmax(load_hf(tiny_model_dir), ids)


def _joined(chunks) -> tuple[str, list, list, list]:
    """One streamed choice's text and logprobs, concatenated over its chunks."""
    text, toks, vals, offs = "", [], [], []
    for c in chunks:
        for ch in c.choices:
            text += ch.text
            if ch.logprobs is not None:
                toks += ch.logprobs.tokens
                vals += ch.logprobs.token_logprobs
                offs += ch.logprobs.text_offset
    return text, toks, vals, offs


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_with_logprobs_scores_the_prompt_like_hf(server, client, tiny_model_dir, stream, max_tokens):
    """What lm-eval sends for multiple choice: echo + logprobs, the prompt as token ids."""
    h = {"Authorization": f"Bearer {KEY}"}
    ids = httpx.post(server.base + "/tokenize", json={"model": "tiny", "prompt": "the cat sat on"},
                     headers=h).json()["tokens"]
    args = dict(model="tiny", prompt=ids, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True, **args))
        text, toks, vals, offs = _joined(chunks)
        tops = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.top_logprobs]
        reasons = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    else:
        done = client.completions.create(**args)
        ch = done.choices[0]
        text, toks, vals, offs = ch.text, ch.logprobs.tokens, ch.logprobs.token_logprobs, ch.logprobs.text_offset
        tops, reasons = ch.logprobs.top_logprobs, [ch.finish_reason]
        assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == max_tokens
    assert reasons == ["length"]
    assert len(toks) == len(vals) == len(offs) == len(ids) + max_tokens
    assert vals[0] is None and tops[0] is None  # the first token has nothing before it
    assert text == "".join(toks) and text.startswith("".join(toks[:len(ids)]))
    assert offs == [sum(len(t) for t in toks[:k]) for k in range(len(toks))]
    ref = _hf_scores(tiny_model_dir, ids)
    for q in range(1, len(ids)):
        assert abs(vals[q] - float(ref[q - 1, ids[q]])) < 1e-4, q
        assert len(tops[q]) == 2 and max(tops[q].values()) == pytest.approx(float(ref[q - 1].max()), abs=1e-4)


def test_echo_without_logprobs_and_batched(client):
    prompts = ["alpha beta", "gamma"]
    plain = client.completions.create(model="tiny", prompt=prompts, max_tokens=2, temperature=0,
                                      extra_body={"ignore_eos": True})
    echoed = client.completions.create(model="tiny", prompt=prompts, max_tokens=2, temperature=0,
                                       echo=True, extra_body={"ignore_eos": True})
    for p, a, b in zip(prompts, plain.choices, echoed.choices, strict=True):
        assert b.text == p + a.text and b.logprobs is None
    only = client.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True)
    assert [c.text for c in only.choices] == prompts and only.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as exc:  # 0 tokens and no echo: nothing to do
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert exc.value.body["param"] == "max_tokens"
