"""One admitted request as the frontend sees it: an async iterator of its outputs.

The stream is also the frontend's half of the no-delivery-after-cancel contract: once the
frontend decides to abort a request (`cancel`), the iterator hands out no further tokens,
not even ones already computed and queued; it yields only the terminal output of each
sample, stripped of new tokens, with usage counting what the consumer actually received.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from stopline.engine.output import RequestOutput
from stopline.request import AbortSource, FinishReason, Usage


class EngineDead(RuntimeError):
    """The engine core stopped (its process died or its loop failed)."""


class EngineStopped(EngineDead):
    """The engine ended this request on its own (pause, sleep or update with abort, shutdown
    after the drain, its replica died): HTTP 503 / an SSE error event, never a success. A
    subclass of EngineDead so that every consumer that ends on a dead engine ends here too."""

    def __init__(self, source: AbortSource, detail: str = "") -> None:
        why = {AbortSource.PAUSE: "the engine was paused (mode abort)",
               AbortSource.SLEEP: "the engine was put to sleep",
               AbortSource.UPDATE: "the engine's weights were updated (mode abort)",
               AbortSource.SHUTDOWN: "the server shut down before the request finished",
               AbortSource.REPLICA: "the replica serving the request died"}.get(source, source.value)
        super().__init__(f"{why}: {detail}" if detail else why)
        self.source = source


class EngineUnavailable(RuntimeError):
    """The engine does not admit requests now (loading, draining, paused, asleep or dead):
    HTTP 503 with Retry-After."""


class EngineOverloaded(RuntimeError):
    """Too many requests wait for their first step: HTTP 429."""


_DETACHED = object()  # the consumer left: end the iteration without a terminal
_COMPLETE = (FinishReason.STOP, FinishReason.LENGTH, None)  # what a cut output can't claim


class RequestStream:
    def __init__(self, request_id: str, n: int, prompt_tokens: int, arrival: float, *,
                 incarnation: str = "", max_buffered: int = 64,
                 on_full: Callable[[RequestStream, bool], None] | None = None) -> None:
        """on_full(stream, True) when `max_buffered` outputs wait unread (the frontend pauses
        the request), on_full(stream, False) once the consumer has read half of them."""
        self.request_id = request_id
        self.incarnation = incarnation or request_id
        self.n = n
        self.prompt_tokens = prompt_tokens
        self.arrival = arrival
        self.open_samples = set(range(n))  # samples whose terminal output has not arrived
        self.cancelled: AbortSource | None = None  # set the moment the frontend aborts it
        self.delivered = [0] * n  # tokens handed to the consumer, per sample
        self.finish_reasons: list[FinishReason | None] = [None] * n
        self.started = False  # any output arrived (the request left the queue)
        self.last_token_at: list[float | None] = [None] * n
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._consumer_open = 0  # samples still open from the consumer's view
        self.max_buffered = max_buffered
        self.on_full = on_full
        self.full = False
        self.last_read = time.monotonic()
        # on_end(stream, reason) as each sample's terminal output arrives (ERROR, once, when the
        # stream fails): the server's group of requests ends its other members
        # there, at once, whether or not anyone is reading.
        self.on_end: Callable[[RequestStream, FinishReason], None] | None = None

    @property
    def finished(self) -> bool:
        return not self.open_samples

    # ---- producer side (the engine's output dispatcher) ----------------------------------
    def push(self, out: RequestOutput) -> bool:
        """Queue one output; returns True if it was the sample's terminal output."""
        self.started = True
        self._queue.put_nowait(out)
        if not out.finished:
            if not self.full and self._queue.qsize() >= self.max_buffered and self.on_full:
                self.full = True
                self.on_full(self, True)
            return False
        self.finish_reasons[out.index] = out.finish_reason
        self.open_samples.discard(out.index)
        if not self.open_samples and not self.done.done():
            self.done.set_result(None)
        if self.on_end is not None:
            self.on_end(self, out.finish_reason or FinishReason.ERROR)
        return True

    def fail(self, exc: BaseException) -> None:
        """End the stream with an exception (engine death): the consumer raises it."""
        failed = bool(self.open_samples)
        self.open_samples.clear()
        self._queue.put_nowait(exc)
        if not self.done.done():
            self.done.set_result(None)
        if failed and self.on_end is not None:
            self.on_end(self, FinishReason.ERROR)

    def cancel(self, source: AbortSource) -> None:
        """The frontend fence: no token is handed out from now on."""
        if self.cancelled is None:
            self.cancelled = source

    def detach(self) -> None:
        """The consumer is gone (client disconnected): wake it up so it can return."""
        self._queue.put_nowait(_DETACHED)

    # ---- consumer side --------------------------------------------------------------------
    def __aiter__(self) -> RequestStream:
        self._consumer_open = self.n
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._consumer_open <= 0:
                raise StopAsyncIteration
            item = await self._queue.get()
            self.last_read = time.monotonic()
            if self.full and self._queue.qsize() <= self.max_buffered // 2 and self.on_full:
                self.full = False
                self.on_full(self, False)
            if item is _DETACHED:
                raise StopAsyncIteration
            if isinstance(item, BaseException):
                self._consumer_open = 0
                raise item
            assert isinstance(item, RequestOutput)  # the queue holds nothing else
            if item.finished:
                self._consumer_open -= 1
                out = self._terminal(item)
                if (self.cancelled is not None and self.cancelled.engine_initiated
                        and out.finish_reason is FinishReason.ABORT):
                    # Not a success: the consumer raises (the client gets an error), and the
                    # other samples' terminals are not read.
                    self._consumer_open = 0
                    raise EngineStopped(self.cancelled)
                return out
            if self.cancelled is not None:
                continue  # computed before the engine saw the abort: never delivered
            self.delivered[item.index] += len(item.new_token_ids)
            return item

    def _terminal(self, out: RequestOutput) -> RequestOutput:
        if self.cancelled is None:
            self.delivered[out.index] += len(out.new_token_ids)
            return out
        engine_usage = out.usage or Usage(self.prompt_tokens, 0)
        got = self.delivered[out.index]
        withheld = max(0, engine_usage.completion_tokens - got) + engine_usage.undelivered_tokens
        reason = out.finish_reason
        if reason in _COMPLETE and (out.new_token_ids or out.new_text
                                    or engine_usage.completion_tokens > got):
            # Tokens were withheld after the cancel: the client's output was cut by the cancel,
            # so it is never reported complete. An abnormal end (a sample's error that made the
            # server end the rest of its request, a deadline) stands as the engine reported it.
            reason = FinishReason.ABORT
        # An end that stands (the request finished in full before the cancel reached the
        # engine, nothing withheld) keeps the prompt's scores it carries: they are part of it.
        kept = out.prompt_logprobs if reason is out.finish_reason and reason in _COMPLETE else None
        return RequestOutput(
            out.request_id, out.index, out.incarnation, finished=True, finish_reason=reason,
            weight_version=out.weight_version, prompt_logprobs=kept,
            stop_detail=out.stop_detail if reason is out.finish_reason else self.cancelled.value,
            usage=dataclasses.replace(engine_usage, completion_tokens=got, undelivered_tokens=withheld),
        )
