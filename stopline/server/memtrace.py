"""Opt-in allocation tracing for memory soaks: the server's own, and its engine core's.

STOPLINE_TRACEMALLOC=N (frames kept per allocation, 1 or more) makes the server trace its
Python allocations from the start, and GET /debug/tracemalloc answer the allocation sites that
grew most since the previous call (the first call only takes the baseline). The engine-core
process inherits the variable and traces itself too (engine/memtrace.py):
`/debug/tracemalloc?process=core` asks it (a utility call, run between steps) for its own
growth. Unset or 0: no tracing, no route. Tracing costs memory and time, so a soak's figure is
measured without it; `stopline bench soak --tracemalloc N` sets it and reads both at the half
and the end.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from stopline.engine.memtrace import ENV, Tracer, frames
from stopline.engine.messages import Utility
from stopline.server.errors import ApiError

__all__ = ["ENV", "PROCESSES", "Tracer", "frames", "install"]

PROCESSES = ("server", "core")


def install(app: FastAPI) -> None:
    """Start tracing and add the route, when the environment asks for it."""
    n = frames()
    if not n:
        return
    tracer = Tracer(n)

    @app.get("/debug/tracemalloc")
    async def growth(request: Request, top: int = 15, process: str = "server") -> Any:
        if process not in PROCESSES:
            raise ApiError(400, f"process: must be one of {', '.join(PROCESSES)}, got {process!r}",
                           param="process")
        if process == "server":
            return tracer.growth(top)
        # The core answers for itself (with --replicas or --disagg: one answer per process).
        return await request.app.state.server.engine.utility(Utility.TRACEMALLOC, {"top": top})
