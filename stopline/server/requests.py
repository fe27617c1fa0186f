"""What every generation API (chat/completions, Responses, Anthropic messages) does with a
request the same way: read its body, encode its prompt, admit it to the engine (and map a
refusal to its HTTP error), race its work against the client leaving, and peek at its first
output before a stream starts. serving.py, responses.py and anthropic.py call these; none of
them holds its own copy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import Request

from stopline.engine.output import RequestOutput
from stopline.engine.streams import EngineDead, EngineOverloaded, EngineStopped, EngineUnavailable
from stopline.request import AbortSource, InvalidRequest, SamplingParams
from stopline.server import batch
from stopline.server.disconnect import watch_disconnect
from stopline.server.errors import ApiError, param_of

if TYPE_CHECKING:
    from stopline.engine.async_engine import AsyncEngine

OFFLOAD_CHARS = 50_000  # tokenize longer prompts off the event loop
_TRACE_CHARS = 128


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


def client_id(request: Request) -> str | None:
    """The client's X-Request-Id (checked), echoed for tracing; None when it sent none."""
    value = request.headers.get("x-request-id")
    if value is None:
        return None
    if not value or len(value) > _TRACE_CHARS or not value.isprintable():
        raise ApiError(400, f"X-Request-Id: must be 1-{_TRACE_CHARS} printable characters",
                       param="X-Request-Id", code="invalid_value")
    return value


def trace_headers(rid: str, trace: str, version: int = 0) -> dict[str, str]:
    # X-Request-Id: the client's id when it sent one (tracing), else ours; X-Stopline-Id: ours,
    # always (the id the cancel endpoint takes, also the response body's `id`); X-Weight-Version:
    # the weights served when it was admitted (the body says which its tokens came from).
    return {"X-Request-Id": trace, "X-Stopline-Id": rid, "X-Weight-Version": str(version)}


async def encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """The prompt's token ids; a long one is tokenized off the event loop."""
    if len(text) > OFFLOAD_CHARS:
        return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


# ---- errors ---------------------------------------------------------------------------------
def unavailable(why: str) -> ApiError:
    return ApiError(503, why, code="unavailable", headers={"Retry-After": "1"})


def stopped(exc: EngineStopped) -> ApiError:
    """What a client gets for a request the engine ended on its own: a 503 (or that body as
    an SSE error event) whose code names the reason, engine_pause, engine_sleep, ..."""
    return ApiError(503, str(exc), code=f"engine_{exc.source.value}", headers={"Retry-After": "1"})


def engine_died(exc: EngineDead) -> ApiError:
    return ApiError(500, f"the engine core died: {exc}", code="engine_dead")


def grammar_refusal(reason: str | None, detail: str | None, param: str) -> ApiError | None:
    """The 400 for a request the engine ended because its grammar could not be compiled
    (invalid, over a limit, past its deadline), named after `param` (the request's tools or
    its format); None for any other end."""
    detail = detail or ""
    if reason != "error" or not detail.startswith("grammar: "):
        return None
    return ApiError(400, f"{param}: {detail.removeprefix('grammar: ')}", param=param,
                    code="invalid_grammar")


def add_error(exc: BaseException, prompt_param: str = "prompt", model_404: bool = True) -> ApiError | None:
    """The HTTP error for an engine add that raised `exc`; None: not a refusal (re-raise it).
    prompt_param: what the API calls the prompt in its messages; model_404: an adapter
    unloaded since the model was checked is a 404 (else a 400 like any invalid value)."""
    if isinstance(exc, InvalidRequest):
        msg = str(exc)
        param = param_of(msg)
        if model_404 and param == "model":  # its adapter was unloaded meanwhile
            return ApiError(404, msg, param="model", code="model_not_found")
        if param == "prompt":
            param, msg = prompt_param, prompt_param + msg.removeprefix("prompt")
        return ApiError(400, msg, param=param, code="invalid_value")
    if isinstance(exc, EngineOverloaded):
        return ApiError(429, f"the server is busy: {exc}", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, (EngineUnavailable, EngineDead)):
        return unavailable(str(exc))
    return None


async def admit(engine: AsyncEngine, group: batch.Group, rid: str, prompts: Sequence[list[int]],
                params: SamplingParams, arrival: float, *, prompt_param: str = "prompt",
                model_404: bool = True) -> None:
    """Add each prompt to the engine as a member of `group` (prompt k as `batch.member_id(rid,
    k)`). A refusal of any ends the ones added before it and is raised as its HTTP error
    (add_error); anything else is raised as it is, after the same end."""
    try:
        for k, prompt in enumerate(prompts):
            mid = batch.member_id(rid, k)
            group.add(await engine.add(mid, prompt, params, arrival=arrival, incarnation=mid))
    except BaseException as exc:
        group.end(AbortSource.CANCEL)  # a later prompt was refused: the earlier ones end with it
        group.detach()
        err = add_error(exc, prompt_param, model_404)
        if err is None:
            raise
        raise err from None


# ---- the client leaving -----------------------------------------------------------------------
LEFT = object()  # what unless_client_leaves gives when the client left first


async def unless_client_leaves(request: Request, work: Awaitable[Any], abort: Any) -> Any:
    """`work`'s result, raced against the client: LEFT (and `work` cancelled) when the
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
        return LEFT
    try:
        return task.result()
    except EngineStopped as exc:
        raise stopped(exc) from None
    except EngineDead as exc:
        raise engine_died(exc) from None


async def whole(request: Request, group: batch.Group, work: Awaitable[Any], abort: Any) -> Any:
    """unless_client_leaves for a response read whole: however it ends, no member of the
    request keeps running."""
    try:
        return await unless_client_leaves(request, work, abort)
    finally:
        group.end(AbortSource.DISCONNECT)
        group.close()


async def first_output(request: Request, stream: Any, abort: Any) -> Peeked | None:
    """The stream with its first output read, raced against the client (None: the client
    left first)."""
    it = aiter(stream)
    try:
        first = await unless_client_leaves(request, anext(it), abort)
    except StopAsyncIteration:
        return None
    return None if first is LEFT else Peeked(stream, it, first)


async def unless_refused(request: Request, group: batch.Group, abort: Any,
                         refusal: Callable[[RequestOutput], ApiError | None]) -> Peeked | None:
    """The group with its first output read before a stream's first byte, so that a request
    the engine refuses at once (a grammar that can't be compiled) is its HTTP error, not a
    200 stream that ends in one: `refusal(first)` is raised, after ending every member. None:
    the client left first."""
    peeked = await first_output(request, group, abort)
    if peeked is None:
        return None
    refused = refusal(peeked.first)
    if refused is not None:
        group.end(AbortSource.CANCEL)  # members that have not failed yet end with it
        group.detach()
        raise refused
    return peeked


class Peeked:
    """A stream whose first output was read before its response started: that output
    first, then the rest, from the one iterator (iterating a stream again restarts it)."""

    def __init__(self, stream: Any, it: Any, first: RequestOutput) -> None:
        self._stream = stream
        self._it = it
        self.first = first
        self._pending: RequestOutput | None = first

    def __getattr__(self, name: str) -> Any:  # prompt_tokens, detach, ...
        return getattr(self._stream, name)

    def __aiter__(self) -> Peeked:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._pending is not None:
            out, self._pending = self._pending, None
            return out
        return await anext(self._it)
