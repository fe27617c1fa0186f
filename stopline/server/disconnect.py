"""Event-driven disconnect detection for a request whose body has been read.

After the body, the next ASGI `receive()` message is `http.disconnect`, and uvicorn delivers
it the moment the connection is lost (its protocol sets the event in `connection_lost`). So a
task parked on `receive()` learns of a disconnect with no polling interval and no grace
delay. The callback runs right there, so the abort leaves before anything else is scheduled.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.types import Receive


async def watch_disconnect(receive: Receive, on_disconnect: Callable[[float], None]) -> float:
    """Wait until the client disconnects, call on_disconnect(t0) and return t0
    (time.monotonic() of the moment we learned it). Cancel the task to stop watching."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            t0 = time.monotonic()
            on_disconnect(t0)
            return t0
