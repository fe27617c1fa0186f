"""Run the server: uvicorn plus the stop rules of a serving process.

SIGTERM (or the first Ctrl-C): stop admitting (503), let open requests finish for up to the
drain timeout, abort the rest (source: shutdown, an engine-initiated end: their clients get
an error, docs/engine-stops.md), exit 0. A second signal exits at once. Engine-core death: exit EXIT_CORE_DIED after a short delay (state.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from types import FrameType

import uvicorn

from stopline.config import EngineConfig
from stopline.engine.async_engine import AsyncEngine
from stopline.engine.liveness import Bounds
from stopline.server.app import build_app
from stopline.server.state import ServerSettings, ServerState

log = logging.getLogger("stopline.server")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's handler: that one records the signal and re-raises it at exit, which
        # would turn a clean drain into death by SIGTERM.
        if self._draining or self._loop is None:
            self.force_exit = True
            self.should_exit = True
            return
        self._draining = True
        log.info("%s: draining (up to %.0f s), then aborting what is left",
                 signal.Signals(sig).name, self.state.settings.drain_timeout)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            aborted = await self.state.engine.drain(self.state.settings.drain_timeout)
            log.info("drained (%d requests aborted)", aborted)
        finally:
            self.should_exit = True


def serve(model: str | None, config: EngineConfig, settings: ServerSettings, *,
          host: str = "127.0.0.1", port: int = 8000, in_process: bool = False,
          max_waiting: int | None = None, core_threads: int | None = None,
          stall_timeout: float = 60.0, max_buffered: int = 64,
          log_level: str = "info", access_log: bool = True,
          engine: AsyncEngine | None = None, liveness: Bounds | None = None) -> int:
    """Serve until stopped; returns the process exit status. `engine`: one built elsewhere
    (the Ray replicas of stopline/cluster) instead of a local core."""
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    streams = dict(max_waiting=max_waiting, stall_timeout=stall_timeout, max_buffered=max_buffered)
    if engine is not None:
        in_process = False
    elif in_process:
        engine = AsyncEngine.in_process(model, config, progress=True, **streams)
    else:
        engine = AsyncEngine.in_subprocess(model, config, progress=True, core_threads=core_threads,
                                           liveness=liveness, **streams)
    state = ServerState(engine, settings)
    app = build_app(state)
    uconfig = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                             lifespan="on", timeout_graceful_shutdown=int(settings.drain_timeout) + 15)
    server = _Server(uconfig, state)

    def request_exit(code: int) -> None:
        server.should_exit = True

    state.request_exit = request_exit
    mode = "in-process" if in_process else "engine core in its own process"
    if hasattr(engine.backend, "slots"):
        mode = f"{engine.backend.n} Ray replicas"
    if hasattr(engine.backend, "restarts") and not hasattr(engine.backend, "split"):
        mode += ", restarted when it dies"
    if hasattr(engine.backend, "split"):
        mode = "prefill and decode engines in two processes"
    print(f"stopline: serving {settings.model_name!r} at http://{host}:{port} ({mode}); "
          "loading the model, /health answers 503 until it is ready", file=sys.stderr, flush=True)
    server.run()
    return state.exit_code or 0
