"""What other threads ask of the engine core, kept until its thread applies it between steps.

Adds, aborts and pauses may come from any thread (the async frontend's event loop, the core
process's input thread); the core's thread takes them all at once at each step boundary, and
again right after a forward pass, so an abort that arrived mid-step wins over that step's
tokens.

Everything names an incarnation, never a caller's id. An abort whose incarnation has not been
added yet (it overtook its add: the two travel on different sockets) is kept for that
incarnation alone and applied when the add comes; kept ones expire by age, so an abort for an
incarnation that ended long ago costs a few bytes for `EARLY_TTL` seconds and touches nothing.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from stopline.request import AbortSource, Family

EARLY_TTL = 60.0  # seconds an abort waits for its incarnation's add


@dataclass
class Taken:
    """One step boundary's share of the inbox."""

    adds: list[Family] = field(default_factory=list)
    aborts: list[tuple[str, AbortSource, float]] = field(default_factory=list)  # (incarnation, source, t0)
    pauses: list[tuple[str, bool]] = field(default_factory=list)


class Inbox:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._adds: list[Family] = []
        self._aborts: list[tuple[str, AbortSource, float]] = []
        self._pauses: list[tuple[str, bool]] = []
        self.aborting: set[str] = set()  # incarnations with an abort not yet applied
        self._early: OrderedDict[str, tuple[AbortSource, float]] = OrderedDict()

    # ---- any thread -----------------------------------------------------------------------
    def add(self, fam: Family, known: set[str] | dict[str, object]) -> bool:
        """Queue a family; False if its incarnation is live (`known`) or already queued."""
        with self.lock:
            if fam.incarnation in known or any(f.incarnation == fam.incarnation for f in self._adds):
                return False
            self._adds.append(fam)
            return True

    def abort(self, incarnations: list[str], source: AbortSource, t0: float) -> None:
        with self.lock:
            for inc in incarnations:
                self._aborts.append((inc, source, t0))
                self.aborting.add(inc)

    def pause(self, incarnations: list[str], paused: bool) -> None:
        with self.lock:
            self._pauses += [(inc, paused) for inc in incarnations]

    def queued(self) -> list[str]:
        """Incarnations added and not yet taken by the core's thread."""
        with self.lock:
            return [f.incarnation for f in self._adds]

    def has_any(self) -> bool:
        with self.lock:
            return bool(self._adds or self._aborts or self._pauses)

    # ---- the core's thread ----------------------------------------------------------------
    def take(self, adds: bool = True) -> Taken:
        with self.lock:
            taken = Taken(self._adds if adds else [], self._aborts, self._pauses)
            if adds:
                self._adds = []
            self._aborts, self._pauses = [], []
            self.aborting.clear()
        return taken

    def keep_early(self, incarnation: str, source: AbortSource, t0: float) -> None:
        """An abort for an incarnation not (yet) added, asked at t0: its age counts from then."""
        if incarnation not in self._early:
            self._early[incarnation] = (source, t0)

    def early_abort(self, incarnation: str) -> AbortSource | None:
        """The abort that overtook this incarnation's add, if any (taken: applied once)."""
        kept = self._early.pop(incarnation, None)
        return None if kept is None else kept[0]

    def expire(self) -> None:
        now = time.monotonic()
        # By age, not by position: aborts from different senders arrive out of t0 order.
        for inc in [i for i, (_, t0) in self._early.items() if now - t0 > EARLY_TTL]:
            del self._early[inc]

    @property
    def num_early(self) -> int:
        return len(self._early)
