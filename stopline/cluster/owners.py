"""The owner table: which replica runs each request, from dispatch until the replica's
terminal output says it ended; then a bounded tombstone.

An abort names an incarnation and goes to its owner only. An abort that arrives before the
request was dispatched is remembered (`Owner.aborted`) and sent right after the add; one that
arrives after the end finds the tombstone and does nothing, so it is never lost and never
reaches a replica that has since been handed a newer request.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from stopline.config import Choice
from stopline.request import AbortSource


class Phase(Choice):
    ROUTING = "routing"  # a replica is chosen, the add is on its way
    RUNNING = "running"  # the replica admitted it
    ENDED = "ended"  # terminal output seen (or the replica died): a tombstone


@dataclass
class Owner:
    incarnation: str
    replica: int
    phase: Phase = Phase.ROUTING
    aborted: tuple[AbortSource, float] | None = None  # an abort that came while ROUTING


class OwnerTable:
    def __init__(self, tombstones: int = 10_000) -> None:
        self.live: dict[str, Owner] = {}
        self.ended: OrderedDict[str, int] = OrderedDict()  # incarnation -> replica it ran on
        self._keep = tombstones

    def dispatch(self, incarnation: str, replica: int) -> Owner:
        if incarnation in self.live:
            raise ValueError(f"incarnation {incarnation!r} already has an owner")
        owner = self.live[incarnation] = Owner(incarnation, replica)
        return owner

    def admitted(self, incarnation: str) -> tuple[AbortSource, float] | None:
        """The add was accepted; returns an abort that arrived meanwhile (send it now)."""
        owner = self.live[incarnation]
        owner.phase = Phase.RUNNING
        return owner.aborted

    def end(self, incarnation: str) -> Owner | None:
        owner = self.live.pop(incarnation, None)
        if owner is not None:
            owner.phase = Phase.ENDED
            self.ended[incarnation] = owner.replica
            while len(self.ended) > self._keep:
                self.ended.popitem(last=False)
        return owner

    def route_aborts(self, incarnations: list[str], source: AbortSource,
                     t0: float) -> dict[int, list[str]]:
        """replica -> the incarnations to abort there now. Routing ones are held until their
        add is answered; ended and unknown ones need nothing."""
        out: dict[int, list[str]] = {}
        for inc in incarnations:
            owner = self.live.get(inc)
            if owner is None:
                continue
            if owner.phase is Phase.ROUTING:
                if owner.aborted is None:
                    owner.aborted = (source, t0)
                continue
            out.setdefault(owner.replica, []).append(inc)
        return out

    def running(self, incarnations: list[str]) -> dict[int, list[str]]:
        """replica -> those of `incarnations` it admitted and still runs."""
        out: dict[int, list[str]] = {}
        for inc in incarnations:
            owner = self.live.get(inc)
            if owner is not None and owner.phase is Phase.RUNNING:
                out.setdefault(owner.replica, []).append(inc)
        return out

    def owned_by(self, replica: int) -> list[str]:
        return [i for i, o in self.live.items() if o.replica == replica]

    def load(self, replica: int) -> int:
        return sum(1 for o in self.live.values() if o.replica == replica)
