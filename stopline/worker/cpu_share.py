"""How many threads a step runs on, from how much of our CPUs other processes take.

Every step runs ~300 parallel regions, and each waits for whichever of its threads the OS
has paused for a neighbour. Measured with `stopline bench neighbours` (another process spinning
for part of every 2-10 ms) on a 2-core host: beside a neighbour taking half a core, a
one-stream step took 13.3 ms on two threads and 11.3 on one; beside 10% or 25% of a core,
and at 32 streams, two threads stayed faster. So small steps drop one thread while the
neighbours take at least BUSY of a core, and everything else keeps them all.

A step is only moved when all its kernels are stopline's own (the fused decoder and a
quantized or bf16 LM head, `LlamaModel.own_kernels`): their bits never depend on the thread
count (a panel or row is one thread's work, whichever thread that is), while the GEMM
library's may, and its block orders were probed at the full count.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable

BUSY = 0.4  # cores other processes take before small steps drop a thread
SMALL_ROWS = 4  # steps of at most this many rows are "small"
PERIOD_S = 0.1  # how often /proc is read
WINDOW_S = 0.5  # the span the share is measured over: /proc counts in 10 ms ticks, so a
# 0.1 s window read a neighbour at a quarter of a core as 0.4 often enough to drop threads


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


class CpuShare:
    """Cores of this process's CPU set that other processes used over the last `window`
    seconds, read every `period` (Linux /proc; elsewhere always 0). `read` and `clock` are
    injectable for tests."""

    def __init__(self, cpus: set[int] | None = None, period: float = PERIOD_S,
                 window: float = WINDOW_S, read: Callable[[str], str] = _read,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cpus = cpus if cpus is not None else set(os.sched_getaffinity(0))
        self.period, self.window = period, window
        self._read, self._clock = read, clock
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._others = 0.0
        first = self._sample()
        self._samples: deque[tuple[float, int, int]] = deque([first] if first else [])

    def _sample(self) -> tuple[float, int, int] | None:
        try:
            busy = 0
            for line in self._read("/proc/stat").splitlines():
                name, *vals = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in self.cpus:
                    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, vals[:8])
                    busy += user + nice + system + irq + softirq + steal
            # utime and stime: fields 14 and 15, counted after the ")" that ends the name
            fields = self._read("/proc/self/stat").rsplit(")", 1)[1].split()
            ours = int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            return None
        return self._clock(), busy, ours

    def others(self) -> float:
        """Cores other processes used over the window (read again once a period passed)."""
        if not self._samples or self._clock() - self._samples[-1][0] < self.period:
            return self._others
        cur = self._sample()
        if cur is None:
            return self._others
        self._samples.append(cur)
        # Keep the newest sample at least a window old as the start.
        while len(self._samples) > 2 and cur[0] - self._samples[1][0] >= self.window:
            self._samples.popleft()
        t0, busy0, ours0 = self._samples[0]
        if cur[0] > t0:
            ticks = (cur[1] - busy0) - (cur[2] - ours0)
            self._others = max(0.0, ticks / self._hz / (cur[0] - t0))
        return self._others


class ThreadPolicy:
    """The thread count of each step (the runner sets it on the thread that runs the step:
    OpenMP's count is per calling thread)."""

    def __init__(self, threads: int, share: CpuShare | None, busy: float = BUSY,
                 small_rows: int = SMALL_ROWS) -> None:
        self.threads = threads
        self.share = share
        self.busy, self.small_rows = busy, small_rows
        self.dropped_steps = 0  # steps run on fewer threads (for tests and the curious)

    @property
    def reading_s(self) -> float:
        """Seconds until a change in the neighbours fully shows in pick (a bench waits this long
        before timing a phase); the same span with adaptation off, so both are timed alike."""
        share = self.share
        return share.window + share.period if share is not None else WINDOW_S + PERIOD_S

    def pick(self, rows: int, own_kernels: Callable[[], bool]) -> int:
        """own_kernels: asked last, only for a step that could move (the common step, big or
        on a quiet host, pays for none of it)."""
        if (self.share is None or self.threads < 2 or rows > self.small_rows
                or self.share.others() < self.busy or not own_kernels()):
            return self.threads
        self.dropped_steps += 1
        return self.threads - 1
