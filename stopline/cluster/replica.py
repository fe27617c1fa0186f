"""One engine replica: an async Ray actor owning one engine core (a CoreLoop on a thread).

Async, because a sync actor's running task cannot be cancelled and would serialize the long
`pull` poll with every add and abort. The model loads in __init__, so when Ray restarts a
dead replica (max_restarts) the new incarnation of the actor loads it again by itself; the
front end calls `info()` to learn when it is back.

Outputs travel by long poll: `pull()` waits (no CPU) until the core emitted something and
returns every batch since. A pending `pull` is also how the front end learns at once that
the replica died: Ray fails it with RayActorError.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

from stopline.config import EngineConfig
from stopline.engine.core_loop import CoreLoop
from stopline.engine.messages import Batch, CoreInfo, Utility
from stopline.request import InvalidRequest, SamplingParams


class Replica:
    """The actor's class (made remote by `actor_class`)."""

    def __init__(self, model: str | None, config: EngineConfig | None, threads: int | None) -> None:
        import torch

        from stopline.engine.core import EngineCore

        if threads:
            torch.set_num_threads(threads)
        self.core = EngineCore(model, config, progress=False)
        self.loop = CoreLoop(self.core, self._emit)
        self.batches: list[Batch] = []
        self.dead: str | None = None
        self._next = 1  # the number of the next abort or pause to apply (deliver)
        self._held: dict[int, tuple[str, tuple]] = {}  # arrived ahead of their turn
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    def _emit(self, batch: Batch) -> None:  # on the core thread
        assert self._aloop is not None
        self._aloop.call_soon_threadsafe(self._push, batch)

    def _push(self, batch: Batch) -> None:
        self.batches.append(batch)
        assert self._wake is not None
        self._wake.set()

    def _run(self) -> None:
        try:
            self.loop.run()
        except BaseException as exc:  # noqa: BLE001 - the replica dies with its core
            self.dead = f"engine core loop failed: {exc!r}"
            assert self._aloop is not None
            self._aloop.call_soon_threadsafe(os._exit, 1)  # Ray sees a dead actor and restarts it

    async def info(self) -> CoreInfo:
        """Start stepping (first call) and describe the core, tokenizer included."""
        if self._thread is None:
            self._aloop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._thread = threading.Thread(target=self._run, name="stopline-core", daemon=True)
            self._thread.start()
        return self.loop.info(with_tokenizer=True)

    async def add(self, request_id: str, incarnation: str, prompt: list[int],
                  params: SamplingParams, arrival: float) -> str | None:
        """None when admitted, else why the core refused it (nothing was queued)."""
        try:
            self.loop.add(request_id, prompt, params, arrival, incarnation=incarnation)
        except InvalidRequest as exc:
            return str(exc)
        return None

    async def deliver(self, seq: int, method: str, *args: Any) -> None:
        """An abort or a pause, numbered by the front end: applied in its order, since Ray
        runs an async actor's calls in any order."""
        if method not in ("abort", "pause"):
            raise ValueError(f"deliver: no method {method!r}")
        self._held[seq] = (method, args)
        while self._next in self._held:
            name, held = self._held.pop(self._next)
            self._next += 1
            getattr(self.loop, name)(*held)

    async def utility(self, method: Utility, *args: Any) -> Any:
        return await asyncio.wrap_future(self.loop.call(method, *args))

    async def pull(self) -> list[Batch]:
        """Every batch since the last pull; waits while there is none."""
        assert self._wake is not None
        while not self.batches:
            self._wake.clear()
            await self._wake.wait()
        out, self.batches = self.batches, []
        return out

    async def beat(self) -> float:
        """A heartbeat (engine/liveness.py): seconds inside the current step, 0 between."""
        return self.loop.step_age()

    async def where(self) -> tuple[int, str]:
        """This replica's process id and Ray node id."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    async def stop(self) -> None:
        self.loop.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)


def actor_class(num_cpus: float = 1.0, max_restarts: int = -1) -> Any:
    """The Ray actor class: restarted by Ray when its process dies; a call in flight then
    fails (max_task_retries=0: the front end decides, and it never retries a request)."""
    import ray

    return ray.remote(num_cpus=num_cpus, max_restarts=max_restarts, max_task_retries=0,
                      max_concurrency=1000)(Replica)
