"""`stopline serve --restart-core`: the engine-core process is started again after it dies.

Without it a dead core ends the server (server/state.py). With it the front end stays up: the
dead core's open streams end with an error at once (EngineDead, the engine's own stop, never
`abort`), /health says `restarting` (503) and new requests get 503 while a fresh process loads
the same model, then it serves again. A core killed for being stuck (engine/liveness.py, past
`--stuck-kill-s`) is a death like any other. Past `Restarts.limit` deaths within its window
the core stays dead, and the server ends as it would without the flag.

One core at a time: every open stream of the front end runs on the current core, so a death
fails all of them (`on_lost`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stopline.engine.liveness import Restarts
from stopline.engine.messages import Batch, CoreInfo, Missed, Utility, catch_up
from stopline.engine.proc.transport import ProcCore
from stopline.engine.streams import EngineDead, EngineUnavailable
from stopline.request import AbortSource, SamplingParams

if TYPE_CHECKING:
    from stopline.config import EngineConfig
    from stopline.engine.async_engine import AsyncEngine
    from stopline.engine.liveness import Bounds

log = logging.getLogger("stopline.restart")


class RestartingCore:
    """A CoreBackend over a ProcCore that `make` builds again after each death."""

    def __init__(self, make: Callable[[], ProcCore], restarts: Restarts | None = None) -> None:
        self.make = make
        self.restarts = restarts or Restarts()
        self.core = make()
        self.tokenizer = None
        self.info: CoreInfo | None = None
        self.state = "starting"  # healthy, restarting, dead (stuck: the core's own word)
        self.last_error: str | None = None
        self.restarted = 0  # fresh processes started after a death
        # Set by the AsyncEngine in front: end these open streams with an error (the core they
        # ran on died); and end the cancelled ones of these at the front end (stuck core).
        self.on_lost: Callable[[str], None] = lambda why: None
        self.confirm_cancels: Callable[[list[str] | None], list[str]] = lambda incs: []
        self.catch_up: Missed = lambda: []  # AsyncEngine.missed: what the restarted core must get
        self._deaths: list[float] = []
        self._ended: set[ProcCore] = set()  # cores whose death was handled: told once
        self._restart: asyncio.Task | None = None
        self._closing = False

    @property
    def pid(self) -> int | None:
        return self.core.pid

    def _wire(self, core: ProcCore) -> None:
        core.confirm_cancels = lambda incs: self.confirm_cancels(incs) if self.core is core else []

    async def start(self, on_batch: Callable[[Batch], None],
                    on_dead: Callable[[str], None]) -> CoreInfo:
        self._on_batch, self._on_dead = on_batch, on_dead
        self.info = await self._start(self.core)
        self.tokenizer = self.core.tokenizer
        self.state = "healthy"
        return self.info

    async def _start(self, core: ProcCore) -> CoreInfo:
        self._wire(core)

        def batch(b: Batch) -> None:
            if self.core is core:  # a late word from a replaced process changes nothing
                self._on_batch(b)

        return await core.start(batch, lambda why: self._lost(core, why))

    # ---- death and restart ------------------------------------------------------------------
    def _lost(self, core: ProcCore, why: str) -> None:
        if self._closing or core is not self.core or core in self._ended:
            return
        self._ended.add(core)
        if self.info is None:  # it never came up: the start fails as a whole
            self._on_dead(why)
            return
        self.last_error = why
        delay = self.restarts.died(self._deaths, time.monotonic())
        if delay is None:
            log.error("the engine core died %d times within %g s: it is not restarted again: %s",
                      len(self._deaths), self.restarts.window_s, why)
            self.state = "dead"
            self._on_dead(why)
            return
        self.state = "restarting"
        log.error("the engine core died: %s; ending its open requests with an error and "
                  "restarting it in %g s (death %d within %g s; it stays dead at %d)", why, delay,
                  len(self._deaths), self.restarts.window_s, self.restarts.limit)
        self.on_lost(why)  # the server says "the engine core died: " before it
        self._restart = asyncio.ensure_future(self._again(delay))

    async def _again(self, delay: float) -> None:
        await asyncio.sleep(delay)
        old = self.core
        try:
            await old.close()  # its sockets and ipc dir; the process is gone already
        except Exception:  # noqa: BLE001 - a half-closed dead core must not stop the restart
            log.exception("closing the dead engine core failed")
        if self._closing:
            return
        core = self.make()
        self.core = core
        t0 = time.monotonic()
        try:
            info = await self._start(core)
            # The pause, sleep or weight update it missed while dead, before it serves.
            await catch_up(self.catch_up, core.utility)
        except Exception as exc:  # noqa: BLE001 - it died while starting: a death like any other
            self._lost(core, f"restart failed: {exc}")  # no-op if its sentinel told us first
            return
        if self._closing:
            return
        if (info.vocab_size, info.block_size) != (self.info.vocab_size, self.info.block_size):
            log.error("the restarted engine core loaded another model (%s); it stays dead", info.source)
            self.state = "dead"
            self._on_dead(f"the restarted engine core loaded another model: {info.source}")
            return
        self.info = info
        self.restarted += 1
        self.state = "healthy"  # last_error still says why it died
        log.warning("the engine core is back in process %d (restarted in %.1f s)", core.pid,
                    time.monotonic() - t0)

    # ---- requests ---------------------------------------------------------------------------
    def _serving(self) -> ProcCore:
        if self.state != "healthy":
            raise EngineUnavailable(f"the engine core is {self.state}: {self.last_error}")
        return self.core

    async def add(self, request_id: str, incarnation: str, prompt_token_ids: list[int],
                  params: SamplingParams, arrival: float) -> None:
        await self._serving().add(request_id, incarnation, prompt_token_ids, params, arrival)

    def abort(self, incarnations: list[str], source: AbortSource, t0: float) -> list[str]:
        try:
            return self.core.abort(incarnations, source, t0)
        except EngineDead:
            # Between the death and its notice: the front end ends them (they are failed anyway).
            return list(incarnations)

    def pause(self, incarnations: list[str], paused: bool) -> None:
        try:
            self.core.pause(incarnations, paused)
        except EngineDead:
            pass  # its streams are ending with the core

    async def utility(self, method: Utility, *args: Any) -> Any:
        return await self._serving().utility(method, *args)

    @property
    def stuck(self) -> str | None:
        return self.core.stuck if self.state == "healthy" else None

    def health(self) -> list[dict[str, Any]]:
        part = self.core.health()[0] if self.state == "healthy" else {
            "role": "core", "state": self.state, "pid": self.core.pid, "remote": False}
        part["last_error"] = part.get("last_error") or self.last_error
        part["restarts"] = self.restarted
        return [part]

    async def close(self) -> None:
        self._closing = True
        if self._restart is not None:
            self._restart.cancel()
            await asyncio.gather(self._restart, return_exceptions=True)
        core = self.core
        if core.pid is None and core.proc is not None and core.proc.is_alive():
            core.proc.kill()  # a restart still loading: nothing to drain
        await core.close()


def restarting_engine(model: str | None, config: EngineConfig | None = None, *,
                      progress: bool = True, core_threads: int | None = None,
                      liveness: Bounds | None = None, restarts: Restarts | None = None,
                      **streams: Any) -> AsyncEngine:
    """An AsyncEngine whose one core process is restarted after it dies."""
    from stopline.engine.async_engine import AsyncEngine

    backend = RestartingCore(lambda: ProcCore(model, config, progress=progress, threads=core_threads,
                                              liveness=liveness), restarts)
    engine = AsyncEngine(backend, **streams)
    backend.on_lost = lambda why: engine.fail(engine.open_ids(), why)
    return engine
