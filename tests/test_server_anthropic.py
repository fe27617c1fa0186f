"""Anthropic's /v1/messages (issue 45, item 4) with the official `anthropic` client against
`stopline serve` over loopback, on a tiny model whose template thinks. A logit bias (a stopline
extension) holds the random model to one token, and the tools' grammar holds it to a valid
call, so each stop_reason below is exact."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import pytest

from tests.server_harness import ServerProcess, serving, total

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-think"
A, EOS = 262, 2  # " a", <|im_end|>
ONLY_A = {"logit_bias": {str(A): 100}}
ASK = [{"role": "user", "content": "Think, then answer."}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                            "required": ["city"], "additionalProperties": False}}
OFF = {"type": "disabled"}


@pytest.fixture(scope="module")
def server(tiny_think_model_dir):
    with serving(ServerProcess("--model", str(tiny_think_model_dir), "--served-model-name", MODEL)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0, timeout=60)


def test_thinking_block_then_text_and_max_tokens(client) -> None:
    m = client.messages.create(model=MODEL, max_tokens=6, messages=ASK,
                               system="You are terse.", thinking={"type": "enabled", "budget_tokens": 3},
                               extra_body=ONLY_A)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == " a a a" and m.content[1].text == " a a"
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 6 and m.id.startswith("msg_")


def test_a_stop_sequence_is_stop_sequence_not_end_turn(client) -> None:
    """sglang#40529 reported end_turn for a user stop sequence; and the thinking (" a a")
    holds the sequence without ending there."""
    m = client.messages.create(model=MODEL, max_tokens=20, messages=ASK,
                               stop_sequences=["zz", " a a"], thinking={"type": "enabled", "budget_tokens": 2},
                               extra_body=ONLY_A)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == " a a"
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking == " a a"


def test_eos_is_end_turn(client) -> None:
    m = client.messages.create(model=MODEL, max_tokens=5, messages=ASK, thinking=OFF,
                               extra_body={"logit_bias": {str(EOS): 100}})
    assert m.stop_reason == "end_turn" and m.content == []


def test_tool_use_and_a_tool_result_turn(client) -> None:
    m = client.messages.create(model=MODEL, max_tokens=100, messages=ASK, thinking=OFF,
                               tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               extra_body={"temperature": 0})
    assert m.stop_reason == "tool_use"
    call = m.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    assert isinstance(call.input["city"], str)
    turns = ASK + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                 "content": "sunny"}, {"type": "text", "text": "And?"}]}]
    again = client.messages.create(model=MODEL, max_tokens=3, messages=turns, thinking=OFF,
                                   tools=[WEATHER], tool_choice={"type": "none"}, extra_body=ONLY_A)
    assert again.content[0].text == " a a a" and again.stop_reason == "max_tokens"
    # the result reached the prompt
    assert client.messages.count_tokens(model=MODEL, messages=turns, tools=[WEATHER]).input_tokens > \
        client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER]).input_tokens


def test_stream_events_and_final_message(client) -> None:
    kinds = []
    with client.messages.stream(model=MODEL, max_tokens=7, messages=ASK,
                                thinking={"type": "enabled", "budget_tokens": 4}, extra_body=ONLY_A) as s:
        for ev in s:
            kinds.append(ev.type if ev.type not in ("content_block_delta",) else ev.delta.type)
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.index("thinking_delta") < kinds.index("text_delta")
    assert kinds.count("content_block_start") == 2 == kinds.count("content_block_stop")
    assert final.content[0].thinking == " a a a a" and final.content[1].text == " a a"
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 7


def test_streamed_tool_use(client) -> None:
    with client.messages.stream(model=MODEL, max_tokens=100, messages=ASK, thinking=OFF,
                                tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body={"temperature": 0}) as s:
        deltas = [ev.delta.partial_json for ev in s
                  if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta"]
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert json.loads("".join(deltas)) == final.content[-1].input


def test_count_tokens_is_the_prompt(client) -> None:
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, system="You are terse.")
    m = client.messages.create(model=MODEL, max_tokens=1, messages=ASK, system="You are terse.",
                               extra_body=ONLY_A)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


@pytest.mark.parametrize("body,status,words", [
    ({"messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 5, "messages": ASK, "thinking": {"type": "sometimes"}}, 400, "thinking.type"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400, "messages.0.role"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "bash_20250124", "name": "bash"}]}, 400, "tools.0.type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     400, "messages.0.content.0"),
    ({"max_tokens": 0, "messages": ASK}, 400, "max_tokens"),
])
def test_bad_requests_are_anthropic_errors(server, body, status, words) -> None:
    r = httpx.post(server.base + "/v1/messages", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == status
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert words in err["error"]["message"]


def test_the_client_raises_its_own_errors(client) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-none", max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=MODEL, messages=[])


def _events(lines) -> list[tuple[str, dict]]:
    out, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[6:])))
    return out


def test_a_cancelled_stream_ends_with_an_error_event(server) -> None:
    body = {"model": MODEL, "max_tokens": 6000, "messages": ASK, "stream": True, **ONLY_A}
    seen = []
    with httpx.stream("POST", server.base + "/v1/messages", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            seen.append(line)
            if line.startswith("data: ") and '"content_block_delta"' in line:
                break
        mid = _events(seen)[0][1]["message"]["id"]
        c = httpx.post(f"{server.base}/v1/requests/{mid}/cancel", timeout=30).json()
        assert c["cancelled"] is True
        seen += list(lines)
    names = [n for n, _ in _events(seen)]
    assert names[-1] == "error" and "message_stop" not in names and "message_delta" not in names
    assert "cancelled" in _events(seen)[-1][1]["error"]["message"]


def test_a_disconnect_cancels_the_request(server) -> None:
    before = total(server.metrics(), 'stopline_aborts_total{source="disconnect"')
    body = {"model": MODEL, "max_tokens": 6000, "messages": ASK, "stream": True, **ONLY_A}
    with httpx.stream("POST", server.base + "/v1/messages", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if '"content_block_delta"' in line:
                break
    deadline = time.monotonic() + 20
    while total(server.metrics(), 'stopline_aborts_total{source="disconnect"') <= before:
        assert time.monotonic() < deadline, "the disconnect never aborted the request"
        time.sleep(0.05)
    server.wait_idle(timeout=10)
    assert server.metrics()['stopline_api_requests_total{api="messages"}'] >= 2
