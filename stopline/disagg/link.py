"""The link between the two roles: ZMQ PUSH -> PULL, ipc with both roles on one host and TCP
with one on another (docs/disagg.md measured the two alike on loopback).

Each role has one PULL socket (what the other sends) and one PUSH socket. With both roles
on one machine each binds its PULL and connects its PUSH to the other's. With one role on
another machine (`stopline role`), the role beside the front end binds both and the remote
one connects both, so the remote side needs the front end's host and nothing else.

A receiver thread puts what arrives into a queue that the stepping thread drains at every
step start, and wakes that thread (`wake`): a role with nothing to run sleeps until the link
or a deadline needs it, instead of stepping empty. The stepping thread and the prefill
side's heartbeat thread both send, under a lock (ZMQ sockets are not thread-safe).
High-water marks are unlimited and sends never block: a message for a dead peer waits and
the reclaim deadline ends its request. A connected PUSH queues in ZMQ; a bound one has
nowhere to queue until its peer has connected (at start, or after the peer died), so what it
refuses waits in `_backlog`, in order, and goes out at the next send or heartbeat. A
transfer's frames waiting there belong to its request: its release drops them (`drop`), and
the audit finds any left (`queued`), through the prefill role's `Backlog` holder.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence

import msgspec
import zmq

from stopline.disagg.messages import LinkMsg, Progress
from stopline.disagg.wire import TransferHeader, unpack

KV_TAG = b"kv"
MSG_TAG = b"msg"

Received = LinkMsg | tuple[TransferHeader, list]


class Link:
    def __init__(self, pull: str, push: str, *, bind_pull: bool = True, bind_push: bool = False,
                 wake: Callable[[], None] = lambda: None) -> None:
        """wake: called on the receiver thread after each message is queued."""
        self._wake = wake
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.LINGER, 0)
        (self._pull.bind if bind_pull else self._pull.connect)(pull)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        (self._push.bind if bind_push else self._push.connect)(push)
        self._lock = threading.Lock()
        # (request incarnation or None, parts) a bound PUSH refused (no peer yet), in order
        self._backlog: deque[tuple[str | None, list]] = deque()
        self._beat_enc = msgspec.msgpack.Encoder()
        self.inbox: queue.SimpleQueue[Received] = queue.SimpleQueue()
        self.bad: list[str] = []  # frames that could not be decoded (logged by the role)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(LinkMsg)
        self._thread = threading.Thread(target=self._recv, daemon=True, name="stopline-link")
        self._thread.start()

    def send(self, msg: msgspec.Struct) -> None:
        data = self._enc.encode(msg)
        with self._lock:
            self._backlog.append((None, [MSG_TAG, data]))
            self._flush()

    def send_kv(self, incarnation: str, frames: Sequence[bytes | memoryview]) -> None:
        """One request's KV transfer; kept under its incarnation while no peer can take it."""
        with self._lock:
            self._backlog.append((incarnation, [KV_TAG, *frames]))
            self._flush()

    def drop(self, incarnation: str) -> None:
        """The request ended: its transfer's frames not sent yet are not sent at all."""
        with self._lock:
            if any(key == incarnation for key, _ in self._backlog):
                self._backlog = deque(e for e in self._backlog if e[0] != incarnation)

    def queued(self) -> set[str]:
        """Incarnations whose KV frames wait for a peer."""
        with self._lock:
            return {key for key, _ in self._backlog if key is not None}

    def beat(self, incarnations: list[str]) -> None:
        """From the heartbeat thread (its own encoder; the socket under the lock). A beat
        nobody can receive yet is dropped: the next one says the same."""
        msgs = [self._beat_enc.encode(Progress(inc)) for inc in incarnations]
        with self._lock:
            if not self._flush():
                return
            for data in msgs:
                try:
                    self._push.send_multipart([MSG_TAG, data], zmq.NOBLOCK)
                except zmq.Again:
                    return

    def _flush(self) -> bool:
        """Send the backlog in order (under the lock); False when the peer is not there."""
        while self._backlog:
            try:
                self._push.send_multipart(self._backlog[0][1], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            self._backlog.popleft()
        return True

    def pending(self) -> bool:
        """Something arrived that the stepping thread has not taken yet."""
        return not self.inbox.empty() or bool(self.bad)

    def take(self) -> list[Received]:
        out = []
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def _recv(self) -> None:
        while True:
            try:
                parts = self._pull.recv_multipart(copy=False)
            except zmq.ZMQError:  # the context is terminating: close here, on our thread
                self._pull.close(linger=0)
                return
            try:
                tag = parts[0].bytes
                if tag == KV_TAG:
                    self.inbox.put(unpack([p.buffer for p in parts[1:]]))
                else:
                    self.inbox.put(self._dec.decode(parts[1].bytes))
            except Exception as exc:  # noqa: BLE001 - a bad frame must not stop the link
                self.bad.append(repr(exc))
            self._wake()

    def close(self) -> None:
        with self._lock:  # the heartbeat thread has stopped (see PrefillRole.close)
            self._push.close(linger=0)
        self._ctx.term()  # the receiver thread sees ETERM and closes its socket
        self._thread.join(1.0)
