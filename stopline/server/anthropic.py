"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the same engine.

A message request becomes one engine request: the system text, the turns, tool use and tool
results are shown to the model as chat completions show them (stopline's tool-call format,
grammar/tool_format.py; the tools' grammar, grammar/tools.py), and a thinking model's
thinking (server/reasoning.py) comes back as a `thinking` block before the answer.

The stop path decides `stop_reason`: a stop string is `stop_sequence` (with the string), a
stop after complete tool calls `tool_use`, EOS `end_turn`, max_tokens `max_tokens`. An end
that is no answer (a cancel, the server's shutdown, a deadline, a failure) is an HTTP error,
or in a stream an `error` event and nothing after it: never `message_stop`. A disconnect
aborts the request at once, as in serving.py (the race and the first-output peek: requests.py).
Errors have Anthropic's shape: {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from stopline.engine.output import RequestOutput
from stopline.engine.streams import EngineDead
from stopline.grammar import tool_format
from stopline.grammar.tools import ToolPlan, tool_plan
from stopline.request import AbortSource, InvalidRequest, SamplingParams
from stopline.server import batch, limits, reasoning
from stopline.server.errors import ApiError, param_of
from stopline.server.protocol import _Strict, parse
from stopline.server.requests import (
    LEFT,
    admit,
    client_id,
    encode,
    engine_died,
    grammar_refusal,
    read_body,
    trace_headers,
    unavailable,
    unless_refused,
    whole,
)
from stopline.server.serving import chat_text, template_kwargs
from stopline.server.sse import SSEResponse

if TYPE_CHECKING:
    from stopline.server.state import ServerState

log = logging.getLogger("stopline.server")

# HTTP status -> Anthropic's error type
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
          429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 504: "timeout_error"}
MAX_STOP_SEQUENCES = 64


class CountRequest(_Strict):
    model: str
    messages: list[Any]
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # accepted and ignored
    # stopline extensions (the SDK's extra_body=)
    queue_timeout: float | None = None
    deadline: float | None = None
    logit_bias: dict[str, float] | None = None


def error_body(exc: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _TYPES.get(exc.status, "api_error"),
                                       "message": exc.message}}


def _error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)


def _bad(param: str, why: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {why}", param=param, code=code)


async def messages(request: Request) -> Response:
    srv: ServerState = request.app.state.server
    try:
        return await _messages(request, srv)
    except ApiError as exc:
        srv.metrics.rejected.labels(str(exc.status)).inc()
        return _error_response(exc)


async def count_tokens(request: Request) -> Response:
    srv: ServerState = request.app.state.server
    try:
        _authorize(request, srv)
        req = parse(CountRequest, await read_body(request, srv.settings.max_body_bytes))
        srv.check_model(req.model)
        tok = srv.engine.tokenizer
        if not srv.engine.ready or tok is None:
            raise unavailable(srv.engine.unavailable_why())
        text, _, _ = _prompt(req, srv, tok)
        return JSONResponse({"input_tokens": len(await encode(tok, text, add_special_tokens=False))})
    except ApiError as exc:
        return _error_response(exc)


def _authorize(request: Request, srv: ServerState) -> None:
    """Anthropic's clients send the key as x-api-key; a Bearer token works too."""
    key = srv.settings.api_key
    given = request.headers.get("x-api-key")
    if key is not None and given is not None:
        if not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise ApiError(401, "invalid x-api-key", code="invalid_api_key")
        return
    srv.authorize(request)


# ---- the request -> prompt and sampling --------------------------------------------------------
def _system(system: str | list[Any] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "".join(_text_block(b, f"system.{i}") for i, b in enumerate(system))


def _text_block(b: Any, param: str) -> str:
    if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
        kind = b.get("type") if isinstance(b, dict) else type(b).__name__
        raise _bad(param, f"content block type {kind!r} is not supported here (text only)", "unsupported")
    return b["text"]


def _result_text(b: dict[str, Any], param: str) -> str:
    content = b.get("content", "")
    text = content if isinstance(content, str) else \
        "".join(_text_block(c, f"{param}.content.{k}") for k, c in enumerate(content or []))
    return f"Error: {text}" if b.get("is_error") else text


def _turns(req: CountRequest, plan: ToolPlan) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it: tools and past calls in stopline's
    tool-call format, a tool result as the user turn that brings it back, past thinking
    dropped (the model thought it; templates drop it too)."""
    if not req.messages:
        raise _bad("messages", "must contain at least one message")
    if len(req.messages) > limits.LIMITS.messages:
        raise _bad("messages", f"at most {limits.LIMITS.messages} entries, got {len(req.messages)}")
    system = "\n\n".join(s for s in (_system(req.system), plan.system_text()) if s)
    out = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(req.messages):
        p = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"{p}.role", "must be 'user' or 'assistant'")
        role, content = m["role"], m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{p}.content", "must be a string or a list of content blocks")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(content):
            bp = f"{p}.content.{j}"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise _bad(bp, "a tool_use block has a 'name' and an 'input' object")
                calls.append({"function": {"name": b["name"], "arguments": b.get("input") or {}}})
            elif kind == "tool_result" and role == "user":
                if texts:
                    out.append({"role": "user", "content": "".join(texts)})
                    texts = []
                out.append({"role": "user", "content": tool_format.tool_result_text(_result_text(b, bp))})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            else:
                texts.append(_text_block(b, bp))
        if calls:
            out.append({"role": "assistant", "content": tool_format.assistant_text("".join(texts), calls)})
        elif texts or role == "assistant":
            out.append({"role": role, "content": "".join(texts)})
    return out


def _tools(req: CountRequest) -> ToolPlan:
    tools = []
    for i, t in enumerate(req.tools or []):
        if not isinstance(t, dict):
            raise _bad(f"tools.{i}", "must be an object")
        if t.get("type") not in (None, "custom"):
            raise _bad(f"tools.{i}.type", f"server tools ({t['type']!r}) are not supported", "unsupported")
        if not isinstance(t.get("input_schema"), dict):
            raise _bad(f"tools.{i}.input_schema", "required: the tool's JSON schema")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        tools.append({"type": "function", "function": fn})
    tc = req.tool_choice
    choice: Any = None
    parallel = None
    if tc is not None:
        kind = tc.get("type")
        if kind == "tool":
            choice = {"type": "function", "function": {"name": tc.get("name")}}
        elif kind in ("auto", "any", "none"):
            choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise _bad("tool_choice.type", f"one of auto, any, tool, none; got {kind!r}")
        if tc.get("disable_parallel_tool_use"):
            parallel = False
    try:
        return tool_plan(tools or None, choice, parallel)
    except InvalidRequest as exc:
        msg = str(exc).replace("tool_choice.function.name", "tool_choice.name")
        raise ApiError(400, msg, param=param_of(msg), code="invalid_value") from None


def _thinking(req: CountRequest) -> tuple[bool | None, int | None]:
    """(enable_thinking for the template, budget); (None, None): the template's default."""
    th = req.thinking
    if th is None:
        return None, None
    kind = th.get("type")
    if kind == "enabled":
        budget = th.get("budget_tokens")
        if not isinstance(budget, int) or budget < 0:
            raise _bad("thinking.budget_tokens", f"must be an integer >= 0, got {budget!r}")
        return True, budget
    if kind == "adaptive":
        return True, None
    if kind == "disabled":
        return False, 0  # should the model open a thinking anyway, it ends at once
    raise _bad("thinking.type", f"one of enabled, disabled, adaptive; got {kind!r}")


def _prompt(req: CountRequest, srv: ServerState, tok: Any) -> tuple[str, ToolPlan, Any]:
    """The rendered prompt, the tool plan and the reasoning spec of a request."""
    plan = _tools(req)
    enable, budget = _thinking(req)
    kwargs = template_kwargs({"enable_thinking": enable} if enable is not None else None)
    text = chat_text(tok, _turns(req, plan), kwargs)
    return text, plan, reasoning.spec(srv.reasoning_markers, tok, text, budget)


def _params(req: MessagesRequest, srv: ServerState) -> SamplingParams:
    if req.max_tokens < 1:
        raise _bad("max_tokens", f"must be >= 1, got {req.max_tokens}")
    limits.check(_Limited(req.model, req.max_tokens, req.stop_sequences, logit_bias=req.logit_bias),
                 limits.Limits(stop_count=MAX_STOP_SEQUENCES))
    if srv.engine.info is not None:
        limits.check_vocab(req.logit_bias, srv.engine.info.vocab_size)
    p = SamplingParams(n=1, max_tokens=req.max_tokens, stop=list(req.stop_sequences or ()),
                       queue_timeout=req.queue_timeout if req.queue_timeout is not None
                       else srv.settings.queue_timeout, deadline=req.deadline)
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(req, name)
        if value is not None:
            setattr(p, name, value)
    if req.logit_bias:
        p.logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
    try:
        p.validate()
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param=param_of(str(exc)), code="invalid_value") from None
    return p


@dataclass
class _Limited:
    """What limits.check reads, from a message request."""

    model: str | None
    max_tokens: int | None
    stop: list[str] | None
    n: int = 1
    user: str | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None


# ---- serving -------------------------------------------------------------------------------
async def _messages(request: Request, srv: ServerState) -> Response:
    arrival = time.monotonic()
    _authorize(request, srv)
    req = parse(MessagesRequest, await read_body(request, srv.settings.max_body_bytes))
    lora = srv.check_model(req.model)
    engine = srv.engine
    tok = engine.tokenizer
    if not engine.ready or tok is None:
        raise unavailable(engine.unavailable_why())
    params = _params(req, srv)
    text, plan, params.reasoning = _prompt(req, srv, tok)
    params.grammar = plan.grammar
    params.lora = lora
    prompt = await encode(tok, text, add_special_tokens=False)
    rid = f"msg_{uuid.uuid4().hex}"
    trace = client_id(request) or rid
    group = batch.Group(engine, 1)
    await admit(engine, group, rid, [prompt], params, arrival, prompt_param="messages")
    srv.metrics.requests.labels("messages").inc()
    log.info("%s: admitted (request id %s), %d prompt tokens", rid, trace, len(prompt))
    msg = Message(rid, lora or srv.model_name, len(prompt), list(params.stop), plan.parses_calls)
    headers = trace_headers(rid, trace)

    def disconnected(t0: float) -> None:
        log.info("%s: client disconnected (request id %s)", rid, trace)
        group.end(AbortSource.DISCONNECT, t0)
        group.detach()

    if req.stream:
        outputs: Any = group
        if params.grammar is not None:
            # A tool grammar that can't be compiled is a 400 before the stream's first byte.
            outputs = await unless_refused(request, group, disconnected, _grammar_error)
            if outputs is None:
                return Response(status_code=499)
        return SSEResponse(_events(outputs, msg), on_disconnect=disconnected, wake=group.detach,
                           headers=headers)
    got = await whole(request, group, _collect(group, msg), disconnected)
    if got is LEFT:
        return Response(status_code=499)
    return JSONResponse(msg.whole(got), headers=headers)


async def _collect(stream: batch.Group, msg: Message) -> RequestOutput:
    """Read the whole output into msg; the terminal output."""
    async for out in stream:
        msg.take(out)
        if out.finished:
            return out
    raise ApiError(500, "the request ended without a terminal output", code="internal_error")


def _grammar_error(out: RequestOutput) -> ApiError | None:
    return grammar_refusal(out.finish_reason.value if out.finish_reason else None, out.stop_detail, "tools")


def _failure(out: RequestOutput) -> ApiError | None:
    """The error for an end that is no answer (None: stop or length, an answer)."""
    reason = out.finish_reason.value if out.finish_reason else None
    detail = out.stop_detail or ""
    if reason in ("stop", "length"):
        return None
    refused = _grammar_error(out)
    if refused is not None:
        return refused
    if reason == "abort":
        if detail == AbortSource.SHUTDOWN.value:
            return ApiError(503, "the server is shutting down", code="shutdown")
        return ApiError(499, f"the request was cancelled ({detail})", code="cancelled")
    if reason == "timeout":
        return ApiError(504, f"the request passed its deadline ({detail})", code="timeout")
    if reason == "preempted":
        return ApiError(503, f"the request could not be served: {detail}", code="preempted")
    return ApiError(500, f"the request failed: {detail}", code="request_failed")


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


async def _events(stream: Any, msg: Message) -> AsyncIterator[bytes]:
    """message_start, the blocks as they grow, then message_delta and message_stop; or, for
    an end that is no answer, an `error` event and nothing after it."""
    end: RequestOutput | None = None
    try:
        yield _event("message_start", {"type": "message_start", "message": msg.head()})
        async for out in stream:
            for name, data in msg.feed(out):
                yield _event(name, data)
            if out.finished:
                end = out
                break
    except EngineDead as exc:
        yield _event("error", error_body(engine_died(exc)))
        return
    finally:
        stream.end(AbortSource.DISCONNECT)
        stream.close()
    if end is None:
        return  # detached: the client is gone, nobody reads further
    failed = _failure(end)
    if failed is not None:
        yield _event("error", error_body(failed))
        return
    for name, data in msg.close():
        yield _event(name, data)
    stop_reason, stop_sequence = msg.stop_reason(end)
    yield _event("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                   "usage": msg.usage(end)})
    yield _event("message_stop", {"type": "message_stop"})


@dataclass
class Message:
    """One response message: its content blocks, built from engine outputs as they come."""

    id: str
    model: str
    prompt_tokens: int
    stops: list[str]
    tools: bool
    blocks: list[dict[str, Any]] = field(default_factory=list)
    open: str | None = None  # the type of the block being streamed
    parser: tool_format.StreamParser = field(default_factory=tool_format.StreamParser)
    text: str = ""  # the answer's text, for the non-streaming response
    reasoning: str = ""

    def head(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}

    # ---- whole ------------------------------------------------------------------------------
    def take(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.reasoning += out.new_reasoning

    def whole(self, end: RequestOutput) -> dict[str, Any]:
        failed = _failure(end)
        if failed is not None:
            raise failed
        reason = end.finish_reason.value if end.finish_reason else None
        content: list[dict[str, Any]] = []
        if self.reasoning:
            content.append({"type": "thinking", "thinking": self.reasoning, "signature": ""})
        text, calls = tool_format.parse(self.text, reason) if self.tools else (self.text, [])
        if text:
            content.append({"type": "text", "text": text})
        for c in calls:
            content.append({"type": "tool_use", "id": _tool_id(c.id), "name": c.name,
                            "input": _input(c.arguments)})
        self.parser.calls = calls
        stop_reason, stop_sequence = self.stop_reason(end)
        return self.head() | {"content": content, "stop_reason": stop_reason,
                              "stop_sequence": stop_sequence, "usage": self.usage(end)}

    # ---- streamed -----------------------------------------------------------------------------
    def feed(self, out: RequestOutput) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        if out.new_reasoning:
            events += self._block("thinking", {"thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": out.new_reasoning}))
        reason = out.finish_reason.value if out.finish_reason else None
        if not self.tools:
            text, calls = out.new_text, []
        else:
            text, calls = self.parser.feed(out.new_text)
            if out.finished:
                text += self.parser.finish(reason)
        if text and out.finished and _failure(out) is not None:
            text = ""  # nothing of an end that is no answer
        if text:
            events += self._block("text", {"text": ""})
            events.append(self._delta({"type": "text_delta", "text": text}))
        for d in calls:
            args = d["function"].get("arguments") or ""
            if "id" in d:
                events += self._block("tool_use", {"id": _tool_id(d["id"]), "name": d["function"]["name"],
                                                   "input": {}}, new=True)
            if args:
                events.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return events

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def _block(self, kind: str, body: dict[str, Any], new: bool = False) -> list[tuple[str, dict[str, Any]]]:
        """Open a block of `kind` unless one is open (new: always a new one)."""
        if self.open == kind and not new:
            return []
        events = self.close()
        block = {"type": kind, **body}
        self.blocks.append(block)
        self.open = kind
        events.append(("content_block_start", {"type": "content_block_start",
                                               "index": len(self.blocks) - 1, "content_block": block}))
        return events

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return ("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                        "delta": delta})

    # ---- the end ------------------------------------------------------------------------------
    def stop_reason(self, end: RequestOutput) -> tuple[str, str | None]:
        """What the stop path decided, in Anthropic's words."""
        reason = end.finish_reason.value if end.finish_reason else None
        if reason == "length":
            return "max_tokens", None
        if end.stop_detail in self.stops:
            return "stop_sequence", end.stop_detail
        calls = self.parser.calls
        if calls and all(c.complete for c in calls):
            return "tool_use", None
        return "end_turn", None

    def usage(self, end: RequestOutput) -> dict[str, int]:
        u = end.usage
        cached = u.cached_tokens if u is not None else 0
        return {"input_tokens": self.prompt_tokens - cached, "output_tokens": u.completion_tokens if u else 0,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict[str, Any]:
    """A call's input; a call cut by max_tokens has what could be read of it (nothing)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
