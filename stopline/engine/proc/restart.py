"""`stopline serve --restart-core`: the engine-core process is started again after it dies.

Without it a dead core ends the server (server/state.py). With it the front end stays up: the
dead core's open streams end with an error at once (EngineDead, the engine's own stop, never
`abort`), /health says `restarting` (503) and new requests get 503 while a fresh process loads
the same model, then it serves again. A core killed for being stuck (engine/liveness.py, past
`--stuck-kill-s`) is a death like any other. Past `Restarts.limit` deaths within its window
the core stays dead, and the server ends as it would without the flag.

One core at a time: every open stream of the front end runs on the current core, so a death
fails all of them (`on_lost`).

`--standby-core` keeps a second core process loaded and waiting (the spare): it is started
once the core is ready, loads the same model, and sleeps at level 1 (its KV pool freed:
residency.sleep), so it holds the weights and the process and runs no step. When the core
dies the spare is promoted: woken (its KV pool allocated again), caught up with what the
front end holds engine-wide (weights version, sleep, a keep pause: messages.catch_up; and the
LoRA adapters loaded through this backend), and it serves; /health says `restarting` only for
that. A new spare is then loaded in the background. A death while the spare is still loading
waits for it rather than starting a third process. The spare's own death (or a stuck spare
killed past --stuck-kill-s) is logged and it is loaded again, under the same `Restarts` bound.
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

    def __init__(self, make: Callable[[], ProcCore], restarts: Restarts | None = None, *,
                 standby: bool = False) -> None:
        self.make = make
        self.restarts = restarts or Restarts()
        self.standby = standby  # keep a spare core loaded (see the module's docstring)
        self.core = make()
        self.spare: ProcCore | None = None  # loading or loaded, not serving
        self.spare_ready = False  # loaded and asleep: promotion wakes it
        self._spare_task: asyncio.Task | None = None
        self._spare_deaths: list[float] = []
        self.promoted = 0  # deaths answered by a spare (counted in `restarted` too)
        # LoRA adapters loaded through this backend: a fresh or promoted core loads them again.
        self.loras: dict[str, str] = {}
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
        self._load_spare()
        return self.info

    async def _start(self, core: ProcCore) -> CoreInfo:
        self._wire(core)

        def batch(b: Batch) -> None:
            if self.core is core:  # a late word from a replaced process changes nothing
                self._on_batch(b)

        return await core.start(batch, lambda why: self._lost(core, why))

    # ---- death and restart ------------------------------------------------------------------
    def _lost(self, core: ProcCore, why: str) -> None:
        if core is self.spare and not self._closing and core not in self._ended:
            self._ended.add(core)
            self._spare_lost(core, why)
            return
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
        t0 = time.monotonic()
        try:
            await old.close()  # its sockets and ipc dir; the process is gone already
        except Exception:  # noqa: BLE001 - a half-closed dead core must not stop the restart
            log.exception("closing the dead engine core failed")
        if self._closing:
            return
        core = await self._take_spare()
        promoted = core is not None
        if core is None:
            core = self.make()
        self.core = core
        try:
            if promoted:
                await core.utility(Utility.WAKE)  # its KV pool, freed while it waited
                assert core.info is not None  # it said ready before it became the spare
                info = core.info
            else:
                info = await self._start(core)
            # The pause, sleep or weight update it missed while dead, before it serves.
            await catch_up(self.catch_up, core.utility)
            await self._load_loras(core)
            if promoted:  # the pool as the fresh core has it (the dead one's was the last seen)
                self._on_batch(Batch(snapshot=await core.utility(Utility.SNAPSHOT)))
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
        self.promoted += promoted
        self.state = "healthy"  # last_error still says why it died
        log.warning("the engine core is back in process %d (%s in %.1f s)", core.pid,
                    "the standby core promoted" if promoted else "restarted", time.monotonic() - t0)
        self._load_spare()

    # ---- the standby core (--standby-core) ----------------------------------------------------
    def _load_spare(self) -> None:
        """Start loading a spare in the background, if asked for and none is there."""
        if not self.standby or self._closing or self.spare is not None:
            return
        self.spare, self.spare_ready = self.make(), False
        self._spare_task = asyncio.ensure_future(self._spare_up(self.spare))

    async def _spare_up(self, core: ProcCore) -> ProcCore | None:
        """Load `core` and put it to sleep; it is the spare once this returns it (None: it
        died or loaded another model, and it is no longer the spare)."""
        try:
            info = await self._start(core)
            if self.info is not None and (info.vocab_size, info.block_size) != (
                    self.info.vocab_size, self.info.block_size):
                raise RuntimeError(f"it loaded another model: {info.source}")
            await core.utility(Utility.SLEEP, {"level": 1})  # no KV pool until promoted
        except Exception as exc:  # noqa: BLE001 - a spare that can't come up is not used
            if core is self.spare and core not in self._ended:
                self._ended.add(core)
                self._spare_lost(core, f"loading failed: {exc}")
            return None
        if core is not self.spare:
            return None
        self.spare_ready = True
        log.info("standby engine core ready in process %d (asleep: no KV pool)", core.pid)
        return core

    def _spare_lost(self, core: ProcCore, why: str) -> None:
        self.spare, self.spare_ready = None, False
        asyncio.ensure_future(_close_quietly(core))
        delay = self.restarts.died(self._spare_deaths, time.monotonic())
        if delay is None:
            log.error("the standby engine core died %d times within %g s: no standby from now "
                      "on (a dead core is restarted by loading a fresh one): %s",
                      len(self._spare_deaths), self.restarts.window_s, why)
            self.standby = False
            return
        log.error("the standby engine core died: %s; loading another in %g s", why, delay)
        self._spare_task = asyncio.ensure_future(self._spare_again(delay))

    async def _spare_again(self, delay: float) -> ProcCore | None:
        await asyncio.sleep(delay)
        self._load_spare()
        task = self._spare_task
        return None if task is None or task is asyncio.current_task() else await task

    async def _take_spare(self) -> ProcCore | None:
        """The spare, once loaded (waiting for one still loading), taken out of its post;
        None if there is none or it died."""
        task = self._spare_task
        while task is not None:
            try:
                core = await asyncio.shield(task)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - _spare_up handles its own failures
                core = None
            if core is not None and core is self.spare:
                self.spare, self.spare_ready, self._spare_task = None, False, None
                return core
            if self._spare_task is task:
                return None
            task = self._spare_task  # it died and another is loading
        return None

    async def _load_loras(self, core: ProcCore) -> None:
        for name, path in list(self.loras.items()):
            got = await core.utility(Utility.LOAD_LORA, name, path)
            if got.get("status") != 200:  # the adapter's requests get 404 from this core
                log.error("the restarted engine core could not load LoRA adapter %r from %s: %s",
                          name, path, got.get("message"))

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
        got = await self._serving().utility(method, *args)
        if method in (Utility.LOAD_LORA, Utility.UNLOAD_LORA) and got.get("status") == 200:
            if method is Utility.LOAD_LORA:
                self.loras[args[0]] = args[1]
            else:
                self.loras.pop(args[0], None)
        return got

    @property
    def stuck(self) -> str | None:
        return self.core.stuck if self.state == "healthy" else None

    def health(self) -> list[dict[str, Any]]:
        part = self.core.health()[0] if self.state == "healthy" else {
            "role": "core", "state": self.state, "pid": self.core.pid, "remote": False}
        part["last_error"] = part.get("last_error") or self.last_error
        part["restarts"] = self.restarted
        if self.standby or self.spare is not None:
            spare = self.spare
            part["standby"] = None if spare is None else {
                "state": "ready" if self.spare_ready else "loading",
                # while it loads: the process spawned (it says its pid once ready)
                "pid": spare.pid or (spare.proc.pid if spare.proc is not None else None)}
            part["promoted"] = self.promoted
        return [part]

    async def close(self) -> None:
        self._closing = True
        for task in (self._restart, self._spare_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for core in (self.spare, self.core):
            if core is None:
                continue
            if core.pid is None and core.proc is not None and core.proc.is_alive():
                core.proc.kill()  # a restart or spare still loading: nothing to drain
            await core.close()


async def _close_quietly(core: ProcCore) -> None:
    try:
        if core.pid is None and core.proc is not None and core.proc.is_alive():
            core.proc.kill()
        await core.close()
    except Exception:  # noqa: BLE001 - a dead spare's sockets: nothing to save
        log.exception("closing the dead standby engine core failed")


def restarting_engine(model: str | None, config: EngineConfig | None = None, *,
                      progress: bool = True, core_threads: int | None = None,
                      liveness: Bounds | None = None, restarts: Restarts | None = None,
                      standby: bool = False, **streams: Any) -> AsyncEngine:
    """An AsyncEngine whose one core process is restarted after it dies (standby: by
    promoting a spare kept loaded)."""
    from stopline.engine.async_engine import AsyncEngine

    backend = RestartingCore(lambda: ProcCore(model, config, progress=progress, threads=core_threads,
                                              liveness=liveness), restarts, standby=standby)
    engine = AsyncEngine(backend, **streams)
    backend.on_lost = lambda why: engine.fail(engine.open_ids(), why)
    return engine
