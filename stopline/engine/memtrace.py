"""Opt-in allocation tracing of a process (tracemalloc), for memory soaks.

STOPLINE_TRACEMALLOC=N (frames kept per allocation, 1 or more) turns it on. The server reads
it (server/memtrace.py: GET /debug/tracemalloc), and so does an engine-core process at start
(engine/proc/core_proc.py), which answers `Utility.TRACEMALLOC` with its own growth: the core
is another process, and its allocations are not the server's. Each answer lists the allocation
sites that grew most since the previous one (the first only takes the baseline). Tracing costs
memory and time, so a soak's RSS figure is measured without it.
"""

from __future__ import annotations

import gc
import os
import tracemalloc
from typing import Any

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
        out: dict[str, Any] = {"pid": os.getpid(), "traced_bytes": traced, "peak_bytes": peak,
                               "top": []}
        if self.base is not None:
            key = "traceback" if self.nframes > 1 else "lineno"
            for st in snap.compare_to(self.base, key)[:top]:
                out["top"].append({"size_diff": st.size_diff, "count_diff": st.count_diff,
                                   "size": st.size, "count": st.count,
                                   "traceback": [f"{f.filename}:{f.lineno}" for f in st.traceback]})
        self.base = snap
        return out


_process: Tracer | None = None  # this engine process's, started by start_from_env


def start_from_env() -> bool:
    """Trace this process if the environment asks for it; True if it traces."""
    global _process
    n = frames()
    if n and _process is None:
        _process = Tracer(n)
    return _process is not None


def growth(top: int = 15) -> dict[str, Any]:
    """This process's growth since the last call (Utility.TRACEMALLOC's answer)."""
    if _process is None:
        return {"pid": os.getpid(), "error": f"this engine process does not trace its allocations "
                                             f"({ENV} was unset when it started)"}
    return _process.growth(top)
