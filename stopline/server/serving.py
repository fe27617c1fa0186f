"""POST /v1/completions and /v1/chat/completions: from HTTP request to engine stream and back.

A request is checked in full (key, body size, JSON, model, parameters, prompt) before the
engine sees it, and the engine validates again before it queues anything, so a bad request
changes nothing. Once admitted, the request is tied to its connection: streaming or not, a
disconnect aborts it at once (see disconnect.py), and so does any way the handler ends early.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from stopline.engine.output import RequestOutput
from stopline.engine.streams import EngineDead, EngineOverloaded, EngineStopped, EngineUnavailable
from stopline.request import AbortSource, InvalidRequest
from stopline.server import batch, limits, reasoning
from stopline.server.disconnect import watch_disconnect
from stopline.server.errors import ApiError, param_of
from stopline.server.format import SSE_DONE, Choice, Echo, Formatter, UsageSum, note_version, sse
from stopline.server.protocol import (
    ChatRequest,
    CompletionRequest,
    chat_messages,
    grammar_of,
    parse,
    sampling_params,
    tools_of,
)
from stopline.server.sse import SSEResponse
from stopline.tokenizer.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from stopline.server.state import ServerState

log = logging.getLogger("stopline.server")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context
_OFFLOAD_CHARS = 50_000  # tokenize longer prompts off the event loop


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                       code="body_too_large")
    size, parts = 0, []
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
        parts.append(part)
    return b"".join(parts)


async def create(request: Request, chat: bool) -> Response:
    srv: ServerState = request.app.state.server
    try:
        return await _create(request, srv, chat)
    except ApiError as exc:
        srv.metrics.rejected.labels(str(exc.status)).inc()
        raise


async def _create(request: Request, srv: ServerState, chat: bool) -> Response:
    arrival = time.monotonic()
    srv.authorize(request)
    body = await read_body(request, srv.settings.max_body_bytes)
    req = parse(ChatRequest if chat else CompletionRequest, body)
    lora = srv.check_model(req.model)
    engine = srv.engine
    if not engine.ready or engine.tokenizer is None:
        raise _unavailable(str(EngineUnavailable(engine.unavailable_why())))
    limits.check(req)
    if engine.info is not None:
        limits.check_vocab(req.logit_bias, engine.info.vocab_size)
    params = sampling_params(req, queue_timeout=srv.settings.queue_timeout,
                             default_max_tokens=None if chat else COMPLETION_DEFAULT_MAX_TOKENS)
    tools = tools_of(req)
    params.grammar = grammar_of(req, tools)
    params.lora = lora
    if isinstance(req, ChatRequest):
        limit = reasoning.budget(req.reasoning_effort, req.max_thinking_tokens)
        text = chat_text(engine.tokenizer, chat_messages(req, tools),
                         template_kwargs(req.chat_template_kwargs))
        prompts = [await _encode(engine.tokenizer, text, add_special_tokens=False)]
        params.reasoning = reasoning.spec(srv.reasoning_markers, engine.tokenizer, text, limit)
    else:
        prompts = await _prompt_ids(req, engine.tokenizer, tools)
    if len(prompts) > 1 and engine.info is not None:
        _precheck(prompts, engine.info.vocab_size, engine.info.max_model_len)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    trace = _client_id(request) or rid  # the client's X-Request-Id, echoed; rid stays the cancel id
    group = batch.Group(engine, params.n)  # where every engine request of this one ends
    try:
        for k, prompt in enumerate(prompts):
            mid = batch.member_id(rid, k)
            group.add(await engine.add(mid, prompt, params, arrival=arrival, incarnation=mid))
    except BaseException as exc:
        group.end(AbortSource.CANCEL)  # a later prompt was refused: the earlier ones end with it
        group.detach()
        if isinstance(exc, InvalidRequest):
            msg = str(exc)
            param = param_of(msg)
            if param == "model":  # its adapter was unloaded meanwhile
                raise ApiError(404, msg, param="model", code="model_not_found") from None
            if chat and param == "prompt":
                param, msg = "messages", "messages" + msg.removeprefix("prompt")
            raise ApiError(400, msg, param=param, code="invalid_value") from None
        if isinstance(exc, EngineOverloaded):
            raise ApiError(429, f"the server is busy: {exc}", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        if isinstance(exc, (EngineUnavailable, EngineDead)):
            raise _unavailable(str(exc)) from None
        raise
    srv.metrics.requests.labels("chat" if chat else "completions").inc()
    prompt_len = sum(len(p) for p in prompts)
    log.info("%s: admitted (request id %s), %d prompt(s), %d prompt tokens, n=%d", rid, trace,
             len(prompts), prompt_len, params.n)
    opts = req.stream_options if req.stream else None
    include_usage = bool(opts and opts.include_usage)
    fmt = Formatter(chat=chat, request_id=rid, created=int(time.time()), model=lora or srv.model_name,
                    n=params.n * len(prompts), token_text=srv.token_text, include_usage=include_usage,
                    tool_calls=tools.parses_calls,
                    continuous_usage=bool(opts and opts.continuous_usage_stats),
                    echo=_echoes(req, prompts, engine.tokenizer) if not chat and req.echo else None,
                    logprobs=params.logprobs is not None, reasoning=params.reasoning is not None)
    fmt.prompt_tokens = prompt_len

    def disconnected(t0: float) -> None:
        log.info("%s: client disconnected (request id %s)", rid, trace)
        group.end(AbortSource.DISCONNECT, t0)
        group.detach()

    if req.stream:
        outputs: Any = group
        if params.grammar is not None:
            # A grammar compiles in the engine; one that can't be (invalid, too big, too slow)
            # is a 400 before the stream's first byte, as without streaming, not a 200 stream
            # that ends in an error. So the response starts with the first output.
            peeked = await _first_output(request, group, disconnected)
            if peeked is None:
                return Response(status_code=499)  # client closed the request
            first = peeked.first
            reason = first.finish_reason.value if first.finish_reason else None
            refused = fmt.grammar_error(reason, first.stop_detail)
            if refused is not None:
                group.end(AbortSource.CANCEL)  # members that have not failed yet end with it
                group.detach()
                raise refused
            outputs = peeked
        return SSEResponse(_events(outputs, fmt, srv, trace), on_disconnect=disconnected, wake=group.detach,
                           headers=_headers(rid, trace, engine.weight_version))
    return await _whole(request, group, fmt, disconnected, _headers(rid, trace, engine.weight_version))


_TRACE_CHARS = 128


def _client_id(request: Request) -> str | None:
    value = request.headers.get("x-request-id")
    if value is None:
        return None
    if not value or len(value) > _TRACE_CHARS or not value.isprintable():
        raise ApiError(400, f"X-Request-Id: must be 1-{_TRACE_CHARS} printable characters",
                       param="X-Request-Id", code="invalid_value")
    return value


def _headers(rid: str, trace: str, version: int = 0) -> dict[str, str]:
    # X-Request-Id: the client's id when it sent one (tracing), else ours; X-Stopline-Id: ours,
    # always (the id the cancel endpoint takes, also the response body's `id`); X-Weight-Version:
    # the weights served when it was admitted (the body says which its tokens came from).
    return {"X-Request-Id": trace, "X-Stopline-Id": rid, "X-Weight-Version": str(version)}


def stopped(exc: EngineStopped) -> ApiError:
    """What a client gets for a request the engine ended on its own: a 503 (or that body as
    an SSE error event) whose code names the reason, engine_pause, engine_sleep, ..."""
    return ApiError(503, str(exc), code=f"engine_{exc.source.value}", headers={"Retry-After": "1"})


def _unavailable(why: str) -> ApiError:
    return ApiError(503, why, code="unavailable", headers={"Retry-After": "1"})


def _precheck(prompts: list[list[int]], vocab: int, max_model_len: int) -> None:
    """The engine's prompt checks, for every prompt before the first is admitted."""
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= t < vocab]
        if not p or bad or len(p) >= max_model_len:
            why = ("empty" if not p else f"token ids {bad[:5]} outside the vocabulary" if bad
                   else f"{len(p)} tokens; the context is {max_model_len}")
            raise ApiError(400, f"prompt: prompt {i} is {why}", param="prompt", code="invalid_value")


def template_kwargs(given: dict[str, Any] | None) -> dict[str, Any]:
    """What the chat template is rendered with beyond the messages: the client's switches
    (enable_thinking, ...), less the names the server sets itself."""
    return {k: v for k, v in (given or {}).items()
            if k not in ("messages", "add_generation_prompt", "tools")}


def chat_text(tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any] | None = None,
              param: str = "messages") -> str:
    """The chat template's prompt for `messages`; a template that refuses them is a 400."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **(kwargs or {}))
    except ChatTemplateError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param, code="chat_template") from None


async def _prompt_ids(req: CompletionRequest | ChatRequest, tokenizer: Any,
                      tools: Any = None) -> list[list[int]]:
    """The request's prompts as token ids: one for chat, one or more for completions."""
    if isinstance(req, ChatRequest):
        text = chat_text(tokenizer, chat_messages(req, tools))
        return [await _encode(tokenizer, text, add_special_tokens=False)]
    prompt = req.prompt
    many = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    out = []
    for p in many:
        out.append(await _encode(tokenizer, p, add_special_tokens=True) if isinstance(p, str) else list(p))
    return out


def _echoes(req: CompletionRequest, prompts: list[list[int]], tokenizer: Any) -> list[Echo]:
    """What echo=true puts before each prompt's choices: the prompt as sent (a string as it
    is, token ids as their text)."""
    sent = req.prompt
    many = sent if isinstance(sent, list) and sent and not isinstance(sent[0], int) else [sent]
    return [Echo(p if isinstance(p, str) else tokenizer.decode(ids, skip_special_tokens=False), ids)
            for p, ids in zip(many, prompts, strict=True)]


async def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) > _OFFLOAD_CHARS:
        return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


async def _events(stream: batch.Group, fmt: Formatter, srv: ServerState | None = None,
                  trace: str = ""):  # -> AsyncIterator[bytes]
    usage = fmt.usage_sum(stream.prompt_tokens)
    ended = 0
    sent = False
    try:
        for chunk in fmt.first_chunks():
            yield sse(chunk)
        async for out in stream:
            if out.finished:
                ended += 1
                usage.add(out)
            chunk = fmt.chunk(out)
            if chunk is not None:
                yield sse(chunk)
    except EngineDead as exc:
        # The terminal message of a stream whose engine died or ended it on its own (pause,
        # sleep, update, shutdown): an error event, then [DONE]. The openai client raises
        # APIError at the error event (docs/api.md).
        err = stopped(exc) if isinstance(exc, EngineStopped) else \
            ApiError(500, f"the engine core died: {exc}", code="engine_dead")
        yield sse(err.body())
        if fmt.include_usage:  # what was generated before the death, still billed
            usage.completion_tokens = max(usage.completion_tokens, fmt.streamed)
            yield sse(fmt.usage_chunk(usage))
            sent = True
        yield SSE_DONE
        return
    finally:
        # However the stream ends (an engine error, a detach, an exception), no member of it
        # keeps running: nobody reads it any more.
        stream.end(AbortSource.DISCONNECT)
        stream.close()
        if fmt.include_usage and not sent and ended < fmt.n:
            # The client left (or the response was cancelled) first: nobody to send it to.
            log.info("%s: usage not sent, the client is gone (request id %s): %d completion "
                     "tokens so far", fmt.id, trace, fmt.streamed)
            if srv is not None:
                srv.metrics.usage_unsent.inc()
    if ended < fmt.n:
        return  # detached: the client is gone, nobody reads further
    if fmt.include_usage:
        sent = True
        yield sse(fmt.usage_chunk(usage))
    yield SSE_DONE


async def _whole(request: Request, stream: batch.Group, fmt: Formatter, abort: Any,
                 headers: dict[str, str]) -> Response:
    """Race the engine against the client: whichever ends first decides. However it ends, no
    member of the request keeps running."""
    try:
        return await _race(request, stream, fmt, abort, headers)
    finally:
        stream.end(AbortSource.DISCONNECT)
        stream.close()


_LEFT = object()  # what _unless_client_leaves gives when the client left first


async def _unless_client_leaves(request: Request, work: Awaitable[Any], abort: Any) -> Any:
    """`work`'s result, raced against the client: _LEFT (and `work` cancelled) when the
    client closed the request first; a dead engine is a 500."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(watch_disconnect(request.receive, abort))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # our own task was cancelled (shutdown): the request goes with it
        abort(time.monotonic())
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done() or (watch.done() and not watch.cancelled()):
        task.cancel()
        return _LEFT
    try:
        return task.result()
    except EngineStopped as exc:
        raise stopped(exc) from None
    except EngineDead as exc:
        raise ApiError(500, f"the engine core died: {exc}", code="engine_dead") from None


async def _race(request: Request, stream: batch.Group, fmt: Formatter, abort: Any,
                headers: dict[str, str]) -> Response:
    got = await _unless_client_leaves(request, _collect(stream, fmt), abort)
    if got is _LEFT:
        return Response(status_code=499)  # client closed the request; nobody reads this
    choices, usage = got
    fmt.check_outcome(choices)
    return JSONResponse(fmt.response(choices, usage), headers=headers)


async def _first_output(request: Request, stream: Any, abort: Any) -> _Peeked | None:
    """The stream with its first output read, raced against the client (None: the client
    left first)."""
    it = aiter(stream)
    try:
        first = await _unless_client_leaves(request, anext(it), abort)
    except StopAsyncIteration:
        return None
    return None if first is _LEFT else _Peeked(stream, it, first)


class _Peeked:
    """A stream whose first output was read before its response started: that output
    first, then the rest, from the one iterator (iterating a stream again restarts it)."""

    def __init__(self, stream: Any, it: Any, first: RequestOutput) -> None:
        self._stream = stream
        self._it = it
        self.first = first
        self._pending: RequestOutput | None = first

    def __getattr__(self, name: str) -> Any:  # prompt_tokens, detach, ...
        return getattr(self._stream, name)

    def __aiter__(self) -> _Peeked:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._pending is not None:
            out, self._pending = self._pending, None
            return out
        return await anext(self._it)


async def _collect(stream: batch.Group, fmt: Formatter) -> tuple[list[Choice], UsageSum]:
    choices = [Choice() for _ in range(fmt.n)]
    usage = fmt.usage_sum(stream.prompt_tokens)
    async for out in stream:
        c = choices[out.index]
        note_version(c.versions, out, c.tokens)
        c.text += out.new_text
        c.reasoning += out.new_reasoning
        c.tokens += len(out.new_token_ids)
        c.logprobs += out.new_logprobs
        if out.prompt_logprobs is not None:
            c.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            c.finish_reason = out.finish_reason.value if out.finish_reason else None
            c.stop_detail = out.stop_detail
            usage.add(out)
    return choices, usage
