"""Several prompts in one completions request: one engine request per prompt, read as one.

Prompt i's sample j is choice i*n + j (OpenAI's order). Prompt 0's engine request has the
response id; prompt k > 0 has `{id}-p{k}`, so the cancel endpoint, given the response id,
finds them all (`members`). Each engine request is its own family with its own terminal
messages, so the stop path is unchanged: this only merges what the streams deliver.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from stopline.engine.output import RequestOutput
from stopline.engine.streams import RequestStream


def member_id(rid: str, k: int) -> str:
    return rid if k == 0 else f"{rid}-p{k}"


def members(rid: str, status: Callable[[str], object]) -> list[str]:
    """The engine ids a response id stands for: itself, then `{rid}-p1`, ... while known."""
    out = [rid]
    while status(member_id(rid, len(out))) is not None:
        out.append(member_id(rid, len(out)))
    return out


class MergedStream:
    """The outputs of several RequestStreams, their indices shifted to i*n + j."""

    def __init__(self, streams: list[RequestStream], n: int) -> None:
        self.streams = streams
        self.n = n
        self.request_id = streams[0].request_id
        self.prompt_tokens = sum(s.prompt_tokens for s in streams)
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._open = len(streams)

    def detach(self) -> None:
        for s in self.streams:
            s.detach()

    async def _pump(self, i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((i, out))
        except BaseException as exc:  # EngineDead and the like: the reader raises it
            self._queue.put_nowait(exc)
            return
        self._queue.put_nowait(None)

    def __aiter__(self) -> MergedStream:
        self._tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(self.streams)]
        return self

    async def __anext__(self) -> RequestOutput:
        while self._open > 0:
            item = await self._queue.get()
            if item is None:
                self._open -= 1
                continue
            if isinstance(item, BaseException):
                self.aclose()
                raise item
            i, out = item
            return dataclasses.replace(out, index=i * self.n + out.index)
        raise StopAsyncIteration

    def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
