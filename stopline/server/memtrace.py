"""Opt-in allocation tracing of the server process, for memory soaks.

STOPLINE_TRACEMALLOC=N (frames kept per allocation, 1 or more) makes the server trace its
Python allocations from the start, and GET /debug/tracemalloc answer the allocation sites that
grew most since the previous call (the first call only takes the baseline). Unset or 0: no
tracing, no route. Tracing costs memory and time, so a soak's figure is measured without it;
`stopline bench soak --tracemalloc N` sets it and reads the route at the half and the end.
Only this process is traced: the engine core inherits the variable but does not read it.
"""

from __future__ import annotations

import gc
import os
import tracemalloc
from typing import Any

from fastapi import FastAPI

ENV = "STOPLINE_TRACEMALLOC"


def frames() -> int:
    try:
        return max(0, int(os.environ.get(ENV, "0") or 0))
    except ValueError:
        return 0


class Tracer:
    def __init__(self, nframes: int) -> None:
        self.nframes = nframes
        if not tracemalloc.is_tracing():
            tracemalloc.start(nframes)
        self.base: tracemalloc.Snapshot | None = None

    def growth(self, top: int = 15) -> dict[str, Any]:
        gc.collect()  # what is still held, not what a collection would free
        snap = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)])
        traced, peak = tracemalloc.get_traced_memory()
        out: dict[str, Any] = {"traced_bytes": traced, "peak_bytes": peak, "top": []}
        if self.base is not None:
            key = "traceback" if self.nframes > 1 else "lineno"
            for st in snap.compare_to(self.base, key)[:top]:
                out["top"].append({"size_diff": st.size_diff, "count_diff": st.count_diff,
                                   "size": st.size, "count": st.count,
                                   "traceback": [f"{f.filename}:{f.lineno}" for f in st.traceback]})
        self.base = snap
        return out


def install(app: FastAPI) -> None:
    """Start tracing and add the route, when the environment asks for it."""
    n = frames()
    if not n:
        return
    tracer = Tracer(n)

    @app.get("/debug/tracemalloc")
    async def growth(top: int = 15) -> dict[str, Any]:
        return tracer.growth(top)
