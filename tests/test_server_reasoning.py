"""Reasoning over HTTP (issue 45, item 1): chat completions on a tiny model whose template
thinks (<think> opened by the generation prompt), with the official openai client over
loopback. A logit bias holds the random model to one token (" a"), so every phase is exact:
the thinking runs until its budget, the engine writes </think>, the answer follows."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server_harness import ServerProcess, serving

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-think"
ASK = [{"role": "user", "content": "Think, then answer."}]
A = 262  # " a"
ONLY_A = {"logit_bias": {str(A): 100}}


@pytest.fixture(scope="module")
def server(tiny_think_model_dir):
    with serving(ServerProcess("--model", str(tiny_think_model_dir), "--served-model-name", MODEL)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


def test_thinking_is_reasoning_content_and_the_budget_ends_it(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0,
                                       extra_body={**ONLY_A, "max_thinking_tokens": 3,
                                                   "skip_special_tokens": False})
    msg = r.choices[0].message
    assert msg.reasoning_content == " a a a"
    assert msg.content == " a a"  # the end marker the engine wrote is in neither
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.completion_tokens_details.reasoning_tokens == 4


def test_a_stop_string_in_the_thinking_does_not_end_the_request(client) -> None:
    """vllm#52393: a stop string inside the thinking must not end the request."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=7, temperature=0,
                                       stop=[" a a a"], extra_body={**ONLY_A, "max_thinking_tokens": 4})
    msg = r.choices[0].message
    assert msg.reasoning_content == " a a a a" and msg.content == " a a"
    assert r.choices[0].finish_reason == "length"


def test_the_stop_string_ends_the_answer(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0,
                                       stop=[" a a"], extra_body={**ONLY_A, "max_thinking_tokens": 4})
    assert r.choices[0].message.reasoning_content == " a a a a"
    assert r.choices[0].message.content == ""
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens_details.reasoning_tokens == 5


def test_streamed_thinking_comes_as_reasoning_deltas_before_the_answer(client) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, reasoning_effort="low",
        extra_body={**ONLY_A, "max_thinking_tokens": 5})
    kinds, reasoning, content, usage, reason = [], "", "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            d = c.delta.model_dump()
            if d.get("reasoning_content"):
                reasoning += d["reasoning_content"]
                kinds.append("r")
            if d.get("content"):
                content += d["content"]
                kinds.append("c")
            reason = c.finish_reason or reason
    assert reasoning == " a" * 5 and content == " a a"
    assert kinds == sorted(kinds, reverse=True)  # every thinking delta before the answer
    assert reason == "length"
    assert usage.completion_tokens_details.reasoning_tokens == 6


def test_reasoning_effort_none_answers_at_once(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0,
                                       reasoning_effort="none", extra_body=ONLY_A)
    assert r.choices[0].message.reasoning_content == ""
    assert r.choices[0].message.content == " a a"
    assert r.usage.completion_tokens_details.reasoning_tokens == 1


def test_thinking_switched_off_by_the_template(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0,
                                       extra_body={**ONLY_A, "chat_template_kwargs": {"enable_thinking": False}})
    # the prompt leaves the thinking closed: the model may still open it, and doesn't here
    assert r.choices[0].message.content == " a a a"
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("body,param", [({"reasoning_effort": "huge"}, "reasoning_effort"),
                                        ({"max_thinking_tokens": -1}, "max_thinking_tokens")])
def test_a_bad_budget_is_a_400(server, body, param) -> None:
    r = httpx.post(server.base + "/v1/chat/completions", json={"messages": ASK, **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_requests_are_counted_by_api(server, client) -> None:
    before = server.metrics().get('stopline_api_requests_total{api="chat"}', 0)
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body=ONLY_A)
    after = server.metrics()
    assert after['stopline_api_requests_total{api="chat"}'] == before + 1
    assert 'stopline_api_requests_total{api="messages"}' in after


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}


def test_a_tool_call_follows_the_thinking(client) -> None:
    """The tool grammar holds the answer only: the thinking before it is free."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0,
                                       tools=[WEATHER], tool_choice="required",
                                       extra_body={**ONLY_A, "max_thinking_tokens": 2})
    msg = r.choices[0].message
    assert msg.reasoning_content == " a a"
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls[0].function.name == "get_weather"


def test_responses_carry_the_thinking_as_a_reasoning_item(client) -> None:
    r = client.responses.create(model=MODEL, input="Think, then answer.", max_output_tokens=5,
                                reasoning={"effort": "none"}, extra_body=ONLY_A)
    kinds = [o.type for o in r.output]
    assert "message" in kinds and r.output_text == " a a a a"  # budget 0: the marker, then the answer
    assert r.usage.output_tokens_details.reasoning_tokens == 1
    r = client.responses.create(model=MODEL, input="Think, then answer.", max_output_tokens=4,
                                extra_body=ONLY_A)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == " a a a a"
    assert r.usage.output_tokens_details.reasoning_tokens == 4


def test_responses_stream_the_thinking_within_its_budget_then_the_answer(client) -> None:
    events = list(client.responses.create(model=MODEL, input="Think, then answer.", max_output_tokens=6,
                                          stream=True, temperature=0,
                                          extra_body={**ONLY_A, "max_thinking_tokens": 3}))
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert thinking == " a a a" and answer == " a a"
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert kinds[-1] == "response.incomplete" and sum(k.startswith("response.in") and k != "response.in_progress"
                                                      for k in kinds) == 1
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == 4
