"""POST /v1/completions and /v1/chat/completions: from HTTP request to engine stream and back.

A request is checked in full (key, body size, JSON, model, parameters, prompt) before the
engine sees it, and the engine validates again before it queues anything, so a bad request
changes nothing. Once admitted, the request is tied to its connection: streaming or not, a
disconnect aborts it at once (see disconnect.py), and so does any way the handler ends early.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from stopline.engine.streams import EngineDead, EngineStopped, EngineUnavailable
from stopline.request import AbortSource
from stopline.server import batch, limits, reasoning
from stopline.server.errors import ApiError
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
from stopline.server.requests import (
    LEFT,
    admit,
    client_id,
    encode,
    engine_died,
    read_body,
    stopped,
    trace_headers,
    unavailable,
    unless_refused,
    whole,
)
from stopline.server.sse import SSEResponse
from stopline.tokenizer.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from stopline.server.state import ServerState

log = logging.getLogger("stopline.server")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context


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
        raise unavailable(str(EngineUnavailable(engine.unavailable_why())))
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
        prompts = [await encode(engine.tokenizer, text, add_special_tokens=False)]
        params.reasoning = reasoning.spec(srv.reasoning_markers, engine.tokenizer, text, limit)
    else:
        prompts = await _prompt_ids(req, engine.tokenizer, tools)
    if len(prompts) > 1 and engine.info is not None:
        _precheck(prompts, engine.info.vocab_size, engine.info.max_model_len)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    trace = client_id(request) or rid  # the client's X-Request-Id, echoed; rid stays the cancel id
    group = batch.Group(engine, params.n)  # where every engine request of this one ends
    await admit(engine, group, rid, prompts, params, arrival, prompt_param="messages" if chat else "prompt")
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
            outputs = await unless_refused(request, group, disconnected, fmt.refusal)
            if outputs is None:
                return Response(status_code=499)  # client closed the request
        return SSEResponse(_events(outputs, fmt, srv, trace), on_disconnect=disconnected, wake=group.detach,
                           headers=trace_headers(rid, trace, engine.weight_version))
    headers = trace_headers(rid, trace, engine.weight_version)  # as admitted, not as ended
    got = await whole(request, group, _collect(group, fmt), disconnected)
    if got is LEFT:
        return Response(status_code=499)  # client closed the request; nobody reads this
    choices, usage = got
    fmt.check_outcome(choices)
    return JSONResponse(fmt.response(choices, usage), headers=headers)


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
        return [await encode(tokenizer, text, add_special_tokens=False)]
    prompt = req.prompt
    many = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    out = []
    for p in many:
        out.append(await encode(tokenizer, p, add_special_tokens=True) if isinstance(p, str) else list(p))
    return out


def _echoes(req: CompletionRequest, prompts: list[list[int]], tokenizer: Any) -> list[Echo]:
    """What echo=true puts before each prompt's choices: the prompt as sent (a string as it
    is, token ids as their text)."""
    sent = req.prompt
    many = sent if isinstance(sent, list) and sent and not isinstance(sent[0], int) else [sent]
    return [Echo(p if isinstance(p, str) else tokenizer.decode(ids, skip_special_tokens=False), ids)
            for p, ids in zip(many, prompts, strict=True)]


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
        err = stopped(exc) if isinstance(exc, EngineStopped) else engine_died(exc)
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
