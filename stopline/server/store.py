"""Stored responses of /v1/responses and the runs behind them: server-side holders.

A `Run` is one response in progress. One pump writes it (the foreground handler, or for
`background: true` a task of its own that no client holds); any number of followers read its
events by sequence number (a resumed stream, a poll). It ends exactly once (`Run.end`): the
first end decides the status, so a cancel accepted before the engine's terminal output makes
the run `cancelled` whatever that output says, and a cancel after the end changes nothing.

`ResponseStore` keeps responses with `store: true` for `previous_response_id`, GET and the
cancel endpoint, bounded by count (oldest ended first) and by age since their end. A run in
progress is never evicted: it is bounded by `max_stored` at admission instead (429 beyond).
`close` (server shutdown) ends every run still going as `failed`, naming the shutdown.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

TERMINAL = ("completed", "incomplete", "failed", "cancelled")


def frame(event: dict[str, Any]) -> bytes:
    """One server-sent event of the Responses API: its type as the SSE event name."""
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


class Run:
    """One response being produced: its response object, its numbered events, how it ended."""

    def __init__(self, response: dict[str, Any], *, keep_events: bool) -> None:
        self.response = response  # the live response object (status, output, usage)
        self.keep_events = keep_events  # background: followers may resume from any number
        self.events: list[bytes] = []  # frame of event k at index k (when kept)
        self.seq = 0  # the next event's sequence_number
        self.cancel_accepted = False  # POST .../cancel came while the run was going
        self.task: asyncio.Task | None = None  # the background pump
        self.ender: Callable[[], None] | None = None  # ends the engine requests (the group)
        self.done = asyncio.Event()
        self._changed = asyncio.Event()

    @property
    def id(self) -> str:
        return self.response["id"]

    @property
    def status(self) -> str:
        return self.response["status"]

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL

    def emit(self, event: dict[str, Any]) -> bytes:
        """Number the event, keep it for followers, wake them; returns its frame."""
        event["sequence_number"] = self.seq
        self.seq += 1
        data = frame(event)
        if self.keep_events:
            self.events.append(data)
        self._changed.set()
        self._changed = asyncio.Event()
        return data

    def cancel(self) -> bool:
        """Accept a cancel: True when the run was still going (it will end `cancelled`)."""
        if self.ended:
            return False
        self.cancel_accepted = True
        if self.ender is not None:
            self.ender()
        return True

    def finish(self) -> None:
        """The terminal event has been emitted."""
        self.done.set()
        self._changed.set()

    async def follow(self, after: int, stop: asyncio.Event) -> AsyncIterator[bytes]:
        """The kept frames after sequence number `after`, then each new one, to the terminal;
        `stop` (the reader left) ends it early."""
        k = after + 1
        while not stop.is_set():
            if k < len(self.events):
                yield self.events[k]
                k += 1
                continue
            if self.done.is_set():
                return
            waits = [asyncio.ensure_future(self._changed.wait()), asyncio.ensure_future(stop.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()


@dataclass
class Stored:
    response: dict[str, Any]  # the response object as GET shows it (the run's, while it runs)
    messages: list[dict[str, Any]]  # the conversation through this response (chat format)
    run: Run | None = None
    ended_at: float | None = None  # monotonic; None while its run is going
    background: bool = False


@dataclass
class StoreCounts:
    created: collections.Counter = field(default_factory=collections.Counter)  # by mode
    ended: collections.Counter = field(default_factory=collections.Counter)  # by status
    evicted: int = 0


class ResponseStore:
    def __init__(self, max_stored: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_stored < 1 or ttl_s <= 0:
            raise ValueError("the response store needs max_stored >= 1 and ttl_s > 0")
        self.max_stored = max_stored
        self.ttl_s = ttl_s
        self.clock = clock
        self._items: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self.runs: dict[str, Run] = {}  # background runs going (stored or not yet)
        self.counts = StoreCounts()
        self.closed = False

    # ---- holders ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._items)

    @property
    def running(self) -> int:
        return len(self.runs)

    def full_of_runs(self) -> bool:
        """No room for another background run (each stays until it ends)."""
        return len(self.runs) >= self.max_stored

    # ---- entries ----------------------------------------------------------------------------
    def put(self, entry: Stored) -> None:
        self._items[entry.response["id"]] = entry
        self._items.move_to_end(entry.response["id"])
        self.sweep()

    def get(self, rid: str) -> Stored | None:
        self.sweep()
        return self._items.get(rid)

    def delete(self, rid: str) -> Stored | None:
        return self._items.pop(rid, None)

    def ended(self, rid: str) -> None:
        """Its run ended: from now on it ages, and counts among the evictable."""
        entry = self._items.get(rid)
        if entry is not None and entry.ended_at is None:
            entry.ended_at = self.clock()
        self.sweep()

    def sweep(self) -> None:
        """Drop what is past its age, then the oldest ended ones over the count bound."""
        now = self.clock()
        old = [k for k, e in self._items.items()
               if e.ended_at is not None and now - e.ended_at > self.ttl_s]
        for k in old:
            del self._items[k]
        over = max(0, len(self._items) - self.max_stored)
        oldest = [k for k, e in self._items.items() if e.ended_at is not None][:over]
        for k in oldest:
            del self._items[k]
        self.counts.evicted += len(old) + len(oldest)

    # ---- shutdown ---------------------------------------------------------------------------
    async def close(self, why: str) -> None:
        """End every background run still going as failed (why: the shutdown)."""
        self.closed = True
        tasks = []
        for run in list(self.runs.values()):
            if run.ender is not None:
                run.ender()
            if run.task is not None and not run.task.done():
                run.task.cancel()
                tasks.append(run.task)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
