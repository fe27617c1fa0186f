"""The engine-core process: `main` is the target `ProcCore` spawns.

Two threads: the main thread steps the engine (CoreLoop); the input thread receives from the
frontend and hands adds and aborts straight to the core's thread-safe inbox, so an abort is
accepted while a forward pass runs, and is never queued behind adds: before each input
message the input thread empties the abort socket. Both threads send on the one output
socket, under a lock (ZMQ sockets are not thread-safe).

Exit codes: 0 after a shutdown message, 1 if loading or stepping failed (a FatalMsg with the
reason goes out first), 0 when the frontend process disappears. A core the frontend spawned
watches its parent's pid; a remote one (`stopline role`, over TCP) watches its connection to
the frontend, with ZMTP heartbeats so a silent network is noticed too.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import msgspec
import zmq

from stopline.engine import memtrace
from stopline.engine.core_loop import CoreLoop
from stopline.engine.messages import (
    AbortMsg,
    AddMsg,
    AddReply,
    FatalMsg,
    PauseMsg,
    PingMsg,
    PongMsg,
    ReadyMsg,
    ShutdownMsg,
    ToCore,
    UtilityMsg,
    UtilityReply,
)
from stopline.request import InvalidRequest

if TYPE_CHECKING:
    from stopline.config import EngineConfig
    from stopline.engine.core import EngineCore
    from stopline.engine.proc.transport import CoreAddresses

log = logging.getLogger("stopline.core_proc")

ABORT_SWITCH_INTERVAL = 0.0002  # seconds; measured: 5 ms (default) -> p50 5 ms, 0.1 ms -> p50 0.4 ms


HEARTBEAT_MS = 250  # ZMTP heartbeats on a remote core's sockets: a silent peer is gone after
HEARTBEAT_TIMEOUT_MS = 1000  # this long (a killed process's connection closes at once)


def heartbeats(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def main(addrs: CoreAddresses, model: str | None, config: EngineConfig | None, progress: bool,
         parent_pid: int | None, threads: int | None = None,
         make_core: Callable[..., EngineCore] | None = None) -> None:
    """make_core: builds the core instead of EngineCore (a picklable callable taking the
    same arguments: the prefill and decode roles of stopline/disagg). parent_pid None: a
    remote core, reached over TCP, that exits when its frontend's connection drops."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [core] %(message)s")
    remote = parent_pid is None
    if not remote:
        # Ctrl-C in a terminal, and systemd's stop, signal the whole process group: the
        # frontend decides how we stop (it drains first, then sends ShutdownMsg; if it dies,
        # so do we). A remote core is its own command: those signals stop it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The input thread must get the GIL quickly while the stepping thread runs Python code:
    # with the default 5 ms switch interval an abort waits about that long to be accepted.
    sys.setswitchinterval(ABORT_SWITCH_INTERVAL)
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    if remote:
        heartbeats(out)
        threading.Thread(target=watch_connection, daemon=True, name="stopline-frontend-watch",
                         args=(out.get_monitor_socket(), zmq.EVENT_CONNECTED, _frontend_gone)).start()
    else:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                         name="stopline-parent-watch").start()
    out.connect(addrs.output)
    lock = threading.Lock()
    enc = msgspec.msgpack.Encoder()

    def send(msg: msgspec.Struct) -> None:
        data = enc.encode(msg)
        with lock:
            out.send(data)

    try:
        from tqdm import tqdm

        # tqdm's default lock is a multiprocessing semaphore registered with the frontend's
        # resource tracker; we leave with os._exit, so it would be reported as leaked.
        tqdm.set_lock(threading.RLock())
        _set_threads(threads)
        from stopline.engine.core import EngineCore

        core = (make_core or EngineCore)(model, config, progress=progress)
    except BaseException as exc:  # noqa: BLE001 - report any load failure, then exit
        log.exception("loading the model failed")
        send(FatalMsg(f"loading the model failed: {exc}"))
        _exit(out, 1)
    if memtrace.start_from_env():  # after the load: its growth under load is what counts
        log.info("tracing allocations (%s=%d)", memtrace.ENV, memtrace.frames())
    loop = CoreLoop(core, send)
    inp = _pull(ctx, addrs.input, remote)
    abort = _pull(ctx, addrs.abort, remote)
    bell = Doorbell(os.open(addrs.doorbell, os.O_RDONLY | os.O_NONBLOCK) if addrs.doorbell else None)
    loop.before_step = bell.let_input_in
    send(ReadyMsg(loop.info()))
    if remote:
        log.info("engine core %d ready; serving the front end at %s", os.getpid(), addrs.input)
    threading.Thread(target=_serve_input, args=(inp, abort, loop, send, bell), daemon=True,
                     name="stopline-core-input").start()
    code = 0
    try:
        loop.run()
    except BaseException as exc:  # noqa: BLE001 - the frontend must learn why we die
        log.exception("engine core loop failed")
        send(FatalMsg(f"engine core loop failed: {exc!r}"))
        code = 1
    _exit(out, code)


def _set_threads(threads: int | None) -> None:
    """Leave one CPU to the input and ZMQ threads. Torch's OpenMP threads spin between
    parallel regions; with one per CPU they starve the input thread, and an abort waits for
    the scheduler (measured on an idle 16-CPU machine, tiny model: accept p50 3 ms, p99 9 ms
    with 16 threads; p50 0.18 ms, p99 0.47 ms with 15, at the same step rate)."""
    import torch

    cpus = len(os.sched_getaffinity(0))
    if threads is None and cpus > 2 and torch.get_num_threads() >= cpus:
        threads = cpus - 1
    if threads is not None:
        torch.set_num_threads(threads)
        log.info("torch threads: %d of %d CPUs", threads, cpus)


def _pull(ctx: zmq.Context, addr: str, remote: bool) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    if remote:
        heartbeats(sock)
    sock.connect(addr)
    return sock


def _exit(out: zmq.Socket, code: int) -> None:
    out.close(linger=2000)  # flush what we said last (the FatalMsg) before going
    # os._exit: the input thread sits in poll() and must not keep the process alive.
    os._exit(code)


class Doorbell:
    """Lets the input thread in at step boundaries when an abort is waiting.

    The input thread needs the GIL to accept an abort, and a stepping thread running many small
    torch ops keeps taking it back: each op releases and retakes the GIL, which resets
    CPython's switch-interval clock, so a waiting thread gets in only when it wins a race. The
    frontend writes one byte to a FIFO per abort; before each step the stepping thread checks
    the FIFO (one select() call) and, if it rings, blocks until the input thread has taken the
    aborts (at most 5 ms), so that wait is bounded by one step. (Its own effect is not
    isolated in the measurements: the 3 ms medians seen on an idle 16-CPU machine were CPU
    starvation, which _set_threads fixes.)
    """

    WAIT = 0.005

    def __init__(self, fd: int | None) -> None:
        """fd None: no FIFO (a remote core: its frontend is on another host)."""
        self.fd = fd
        self.answered = threading.Event()

    def let_input_in(self) -> None:  # stepping thread
        if self.fd is None:
            return
        self.answered.clear()  # before looking: a ring answered after this point sets it
        if select.select([self.fd], [], [], 0)[0]:
            self.answered.wait(self.WAIT)

    def silence(self) -> None:  # input thread, before it drains the abort socket
        if self.fd is None:
            return
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def answer(self) -> None:  # input thread, after it drained the abort socket
        self.answered.set()


def _serve_input(inp: zmq.Socket, abort: zmq.Socket, loop: CoreLoop,
                 send: Callable[[msgspec.Struct], None], bell: Doorbell) -> None:
    dec = msgspec.msgpack.Decoder(ToCore)
    poller = zmq.Poller()
    poller.register(abort, zmq.POLLIN)
    poller.register(inp, zmq.POLLIN)
    if bell.fd is not None:
        poller.register(bell.fd, zmq.POLLIN)  # a ring with no message left must still be answered
    while True:
        poller.poll()
        bell.silence()
        _drain_aborts(abort, loop, dec, send)
        bell.answer()
        try:
            data = inp.recv(zmq.NOBLOCK)
        except zmq.Again:
            continue
        msg = dec.decode(data)
        if isinstance(msg, AddMsg):
            # An abort that overtook this add (it travels on the other socket) waits in the
            # core for this incarnation: see engine/inbox.py.
            try:
                loop.add(msg.request_id, msg.prompt_token_ids, msg.params, msg.arrival,
                         incarnation=msg.incarnation)
            except InvalidRequest as exc:
                send(AddReply(msg.incarnation, str(exc)))
            except Exception as exc:  # refuse this request, keep serving the others
                log.exception("add_request failed")
                send(AddReply(msg.incarnation, f"internal error: {exc!r}"))
            else:
                send(AddReply(msg.incarnation))
        elif isinstance(msg, PauseMsg):
            loop.pause(msg.incarnations, msg.paused)
        elif isinstance(msg, UtilityMsg):
            loop.call(msg.method, *msg.args).add_done_callback(_reply(msg.call_id, send))
        elif isinstance(msg, ShutdownMsg):
            loop.stop()
            return


def _drain_aborts(abort: zmq.Socket, loop: CoreLoop, dec: msgspec.msgpack.Decoder,
                  send: Callable[[msgspec.Struct], None]) -> None:
    while True:
        try:
            data = abort.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        msg = dec.decode(data)
        if isinstance(msg, AbortMsg):
            loop.abort(msg.incarnations, msg.source, msg.t0)
        elif isinstance(msg, PingMsg):
            # Answered where aborts are taken: a pong says an abort would be taken now too.
            send(PongMsg(msg.seq, loop.step_age()))


def _reply(call_id: int, send: Callable[[msgspec.Struct], None]) -> Callable[[Future], None]:
    def done(fut: Future) -> None:
        exc = fut.exception()
        send(UtilityReply(call_id, None if exc else fut.result(), None if exc is None else repr(exc)))
    return done


def watch_connection(monitor: zmq.Socket, up: int, on_drop: Callable[[], None]) -> None:
    """Read a socket's monitor until it stops and call on_drop once, at the first disconnect
    after an `up` event. Every event is read: an unread monitor fills its pipe, and libzmq
    then blocks the socket's I/O thread (and disable_monitor) on the next event."""
    from zmq.utils.monitor import recv_monitor_message

    connected = dropped = False
    try:
        while True:
            event = recv_monitor_message(monitor)["event"]
            if event == up:
                connected = True
            elif event == zmq.EVENT_DISCONNECTED and connected and not dropped:
                dropped = True
                on_drop()
            elif event == zmq.EVENT_MONITOR_STOPPED:
                return
    except zmq.ZMQError:
        return  # the context is terminating
    finally:
        monitor.close(linger=0)


def _frontend_gone() -> None:
    # A remote core serves one frontend: once its connection is up, a drop (the frontend
    # exited or was killed, or heartbeats timed out) means nobody can use our output.
    log.warning("the front end's connection dropped: exiting")
    os._exit(0)


def _watch_parent(parent_pid: int) -> None:
    # The frontend owns us; if it is gone (even killed with SIGKILL), nobody can use our output.
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(0)
