"""RemoteCore: a ProcCore whose engine core runs on another host (`stopline role`), reached
over TCP instead of a spawned child over ipc.

The frontend binds the three sockets on `listen` (host:port, port+1, port+2) and waits for
the remote core to connect and say ready; the remote side needs only that address. Death is
noticed on the input socket's connection: a killed process's connection closes at once,
and ZMTP heartbeats (core_proc.heartbeats) end one whose network went silent. There is no
doorbell: aborts still overtake adds on their own socket, only the step-boundary wait for
the input thread is gone.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import zmq

from stopline.engine.messages import ShutdownMsg
from stopline.engine.proc import core_proc
from stopline.engine.proc.transport import CoreAddresses, ProcCore

log = logging.getLogger("stopline.transport")

PORTS = 3  # input, abort, output: port, port + 1, port + 2


def split_host_port(listen: str) -> tuple[str, int]:
    """'host:port' (or 'tcp://host:port') -> (host, port); a ValueError naming the problem."""
    text = listen.removeprefix("tcp://")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {listen!r}")
    return host, int(port)


def core_addresses(listen: str) -> CoreAddresses:
    host, port = split_host_port(listen)
    return CoreAddresses(*(f"tcp://{host}:{port + i}" for i in range(PORTS)))


class RemoteCore(ProcCore):
    def __init__(self, listen: str, *, name: str = "engine core", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.addrs = core_addresses(listen)
        self._lost_why = "its connection dropped"

    def _addresses(self) -> CoreAddresses:
        return self.addrs

    def _tune(self, sock: zmq.Socket) -> None:
        core_proc.heartbeats(sock)

    def _launch(self, addrs: CoreAddresses) -> None:
        # The input socket's connection (a plain zmq socket: the output one is asyncio's).
        threading.Thread(target=core_proc.watch_connection, daemon=True, name="stopline-remote-watch",
                         args=(self._in.get_monitor_socket(), zmq.EVENT_ACCEPTED, self._link_dropped)).start()
        log.info("waiting for the remote %s to connect at %s", self.name, addrs.input)

    def _link_dropped(self) -> None:
        try:
            self._aloop.call_soon_threadsafe(self._died)
        except RuntimeError:
            pass  # the event loop is gone: so is everyone who cared

    def _exit_reason(self) -> str:
        return f"the remote {self.name} at {self.addrs.input}: {self._lost_why}"

    async def close(self) -> None:
        self._closing = True
        if self._beats is not None:
            self._beats.cancel()
        if self._dead is None and self.pid is not None:
            try:  # the remote core stops on this; if it is lost, its own watch stops it
                self._in.send(self._enc.encode(ShutdownMsg()), zmq.NOBLOCK)
                await asyncio.sleep(0.2)  # let it leave before our sockets close
            except zmq.ZMQError:
                pass
        if self._reader is not None:
            self._reader.cancel()
        inp = getattr(self, "_in", None)
        if inp is not None:
            inp.disable_monitor()
        for name in ("_in", "_abort", "_out"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        for name in ("_ctx", "_actx"):
            ctx = getattr(self, name, None)
            if ctx is not None:
                ctx.term()
