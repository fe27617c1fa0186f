"""The frontend's side of the two-process mode: `ProcCore` starts the engine core in its own
process (core_proc.py) and talks to it over ZMQ with msgpack-encoded messages (messages.py).

Sockets, all ipc:// in a private temp dir, all bound here:
  input   PUSH -> core   adds, utility calls, shutdown
  abort   PUSH -> core   aborts only: the core drains this socket before every input message
  output  PULL <- core   ready, add replies, one Batch per step, utility replies, fatal errors
High-water marks are unlimited: a burst of adds must neither block the event loop nor
deadlock against a core that is busy sending outputs.

Adds are acknowledged by the core (it validates them, so a bad request is a 400 here exactly
as in-process). Aborts never wait for that acknowledgement: one that overtakes its add on the
priority socket is kept by the core until the add arrives (engine/inbox.py). Core
death is noticed by waiting on the process sentinel (no polling). A core that is alive but
does not answer (stopped, swapped out, wedged in a step) is noticed by heartbeats on the
abort socket (engine/liveness.py): past `Bounds.stuck_s` it takes no new add (503), the adds
and calls waiting on it fail, and an abort of its requests is confirmed by the front end at
once; past `Bounds.kill_s` it is killed, which is then a death like any other.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio

from stopline.engine.liveness import Bounds, Watch
from stopline.engine.messages import (
    AbortMsg,
    AddMsg,
    AddReply,
    Batch,
    CoreInfo,
    FatalMsg,
    FromCore,
    PauseMsg,
    PingMsg,
    PongMsg,
    ReadyMsg,
    ShutdownMsg,
    Utility,
    UtilityMsg,
    UtilityReply,
)
from stopline.engine.snapshot import Snapshot
from stopline.engine.streams import EngineDead, EngineUnavailable
from stopline.request import AbortSource, InvalidRequest, SamplingParams, UnknownAdapter

if TYPE_CHECKING:
    from stopline.config import EngineConfig
    from stopline.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("stopline.transport")


class CoreAddresses(msgspec.Struct, frozen=True):
    input: str
    abort: str
    output: str
    doorbell: str = ""  # a FIFO: one byte per abort sent, see core_proc.Doorbell; "": none (remote)


class ProcCore:
    def __init__(self, model: str | None = None, config: EngineConfig | None = None, *,
                 progress: bool = True, threads: int | None = None,
                 make_core: Callable[..., Any] | None = None, liveness: Bounds | None = None,
                 name: str = "engine core") -> None:
        """make_core: a picklable callable that builds the core in the child (see
        core_proc.main); None: a plain EngineCore. liveness: when it is stuck, when killed."""
        self.model = model
        self.name = name
        self.bounds = liveness or Bounds()
        self.watch: Watch | None = None  # from ready on
        # Told when the core becomes stuck (why) and when it answers again (the split's roles).
        self.on_stuck: Callable[[str], None] = lambda why: None
        self.on_back: Callable[[], None] = lambda: None
        # Ends the open streams already cancelled (all: None) at the front end and returns
        # them: set by the AsyncEngine whose backend this is (AsyncEngine.confirm_cancels).
        self.confirm_cancels: Callable[[list[str] | None], list[str]] = lambda incs: []
        self._beats: asyncio.Task | None = None
        self.make_core = make_core
        self.config = config
        self.progress = progress
        self.threads = threads  # torch threads in the core (None: all CPUs but one, see core_proc)
        self.tokenizer: Tokenizer | None = None
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(FromCore)
        self._acks: dict[str, asyncio.Future[None]] = {}  # add sent, reply not yet here
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._fatal: str | None = None
        self._dead: str | None = None
        self._closing = False
        self._reader: asyncio.Task | None = None
        self._dir: str | None = None
        self._bell: int | None = None
        self.pid: int | None = None  # the core's process, once it said ready
        self.info: CoreInfo | None = None  # what it said then

    # ---- start ----------------------------------------------------------------------------
    async def start(self, on_batch: Callable[[Batch], None],
                    on_dead: Callable[[str], None]) -> CoreInfo:
        from stopline.tokenizer.tokenizer import Tokenizer

        self._aloop = aloop = asyncio.get_running_loop()
        self._on_batch, self._on_dead = on_batch, on_dead
        addrs = self._addresses()
        self._ctx = zmq.Context()
        self._in = self._push(addrs.input)
        self._abort = self._push(addrs.abort)
        self._actx = zmq.asyncio.Context()
        self._out = self._actx.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        self._tune(self._out)
        self._out.bind(addrs.output)
        self._ready: asyncio.Future[CoreInfo] = aloop.create_future()
        self._reader = asyncio.create_task(self._read(), name="stopline-core-reader")
        self._launch(addrs)
        info = await self._ready
        self.pid, self.info = info.pid, info
        # The core connected before it said ready; wait until our PUSH sockets see it, so the
        # first add can't fail for lack of a peer.
        for sock in (self._in, self._abort):
            if not await asyncio.to_thread(sock.poll, 10_000, zmq.POLLOUT):
                raise EngineDead("the engine core never connected its input sockets")
        if addrs.doorbell:
            # The core opened the FIFO for reading before it said ready, so this can't block.
            self._bell = os.open(addrs.doorbell, os.O_WRONLY | os.O_NONBLOCK)
        self.tokenizer = Tokenizer.from_state(info.tokenizer_state)
        self.watch = Watch(f"the {self.name}", self.bounds)
        self._beats = asyncio.create_task(self._beat(), name="stopline-core-beat")
        log.info("engine core ready in process %d (%s)", info.pid, info.source)
        return info

    def _addresses(self) -> CoreAddresses:
        self._dir = tempfile.mkdtemp(prefix="stopline-ipc-")
        addrs = CoreAddresses(*(f"ipc://{self._dir}/{name}" for name in ("input", "abort", "output")),
                              doorbell=f"{self._dir}/doorbell")
        os.mkfifo(addrs.doorbell)
        return addrs

    def _tune(self, sock: zmq.Socket) -> None:
        """Socket options before bind (the remote core adds heartbeats)."""

    def _launch(self, addrs: CoreAddresses) -> None:
        from stopline.engine.proc import core_proc

        mp = multiprocessing.get_context("spawn")  # a clean interpreter: no inherited threads or loop
        self.proc = mp.Process(target=core_proc.main, name="stopline-core", daemon=True,
                               args=(addrs, self.model, self.config, self.progress, os.getpid(),
                                     self.threads, self.make_core))
        self.proc.start()
        threading.Thread(target=self._watch, args=(self.proc.sentinel,), daemon=True,
                         name="stopline-core-watch").start()

    def _push(self, addr: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        self._tune(sock)
        sock.bind(addr)
        return sock

    def _watch(self, sentinel: int) -> None:
        multiprocessing.connection.wait([sentinel])
        try:
            self._aloop.call_soon_threadsafe(self._died)
        except RuntimeError:
            pass  # the event loop is gone: so is everyone who cared

    # ---- liveness (event loop thread) --------------------------------------------------------
    @property
    def stuck(self) -> str | None:
        """Why the core is stuck now, or None."""
        return None if self.watch is None else self.watch.stuck

    async def _beat(self) -> None:
        assert self.watch is not None
        watch = self.watch
        for seq in itertools.count():
            t = time.monotonic()
            await asyncio.sleep(self.bounds.beat_s)
            if self._closing or self._dead is not None:
                return
            try:
                self._send(self._abort, PingMsg(seq))
            except EngineDead:
                return
            if time.monotonic() - t > 2 * self.bounds.beat_s:
                continue  # our own loop was held up: answers may be waiting unread, judge later
            was = watch.stuck
            why = watch.check()
            if why is not None and watch.overdue():
                self._kill_stuck(why)
                return
            if why is not None and was is None:
                self._became_stuck(why)
            elif why is None and was is not None:
                log.warning("the %s answers again (it was stuck: %s)", self.name, was)
                self.on_back()

    def _became_stuck(self, why: str) -> None:
        log.error("%s: it takes no new request; its requests' cancels are confirmed here; "
                  "killed if still stuck after %g s", why, self.bounds.kill_s)
        exc = EngineUnavailable(why)
        for fut in [*self._acks.values(), *self._calls.values()]:
            if not fut.done():
                fut.set_exception(exc)
        self.confirm_cancels(None)  # every request here runs on this core
        self.on_stuck(why)

    def _kill_stuck(self, why: str) -> None:
        self._fatal = f"{why}: killed (stuck past {self.bounds.kill_s:g} s)"
        log.error("%s", self._fatal)
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()  # its sentinel fires: a death like any other (_died)
        else:
            self._died()  # a remote core: nothing to kill from here; given up as dead

    def health(self) -> list[dict[str, Any]]:
        """The core process as /health lists it (one role: "core")."""
        state = ("dead" if self._dead is not None else "starting" if self.watch is None
                 else "stuck" if self.stuck is not None else "healthy")
        return [{"role": "core", "state": state, "pid": self.pid, "remote": False,
                 "last_error": self._dead or self.stuck}]

    # ---- requests (event loop thread) -------------------------------------------------------
    async def add(self, request_id: str, incarnation: str, prompt_token_ids: list[int],
                  params: SamplingParams, arrival: float) -> None:
        if self.stuck is not None:
            raise EngineUnavailable(self.stuck)
        fut = self._aloop.create_future()
        self._acks[incarnation] = fut
        try:
            self._send(self._in, AddMsg(request_id, incarnation, prompt_token_ids, params, arrival))
            # The reply comes from the input thread at once; a core that can't give it within
            # the stuck bound is (or is about to be marked) stuck.
            await asyncio.wait_for(fut, self.bounds.stuck_s)
        except (asyncio.CancelledError, TimeoutError, EngineUnavailable) as exc:
            # Our caller left, or the core is stuck, before it answered: it may still admit the
            # request later, and nobody would listen.
            self._acks.pop(incarnation, None)
            try:
                self._send(self._abort, AbortMsg([incarnation], AbortSource.CANCEL, time.monotonic()))
            except EngineDead:
                pass
            if isinstance(exc, TimeoutError):
                raise EngineUnavailable(f"the {self.name} did not answer an add within "
                                        f"{self.bounds.stuck_s:g} s") from None
            raise
        except BaseException:
            self._acks.pop(incarnation, None)
            raise

    def abort(self, incarnations: list[str], source: AbortSource, t0: float) -> list[str]:
        """Returns the incarnations the front end must end itself: all of them while the core
        is stuck (the abort still goes; the core applies it, frees their KV and its late
        terminal outputs find no stream). Else none."""
        self._send(self._abort, AbortMsg(list(incarnations), source, t0))
        if self._bell is not None:  # a remote core has no doorbell
            try:
                os.write(self._bell, b"!")
            except BlockingIOError:
                pass  # the FIFO is full of rings already: the core will look
        return list(incarnations) if self.stuck is not None else []

    def pause(self, incarnations: list[str], paused: bool) -> None:
        self._send(self._in, PauseMsg(list(incarnations), paused))

    async def utility(self, method: Utility, *args: Any) -> Any:
        if self.stuck is not None:
            raise EngineUnavailable(self.stuck)
        call_id = next(self._call_ids)
        fut = self._aloop.create_future()
        self._calls[call_id] = fut
        try:
            self._send(self._in, UtilityMsg(call_id, method, list(args)))
            result = await fut
        finally:
            self._calls.pop(call_id, None)
        return msgspec.convert(result, Snapshot) if method is Utility.SNAPSHOT else result

    def _send(self, sock: zmq.Socket, msg: msgspec.Struct) -> None:
        if self._dead is not None:
            raise EngineDead(self._dead)
        try:
            sock.send(self._enc.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # no peer: the core is gone or going
            raise EngineDead(f"cannot reach the engine core: {exc}") from exc

    # ---- from the core ----------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            try:
                data = await self._out.recv()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            try:
                self._handle(self._dec.decode(data))
            except Exception:  # a bad message must not stop the reader: later ones matter
                log.exception("failed to handle a message from the engine core")

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, Batch):
            self._on_batch(msg)
        elif isinstance(msg, AddReply):
            self._on_add_reply(msg)
        elif isinstance(msg, UtilityReply):
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                if msg.error is None:
                    fut.set_result(msg.result)
                else:
                    fut.set_exception(RuntimeError(msg.error))
        elif isinstance(msg, PongMsg):
            if self.watch is not None:
                self.watch.answer(msg.step_age)
        elif isinstance(msg, ReadyMsg):
            if not self._ready.done():
                self._ready.set_result(msg.info)
        elif isinstance(msg, FatalMsg):
            log.error("engine core reports: %s", msg.message)
            self._fatal = msg.message

    def _on_add_reply(self, msg: AddReply) -> None:
        fut = self._acks.pop(msg.incarnation, None)
        if fut is None or fut.done():
            return
        if msg.error is not None:
            # The core's UnknownAdapter names the model (its adapter went): the server's 404.
            kind = UnknownAdapter if msg.error.startswith("model:") else InvalidRequest
            fut.set_exception(kind(msg.error))
        else:
            fut.set_result(None)

    def _died(self) -> None:
        if self._closing or self._dead is not None:
            return
        # A FatalMsg sent just before the exit may still sit in the socket: give the reader a
        # moment to pick it up so the reason we log is the real one.
        self._aloop.call_later(0.02, self._declare_dead)

    def _declare_dead(self) -> None:
        if self._closing or self._dead is not None:
            return
        reason = self._fatal or self._exit_reason()
        self._dead = reason
        exc = EngineDead(reason)
        for fut in [*self._acks.values(), *self._calls.values()]:
            if not fut.done():
                fut.set_exception(exc)
        self._acks.clear()
        self._calls.clear()
        if not self._ready.done():
            self._ready.set_exception(exc)
        self._on_dead(reason)

    def _exit_reason(self) -> str:
        code = self.proc.exitcode if self.proc is not None else None
        return f"the engine core process exited with code {code}"

    # ---- stop -------------------------------------------------------------------------------
    async def close(self) -> None:
        self._closing = True
        if self._beats is not None:
            self._beats.cancel()
        proc = self.proc
        if proc is not None and proc.is_alive():
            try:
                self._in.send(self._enc.encode(ShutdownMsg()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            await asyncio.to_thread(proc.join, 10.0)
            if proc.is_alive():
                log.warning("engine core did not stop in 10 s; terminating it")
                proc.terminate()
                await asyncio.to_thread(proc.join, 2.0)
                if proc.is_alive():
                    proc.kill()
                    await asyncio.to_thread(proc.join, 2.0)
        if self._reader is not None:
            self._reader.cancel()
        for name in ("_in", "_abort", "_out"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        if getattr(self, "_bell", None) is not None:
            os.close(self._bell)
            self._bell = None
        for name in ("_ctx", "_actx"):
            ctx = getattr(self, name, None)
            if ctx is not None:
                ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
