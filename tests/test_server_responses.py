"""/v1/responses end to end (issue 45, items 2 and 3): the official openai client against
`stopline serve` on the tiny random Llama, over loopback. Plain, streamed and background
responses; the store (previous_response_id, GET, DELETE, its bounds); cancel in its defined
order; a background run outliving its creator's connection and ended by the shutdown."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from stopline.server.store import ResponseStore, Run, Stored
from tests.server_harness import ServerProcess, serving

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny"
LONG = {"ignore_eos": True}  # extra_body: the tiny model's runs last their max_output_tokens
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
TERMINAL = {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}


@pytest.fixture(scope="module")
def server(tiny_long_model_dir):
    with serving(ServerProcess("--model", str(tiny_long_model_dir), "--served-model-name", MODEL,
                               "--responses-max-stored", "6")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


def check_sequence(events: list, resumed: bool = False) -> None:
    """Numbered from the first event on with no gap; exactly one terminal event, the last;
    every item added is done, and written only while open (a resumed tail may start inside
    one)."""
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers
    kinds = [e.type for e in events]
    assert sum(k in TERMINAL for k in kinds) == 1 and kinds[-1] in TERMINAL, kinds
    if resumed:
        return
    open_items: set[int] = set()
    for e in events:
        if e.type == "response.output_item.added":
            open_items.add(e.output_index)
        elif e.type == "response.output_item.done":
            open_items.remove(e.output_index)
        elif e.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
            assert e.output_index in open_items, e
    assert not open_items


def wait_ended(client: openai.OpenAI, rid: str, timeout: float = 60.0):
    t0 = time.monotonic()
    while True:
        r = client.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress"):
            return r
        assert time.monotonic() - t0 < timeout, r.status
        time.sleep(0.05)


def test_plain_response(client) -> None:
    r = client.responses.create(model=MODEL, input="Hello there", instructions="Be brief.",
                                max_output_tokens=12, extra_body=LONG)
    assert r.object == "response" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 0
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text
    assert r.output_text
    assert client.responses.retrieve(r.id).output_text == r.output_text  # stored by default


def test_stream_events_in_the_official_order(client) -> None:
    events = list(client.responses.create(model=MODEL, input="Hello", max_output_tokens=20,
                                          stream=True, extra_body=LONG))
    check_sequence(events)
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 20


def test_input_items_and_previous_response(client, server) -> None:
    first = client.responses.create(model=MODEL, input=[
        {"role": "developer", "content": "You answer briefly."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
    ], max_output_tokens=6, extra_body=LONG)
    assert first.status == "incomplete"
    second = client.responses.create(model=MODEL, input="And tomorrow?", previous_response_id=first.id,
                                     max_output_tokens=6, extra_body=LONG)
    assert second.previous_response_id == first.id
    # The conversation so far (its input and its answer) comes first, then the new turn.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": [{"type": "image", "url": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0"),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": 5}}}, "text.format"),
])
def test_bad_input_is_a_400_that_changes_nothing(server, body, param) -> None:
    before = server.metrics()
    r = httpx.post(server.base + "/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()
    after = server.metrics()
    for key in ("stopline_responses_stored", 'stopline_responses_created_total{mode="foreground"}'):
        assert after[key] == before[key]


def test_function_call(client) -> None:
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                tool_choice="required", max_output_tokens=60)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].status == "completed"
    assert json.loads(calls[0].arguments).keys() == {"city"}
    events = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=60, stream=True))
    check_sequence(events)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == args and json.loads(args).keys() == {"city"}
    assert not any(e.type == "response.output_text.delta" and "<tool_call" in e.delta for e in events)


def test_text_format_json_schema(client) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="A number", max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "num", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_background_poll_resume_and_cancel_after_the_end(client) -> None:
    b = client.responses.create(model=MODEL, input="Tell me", max_output_tokens=40, background=True,
                                extra_body=LONG)
    assert b.background and b.status in ("queued", "in_progress")
    done = wait_ended(client, b.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 40
    every = list(client.responses.retrieve(b.id, stream=True))
    check_sequence(every)
    assert every[0].sequence_number == 0 and every[0].type == "response.created"
    assert [e.type for e in every[:2]] == ["response.created", "response.queued"]
    tail = list(client.responses.retrieve(b.id, stream=True, starting_after=7))
    assert tail[0].sequence_number == 8 and [e.sequence_number for e in tail] == \
        [e.sequence_number for e in every[8:]]
    # A cancel after the end returns the response as it ended (vllm#57999).
    again = client.responses.cancel(b.id)
    assert again.model_dump() == done.model_dump()
    assert client.responses.retrieve(b.id).status == "incomplete"


def test_background_cancel_mid_run(client, server) -> None:
    b = client.responses.create(model=MODEL, input="Tell me", max_output_tokens=6000,
                                background=True, extra_body=LONG)
    # Follow it a little, leave, resume from the last event seen: no gap, no repeat.
    with client.responses.retrieve(b.id, stream=True) as s:
        seen = [e for _, e in zip(range(8), s, strict=False)]
    last = seen[-1].sequence_number
    with client.responses.retrieve(b.id, stream=True, starting_after=last) as s:
        assert next(iter(s)).sequence_number == last + 1
    c = client.responses.cancel(b.id)
    assert c.status == "cancelled" and 0 < c.usage.output_tokens < 6000
    assert c.output[0].status == "incomplete"
    assert client.responses.retrieve(b.id).model_dump() == c.model_dump()
    rest = list(client.responses.retrieve(b.id, stream=True, starting_after=last))
    assert rest[-1].type == "response.cancelled"
    check_sequence(rest, resumed=True)
    server.wait_idle(timeout=10)
    assert server.metrics()["stopline_responses_background_running"] == 0


def test_cancel_of_a_foreground_response_is_a_400(client) -> None:
    r = client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(r.id)
    assert e.value.body["code"] == "not_background"
    assert client.responses.retrieve(r.id).status == r.status
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


def test_cancel_racing_completion_has_one_order(client, server) -> None:
    """However the cancel and the end interleave, the cancel's answer is the final status,
    and a run whose cancel was accepted is never reported completed (term-llm#789)."""
    answers = []
    for k in range(12):
        b = client.responses.create(model=MODEL, input=f"Race {k}", max_output_tokens=3 + k % 4,
                                    background=True, extra_body=LONG)
        time.sleep(0.004 * (k % 5))
        c = client.responses.cancel(b.id)
        final = wait_ended(client, b.id)
        assert c.status in ("cancelled", "incomplete")
        assert final.status == c.status and final.model_dump() == c.model_dump()
        answers.append(c.status)
    server.wait_idle(timeout=10)
    assert server.metrics()["stopline_responses_background_running"] == 0


def test_background_run_survives_its_creators_disconnect(client, server) -> None:
    with client.responses.create(model=MODEL, input="Go on", max_output_tokens=300, background=True,
                                 stream=True, extra_body=LONG) as s:
        first = [e for _, e in zip(range(5), s, strict=False)]
    rid = first[0].response.id
    done = wait_ended(client, rid)
    assert done.status == "incomplete" and done.usage.output_tokens == 300


def test_foreground_disconnect_ends_the_request(client, server) -> None:
    with client.responses.create(model=MODEL, input="Go on", max_output_tokens=6000, stream=True,
                                 extra_body=LONG) as s:
        first = [e for _, e in zip(range(6), s, strict=False)]
    server.wait_idle(timeout=10)
    r = client.responses.retrieve(first[0].response.id)
    assert r.status == "cancelled" and r.usage.output_tokens < 6000


def test_a_deadline_ends_the_stream_with_one_failed_event(client) -> None:
    events = list(client.responses.create(model=MODEL, input="Go on", max_output_tokens=6000, stream=True,
                                          extra_body={"ignore_eos": True, "deadline": 0.2}))
    check_sequence(events)
    assert events[-1].type == "response.failed" and events[-1].response.error.code == "timeout"


def test_delete(client) -> None:
    r = client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_store_stays_flat_and_holders_return_to_zero(client, server) -> None:
    """A soak in small: 40 stored responses, foreground and background, through a store of 6."""
    ids, peak = [], 0
    for k in range(40):
        kw = {"background": True} if k % 2 else {}
        ids.append(client.responses.create(model=MODEL, input=f"n{k}", max_output_tokens=3, **kw).id)
        peak = max(peak, server.metrics()["stopline_responses_stored"])
    wait_ended(client, ids[-1])
    m = server.wait_for(lambda m: m["stopline_responses_background_running"] == 0)
    assert peak <= 6 + 1 and m["stopline_responses_stored"] <= 6  # the +1: a run not yet ended
    assert m["stopline_responses_evicted_total"] >= 40 - 6
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # the oldest went first
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    server.wait_idle(timeout=10)


# ---- the store alone, on a clock of its own ------------------------------------------------
def _entry(rid: str, running: bool = False) -> Stored:
    run = Run({"id": rid, "status": "in_progress" if running else "completed"}, keep_events=False)
    return Stored(run.response, [], run, background=running)


def test_store_bounds_by_count_and_age_and_keeps_running_ones() -> None:
    now = [0.0]
    store = ResponseStore(max_stored=3, ttl_s=10.0, clock=lambda: now[0])
    store.put(_entry("run", running=True))  # going: never evicted
    for k in range(5):
        store.put(_entry(f"r{k}"))
        store.ended(f"r{k}")
        now[0] += 1.0
    assert len(store) == 3 and store.get("run") is not None
    assert [store.get(f"r{k}") is not None for k in range(5)] == [False, False, False, True, True]
    now[0] += 10.5  # r3 ended at 3.0, r4 at 4.0: both past the age
    store.sweep()
    assert len(store) == 1 and store.get("run") is not None
    assert store.counts.evicted == 5


# ---- shutdown -----------------------------------------------------------------------------
def test_shutdown_fails_a_background_run(tiny_long_model_dir) -> None:
    srv = ServerProcess("--model", str(tiny_long_model_dir), "--served-model-name", MODEL,
                        "--drain-timeout", "0")
    try:
        srv.wait_ready()
        client = srv.openai()
        b = client.responses.create(model=MODEL, input="Go on", max_output_tokens=8000,
                                    background=True, extra_body=LONG)
        events: list = []
        with client.responses.retrieve(b.id, stream=True) as s:
            it = iter(s)
            events.append(next(it))
            t = threading.Timer(0.2, srv.proc.send_signal, (signal.SIGTERM,))
            t.start()
            events += list(it)
        check_sequence(events)
        last = events[-1]
        assert last.type == "response.failed", last.type
        assert last.response.error.code == "server_shutdown" and "shut down" in last.response.error.message
        assert srv.proc.wait(20) == 0
    finally:
        srv.stop()


def test_engine_death_ends_every_stream_with_one_failed_event(tiny_long_model_dir) -> None:
    """vllm#55284: a stream whose engine dies still ends with its terminal event, foreground
    and background."""
    srv = ServerProcess("--model", str(tiny_long_model_dir), "--served-model-name", MODEL)
    try:
        srv.wait_ready()
        client = srv.openai()
        b = client.responses.create(model=MODEL, input="Go on", max_output_tokens=8000,
                                    background=True, extra_body=LONG)
        fore: list = []
        with client.responses.retrieve(b.id, stream=True) as back, \
                client.responses.create(model=MODEL, input="Go on", max_output_tokens=8000, stream=True,
                                        extra_body=LONG) as s:
            fore.append(next(iter(s)))
            os.kill(srv.core_pid(), signal.SIGKILL)
            fore += list(s)
            behind = list(back)
        for events in (fore, behind):
            check_sequence(events)
            assert events[-1].type == "response.failed", events[-1].type
            assert events[-1].response.error.code == "engine_dead"
    finally:
        srv.stop()


# ---- the run's one order, with the engine's side scripted ----------------------------------
class _Stream:
    cancelled = None


class _Group:
    """The engine side of a run: a scripted list of outputs; the cancel is recorded."""

    def __init__(self, outputs: list) -> None:
        self.outputs = outputs
        self.streams = [_Stream()]
        self.prompt_tokens = 5
        self.ended: list = []

    def end(self, source, t0=None) -> None:
        self.ended.append(source)

    def close(self) -> None:
        pass

    async def __aiter__(self):
        for out in self.outputs:
            yield out


def _pump(outputs: list):
    from types import SimpleNamespace

    from stopline.server.responses import Pump, Writer

    store = ResponseStore(4, 10.0)
    response = {"id": "resp_x", "status": "queued", "output": [], "usage": None, "error": None,
                "incomplete_details": None}
    run = Run(response, keep_events=True)
    group = _Group(outputs)
    run.ender = lambda: group.end("cancel")
    srv = SimpleNamespace(responses=store)
    return run, group, Pump(run, group, group, Writer(response, tools=False), srv, None, [])


def test_a_cancel_accepted_before_the_engines_end_is_never_reported_completed() -> None:
    """The engine's terminal output (here: max tokens, nothing withheld) arrives after the
    cancel was accepted: the run ends `cancelled`, with one terminal event (term-llm#789)."""
    import asyncio

    from stopline.engine.output import RequestOutput
    from stopline.request import FinishReason, Usage

    outs = [RequestOutput("resp_x", 0, new_token_ids=[1], new_text="a"),
            RequestOutput("resp_x", 0, new_token_ids=[2], new_text="b", finished=True,
                          finish_reason=FinishReason.LENGTH, usage=Usage(5, 2))]

    async def main(cancel_first: bool) -> tuple[Run, _Group, bool]:
        run, group, pump = _pump(outs)
        accepted = run.cancel() if cancel_first else None
        async for _ in pump.frames():
            pass
        if not cancel_first:
            accepted = run.cancel()  # after the end: refused, nothing changes
        return run, group, accepted

    run, group, accepted = asyncio.run(main(cancel_first=True))
    assert accepted and group.ended[0] == "cancel"
    assert run.status == "cancelled" and run.response["usage"]["output_tokens"] == 2
    kinds = [json.loads(f.split(b"data: ", 1)[1])["type"] for f in run.events]
    assert [k for k in kinds if k in TERMINAL] == ["response.cancelled"]
    run, group, accepted = asyncio.run(main(cancel_first=False))
    assert not accepted and run.status == "incomplete" and "cancel" not in group.ended


def test_reasoning_then_answer_are_two_items() -> None:
    """Thinking text (`new_reasoning` on an output) is a reasoning item streamed as
    reasoning_text deltas, closed before the message opens."""
    import asyncio

    from stopline.engine.output import RequestOutput
    from stopline.request import FinishReason, Usage

    think = RequestOutput("resp_x", 0, new_token_ids=[1, 2])
    think.new_reasoning = "hmm, "  # the reasoning phase's text (issue 45 item 1)
    more = RequestOutput("resp_x", 0, new_token_ids=[3])
    more.new_reasoning = "yes"
    answer = RequestOutput("resp_x", 0, new_token_ids=[4], new_text="Yes.", finished=True,
                           finish_reason=FinishReason.STOP, usage=Usage(5, 4))

    async def main() -> Run:
        run, _, pump = _pump([think, more, answer])
        async for _ in pump.frames():
            pass
        return run

    run = asyncio.run(main())
    events = [json.loads(f.split(b"data: ", 1)[1]) for f in run.events]
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.queued", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     "response.reasoning_text.delta", "response.reasoning_text.delta",
                     "response.reasoning_text.done", "response.content_part.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.completed"]
    out = run.response["output"]
    assert [o["type"] for o in out] == ["reasoning", "message"]
    assert out[0]["content"][0]["text"] == "hmm, yes" and out[1]["content"][0]["text"] == "Yes."
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
