"""Liveness of a process the front end depends on (an engine-core process, a role of the
split, a Ray replica), as the front end sees it.

The front end asks each process for a heartbeat every `Bounds.beat_s`; the answer carries how
long the process has been inside its current step (0 between steps). A process that has not
answered for `stuck_s`, or has been in one step for that long, is stuck: it gets no new work
and its requests can be cancelled at once by the front end. Past `kill_s` it is killed (and,
where its owner restarts processes, restarted). A process stopped by SIGSTOP, swapped out or
wedged in a forward looks the same from here, which is the point: the client can't tell
either.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Bounds:
    stuck_s: float = 5.0  # silent or in one step this long: stuck
    kill_s: float = 60.0  # this long: killed

    def __post_init__(self) -> None:
        if not 0 < self.stuck_s < self.kill_s:
            raise ValueError(f"need 0 < stuck_s < kill_s, got {self.stuck_s} and {self.kill_s}")

    @property
    def beat_s(self) -> float:
        # Four beats per bound: one lost or late beat never makes a live process stuck.
        return min(1.0, self.stuck_s / 4)


class Watch:
    """One process's heartbeats: `answer` on each, `check` on each tick."""

    def __init__(self, name: str, bounds: Bounds, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.bounds = bounds
        self.clock = clock
        self.answered = clock()
        self.step_age = 0.0  # seconds in its current step when it last answered (0: between)
        self.stuck: str | None = None  # why, while stuck

    def answer(self, step_age: float) -> None:
        self.answered = self.clock()
        self.step_age = step_age

    def reset(self) -> None:
        """A fresh process (restarted): count from now."""
        self.answer(0.0)
        self.stuck = None

    def age(self) -> tuple[float, str]:
        """How long the process has shown no progress, and what kind of silence."""
        silent = self.clock() - self.answered
        if silent >= self.bounds.stuck_s or not self.step_age:
            return silent, "answered no heartbeat"
        return self.step_age + silent, "has been in one step"

    def check(self) -> str | None:
        """Why it is stuck now, or None (live). Sets `stuck`."""
        age, what = self.age()
        self.stuck = f"{self.name} {what} for {age:.1f} s" if age >= self.bounds.stuck_s else None
        return self.stuck

    def overdue(self) -> bool:
        """Stuck past the longer bound: kill it."""
        return self.age()[0] >= self.bounds.kill_s


@dataclass(frozen=True)
class Restarts:
    """When a process that died is started again (a local role of the split, the core of
    `serve --restart-core`)."""

    limit: int = 5  # this many deaths within window_s: it stays dead
    window_s: float = 300.0
    first_s: float = 1.0  # the back-off before the second restart in the window; doubles
    cap_s: float = 30.0

    def __post_init__(self) -> None:
        if self.limit < 0 or not self.window_s > 0 or self.first_s < 0 or self.cap_s < self.first_s:
            raise ValueError(f"bad restart bounds: {self}")

    def delay(self, deaths: int) -> float | None:
        """Seconds to wait before restarting after the `deaths`-th death in the window (the
        first restarts at once: a single crash should cost no more than the reload); None:
        not at all."""
        if deaths >= self.limit:
            return None
        return 0.0 if deaths <= 1 else min(self.cap_s, self.first_s * 2 ** (deaths - 2))

    def died(self, deaths: list[float], now: float) -> float | None:
        """Note a death at `now` in `deaths` (times, kept to the window, in place); returns
        `delay` for it."""
        deaths[:] = [t for t in deaths if now - t < self.window_s] + [now]
        return self.delay(len(deaths))
