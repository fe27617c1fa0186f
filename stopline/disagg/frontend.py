"""DisaggCores: the engine backend (async_engine.CoreBackend) whose core is two processes,
a prefill role and a decode role (`stopline serve --disagg`).

The AsyncEngine in front keeps every stream, incarnation and the one-terminal rule as in
one process. Here each add goes to the decode role first (it validates the request, as one
engine would, and starts waiting for the KV), then, when the prompt has a full block to
ship, to the prefill role with the prompt cut to those blocks. Every abort goes to both
(an abort of what a role does not hold is a no-op there). The client's stream is the
decode role's outputs; of the prefill role's outputs only an error terminal reaches it
(the stream ends with that error and the decode side's copy is aborted): its other
terminals are the hand-off or an abort the decode side reports as well.

LoRA adapters load and unload on both roles with one load id (a load one role refuses is
undone on the other); the prefill role computes a request's prompt under its adapter.

One role may run on another host (`stopline role`, `serve --disagg --disagg-remote ROLE`):
it is a RemoteCore reached over TCP at `listen` (ports P..P+2), and the link between the
roles uses P+3 (KV, prefill -> decode) and P+4 (acks), all bound by the side beside the
front end, so the remote host needs the front end's address only (remote_spec).

A role that dies ends every stream it still matters to (an engine-initiated end, source
`replica`: docs/engine-stops.md) within the time its process exit
takes to notice (the process sentinel): the decode role, all open ones; the prefill role,
those whose KV the decode side has not taken yet. The survivor's copies are aborted, so
its blocks come back at once. A role that is alive but answers no heartbeat
(engine/liveness.py) is stuck: /health names it (503), new requests get 503 at once, and
while decode is stuck the front end confirms cancels itself; past the kill bound it is
killed, and that is a death as above.

A local role that died is restarted (`Restarts`): a fresh process with the same RoleSpec and
callbacks, after a back-off that doubles with each death in the window; meanwhile /health
names it `restarting` (503) and new requests get 503. Once it is up, loaded the same model
as the survivor and got the engine-wide state it missed (the current weights and version,
sleep, a keep pause: messages.catch_up), it serves again. Past `Restarts.limit` deaths in the window it stays dead
(503). Nothing of the old process can reach the new one's work: incarnations are never
reused, so its stray KV, acks and beats name requests the new process never had. A remote
role is another host's process: it is not restarted from here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from stopline.config import EngineConfig
from stopline.disagg.decode_core import split_blocks
from stopline.disagg.messages import RoleSpec
from stopline.disagg.role import RoleFactory
from stopline.engine.async_engine import AsyncEngine
from stopline.engine.liveness import Bounds, Restarts
from stopline.engine.messages import Batch, CoreInfo, Missed, Utility, catch_up
from stopline.engine.proc.remote import PORTS, RemoteCore, split_host_port
from stopline.engine.proc.transport import ProcCore
from stopline.engine.snapshot import Snapshot
from stopline.engine.streams import EngineDead, EngineStopped, EngineUnavailable
from stopline.request import AbortSource, FinishReason, SamplingParams

log = logging.getLogger("stopline.disagg")

ROLES = ("prefill", "decode")


def link_addresses(listen: str) -> tuple[str, str]:
    """(kv, ack) addresses of the link when one role is remote: ports P+3 and P+4."""
    host, port = split_host_port(listen)
    return f"tcp://{host}:{port + PORTS}", f"tcp://{host}:{port + PORTS + 1}"


def remote_spec(role: str, listen: str, reclaim_s: float) -> RoleSpec:
    """What `stopline role ROLE --front LISTEN` runs: it connects both link sockets."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    kv, ack = link_addresses(listen)
    return RoleSpec(role, kv, ack, reclaim_s, bind_pull=False, bind_push=False)


class DisaggCores:
    def __init__(self, model: str | None, config: EngineConfig | None, *, reclaim_s: float = 3.0,
                 threads: int | None = None, progress: bool = True, remote: str | None = None,
                 listen: str = "127.0.0.1:7100", liveness: Bounds | None = None,
                 restarts: Restarts | None = None) -> None:
        """remote: the role ("prefill" or "decode") that runs elsewhere and connects to
        `listen` (host:port of this host; ports P..P+4); None: both roles here. restarts:
        when a local role that died is started again."""
        if not reclaim_s > 0:
            raise ValueError(f"reclaim deadline must be > 0 s, got {reclaim_s}")
        if remote is not None and remote not in ROLES:
            raise ValueError(f"the remote role must be one of {', '.join(ROLES)}, got {remote!r}")
        cfg = config or EngineConfig()
        self.reclaim_s = reclaim_s
        self.remote = remote
        self.restarts = restarts or Restarts()
        # Two roles on one host share its CPUs: each gets half (one on two cores) rather than
        # both spinning OpenMP threads on every core.
        local_roles = 2 if remote is None else 1
        threads = threads or max(1, len(os.sched_getaffinity(0)) // local_roles)
        # The decode role's received KV enters its prefix cache: it must have one.
        configs = {"prefill": cfg, "decode": dataclasses.replace(cfg, enable_prefix_caching=True)}
        self._dir: str | None = None
        if remote is None:
            # Both roles here: ipc in a private dir. A loopback port picked free and bound
            # later by the role can be taken meanwhile (any client's ephemeral port).
            self._dir = tempfile.mkdtemp(prefix="stopline-link-")
            kv, ack = f"ipc://{self._dir}/kv", f"ipc://{self._dir}/ack"
            specs = {r: RoleSpec(r, kv, ack, reclaim_s) for r in ROLES}
        else:
            kv, ack = link_addresses(listen)
            specs = {r: RoleSpec(r, kv, ack, reclaim_s, bind_pull=True, bind_push=True) for r in ROLES}

        def local(r: str) -> ProcCore:  # the same role again, on each (re)start
            return ProcCore(model, configs[r], progress=progress and r == "decode", threads=threads,
                            make_core=RoleFactory(specs[r]), liveness=liveness, name=f"{r} role")

        self._local = local
        self.cores: dict[str, ProcCore] = {}
        for r in ROLES:
            if r == remote:
                self._put(r, RemoteCore(listen, name=f"{r} role", liveness=liveness))
            else:
                self._put(r, local(r))
        self.infos: dict[str, CoreInfo] = {}
        self._deaths: dict[str, list[float]] = {r: [] for r in ROLES}  # times, within the window
        self._restarting: dict[str, asyncio.Task] = {}
        self._ended: set[ProcCore] = set()  # cores whose death was handled: told once
        self._closed: set[ProcCore] = set()
        self._closing = False
        self.state = {r: "starting" for r in ROLES}
        self.errors: dict[str, str | None] = {r: None for r in ROLES}
        self.snaps = {r: Snapshot() for r in ROLES}
        self.tokenizer = None
        self.block_size = cfg.block_size
        self.samples: dict[str, int] = {}  # open incarnation -> samples not yet ended
        self.split: set[str] = set()  # open incarnations the prefill role works on
        self.taken: set[str] = set()  # split ones whose KV decode took: prefill no longer matters
        # Ends these streams (source REPLICA: their role died, an engine-initiated end; None: an
        # error of the request's own on the prefill side): set below.
        self.on_lost: Callable[[list[str], str, AbortSource | None], None] = lambda incs, why, src: None
        # Ends the cancelled ones among these here, returns them: set by the AsyncEngine in front
        # (AsyncEngine.confirm_cancels).
        self.confirm_cancels: Callable[[list[str] | None], list[str]] = lambda incs: []
        self.catch_up: Missed = lambda: []  # AsyncEngine.missed: what a restarted role must get
        # LoRA adapters loaded on both roles: name -> (path, load id), in load order.
        self.loras: dict[str, tuple[str, int]] = {}
        self._load_ids = itertools.count(1)
        self._lora_lock = asyncio.Lock()

    async def start(self, on_batch: Callable[[Batch], None],
                    on_dead: Callable[[str], None]) -> CoreInfo:
        self._on_batch = on_batch
        infos = await asyncio.gather(*(self._start_core(r, self.cores[r]) for r in ROLES))
        _check_same_model(*infos)
        self.infos = dict(zip(ROLES, infos, strict=True))
        for r in ROLES:
            if self.state[r] == "starting":
                self.state[r] = "healthy"
        self.tokenizer = self.cores["decode"].tokenizer
        return infos[1]

    def _put(self, role: str, core: ProcCore) -> None:
        # Each callback names its core: a late word from a replaced process changes nothing.
        core.on_stuck = lambda why: self._stuck(role, why) if self.cores[role] is core else None
        core.on_back = lambda: self._back(role) if self.cores[role] is core else None
        self.cores[role] = core

    async def _start_core(self, role: str, core: ProcCore) -> CoreInfo:
        handle = self._from_prefill if role == "prefill" else self._from_decode

        def on_batch(batch: Batch) -> None:
            if self.cores[role] is core:
                handle(batch)

        return await core.start(on_batch, lambda why: self._lost(role, why, core))

    # ---- requests -------------------------------------------------------------------------
    def _check_alive(self) -> None:
        dead = [r for r in ROLES if self.state[r] != "healthy"]
        if dead:
            raise EngineUnavailable(f"the {dead[0]} engine is {self.state[dead[0]]}: "
                                    f"{self.errors[dead[0]] or 'not serving'}")

    async def add(self, request_id: str, incarnation: str, prompt_token_ids: list[int],
                  params: SamplingParams, arrival: float) -> None:
        self._check_alive()
        self.samples[incarnation] = params.n
        n = split_blocks(len(prompt_token_ids), self.block_size)
        if n:
            # Split before the first await: an abort that lands while decode's add is in
            # flight must reach prefill too (its inbox keeps an abort that overtakes the add).
            self.split.add(incarnation)
        try:
            # Decode first: it validates, and it waits for the KV before any can be sent.
            await self._add_to("decode", request_id, incarnation, prompt_token_ids, params, arrival)
            # Decode may have ended it meanwhile (its add reply and abort terminal read
            # together): then prefill has nothing to compute.
            if n and incarnation in self.samples:
                await self._add_to("prefill", request_id, incarnation,
                                   prompt_token_ids[:n * self.block_size],
                                   SamplingParams(max_tokens=1, lora=params.lora), arrival)
        except BaseException:
            self._abort_roles([incarnation], AbortSource.CANCEL, time.monotonic())
            self._forget(incarnation)
            raise

    async def _add_to(self, role: str, request_id: str, incarnation: str, prompt: list[int],
                      params: SamplingParams, arrival: float) -> None:
        try:
            await self.cores[role].add(request_id, incarnation, prompt, params, arrival)
        except EngineStopped:
            raise  # the engine's own stop, not a death
        except EngineDead as exc:
            # A death that lands while the add awaits its reply: the client is told which role
            # died, in the words its streams end with (`_lost`).
            raise EngineDead(f"the {role} engine died: {exc}") from None

    def abort(self, incarnations: list[str], source: AbortSource, t0: float) -> list[str]:
        """Returns those the front end ends itself: all, while the decode role (whose outputs
        are the streams) is stuck."""
        here = self._abort_roles(incarnations, source, t0)
        for inc in here:
            self._forget(inc)
        return here

    def _reachable(self, role: str) -> bool:
        # A stuck role still gets its aborts: it applies them when it comes back.
        return self.state[role] in ("healthy", "stuck")

    def _abort_roles(self, incs: list[str], source: AbortSource, t0: float) -> list[str]:
        here: list[str] = []
        if self._reachable("decode"):
            here = self.cores["decode"].abort(incs, source, t0)
        split = [i for i in incs if i in self.split]
        if split and self._reachable("prefill"):
            self.cores["prefill"].abort(split, source, t0)
        return here

    def pause(self, incarnations: list[str], paused: bool) -> None:
        if self._reachable("decode"):  # only the decode role streams to clients
            self.cores["decode"].pause(incarnations, paused)

    async def utility(self, method: Utility, *args: Any) -> Any:
        """Runs on every live role (an audit checks both); their results, prefill first. A
        LoRA load or unload acts on both roles and answers once (`_load`, `_unload`); `loras`
        answers the adapters loaded on either role."""
        if method is Utility.LOAD_LORA:
            return await self._load(*args)
        if method is Utility.UNLOAD_LORA:
            return await self._unload(*args)
        live = [r for r in ROLES if self.state[r] == "healthy"]
        got = list(await asyncio.gather(*(self.cores[r].utility(method, *args) for r in live)))
        if method is Utility.LORAS:  # one with a `wait` unload still draining counts as loaded
            return {n: v for g in got for n, v in g.items()}
        return got

    # ---- LoRA adapters on both roles --------------------------------------------------------
    # Both roles load the same adapters in the same order with the same load id (the frontend's
    # count), so the adapter load a transfer names (wire.TransferHeader.lora) means one thing on
    # both; a restarted role loads them again with the same ids before it serves (_catch_up).
    async def _on(self, roles: Sequence[str], method: Utility, *args: Any) -> list[dict[str, Any]]:
        """The call on these roles at once; a role that failed it (died, stuck) answers 503."""
        got = await asyncio.gather(*(self.cores[r].utility(method, *args) for r in roles),
                                   return_exceptions=True)
        return [g if isinstance(g, dict) else
                {"status": 503, "message": f"the {r} engine did not answer: {g}"}
                for r, g in zip(roles, got, strict=True)]

    def _lora_down(self) -> dict[str, Any] | None:
        """Loads and unloads need both roles serving (a role that is down could not follow):
        503 naming the one that is not, else None."""
        try:
            self._check_alive()
        except EngineUnavailable as exc:
            return {"status": 503, "message": str(exc)}
        return None

    async def _load(self, name: str, path: str) -> dict[str, Any]:
        """Load on both roles; if one refuses, the other's load is undone and the refusal is
        the answer (nothing changed)."""
        async with self._lora_lock:
            if (down := self._lora_down()) is not None:
                return down
            load_id = next(self._load_ids)
            got = await self._on(ROLES, Utility.LOAD_LORA, name, path, load_id)
            bad = [g for g in got if g["status"] != 200]
            if not bad:
                self.loras[name] = (path, load_id)
                return got[1]
            # No request selects it yet: the server lists it only after this.
            await self._on([r for r, g in zip(ROLES, got, strict=True) if g["status"] == 200],
                           Utility.UNLOAD_LORA, name, "abort")
            return bad[0]

    async def _unload(self, name: str, policy: str) -> dict[str, Any]:
        """Unload on both roles with one policy. `refuse` asks decode first (every request of
        the split is on decode from its add to its end): if decode refuses, nothing changes;
        if it unloads, prefill's copies (of requests decode no longer holds) are aborted."""
        async with self._lora_lock:
            if (down := self._lora_down()) is not None:
                return down
            if policy == "refuse":
                [got] = await self._on(["decode"], Utility.UNLOAD_LORA, name, policy)
                if got["status"] == 200:
                    self.loras.pop(name, None)
                    await self._on(["prefill"], Utility.UNLOAD_LORA, name, "abort")
                return got
            pre, dec = await self._on(ROLES, Utility.UNLOAD_LORA, name, policy)
            done = [g for g in (dec, pre) if g["status"] == 200]
            if not done:
                return dec
            self.loras.pop(name, None)  # gone, or going with its last request on each role
            # Decode's answer (its requests are the clients'), pending while either drains.
            return done[0] | {"pending": any(g.get("pending") for g in done)}

    async def _catch_up(self, core: ProcCore) -> None:
        """A restarted role: the adapters loaded now, in their order and with their ids."""
        async with self._lora_lock:
            for name, (path, load_id) in self.loras.items():
                got = await core.utility(Utility.LOAD_LORA, name, path, load_id)
                if got["status"] != 200:
                    raise RuntimeError(f"load_lora {name!r}: {got['message']}")

    def _forget(self, inc: str) -> None:
        self.samples.pop(inc, None)
        self.split.discard(inc)
        self.taken.discard(inc)

    # ---- from the roles -------------------------------------------------------------------
    def _from_decode(self, batch: Batch) -> None:
        if batch.snapshot is not None:
            self.snaps["decode"] = batch.snapshot
        self.taken.update(i for i in batch.taken if i in self.split)
        for out in batch.outputs:
            inc = out.incarnation
            if out.finished and inc in self.samples:
                ended_early = out.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH)
                if ended_early and inc in self.split and self._reachable("prefill"):
                    # An error or abort on decode: the prefill side may still hold the KV.
                    self.cores["prefill"].abort([inc], AbortSource.CANCEL, time.monotonic())
                self.samples[inc] -= 1
                if self.samples[inc] <= 0:
                    self._forget(inc)
        self._on_batch(batch)

    def _from_prefill(self, batch: Batch) -> None:
        if batch.snapshot is not None:
            self.snaps["prefill"] = batch.snapshot
        for out in batch.outputs:
            # Once decode took the KV, prefill's end (a late ack past its deadline) is no
            # error of the request's.
            if (out.finished and out.finish_reason is FinishReason.ERROR and out.incarnation in self.samples
                    and out.incarnation not in self.taken):
                why = f"prefill engine: {out.stop_detail}"
                if self._reachable("decode"):
                    self.cores["decode"].abort([out.incarnation], AbortSource.CANCEL,
                                               time.monotonic())
                self._forget(out.incarnation)
                self.on_lost([out.incarnation], why, None)
        if batch.timings:
            self._on_batch(Batch(timings=batch.timings))

    def _lost(self, role: str, why: str, core: ProcCore) -> None:
        if self._closing or core is not self.cores[role] or core in self._ended:
            return
        self._ended.add(core)
        self.state[role] = "dead"
        self.errors[role] = why
        if role == "decode":
            incs = list(self.samples)
        else:
            incs = [i for i in self.split if i not in self.taken]
        other = "prefill" if role == "decode" else "decode"
        if incs and self._reachable(other):
            self.cores[other].abort(incs, AbortSource.CANCEL, time.monotonic())
        for inc in incs:
            self._forget(inc)
        log.error("the %s engine died: %s; ending its %d open requests", role, why, len(incs))
        self.on_lost(incs, f"the {role} engine died: {why}", AbortSource.REPLICA)
        self._restart_later(role)

    def _restart_later(self, role: str) -> None:
        """Restart a local role after its death, or leave it dead (remote, or past the bound)."""
        if role == self.remote or not self.infos:
            # Another host's process (that host restarts it: `stopline role`), or one that never
            # started: the start fails as a whole.
            return
        deaths = self._deaths[role]
        delay = self.restarts.died(deaths, time.monotonic())
        if delay is None:
            log.error("the %s engine died %d times within %g s (--disagg-restarts %d): it is not "
                      "restarted again; the server answers 503 until it is restarted", role,
                      len(deaths), self.restarts.window_s, self.restarts.limit)
            return
        self.state[role] = "restarting"
        log.warning("restarting the %s engine in %g s (death %d within %g s; it stays dead at %d)",
                    role, delay, len(deaths), self.restarts.window_s, self.restarts.limit)
        self._restarting[role] = asyncio.create_task(self._restart(role, delay),
                                                     name=f"stopline-restart-{role}")

    async def _restart(self, role: str, delay: float) -> None:
        await asyncio.sleep(delay)
        old = self.cores[role]
        self._closed.add(old)
        try:
            await old.close()  # its sockets and ipc dir; the process is gone already
        except Exception:  # noqa: BLE001 - a half-closed dead core must not stop the restart
            log.exception("closing the dead %s engine's core failed", role)
        core = self._local(role)
        self._put(role, core)
        try:
            info = await self._start_core(role, core)
            both = {**self.infos, role: info}
            _check_same_model(both["prefill"], both["decode"])
            # The adapters, pause, sleep or weight update it missed while dead, before it serves.
            await self._catch_up(core)
            await catch_up(self.catch_up, core.utility)
        except ValueError as exc:  # another model or layout now: no point trying again
            log.error("the restarted %s engine does not match: %s; it stays dead", role, exc)
            self._ended.add(core)
            self.state[role], self.errors[role] = "dead", str(exc)
            self._closed.add(core)
            await core.close()
            return
        except Exception as exc:  # noqa: BLE001 - it died while starting: a death like any other
            self._lost(role, f"restart failed: {exc}", core)  # no-op if its sentinel told us first
            return
        self.infos[role] = info
        if role == "decode":
            self.tokenizer = core.tokenizer
        if self.state[role] == "restarting":
            self.state[role] = "healthy"  # its last_error still says why it died
            log.warning("the %s engine is back in process %d", role, core.pid)

    def _stuck(self, role: str, why: str) -> None:
        if self.state[role] == "healthy":
            self.state[role] = "stuck"
            self.errors[role] = why
        if role == "decode":  # the streams' source: cancels sent before this are confirmed now
            for inc in self.confirm_cancels(list(self.samples)):
                self._forget(inc)

    def _back(self, role: str) -> None:
        if self.state[role] == "stuck":
            self.state[role] = "healthy"  # its last_error still says it was stuck

    # ---- views ----------------------------------------------------------------------------
    def health(self) -> list[dict[str, Any]]:
        return [{"role": r, "state": self.state[r], "pid": self.cores[r].pid,
                 "remote": r == self.remote, "last_error": self.errors[r]} for r in ROLES]

    def snapshots(self) -> dict[str, Snapshot]:
        return dict(self.snaps)

    async def close(self) -> None:
        self._closing = True  # no restart from here on
        for task in self._restarting.values():
            task.cancel()
        await asyncio.gather(*self._restarting.values(), return_exceptions=True)
        for r in ROLES:
            if self._reachable(r) or self.state[r] == "restarting":
                self.state[r] = "closed"
        for core in self.cores.values():
            if core.pid is None and core.proc is not None and core.proc.is_alive():
                core.proc.kill()  # a restart still loading: nothing to drain, no clean stop to wait for
        await asyncio.gather(*(c.close() for c in self.cores.values() if c not in self._closed))
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _check_same_model(prefill: CoreInfo, decode: CoreInfo) -> None:
    """KV blocks cross between the roles as they are: the two must agree on the model and
    the block layout (a remote role loads its own copy)."""
    for what in ("block_size", "vocab_size", "max_model_len"):
        a, b = getattr(prefill, what), getattr(decode, what)
        if a != b:
            raise ValueError(f"the prefill and decode roles differ in {what}: {a} vs {b} "
                             f"(give both the same model and engine settings)")
    if prefill.tokenizer_state != decode.tokenizer_state:
        raise ValueError("the prefill and decode roles loaded different tokenizers "
                         f"({prefill.source} vs {decode.source}): give both the same model")


def disagg_engine(model: str | None, config: EngineConfig | None, *, reclaim_s: float = 3.0,
                  threads: int | None = None, progress: bool = True, remote: str | None = None,
                  listen: str = "127.0.0.1:7100", liveness: Bounds | None = None,
                  restarts: Restarts | None = None, **streams: Any) -> AsyncEngine:
    """An AsyncEngine whose core is a prefill process and a decode process (one of them
    possibly on another host: `remote`, connecting to `listen`)."""
    backend = DisaggCores(model, config, reclaim_s=reclaim_s, threads=threads, progress=progress,
                          remote=remote, listen=listen, liveness=liveness, restarts=restarts)
    engine = AsyncEngine(backend, **streams)
    backend.on_lost = lambda incs, why, source: engine.fail(incs, why, source)
    return engine
