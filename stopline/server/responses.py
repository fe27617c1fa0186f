"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id},
POST /v1/responses/{id}/cancel.

A request is turned into a chat request (input items and instructions into messages, tools
and `text.format` into their chat shapes) and then checked, encoded and admitted by the chat
path's own functions (protocol.py, serving.py, requests.py), so the same input gets the same 4xx here. One
engine request stands for the response, read through a `batch.Group` (the one place its
engine requests end). A `Pump` turns its outputs into the Responses events and ends every run
with exactly one terminal event, however it ends (vllm#55284):

  completed   the model stopped (EOS, stop token or string)
  incomplete  max_output_tokens or the context (incomplete_details.reason "max_output_tokens")
  cancelled   the cancel endpoint, the foreground client leaving, or the admin cancel
  failed      an error, a deadline, a stall, the engine's death, or the server's shutdown

A foreground response is tied to its connection (a disconnect aborts it, as in serving.py)
and can't be cancelled by the endpoint (400, sglang#38002). A background one (`background:
true`, needs `store`) runs in a task no client holds; GET polls it, `GET ?stream=true&
starting_after=N` follows its numbered events from N, and the cancel endpoint ends it through
the engine's abort (source cancel). The run's first end decides (store.py): a cancel after the
end returns the response unchanged (vllm#57999), one accepted before the engine's terminal
output makes it `cancelled` whatever that output says (term-llm#789).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import ValidationError

from stopline.engine.output import RequestOutput
from stopline.engine.streams import EngineDead, EngineStopped, EngineUnavailable
from stopline.grammar import tool_format
from stopline.request import AbortSource, FinishReason
from stopline.server import batch, limits, reasoning
from stopline.server.errors import ApiError
from stopline.server.format import UsageSum
from stopline.server.protocol import (
    ChatRequest,
    _Strict,
    _validation_error,
    chat_messages,
    grammar_of,
    parse,
    sampling_params,
    tools_of,
)
from stopline.server.requests import (
    LEFT,
    admit,
    encode,
    first_output,
    grammar_refusal,
    read_body,
    unavailable,
    unless_client_leaves,
)
from stopline.server.serving import chat_text, template_kwargs
from stopline.server.sse import SSEResponse
from stopline.server.store import TERMINAL, ResponseStore, Run, Stored

if TYPE_CHECKING:
    from stopline.server.state import ServerState

log = logging.getLogger("stopline.server")

CANCEL_TIMEOUT = 30.0  # a cancel waits at most this long for the run to end
SHUTDOWN = {"code": "server_shutdown", "message": "the server shut down before the response ended"}
# stopline's sampling extensions a client may send (the openai client's extra_body=)
_EXTENSIONS = ("top_k", "min_p", "min_tokens", "repetition_penalty", "ignore_eos", "stop", "seed",
               "stop_token_ids", "queue_timeout", "deadline", "priority", "presence_penalty",
               "frequency_penalty", "logit_bias", "skip_special_tokens", "max_thinking_tokens",
               "chat_template_kwargs")
_TERMINAL_EVENT = {s: f"response.{s}" for s in TERMINAL}


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = True
    background: bool | None = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # accepted and echoed


# ---- request -> chat request ----------------------------------------------------------------
def _bad(param: str, why: str, code: str = "invalid_value", status: int = 400) -> ApiError:
    return ApiError(status, f"{param}: {why}", param=param, code=code)


def _text_of(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"input.{i}.content", "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise _bad(f"input.{i}.content.{j}", f"content part type {kind!r} is not supported "
                       "(input_text and output_text only)", code="unsupported")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: messages, function calls (an assistant turn's tool_calls)
    and their outputs (tool turns); reasoning items are dropped (the model rethinks)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise _bad("input", "must contain at least one item")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"input.{i}.role", f"{role!r} is not one of user, assistant, system, developer")
            out.append({"role": role, "content": _text_of(i, item.get("content"))})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, str):
                raise _bad(f"input.{i}", "a function_call needs call_id, name and arguments (strings)")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant":  # one turn: its text, then its calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise _bad(f"input.{i}", "a function_call_output needs call_id and output (strings)")
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise _bad(f"input.{i}.type", f"item type {kind!r} is not supported (message, "
                       "function_call, function_call_output, reasoning)", code="unsupported")
    return out


def _chat_tools(tools: list[Any] | None) -> list[Any] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"tools.{i}.type", f"tool type {kind!r} is not supported (function only)",
                       code="unsupported")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _chat_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format", "must be an object with a 'type'")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return fmt


_RENAMES = (("messages", "input"), ("max_tokens", "max_output_tokens"),
            ("response_format", "text.format"))


def _renamed(exc: ApiError) -> ApiError:
    """The chat path's error with this API's parameter names."""
    msg, param = exc.message, exc.param
    for old, new in _RENAMES:
        if param is not None and (param == old or param.startswith(old + ".")):
            param = new + param[len(old):]
        if msg.startswith(old):
            msg = new + msg[len(old):]
    return ApiError(exc.status, msg, param=param, code=exc.code, headers=exc.headers)


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatRequest:
    body: dict[str, Any] = {"messages": messages, "max_tokens": req.max_output_tokens,
                            "temperature": req.temperature, "top_p": req.top_p,
                            "tools": _chat_tools(req.tools), "tool_choice": _chat_tool_choice(req.tool_choice),
                            "parallel_tool_calls": req.parallel_tool_calls,
                            "response_format": _chat_format(req.text)}
    extra = req.model_extra or {}
    body |= {k: extra[k] for k in _EXTENSIONS if k in extra}
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as exc:
        raise _renamed(_validation_error(exc)) from None


# ---- outputs -> events ------------------------------------------------------------------------
def _hex() -> str:
    return uuid.uuid4().hex[:24]


class Writer:
    """Outputs -> Responses events, keeping the response object's `output` up to date. One
    item is open at a time (reasoning, a message, a call); a new one closes it."""

    def __init__(self, response: dict[str, Any], tools: bool) -> None:
        self.r = response
        self.parser = tool_format.StreamParser() if tools else None
        self.open: tuple[str, int, dict[str, Any]] | None = None  # (kind, output_index, item)
        self.started = False
        self.tokens = 0  # output tokens read so far

    def start(self) -> list[dict[str, Any]]:
        events = [{"type": "response.created", "response": copy.deepcopy(self.r)}]
        if self.r["status"] == "queued":
            events.append({"type": "response.queued", "response": copy.deepcopy(self.r)})
        else:
            events += self._in_progress()
        return events

    def _in_progress(self) -> list[dict[str, Any]]:
        self.started = True
        self.r["status"] = "in_progress"
        return [{"type": "response.in_progress", "response": copy.deepcopy(self.r)}]

    def feed(self, out: RequestOutput, reason: str | None) -> list[dict[str, Any]]:
        """reason: the finish reason of a terminal output, as the stream parser takes it."""
        events = [] if self.started else self._in_progress()
        self.tokens += len(out.new_token_ids)
        thinking = getattr(out, "new_reasoning", "") or ""
        if thinking:
            events += self._reasoning(thinking)
        text, calls = out.new_text, []
        if self.parser is not None:
            text, calls = self.parser.feed(text)
            if out.finished:
                text += self.parser.finish(reason)
        if text:
            events += self._text(text)
        for c in calls:
            events += self._call(c)
        return events

    def _add(self, kind: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close_open("completed")
        index = len(self.r["output"])
        self.r["output"].append(item)
        self.open = (kind, index, item)
        return events + [{"type": "response.output_item.added", "output_index": index,
                          "item": copy.deepcopy(item)}]

    def _part(self, kind: str, item: dict[str, Any], part: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._add(kind, item)
        item["content"].append(part)
        return events + [{"type": "response.content_part.added", "item_id": item["id"],
                          "output_index": self.open[1], "content_index": 0,
                          "part": copy.deepcopy(part)}]

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open[0] != "reasoning":
            item = {"id": f"rs_{_hex()}", "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            events = self._part("reasoning", item, {"type": "reasoning_text", "text": ""})
        _, index, item = self.open
        item["content"][0]["text"] += text
        return events + [{"type": "response.reasoning_text.delta", "item_id": item["id"],
                          "output_index": index, "content_index": 0, "delta": text}]

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open[0] != "message":
            item = {"id": f"msg_{_hex()}", "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
            events = self._part("message", item, {"type": "output_text", "text": "",
                                                  "annotations": [], "logprobs": []})
        _, index, item = self.open
        item["content"][0]["text"] += text
        return events + [{"type": "response.output_text.delta", "item_id": item["id"],
                          "output_index": index, "content_index": 0, "delta": text, "logprobs": []}]

    def _call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        fn = delta.get("function") or {}
        if "id" in delta:
            item = {"id": f"fc_{_hex()}", "type": "function_call", "status": "in_progress",
                    "call_id": delta["id"], "name": fn.get("name", ""), "arguments": ""}
            events = self._add("call", item)
        if self.open is None or self.open[0] != "call":
            return events  # no open call to add to (not the parser's order)
        _, index, item = self.open
        args = fn.get("arguments") or ""
        if args:
            item["arguments"] += args
            events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": index, "delta": args})
        return events

    def _close_open(self, status: str) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        kind, index, item = self.open
        self.open = None
        events: list[dict[str, Any]] = []
        if kind == "call":
            complete = self.parser is not None and any(
                c.id == item["call_id"] and c.complete for c in self.parser.calls)
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": item["arguments"]})
            item["status"] = "completed" if complete else "incomplete"  # whatever came after
        else:
            part = item["content"][0]
            done = "response.output_text.done" if kind == "message" else "response.reasoning_text.done"
            events.append({"type": done, "item_id": item["id"], "output_index": index,
                           "content_index": 0, "text": part["text"]}
                          | ({"logprobs": []} if kind == "message" else {}))
            events.append({"type": "response.content_part.done", "item_id": item["id"],
                           "output_index": index, "content_index": 0, "part": copy.deepcopy(part)})
            item["status"] = status
        return events + [{"type": "response.output_item.done", "output_index": index,
                          "item": copy.deepcopy(item)}]

    def end(self, status: str, usage: dict[str, Any], error: dict[str, Any] | None,
            incomplete: dict[str, Any] | None) -> list[dict[str, Any]]:
        events = self._close_open("completed" if status == "completed" else "incomplete")
        self.r.update(status=status, usage=usage, error=error, incomplete_details=incomplete)
        return events + [{"type": _TERMINAL_EVENT[status], "response": copy.deepcopy(self.r)}]

    def assistant(self) -> dict[str, Any]:
        """The output as the chat turn a later response continues from."""
        text = "".join(i["content"][0]["text"] for i in self.r["output"] if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.r["output"] if i["type"] == "function_call" and i["status"] == "completed"]
        return {"role": "assistant", "content": text or None} | ({"tool_calls": calls} if calls else {})


def _usage(usage: UsageSum, reasoning: int) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


class Pump:
    """Reads a run's engine requests into its events; ends the run exactly once."""

    def __init__(self, run: Run, group: batch.Group, source: Any, writer: Writer, srv: ServerState,
                 entry: Stored | None, messages: list[dict[str, Any]]) -> None:
        self.run = run
        self.group = group
        self.source = source  # the group, or the group with its first output read ahead
        self.writer = writer
        self.srv = srv
        self.entry = entry
        self.messages = messages
        self.usage = UsageSum(group.prompt_tokens)
        self.reasoning_tokens = 0
        self.last: RequestOutput | None = None  # the terminal output
        self.dead: str | None = None
        self.stopped: AbortSource | None = None  # the engine ended it on its own (pause, ...)
        self.closed = False

    async def frames(self) -> AsyncIterator[bytes]:
        """The run's frames in order, ending with its terminal event. A reader that leaves
        (aclose, cancel) still ends the run: its terminal event is recorded, not sent."""
        try:
            for ev in self.writer.start():
                yield self.run.emit(ev)
            async for out in self.source:
                reason = None
                if out.finished:
                    self.last = out
                    self.usage.add(out)
                    self.reasoning_tokens += getattr(out.usage, "reasoning_tokens", 0) or 0
                    reason = "abort" if self.run.cancel_accepted else \
                        out.finish_reason.value if out.finish_reason else None
                for ev in self.writer.feed(out, reason):
                    yield self.run.emit(ev)
        except EngineDead as exc:  # its death, or one of the engine's own stops
            self.dead = str(exc)
            self.stopped = exc.source if isinstance(exc, EngineStopped) else None
        except BaseException:
            self.close()
            raise
        for data in self.close():
            yield data

    async def drain(self) -> None:
        """A background run: nobody reads; followers read the kept events."""
        try:
            async for _ in self.frames():
                pass
        finally:
            self.srv.responses.runs.pop(self.run.id, None)

    def outcome(self) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
        """(status, error, incomplete_details): the first end that applies decides."""
        if self.run.cancel_accepted:
            return "cancelled", None, None
        source = self.group.streams[0].cancelled if self.group.streams else None
        if source is AbortSource.SHUTDOWN or self.srv.responses.closed:
            return "failed", SHUTDOWN, None
        if self.stopped is not None:
            return "failed", {"code": self.stopped.value, "message": self.dead}, None
        if self.dead is not None:
            if "shut down" in self.dead:
                return "failed", SHUTDOWN, None
            return "failed", {"code": "engine_dead", "message": f"the engine core died: {self.dead}"}, None
        out = self.last
        if out is None:  # the reader left before the end: a foreground client's cancel
            return "cancelled", None, None
        reason, detail = out.finish_reason, out.stop_detail or ""
        if reason is FinishReason.STOP:
            return "completed", None, None
        if reason is FinishReason.LENGTH:
            return "incomplete", None, {"reason": "max_output_tokens"}
        if reason is FinishReason.ABORT:
            if source in (AbortSource.CANCEL, AbortSource.DISCONNECT, None):
                return "cancelled", None, None
            return "failed", {"code": source.value, "message": f"the request was ended: {source.value}"}, None
        if reason is FinishReason.ERROR and detail.startswith("grammar: "):
            param = "tools" if self.writer.parser is not None else "text.format"
            return "failed", {"code": "invalid_grammar",
                              "message": f"{param}: {detail.removeprefix('grammar: ')}"}, None
        code = {FinishReason.TIMEOUT: "timeout", FinishReason.PREEMPTED: "preempted"}.get(reason, "server_error")
        return "failed", {"code": code, "message": f"the request failed: {detail or code}"}, None

    def close(self) -> list[bytes]:
        """End the run (once): its engine requests, its open item, its terminal event."""
        if self.closed:
            return []
        self.closed = True
        self.group.end(AbortSource.DISCONNECT)  # a no-op once all have ended
        self.group.close()
        status, error, incomplete = self.outcome()
        if self.last is None:  # no terminal output: the tokens read are what was delivered
            self.usage.completion_tokens = self.writer.tokens
        frames = [self.run.emit(ev) for ev in
                  self.writer.end(status, _usage(self.usage, self.reasoning_tokens), error, incomplete)]
        self.run.finish()
        store = self.srv.responses
        store.counts.ended[status] += 1
        if self.entry is not None:
            self.entry.messages = self.messages + [self.writer.assistant()]
            store.ended(self.run.id)
        log.info("%s: %s", self.run.id, status)
        return frames


# ---- routes ---------------------------------------------------------------------------------
def _json(obj: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    """The object as it is now (encoded at once: a running response changes later)."""
    return Response(msgspec.json.encode(obj), media_type="application/json", headers=headers)


async def create(request: Request) -> Response:
    srv: ServerState = request.app.state.server
    try:
        return await _create(request, srv)
    except ApiError as exc:
        srv.metrics.rejected.labels(str(exc.status)).inc()
        raise


async def _create(request: Request, srv: ServerState) -> Response:
    arrival = time.monotonic()
    srv.authorize(request)
    req = parse(ResponsesRequest, await read_body(request, srv.settings.max_body_bytes))
    lora = srv.check_model(req.model)
    store = srv.responses
    if req.background and not req.store:
        raise _bad("background", "a background response must be stored (store: true)")
    prior: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise _bad("previous_response_id", f"no stored response with id {req.previous_response_id!r}",
                       code="response_not_found", status=404)
        if prev.run is not None and not prev.run.ended:
            raise _bad("previous_response_id", f"response {req.previous_response_id!r} has not ended yet")
        prior = prev.messages
    messages = prior + input_messages(req.input)
    shown = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + messages
    chat = chat_request(req, shown)
    engine = srv.engine
    if not engine.ready or engine.tokenizer is None:
        raise unavailable(str(EngineUnavailable(engine.unavailable_why())))
    try:
        limits.check(chat)
        if engine.info is not None:
            limits.check_vocab(chat.logit_bias, engine.info.vocab_size)
        params = sampling_params(chat, queue_timeout=srv.settings.queue_timeout, default_max_tokens=None)
        tools = tools_of(chat)
        params.grammar = grammar_of(chat, tools)
        params.lora = lora
        # A thinking model thinks here too (server/reasoning.py); reasoning.effort is its budget.
        effort = req.reasoning.get("effort") if isinstance(req.reasoning, dict) else None
        limit = reasoning.budget(effort, chat.max_thinking_tokens, "reasoning.effort")
        text = chat_text(engine.tokenizer, chat_messages(chat, tools),
                         template_kwargs(chat.chat_template_kwargs))
        prompt = await encode(engine.tokenizer, text, add_special_tokens=False)
        params.reasoning = reasoning.spec(srv.reasoning_markers, engine.tokenizer, text, limit)
    except ApiError as exc:
        raise _renamed(exc) from None
    if req.background and store.closed:
        raise unavailable("the server is shutting down")
    if req.background and store.full_of_runs():
        raise ApiError(429, f"{store.running} background responses are running (limit "
                       f"{store.max_stored}, --responses-max-stored)", code="too_many_background",
                       headers={"Retry-After": "1"})
    rid = f"resp_{uuid.uuid4().hex}"
    group = batch.Group(engine, 1)
    try:
        await admit(engine, group, rid, [prompt], params, arrival, model_404=False)
    except ApiError as exc:
        raise _renamed(exc) if exc.status == 400 else exc from None
    background = bool(req.background)
    response = {
        "id": rid, "object": "response", "created_at": int(time.time()),
        "status": "queued" if background else "in_progress", "background": background,
        "error": None, "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "model": srv.model_name, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning or {"effort": None, "summary": None}, "store": bool(req.store),
        "temperature": params.temperature, "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
        "tools": req.tools or [], "top_p": params.top_p, "truncation": "disabled", "usage": None,
        "user": req.user, "metadata": req.metadata or {},
    }
    run = Run(response, keep_events=background)
    run.ender = lambda: group.end(AbortSource.CANCEL)
    entry = Stored(response, messages, run, background=background) if req.store else None
    if entry is not None:
        store.put(entry)
    writer = Writer(response, tools.parses_calls)
    store.counts.created["background" if background else "foreground"] += 1
    log.info("%s: admitted, %d prompt tokens%s", rid, len(prompt), ", background" if background else "")
    headers = {"X-Stopline-Id": rid}

    if background:
        pump = Pump(run, group, group, writer, srv, entry, messages)
        store.runs[rid] = run
        run.task = asyncio.create_task(pump.drain(), name=f"stopline-{rid}")
        if req.stream:  # the creator follows; its leaving ends nothing
            return _follow(run, -1, headers)
        return _json(response, headers)

    def disconnected(t0: float) -> None:
        log.info("%s: client disconnected", rid)
        group.end(AbortSource.DISCONNECT, t0)
        group.detach()

    source: Any = group
    if params.grammar is not None and req.stream:
        # A grammar that can't be compiled is a 400 before the first byte (serving.py).
        peeked = await first_output(request, group, disconnected)
        if peeked is None:
            Pump(run, group, group, writer, srv, entry, messages).close()
            return Response(status_code=499)
        first = peeked.first
        refused = _grammar_error(first, tools.parses_calls)
        if refused is not None:
            pump = Pump(run, group, group, writer, srv, entry, messages)
            pump.last = first
            pump.close()
            if entry is not None:
                store.delete(rid)  # refused: nothing was answered
            raise refused
        source = peeked
    pump = Pump(run, group, source, writer, srv, entry, messages)
    if req.stream:
        return SSEResponse(pump.frames(), on_disconnect=disconnected, wake=group.detach, headers=headers)

    async def whole() -> None:
        async for _ in pump.frames():
            pass

    try:
        got = await unless_client_leaves(request, whole(), disconnected)
    finally:
        pump.close()  # however it ended (the client left, our task was cancelled)
    if got is LEFT:
        return Response(status_code=499)
    err = response.get("error") or {}
    if err.get("code") == "invalid_grammar" and not response["output"]:
        if entry is not None:
            store.delete(rid)
        raise ApiError(400, err["message"], param="tools" if tools.parses_calls else "text.format",
                       code="invalid_grammar")
    return _json(response, headers=headers)


def _grammar_error(first: RequestOutput, tools: bool) -> ApiError | None:
    reason = first.finish_reason.value if first.finish_reason else None
    return grammar_refusal(reason, first.stop_detail, "tools" if tools else "text.format")


def _follow(run: Run, after: int, headers: dict[str, str] | None = None) -> Response:
    """A stream of the run's kept events after `after`; the reader leaving ends only it."""
    stop = asyncio.Event()
    return SSEResponse(run.follow(after, stop), on_disconnect=lambda t0: None, wake=stop.set,
                       headers=headers)


def _stored(srv: ServerState, rid: str) -> Stored:
    entry = srv.responses.get(rid)
    if entry is None:
        raise ApiError(404, f"no stored response with id {rid!r} (unknown, not stored, deleted, "
                       "or evicted)", param="response_id", code="response_not_found")
    return entry


def install(app: FastAPI, srv: ServerState) -> None:
    srv.metrics.registry.register(_StoreCollector(srv.responses))

    @app.post("/v1/responses")
    async def responses_create(request: Request) -> Response:
        return await create(request)

    @app.get("/v1/responses/{rid}")
    async def responses_get(rid: str, request: Request) -> Response:
        srv.authorize(request)
        entry = _stored(srv, rid)
        q = request.query_params
        stream = q.get("stream", "false").lower()
        if stream not in ("true", "false"):
            raise _bad("stream", "must be true or false")
        after = q.get("starting_after")
        if after is not None and not (after.lstrip("-").isdigit() and int(after) >= -1):
            raise _bad("starting_after", "must be an integer sequence number")
        if stream == "false":
            return _json(entry.response)
        if entry.run is None or not entry.background:
            raise _bad("stream", "only a background response can be streamed again", code="unsupported")
        return _follow(entry.run, int(after) if after is not None else -1, {"X-Stopline-Id": rid})

    @app.delete("/v1/responses/{rid}")
    async def responses_delete(rid: str, request: Request) -> Response:
        srv.authorize(request)
        entry = _stored(srv, rid)
        srv.responses.delete(rid)
        if entry.run is not None:
            entry.run.cancel()  # a run still going ends with its record
        return _json({"id": rid, "object": "response.deleted", "deleted": True})

    @app.post("/v1/responses/{rid}/cancel")
    async def responses_cancel(rid: str, request: Request) -> Response:
        srv.authorize(request)
        entry = _stored(srv, rid)
        run = entry.run
        if not entry.background or run is None:
            raise ApiError(400, f"response {rid!r} is not a background response: only those can be "
                           "cancelled here (a foreground one ends when its client closes the "
                           "connection)", param="response_id", code="not_background")
        if run.cancel():
            try:
                await asyncio.wait_for(asyncio.shield(run.done.wait()), CANCEL_TIMEOUT)
            except TimeoutError:
                raise ApiError(504, f"response {rid!r}: the cancel was accepted but the run has not "
                               f"ended in {CANCEL_TIMEOUT:.0f} s", code="cancel_timeout") from None
        return _json(entry.response)  # ended before the cancel: unchanged


class _StoreCollector(Collector):
    """The store's holders (stored responses, background runs going) and its counts."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        s = self.store
        s.sweep()
        yield GaugeMetricFamily("stopline_responses_stored", "Responses kept by the response store.",
                                value=len(s))
        yield GaugeMetricFamily("stopline_responses_background_running",
                                "Background responses whose run has not ended.", value=s.running)
        created = CounterMetricFamily("stopline_responses_created", "Responses admitted, by mode.",
                                      labels=["mode"])
        for mode in ("foreground", "background"):
            created.add_metric([mode], s.counts.created[mode])
        yield created
        ended = CounterMetricFamily("stopline_responses_ended", "Responses ended, by status.",
                                    labels=["status"])
        for status in TERMINAL:
            ended.add_metric([status], s.counts.ended[status])
        yield ended
        yield CounterMetricFamily("stopline_responses_evicted",
                                  "Stored responses dropped by age or by the count bound.",
                                  value=s.counts.evicted)

