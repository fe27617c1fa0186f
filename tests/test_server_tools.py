"""Tool calls and schemas end to end: the official openai client against `stopline serve` on the
tiny random Llama, over loopback. Grammars hold its random output to valid calls, so every
answer below is a real call of the tool (issue 41, items 5-8)."""

from __future__ import annotations

import enum
import json
import socket
import time

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.server_harness import ServerProcess, raw_request, serving

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny"
ASK = [{"role": "user", "content": "Call the tool."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Size(pydantic.BaseModel):
    label: str = pydantic.Field(max_length=8)
    count: int = pydantic.Field(ge=0, le=9)


class Paint(pydantic.BaseModel):
    """A nested model and an Enum: Pydantic writes both as $defs + $ref."""

    color: Color
    size: Size


@pytest.fixture(scope="module")
def server(tiny_long_model_dir):
    with serving(ServerProcess("--model", str(tiny_long_model_dir), "--served-model-name", MODEL,
                               "--grammar-deadline", "1.5")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


def streamed(chunks) -> tuple[str | None, dict[int, dict], str | None, list]:
    """(content, calls by index, finish_reason, the chunks after the role chunk) of a stream."""
    content, calls, reason, rest = None, {}, None, []
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        if d.role is None:
            rest.append(c)
        if d.content:
            content = (content or "") + d.content
        for tc in d.tool_calls or ():
            slot = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
            slot["arguments"] += tc.function.arguments or ""
        reason = c.choices[0].finish_reason or reason
    return content, calls, reason, rest


def test_pydantic_tool_with_defs_and_enum(client) -> None:
    """Item 6: `openai.pydantic_function_tool` of a model with a nested model and an Enum
    ($defs + $ref) is served, in tools and in response_format alike, streaming or not, and the
    arguments validate against the tool's own schema."""
    tool = openai.pydantic_function_tool(Paint)
    params = tool["function"]["parameters"]
    assert "$defs" in params  # the case that was refused
    kw = dict(model=MODEL, messages=ASK, tools=[tool], temperature=0, max_tokens=120)
    for choice in ({"type": "function", "function": {"name": "Paint"}}, "required"):
        r = client.chat.completions.parse(tool_choice=choice, parallel_tool_calls=False, **kw)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "Paint"
        assert isinstance(call.function.parsed_arguments, Paint)
        jsonschema.validate(json.loads(call.function.arguments), params)
    # The stream helper accumulates the argument deltas and parses them the same way.
    with client.chat.completions.stream(tool_choice="required", parallel_tool_calls=False, **kw) as s:
        events = list(s)
        final = s.get_final_completion()
    scall = final.choices[0].message.tool_calls[0]
    assert isinstance(scall.function.parsed_arguments, Paint)
    assert scall.function.arguments == call.function.arguments
    assert sum(e.type == "tool_calls.function.arguments.delta" for e in events) > 1
    # response_format: the same model, parsed into the message.
    r = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Paint, temperature=0,
                                      max_tokens=120)
    assert isinstance(r.choices[0].message.parsed, Paint)
    jsonschema.validate(json.loads(r.choices[0].message.content), Paint.model_json_schema())


def test_arguments_stream_as_deltas(client) -> None:
    """Item 8: a call's first delta has its index, id, type and name; its arguments follow in
    pieces as they are written; no chunk carries an empty content; the pieces add up to the
    non-streaming answer."""
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=NAMED, temperature=0, max_tokens=80)
    whole = client.chat.completions.create(**kw)
    want = whole.choices[0].message.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(want), WEATHER["function"]["parameters"])
    raw = list(client.chat.completions.create(stream=True, **kw))
    content, calls, reason, chunks = streamed(raw)
    assert reason == whole.choices[0].finish_reason == "tool_calls"
    assert content is None and whole.choices[0].message.content is None
    assert all(c.choices[0].delta.content is None for c in raw), "an empty content chunk"
    assert raw[0].choices[0].delta.role == "assistant"
    pieces = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    first, later = pieces[0], pieces[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert len(later) >= 5 and all(p.id is None and p.function.name is None for p in later)
    assert calls[0]["arguments"] == want


def test_cancel_inside_a_call_sends_nothing_after(server, client) -> None:
    """Item 5: a stream cancelled while a call is open ends with one `abort` chunk that carries
    nothing: no call text as content, no further arguments."""
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                            tool_choice="required", max_tokens=4000, temperature=0,
                                            stream=True)
    it = iter(stream)
    seen = []
    for c in it:  # until a call is open and its arguments are coming
        seen.append(c)
        if c.choices and any(tc.function.arguments for tc in c.choices[0].delta.tool_calls or ()):
            break
    r = httpx.post(f"{server.base}/v1/requests/{seen[0].id}/cancel", timeout=10)
    assert r.status_code == 200 and r.json()["cancelled"], r.text
    after = list(it)
    content, _, reason, chunks = streamed(seen + after)
    assert reason == "abort"
    assert content is None, f"text reached the client as content: {content[:200]!r}"
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == "abort"
    assert last.choices[0].delta.content is None and not last.choices[0].delta.tool_calls
    server.wait_idle(timeout=5)


def test_max_tokens_inside_a_call_is_a_cut_call(client) -> None:
    """Item 5: max_tokens landing inside a call (the first or a later parallel one) ends with
    finish_reason `length` and the call as a `tool_calls` entry whose arguments are cut, as
    OpenAI answers; the call's text is never content. Streaming gives the same."""
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0)
    full = client.chat.completions.create(max_tokens=400, **kw).choices[0].message.tool_calls
    assert len(full) >= 2  # parallel calls: the model keeps calling until max_tokens
    cut = 0
    for max_tokens in range(2, 130, 7):
        r = client.chat.completions.create(max_tokens=max_tokens, **kw)
        msg, reason = r.choices[0].message, r.choices[0].finish_reason
        assert reason == "length" and msg.content is None, (max_tokens, msg.content)
        got = [tc.function.arguments for tc in msg.tool_calls or ()]
        for i, args in enumerate(got):
            assert full[i].function.arguments.startswith(args)
        if got and got[-1] != full[len(got) - 1].function.arguments:
            cut += 1
            with pytest.raises(json.JSONDecodeError):
                json.loads(got[-1])
        content, calls, sreason, _ = streamed(client.chat.completions.create(max_tokens=max_tokens,
                                                                             stream=True, **kw))
        assert (content, sreason) == (None, "length")
        assert [calls[i]["arguments"] for i in sorted(calls)] == got
    assert cut >= 3  # some of them landed inside a call's arguments


def test_deadline_inside_a_call_leaves_it_out(client) -> None:
    """Item 5: a non-streaming answer cut by its deadline while a call is open has delivered
    nothing of that call: it is left out, never content; the complete calls stay."""
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0)
    client.chat.completions.create(max_tokens=1, **kw)  # the grammar compiled: the deadline is the answer's
    r = client.chat.completions.create(max_tokens=4000, extra_body={"deadline": 1.0}, **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "timeout" and r.usage.completion_tokens > 0
    assert msg.content is None, f"call text as content: {msg.content[:200]!r}"
    for tc in msg.tool_calls or ():
        jsonschema.validate(json.loads(tc.function.arguments), WEATHER["function"]["parameters"])


def test_held_stop_text_is_dropped_at_a_deadline(client) -> None:
    """Item 5, the engine's side: text held back because it may start a stop string is no
    answer when the request ends without one (deadline, cancel, failure): the terminal chunk
    carries none of it."""
    stop = "\x01" * 50  # never written: the last 49 characters are always held back
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=4000, stop=[stop], stream=True,
        extra_body={"deadline": 1.0, "ignore_eos": True})
    chunks = [c for c in stream if c.choices]
    last = chunks[-1].choices[0]
    assert last.finish_reason == "timeout"
    assert not last.delta.content, f"{len(last.delta.content)} held characters after the deadline"
    assert sum(len(c.choices[0].delta.content or "") for c in chunks) > 0


BAD_REF = {"type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}, "required": ["x"]}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("where", ["tools", "response_format"])
def test_bad_schema_is_a_400_before_the_stream(server, client, where, stream) -> None:
    """Item 7: a schema that can't be compiled is a 400 with the API's error body, for a
    stream too (before its first byte), not a 200 stream that ends in an error."""
    if where == "tools":
        kw = dict(tools=[{"type": "function", "function": {"name": "f", "parameters": BAD_REF}}],
                  tool_choice="required")
    else:
        kw = dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_REF}})
    with pytest.raises(openai.BadRequestError) as ei:
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, stream=stream, **kw)
        list(r) if stream else None
    err = ei.value.body
    assert err["code"] == "invalid_grammar" and err["param"] == where, err
    assert "Missing" in err["message"]
    server.wait_idle(timeout=5)


def slow_lark(tag: str) -> str:
    """A Lark grammar llguidance takes seconds to compile: past the server's 1.5 s deadline."""
    n = 40_000
    return ("start: " + " | ".join(f'"{tag}{i}" x{i}' for i in range(n)) + "\n"
            + "\n".join(f"x{i}: /[a-z]{{{i % 50}}}/" for i in range(n)))


def test_client_leaving_while_the_grammar_compiles(server) -> None:
    """A stream whose grammar is compiling has sent nothing yet; the client that leaves then
    ends it at once (the compile with it)."""
    body = json.dumps({"model": MODEL, "messages": ASK, "max_tokens": 5, "stream": True,
                       "response_format": {"type": "grammar", "grammar": slow_lark("c")}}).encode()
    s = raw_request(server.port, "/v1/chat/completions", body)
    server.wait_for(lambda m: m["stopline_grammar_compiles_pending"] >= 1, timeout=10)
    s.settimeout(0.2)
    with pytest.raises(socket.timeout):
        s.recv(1)  # nothing sent while it compiles: the headers wait for the grammar
    t0 = time.monotonic()
    s.close()
    server.wait_for(lambda m: m["stopline_requests_waiting"] == 0 and m["stopline_requests_running"] == 0,
                    timeout=1.0)
    assert time.monotonic() - t0 < 1.0
    # The compile stopped too. (The gauge is the snapshot of the last step: a step refreshes it.)
    deadline = time.monotonic() + 10
    while server.metrics()["stopline_grammar_compiles_pending"] > 0:
        assert time.monotonic() < deadline, "the compile outlived its only request"
        httpx.post(f"{server.base}/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1},
                   timeout=10)
        time.sleep(0.1)
