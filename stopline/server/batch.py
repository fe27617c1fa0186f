"""One HTTP request's engine requests, read as one stream and ended as one (DESIGN.md 11).

A completions request with several prompts has one engine request per prompt, each its own
family of n samples. Prompt i's sample j is choice i*n + j (OpenAI's order). Prompt 0's engine
request has the response id; prompt k > 0 has `{id}-p{k}`, so the cancel endpoints, given the
response id, find them all (`members`).

`Group` is the one place where all of them end: any member that ends early (an error, a
failure of its replica, a cancel or stall of that member, a deadline) ends the others at once,
and so does any early end of the handler (`end`). It reads its members without queues of its
own: at most one output per member is taken ahead of the consumer, so a consumer that stops
reading fills every member's stream, which pauses its request and, after the stall timeout,
aborts it (engine/streams.py, async_engine.py).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from stopline.engine.output import RequestOutput
from stopline.engine.streams import RequestStream
from stopline.request import AbortSource, FinishReason

if TYPE_CHECKING:
    from stopline.engine.async_engine import AsyncEngine

_MEMBER = re.compile(r"(.+)-p[1-9][0-9]*")


def member_id(rid: str, k: int) -> str:
    return rid if k == 0 else f"{rid}-p{k}"


def members(rid: str, status: Callable[[str], object]) -> list[str]:
    """The engine ids a response id stands for: itself, then `{rid}-p1`, ... while known."""
    out = [rid]
    while status(member_id(rid, len(out))) is not None:
        out.append(member_id(rid, len(out)))
    return out


def response_id(incarnation: str, status: Callable[[str], object]) -> str:
    """The response id an engine id belongs to: `{rid}` for `{rid}-p{k}` while rid is known."""
    m = _MEMBER.fullmatch(incarnation)
    return m.group(1) if m is not None and status(m.group(1)) is not None else incarnation


def reasons(ids: list[str], ended: dict[str, list[str | None]],
            status: Callable[[str], object]) -> list[str | None]:
    """Finish reasons of every choice of these engine requests, in choice order."""
    out: list[str | None] = []
    for i in ids:
        r = ended.get(i) or status(i)
        out += r if isinstance(r, list) else []
    return out


# The abort source for the others when a member ends early; a normal end (stop, length) ends
# nothing else, and an abort passes its own source on (`_member_ended`).
_SPREAD = {FinishReason.TIMEOUT: AbortSource.DEADLINE, FinishReason.ERROR: AbortSource.SIBLING,
           FinishReason.PREEMPTED: AbortSource.SIBLING}


class Group:
    """The engine requests of one HTTP request; outputs re-indexed to choice i*n + j."""

    def __init__(self, engine: AsyncEngine, n: int) -> None:
        self.engine = engine
        self.n = n
        self.streams: list[RequestStream] = []
        self.ended: AbortSource | None = None  # set by the first end; later ones add nothing
        self._reads: list[asyncio.Task | None] = []  # per member: its one read ahead, if any
        self._ready: collections.deque[int] = collections.deque()  # reads done, oldest first
        self._wake = asyncio.Event()
        self._detached = False

    @property
    def request_id(self) -> str:
        return self.streams[0].request_id

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.streams)

    def add(self, stream: RequestStream) -> None:
        """A member admitted; it ends at once if the group has already ended."""
        self.streams.append(stream)
        stream.on_end = self._member_ended
        for reason in stream.finish_reasons:  # it may have ended before it was added
            if reason is not None:
                self._member_ended(stream, reason)
        if self.ended is not None:
            self.end(self.ended)

    def end(self, source: AbortSource, t0: float | None = None) -> None:
        """Abort every member still open (the first end decides the source); t0: when the
        abort was asked (default: now)."""
        if self.ended is None:
            self.ended = source
        t0 = time.monotonic() if t0 is None else t0
        live = [s.incarnation for s in self.streams if not s.finished and s.cancelled is None]
        if live:
            self.engine.abort(live, source, t0)

    def _member_ended(self, stream: RequestStream, reason: FinishReason) -> None:
        if reason is FinishReason.ABORT:  # its own cancel, stall or shutdown: the others too
            source = stream.cancelled or AbortSource.CANCEL
        else:
            source = _SPREAD.get(reason)
        if source is not None and self.ended is None:
            self.end(source)

    def detach(self) -> None:
        """The consumer is gone: wake it so it returns."""
        self._detached = True
        self._wake.set()
        for s in self.streams:
            s.detach()

    # ---- reading ----------------------------------------------------------------------------
    def __aiter__(self) -> Group:
        for s in self.streams:
            s.__aiter__()
        if len(self.streams) > 1:
            self._reads = [self._read(i) for i in range(len(self.streams))]
        return self

    def _read(self, i: int) -> asyncio.Task:
        task = asyncio.ensure_future(_next(self.streams[i]))
        task.add_done_callback(lambda _: (self._ready.append(i), self._wake.set()))
        return task

    async def __anext__(self) -> RequestOutput:
        if len(self.streams) == 1:
            return await self.streams[0].__anext__()
        while not self._detached:
            if not self._ready:
                if not any(self._reads):
                    break
                self._wake.clear()
                await self._wake.wait()
                continue
            i = self._ready.popleft()
            task, self._reads[i] = self._reads[i], None
            if task is None or task.cancelled():
                continue
            exc = task.exception()
            if exc is not None:  # EngineDead and the like: the others are ended by now
                self.end(AbortSource.SIBLING)
                self.close()
                raise exc
            out = task.result()
            if out is None:
                continue  # that member is through
            member = self.streams[i]
            if member.cancelled is not None and not out.finished:
                # Read ahead before the member's cancel: never handed out, so not delivered
                # (its terminal's usage counts what the client got).
                member.delivered[out.index] -= len(out.new_token_ids)
                self._reads[i] = self._read(i)
                continue
            self._reads[i] = self._read(i)
            return dataclasses.replace(out, index=i * self.n + out.index)
        raise StopAsyncIteration

    def close(self) -> None:
        """Stop reading ahead (the handler is done with the group)."""
        for t in self._reads:
            if t is not None and not t.cancel() and not t.cancelled():
                t.exception()  # read, so that a failure nobody will read is not logged


async def _next(stream: RequestStream) -> RequestOutput | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None
