"""A Server-Sent Events response that watches for the client leaving.

Starlette's StreamingResponse (ASGI spec 2.4) notices a disconnect only when a write fails,
so a stream parked between tokens, or waiting in the queue, would keep its request running.
Here a watcher task waits on `receive()` for the whole life of the response: on disconnect it
calls `on_disconnect` (which aborts the request at once) and wakes the event producer so the
response returns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from stopline.server.disconnect import watch_disconnect


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], *, on_disconnect: Callable[[float], None],
                 wake: Callable[[], None], headers: dict[str, str] | None = None) -> None:
        super().__init__(events, status_code=200, headers={"Cache-Control": "no-cache",
                                                           "X-Accel-Buffering": "no", **(headers or {})})
        self.events = events
        self.on_disconnect = on_disconnect
        self.wake = wake  # makes the producer return promptly once the client is gone
        self.gone = False
        self.completed = False

    def _gone(self, t0: float) -> None:
        if not self.gone:
            self.gone = True
            self.on_disconnect(t0)
            self.wake()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(watch_disconnect(receive, self._gone))
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for data in self.events:
                if self.gone:
                    break
                await send({"type": "http.response.body", "body": data, "more_body": True})
            if not self.gone:
                # Stop watching first: once the response is complete, receive() reports a
                # disconnect that is not one.
                watcher.cancel()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                self.completed = True
        except OSError:  # the write failed: the client is gone
            self._gone(time.monotonic())
        finally:
            watcher.cancel()
            if not self.completed:
                # Cancelled or failed before the end: the request must not outlive its response.
                self._gone(time.monotonic())
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
