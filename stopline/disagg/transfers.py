"""Transfers in flight as request state: a holder in the one release, with a reclaim
deadline.

Send side: the request's blocks stay held (by the KV manager, since the request has not
ended) until the receiver acks or the deadline passes. Receive side: the reserved blocks
stay held until the blocks are written or the deadline passes. `expired()` names the
requests past their deadline; the engine fails them through the lifecycle, whose release
calls `release` here, so there is no second way out.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from stopline.disagg.epochs import BlockRef
from stopline.kv.block_pool import LedgerError
from stopline.request import Request


class Side(enum.Enum):
    SEND = "send"
    RECV = "recv"


@dataclass
class Transfer:
    req: Request
    refs: list[BlockRef]  # this side's blocks, with their epochs
    deadline: float


class Transfers:
    """One side's transfers in flight, keyed by request id."""

    def __init__(self, side: Side, reclaim_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if reclaim_s <= 0:
            raise ValueError(f"reclaim deadline must be > 0 s, got {reclaim_s}")
        self.side = side
        self.name = f"{side.value}_transfer"
        self.reclaim_s = reclaim_s
        self._clock = clock
        # Keyed by internal id, unique per Request: a caller's request_id may be reused.
        self._live: dict[int, Transfer] = {}

    def start(self, req: Request, refs: Sequence[BlockRef]) -> Transfer:
        if req.internal_id in self._live:
            raise ValueError(f"request {req.request_id!r} already has a {self.side.value} transfer")
        t = Transfer(req, list(refs), self._clock() + self.reclaim_s)
        self._live[req.internal_id] = t
        return t

    def done(self, req: Request) -> Transfer | None:
        """The other side acked (send) or the blocks were written (recv). None if the
        transfer already ended (aborted, expired): a late message changes nothing."""
        return self._live.pop(req.internal_id, None)

    def get(self, req: Request) -> Transfer | None:
        return self._live.get(req.internal_id)

    def expired(self) -> list[Request]:
        now = self._clock()
        return [t.req for t in self._live.values() if t.deadline <= now]

    def next_deadline(self) -> float:
        """The nearest deadline (time.monotonic()); inf: none armed."""
        return min((t.deadline for t in self._live.values()), default=math.inf)

    def requests(self) -> list[Request]:
        return [t.req for t in self._live.values()]

    def audit(self, live: Iterable[Request]) -> None:
        """The ledger check: no transfer outlives its request."""
        ids = {r.internal_id for r in live}
        for t in self._live.values():
            if t.req.internal_id not in ids:
                raise LedgerError(f"{self.side.value} transfer of {t.req.incarnation!r} outlives its request")

    def __len__(self) -> int:
        return len(self._live)

    # ---- Holder -------------------------------------------------------------------------
    def release(self, req: Request) -> None:
        self._live.pop(req.internal_id, None)

    def preempt(self, req: Request) -> None:
        # Receive side: preemption frees the reserved blocks, so the transfer can't land
        # (epochs would refuse it anyway). Send side: the KV left at pack time; the entry
        # still waits for the ack or the deadline, or the request would wait forever.
        if self.side is Side.RECV:
            self._live.pop(req.internal_id, None)

    def holds(self, req: Request) -> bool:
        return req.internal_id in self._live
