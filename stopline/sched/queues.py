"""The scheduler's queues: waiting (arrival order; preempted requests re-enter at the front)
and running. A holder of the one release (lifecycle.py): an ended request leaves its queue
at once, a preempted one goes back to the front of the waiting queue."""

from __future__ import annotations

from collections import deque

from stopline.request import Request


class Queues:
    name = "queues"

    def __init__(self) -> None:
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # holding blocks; a family's samples before the fork too

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def start(self, req: Request) -> None:
        """A waiting request was admitted (the head, or one behind paused ones), with its samples."""
        if self.waiting and self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)
        self.running += [req, *req.forks_pending]

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- holder -------------------------------------------------------------------------
    def release(self, req: Request) -> None:
        for q in (self.running, self.waiting):
            try:
                q.remove(req)
                return
            except ValueError:
                pass

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        if req.fork_leader is None:  # samples that have not forked wait inside their leader
            self.waiting.appendleft(req)

    def holds(self, req: Request) -> bool:
        return any(r is req for r in self.running) or any(r is req for r in self.waiting)
