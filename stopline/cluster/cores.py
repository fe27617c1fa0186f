"""RayCores: the engine backend (async_engine.CoreBackend) whose core is N Ray replicas.

The AsyncEngine in front keeps every request's stream, incarnation and terminal-output rule
as in one process; this backend routes each add to one replica (router.py), remembers the
owner (owners.py), sends aborts and pauses to that owner only, and pulls outputs from every
replica. A replica that dies ends its own open streams at once, as an engine-initiated end (EngineStopped,
source REPLICA: docs/engine-stops.md) (its pending
pull fails), its requests are not retried, the router skips it, and it rejoins when Ray has
restarted it, it answers again and it got the engine-wide state it missed (the current
weights and version, sleep, a keep pause: messages.catch_up).

A replica that is alive but answers no heartbeat, or stays in one step, for `Bounds.stuck_s`
(engine/liveness.py) is stuck: the router skips it, /health lists it as such, and cancels of
its requests are confirmed here at once (the abort still goes; when it comes back it applies
it and its late terminal outputs find no stream). Stuck for `Bounds.kill_s`, it is killed:
its open requests end with an error and Ray restarts it, as after any death.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stopline.cluster.owners import OwnerTable
from stopline.cluster.replica import actor_class
from stopline.cluster.router import NoReplica, Policy, Router
from stopline.config import Choice, EngineConfig
from stopline.engine.liveness import Bounds, Watch
from stopline.engine.messages import Batch, CoreInfo, Missed, Utility, catch_up
from stopline.engine.snapshot import Snapshot
from stopline.engine.streams import EngineDead, EngineUnavailable
from stopline.request import AbortSource, InvalidRequest, SamplingParams

log = logging.getLogger("stopline.cluster")

REJOIN_POLL = 0.5  # seconds between asking a dead replica whether it is back


class ReplicaState(Choice):
    STARTING = "starting"
    HEALTHY = "healthy"
    STUCK = "stuck"  # alive, but no heartbeat answer or no step for the stuck bound
    DEAD = "dead"  # died; Ray is restarting it
    CLOSED = "closed"


@dataclass
class ReplicaSlot:
    index: int
    actor: Any
    state: ReplicaState = ReplicaState.STARTING
    pid: int | None = None
    deaths: int = 0
    last_error: str | None = None
    snapshot: Snapshot = Snapshot()
    watch: Watch | None = None  # from healthy on; a fresh one per incarnation of the actor
    beat: asyncio.Future | None = None  # the heartbeat call in flight
    sent: int = 0  # aborts and pauses sent to this incarnation of the actor (their order)

    @property
    def serving(self) -> bool:
        """Healthy or stuck: its process runs and owns its requests."""
        return self.state in (ReplicaState.HEALTHY, ReplicaState.STUCK)


class RayCores:
    def __init__(self, model: str | None, config: EngineConfig | None, *, replicas: int = 2,
                 address: str | None = None, policy: Policy = Policy.AFFINITY,
                 threads: int | None = 1, num_cpus: float = 1.0,
                 ray_init: dict[str, Any] | None = None, liveness: Bounds | None = None) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.model, self.config = model, config
        self.n = replicas
        self.address = address
        self.threads = threads
        self.num_cpus = num_cpus
        self.ray_init = ray_init or {}
        self.router = Router(policy)
        self.owners = OwnerTable()
        self.samples: dict[str, int] = {}  # incarnation -> samples not yet ended
        self.slots: list[ReplicaSlot] = []
        self.tokenizer = None
        self.on_lost: Callable[[list[str], str], None] = lambda incs, why: None  # set by frontend
        # Ends the cancelled ones among these here, returns them: set by the AsyncEngine in front
        # (AsyncEngine.confirm_cancels).
        self.confirm_cancels: Callable[[list[str] | None], list[str]] = lambda incs: []
        self.catch_up: Missed = lambda: []  # AsyncEngine.missed: what a restarted replica must get
        self.bounds = liveness or Bounds()
        self._watcher: asyncio.Task | None = None
        self._on_batch: Callable[[Batch], None] | None = None
        self._pullers: list[asyncio.Task] = []
        self._started_ray = False
        self._node: str | None = None
        self._pidfds: dict[int, int] = {}  # replica -> pidfd of its process (same node only)
        self._closing = False
        # LoRA adapters every replica serves: name -> (path, load id), in load order.
        self.loras: dict[str, tuple[str, int]] = {}
        self._load_ids = itertools.count(1)
        self._lora_lock = asyncio.Lock()

    # ---- start ----------------------------------------------------------------------------
    async def start(self, on_batch: Callable[[Batch], None],
                    on_dead: Callable[[str], None]) -> CoreInfo:
        import ray

        from stopline.tokenizer.tokenizer import Tokenizer

        self._on_batch = on_batch
        if not ray.is_initialized():
            kwargs = dict(address=self.address, include_dashboard=False, log_to_driver=False)
            if self.address is None:
                kwargs["num_cpus"] = max(2, int(self.n * self.num_cpus))
            await asyncio.to_thread(ray.init, **(kwargs | self.ray_init))
            self._started_ray = True
        cls = actor_class(self.num_cpus)
        self.slots = [ReplicaSlot(i, cls.remote(self.model, self.config, self.threads))
                      for i in range(self.n)]
        infos = await asyncio.gather(*(s.actor.info.remote() for s in self.slots))
        self._node = ray.get_runtime_context().get_node_id()
        for slot in self.slots:
            await self._healthy(slot)
        info: CoreInfo = infos[0]
        self.router.block_size = info.block_size
        self.tokenizer = Tokenizer.from_state(info.tokenizer_state)
        self._pullers = [asyncio.create_task(self._pull(s), name=f"stopline-replica-{s.index}")
                         for s in self.slots]
        self._watcher = asyncio.create_task(self._watch(), name="stopline-replica-beats")
        log.info("%d replicas ready (pids %s)", self.n, [s.pid for s in self.slots])
        return info

    # ---- requests -------------------------------------------------------------------------
    def healthy(self) -> list[int]:
        return [s.index for s in self.slots if s.state is ReplicaState.HEALTHY]

    async def add(self, request_id: str, incarnation: str, prompt_token_ids: list[int],
                  params: SamplingParams, arrival: float) -> None:
        from ray.exceptions import RayActorError

        try:
            r = self.router.choose(prompt_token_ids, self.healthy(), self.owners.load)
        except NoReplica as exc:
            raise EngineUnavailable(str(exc)) from None
        self.owners.dispatch(incarnation, r)
        self.samples[incarnation] = params.n
        try:
            # The replica answers at once unless it is stuck: the add waits no longer than it
            # takes to mark that.
            refused = await asyncio.wait_for(
                self._call(self.slots[r].actor.add, request_id, incarnation, prompt_token_ids,
                           params, arrival), self.bounds.stuck_s)
        except TimeoutError:
            self._forget(incarnation)
            self._send(r, "abort", [incarnation], AbortSource.CANCEL, time.monotonic())
            raise EngineUnavailable(f"replica {r} did not answer the add within "
                                    f"{self.bounds.stuck_s:g} s") from None
        except asyncio.CancelledError:
            # The caller is gone while the add was in flight: the replica may admit it anyway,
            # so an abort follows (Ray keeps it behind the add); its terminal output finds no
            # stream and is dropped.
            self._forget(incarnation)
            self._send(r, "abort", [incarnation], AbortSource.DISCONNECT, time.monotonic())
            raise
        except RayActorError:
            self._forget(incarnation)
            raise EngineDead(f"replica {r} died while admitting the request") from None
        if refused is not None:
            self._forget(incarnation)
            raise InvalidRequest(refused)
        if incarnation in self.owners.live:
            held = self.owners.admitted(incarnation)
            if held is not None:
                self._send(r, "abort", [incarnation], held[0], held[1])

    def abort(self, incarnations: list[str], source: AbortSource, t0: float) -> list[str]:
        """Returns those on a stuck replica: the front end ends them itself."""
        here: list[str] = []
        for r, incs in self.owners.route_aborts(incarnations, source, t0).items():
            self._send(r, "abort", incs, source, t0)
            if self.slots[r].state is ReplicaState.STUCK:
                here += incs
        for inc in here:
            self._forget(inc)
        return here

    def pause(self, incarnations: list[str], paused: bool) -> None:
        for r, incs in self.owners.running(incarnations).items():
            self._send(r, "pause", incs, paused)

    def _send(self, r: int, method: str, *args: Any) -> None:
        slot = self.slots[r]
        if slot.serving:  # a stuck one gets it when it comes back
            # Fire and forget, numbered: Ray may run an async actor's calls out of order, and a
            # pause overtaken by its resume would hold a request paused for good.
            slot.sent += 1
            slot.actor.deliver.remote(slot.sent, method, *args)

    async def utility(self, method: Utility, *args: Any) -> list[Any]:
        """Runs on every healthy replica; their results in replica order. A LoRA load or
        unload keeps every replica alike (`_lora`)."""
        if method in (Utility.LOAD_LORA, Utility.UNLOAD_LORA):
            async with self._lora_lock:
                return await self._lora(method, *args)
        return await self._on(self.healthy(), method, *args)

    async def _on(self, replicas: list[int], method: Utility, *args: Any) -> list[Any]:
        calls = asyncio.gather(*(self._call(self.slots[r].actor.utility, method, *args)
                                 for r in replicas))
        # A utility waits for a step boundary: a replica that gives none for twice the stuck
        # bound is stuck anyway.
        return list(await asyncio.wait_for(calls, 2 * self.bounds.stuck_s))

    async def _lora(self, method: Utility, name: str, *args: Any) -> list[Any]:
        """Every replica serves the same adapters: a load refused by one is undone on the
        others; an unload refused (409) by one is undone (loaded again, same id) on those
        that unloaded it; 503 while a replica is stuck. A dead one loads the table
        (`loras`) when it rejoins (`_rejoin`)."""
        stuck = [s for s in self.slots if s.state is ReplicaState.STUCK]
        if stuck:  # it would miss the call and serve on without it once it answers again
            return [{"status": 503, "message": f"replica {stuck[0].index} is stuck ({stuck[0].last_error}): "
                                               "LoRA adapters load and unload once it answers again"}]
        live = self.healthy()
        if not live:
            return [{"status": 503, "message": "no replica is serving"}]
        if method is Utility.LOAD_LORA:
            load_id = next(self._load_ids)
            got = await self._on(live, method, name, args[0], load_id)
            done = [r for r, g in zip(live, got, strict=True) if g["status"] == 200]
            if len(done) == len(live):
                self.loras[name] = (args[0], load_id)
            elif done:  # no request selects it yet: the server lists it only once all loaded
                await self._on(done, Utility.UNLOAD_LORA, name, "abort")
            return got
        got = await self._on(live, method, name, *args)
        done = [r for r, g in zip(live, got, strict=True) if g["status"] == 200]
        if len(done) == len(live) or not done:
            if done:
                self.loras.pop(name, None)
            return got
        if name in self.loras:  # refused by some (in use): the others serve it again
            path, load_id = self.loras[name]
            await self._on(done, Utility.LOAD_LORA, name, path, load_id)
        return got

    @staticmethod
    async def _call(method: Any, *args: Any) -> Any:
        return await method.remote(*args)

    def _forget(self, incarnation: str) -> None:
        self.owners.end(incarnation)
        self.samples.pop(incarnation, None)

    # ---- from the replicas ----------------------------------------------------------------
    async def _pull(self, slot: ReplicaSlot) -> None:
        from ray.exceptions import RayActorError

        while not self._closing:
            try:
                batches = await slot.actor.pull.remote()
            except RayActorError as exc:
                if self._closing:
                    return
                if slot.serving:  # the pidfd watch may have seen it first
                    self._lost(slot, f"replica {slot.index} died: {type(exc).__name__}")
                await self._rejoin(slot)
                continue
            for batch in batches:
                self._deliver(slot, batch)

    def _deliver(self, slot: ReplicaSlot, batch: Batch) -> None:
        if batch.snapshot is not None:
            slot.snapshot = batch.snapshot
        for out in batch.outputs:
            if out.finished and out.incarnation in self.samples:
                self.samples[out.incarnation] -= 1
                if self.samples[out.incarnation] <= 0:
                    self._forget(out.incarnation)
        assert self._on_batch is not None
        self._on_batch(batch)

    async def _healthy(self, slot: ReplicaSlot) -> None:
        slot.pid, node = await slot.actor.where.remote()
        slot.watch = Watch(f"replica {slot.index}", self.bounds)
        slot.beat = None
        slot.sent = 0  # a new process numbers from 1
        slot.state = ReplicaState.HEALTHY
        self._unwatch(slot)
        if node == self._node and hasattr(os, "pidfd_open"):
            # Same machine: the kernel says at once when the process exits; Ray's own notice
            # (the pending pull failing) can take about a second.
            with contextlib.suppress(OSError):
                fd = self._pidfds[slot.index] = os.pidfd_open(slot.pid)
                asyncio.get_running_loop().add_reader(fd, self._exited, slot)

    def _unwatch(self, slot: ReplicaSlot) -> None:
        fd = self._pidfds.pop(slot.index, None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def _exited(self, slot: ReplicaSlot) -> None:
        self._unwatch(slot)
        if slot.serving and not self._closing:
            self._lost(slot, f"replica {slot.index} died: its process {slot.pid} exited")

    def _lost(self, slot: ReplicaSlot, why: str) -> None:
        slot.state = ReplicaState.DEAD
        slot.deaths += 1
        slot.last_error = why
        incs = self.owners.owned_by(slot.index)
        for inc in incs:
            self._forget(inc)
        log.error("%s; ending its %d open requests (not retried)", why, len(incs))
        self.on_lost(incs, why)

    # ---- liveness -------------------------------------------------------------------------
    async def _watch(self) -> None:
        while not self._closing:
            t = time.monotonic()
            await asyncio.sleep(self.bounds.beat_s)
            if time.monotonic() - t > 2 * self.bounds.beat_s:
                continue  # our own loop was held up: answers may be waiting unread, judge later
            for slot in self.slots:
                if slot.serving and slot.watch is not None:
                    self._tick(slot, slot.watch)

    def _tick(self, slot: ReplicaSlot, watch: Watch) -> None:
        if slot.beat is None or slot.beat.done():  # one heartbeat in flight at a time
            beat = slot.beat = asyncio.ensure_future(self._call(slot.actor.beat))

            def answered(f: asyncio.Future) -> None:
                if not f.cancelled() and f.exception() is None:
                    watch.answer(f.result())

            beat.add_done_callback(answered)
        was = watch.stuck
        why = watch.check()
        if why is not None and watch.overdue():
            self._kill(slot, why)
        elif why is not None and was is None:
            slot.state = ReplicaState.STUCK
            slot.last_error = why
            ended = self.confirm_cancels(self.owners.owned_by(slot.index))
            for inc in ended:
                self._forget(inc)
            log.error("%s: the router skips it; %d cancels confirmed here; killed if still stuck "
                      "after %g s", why, len(ended), self.bounds.kill_s)
        elif why is None and was is not None:
            slot.state = ReplicaState.HEALTHY
            log.warning("replica %d answers again (it was stuck: %s)", slot.index, was)

    def _kill(self, slot: ReplicaSlot, why: str) -> None:
        import ray

        pid, here = slot.pid, slot.index in self._pidfds
        self._lost(slot, f"{why}: killed (stuck past {self.bounds.kill_s:g} s)")
        # Ray restarts it (max_restarts): its pending pull fails and _pull waits for it to rejoin.
        if here and pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # a stopped process cannot act on Ray's kill request
        else:
            ray.kill(slot.actor, no_restart=False)

    async def _rejoin(self, slot: ReplicaSlot) -> None:
        from ray.exceptions import RayActorError

        while not self._closing:
            await asyncio.sleep(REJOIN_POLL)
            try:
                await slot.actor.info.remote()
                # The adapters, pause, sleep or weight update it missed while dead, before it serves.
                await self._load_adapters(slot)
                await catch_up(self.catch_up, lambda m, *a: self._call(slot.actor.utility, m, *a))
                slot.snapshot = Snapshot()
                await self._healthy(slot)
            except RayActorError:
                continue
            except RuntimeError as exc:  # the state it missed could not be applied: not yet
                log.error("replica %d is back but did not catch up: %s; asking again", slot.index, exc)
                continue
            log.info("replica %d rejoined (pid %d)", slot.index, slot.pid)
            return

    async def _load_adapters(self, slot: ReplicaSlot) -> None:
        """A restarted replica: the adapters the others serve, in their order, with their ids
        (one it already has, from an earlier try, is kept)."""
        async with self._lora_lock:
            for name, (path, load_id) in self.loras.items():
                got = await self._call(slot.actor.utility, Utility.LOAD_LORA, name, path, load_id)
                if got["status"] != 200 and "already loaded" not in got["message"]:
                    raise RuntimeError(f"load_lora {name!r}: {got['message']}")

    # ---- views ----------------------------------------------------------------------------
    def health(self) -> list[dict[str, Any]]:
        return [{"replica": s.index, "state": s.state.value, "pid": s.pid, "deaths": s.deaths,
                 "open": self.owners.load(s.index), "last_error": s.last_error}
                for s in self.slots]

    def snapshots(self) -> dict[str, Snapshot]:
        return {str(s.index): s.snapshot for s in self.slots}

    # ---- stop -----------------------------------------------------------------------------
    async def close(self) -> None:
        self._closing = True
        if self._watcher is not None:
            self._watcher.cancel()
        if not self.slots and not self._started_ray:
            return  # start never reached Ray (or Ray is not installed): nothing to stop
        import ray

        for slot in self.slots:
            self._unwatch(slot)
        for t in self._pullers:
            t.cancel()
        for s in self.slots:
            s.state = ReplicaState.CLOSED
            try:
                await asyncio.wait_for(s.actor.stop.remote(), 10.0)
            except Exception:  # noqa: BLE001 - a dead or wedged replica: kill below
                pass
            ray.kill(s.actor, no_restart=True)
        if self._started_ray:
            await asyncio.to_thread(ray.shutdown)


