"""AsyncEngine: the asyncio face of an engine core, for the HTTP server and async callers.

The core runs elsewhere — a thread of this process (`LocalCore`, the in-process mode) or its
own process behind ZMQ (`ProcCore` in transport.py) — and this class keeps the per-request
streams: outputs of each step are dispatched to them on the event loop, every admitted
request gets exactly one terminal output per sample, and if the core dies every open stream
ends with `EngineDead` at once.

Every admitted request has an incarnation (`RequestStream.incarnation`, unique: minted here
unless the caller gives one); aborts and outputs name incarnations, so a late abort can
never reach a newer request that reuses a caller's id. `abort()` is immediate (it returns
after handing the abort to the core, without waiting); `abort_and_wait()` is the confirmed
form: it returns when every request it aborted has ended.

Backpressure: a stream whose consumer does not read buffers at most `max_buffered` outputs;
then its request is paused in the core (it keeps its place and takes no step) until the
consumer has read half of them. A consumer that reads nothing for `stall_timeout` seconds
while its stream is full is treated as gone: its request is aborted with source `stalled`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from stopline.config import Choice
from stopline.engine.core_loop import CoreLoop
from stopline.engine.messages import AbortTiming, Batch, CoreInfo, Utility
from stopline.engine.output import RequestOutput
from stopline.engine.snapshot import Snapshot
from stopline.engine.streams import (
    EngineDead,
    EngineOverloaded,
    EngineStopped,
    EngineUnavailable,
    RequestStream,
)
from stopline.request import AbortSource, FinishReason, InvalidRequest, SamplingParams, Usage

if TYPE_CHECKING:
    from stopline.config import EngineConfig
    from stopline.engine.liveness import Bounds
    from stopline.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("stopline.async_engine")

__all__ = ["Admission", "AsyncEngine", "CoreBackend", "EngineDead", "PauseMode", "EngineState", "EngineObserver", "EngineOverloaded",
           "EngineUnavailable", "LocalCore", "RequestStream"]


class PauseMode(Choice):
    """What an engine-wide pause does with the requests in flight (docs/engine-stops.md)."""

    ABORT = "abort"  # end them now, as engine-initiated errors
    KEEP = "keep"  # hold them in place: no step runs, KV kept, streams stay open
    WAIT = "wait"  # let them finish


class Admission(Choice):
    """What a request that arrives while the engine is paused or asleep gets."""

    QUEUE = "queue"  # it waits for the resume (at most its queue timeout, then 503)
    REJECT = "reject"  # 503 with Retry-After at once


class EngineState(Choice):
    STARTING = "starting"  # the model is loading
    READY = "ready"
    DRAINING = "draining"  # shutting down: no new requests, open ones may finish
    DEAD = "dead"  # the core died; every stream ended with EngineDead
    CLOSED = "closed"


class CoreBackend(Protocol):
    """Where the engine core runs. All methods are called on the event loop thread."""

    tokenizer: Tokenizer | None

    async def start(self, on_batch: Callable[[Batch], None],
                    on_dead: Callable[[str], None]) -> CoreInfo: ...

    async def add(self, request_id: str, incarnation: str, prompt_token_ids: list[int],
                  params: SamplingParams, arrival: float) -> None: ...  # InvalidRequest if refused

    def abort(self, incarnations: list[str], source: AbortSource, t0: float) -> list[str] | None:
        """Returns those the front end must end itself (their process is stuck), or None."""

    def pause(self, incarnations: list[str], paused: bool) -> None: ...

    async def utility(self, method: Utility, *args: Any) -> Any: ...

    async def close(self) -> None: ...


class EngineObserver:
    """Hooks for metrics; called on the event loop thread. The default does nothing."""

    def on_first_token(self, seconds: float) -> None: ...
    def on_token_gap(self, seconds: float) -> None: ...
    def on_tokens(self, n: int) -> None: ...
    def on_sample_end(self, reason: str, usage: Usage | None) -> None: ...
    def on_request_end(self, prompt_tokens: int) -> None: ...
    def on_abort_timing(self, timing: AbortTiming) -> None: ...
    def on_aborted(self, source: str) -> None: ...  # a sample's terminal 'abort', by source


class AsyncEngine:
    def __init__(self, backend: CoreBackend, *, max_waiting: int | None = None,
                 observer: EngineObserver | None = None, remember_finished: int = 10_000,
                 max_buffered: int = 64, stall_timeout: float = 60.0,
                 paused_admission: Admission | str = Admission.QUEUE) -> None:
        if max_buffered < 2:
            raise ValueError(f"max_buffered must be >= 2, got {max_buffered}")
        if not stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0 seconds, got {stall_timeout}")
        self.backend = backend
        self.max_waiting = max_waiting
        self.max_buffered = max_buffered
        self.stall_timeout = stall_timeout
        self.observer = observer or EngineObserver()
        self.state = EngineState.STARTING
        self.dead_reason: str | None = None
        self.info: CoreInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self.snapshot = Snapshot()
        self.on_dead: list[Callable[[str], None]] = []
        self._streams: dict[str, RequestStream] = {}
        # Open streams and recently ended incarnations -> finish reasons, so that cancelling
        # one answers "finished" instead of "unknown" (bounded: an old one becomes unknown).
        self._finished: OrderedDict[str, list[str | None]] = OrderedDict()
        self._remember = remember_finished
        self._incarnations = itertools.count()
        # Engine-wide stops (docs/engine-stops.md): these are the front end's, not a request's.
        self.admission = Admission(paused_admission)
        self.paused: PauseMode | None = None
        self.asleep = 0  # sleep level
        self.weight_version = 0
        self.weights_path: str | None = None  # of the last update (None: the weights it started with)
        # A keep update recomputes the in-flight requests' KV under the new weights
        # (--update-recompute; a body's `recompute` decides for its update).
        self.update_recompute = False
        self._halted = False  # the core runs no step (pause mode keep)
        self._resumed = asyncio.Event()  # set while admitting: held adds wait on it
        self._resumed.set()
        self._control = asyncio.Lock()  # one pause, resume, sleep, wake or update at a time
        if hasattr(backend, "confirm_cancels"):  # it watches processes that can get stuck
            backend.confirm_cancels = self.confirm_cancels
        if hasattr(backend, "catch_up"):  # it restarts parts: they get the state they missed
            backend.catch_up = self.missed

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def in_process(cls, model: str | None = None, config: EngineConfig | None = None, *,
                   progress: bool = True, **kwargs: Any) -> AsyncEngine:
        """The core steps in a thread of this process."""
        return cls(LocalCore(model, config, progress=progress), **kwargs)

    @classmethod
    def in_subprocess(cls, model: str | None = None, config: EngineConfig | None = None, *,
                      progress: bool = True, core_threads: int | None = None,
                      liveness: Bounds | None = None, **kwargs: Any) -> AsyncEngine:
        """The core runs in its own process and talks ZMQ. core_threads: torch threads there
        (None: all CPUs but one when there are more than two). liveness: when the process is
        stuck and when it is killed (engine/liveness.py)."""
        from stopline.engine.proc.transport import ProcCore

        return cls(ProcCore(model, config, progress=progress, threads=core_threads,
                            liveness=liveness), **kwargs)

    async def start(self) -> CoreInfo:
        """Load the model and start the core; returns when requests can be admitted."""
        try:
            self.info = await self.backend.start(self._on_batch, self._on_dead)
        except BaseException as exc:
            if self.state is EngineState.STARTING:
                self._on_dead(f"engine core failed to start: {exc}")
            raise
        self.tokenizer = self.backend.tokenizer
        if self.state is EngineState.STARTING:
            self.state = EngineState.READY
        return self.info

    # ---- state ----------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def num_open(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests admitted here that have not produced any output yet (queued or in their
        first prefill)."""
        return sum(1 for s in self._streams.values() if not s.started)

    def open_ids(self) -> list[str]:
        """Incarnations of the open streams."""
        return list(self._streams)

    def status(self, incarnation: str) -> str | list[str | None] | None:
        """'open', the finish reasons of a recently ended request, or None if unknown."""
        if incarnation in self._streams:
            return "open"
        return self._finished.get(incarnation)

    # ---- requests -------------------------------------------------------------------------
    async def add(self, request_id: str, prompt_token_ids: Sequence[int],
                  params: SamplingParams | None = None, *, arrival: float | None = None,
                  incarnation: str | None = None) -> RequestStream:
        """Admit a request and return its stream (`stream.incarnation` names it from now on).
        Raises InvalidRequest (400), EngineOverloaded (429) or EngineUnavailable (503);
        nothing is queued then."""
        if self.state is not EngineState.READY:
            raise EngineUnavailable(self.unavailable_why())
        params = params or SamplingParams()
        params.validate()
        if self.held:
            await self._held(params)
        inc = incarnation if incarnation is not None else f"{request_id}#{next(self._incarnations)}"
        if inc in self._streams:
            raise InvalidRequest(f"incarnation {inc!r} is already in use")
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise EngineOverloaded(f"{self.num_waiting} requests are waiting for their first step "
                                   f"(limit {self.max_waiting})")
        arrival = time.monotonic() if arrival is None else arrival
        prompt = list(prompt_token_ids)
        stream = RequestStream(request_id, params.n, len(prompt), arrival, incarnation=inc,
                               max_buffered=self.max_buffered, on_full=self._on_full)
        # Registered before the core sees it: its outputs can't arrive before its stream exists.
        self._streams[inc] = stream
        try:
            await self.backend.add(request_id, inc, prompt, params, arrival)
        except BaseException:
            if self._streams.get(inc) is stream:
                del self._streams[inc]
            if not stream.done.done():
                stream.done.set_result(None)
            raise
        return stream

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams | None = None, *,
                       incarnation: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; leaving the loop early aborts it."""
        stream = await self.add(request_id, prompt_token_ids, params, incarnation=incarnation)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort([stream.incarnation], AbortSource.CANCEL, time.monotonic())

    def abort(self, incarnations: list[str], source: AbortSource, t0: float) -> list[str]:
        """Abort now, without waiting (t0: time.monotonic() when the abort was asked); returns
        the incarnations that were open. From this call on, the streams hand out no token;
        each still gets its terminal output."""
        open_incs = [i for i in dict.fromkeys(incarnations) if i in self._streams]
        for inc in open_incs:
            self._streams[inc].cancel(source)
        if open_incs and self.state not in (EngineState.DEAD, EngineState.CLOSED):
            stuck = self.backend.abort(open_incs, source, t0)
            if stuck:
                self._end_here(stuck, source)
        return open_incs

    def confirm_cancels(self, incarnations: Iterable[str] | None = None) -> list[str]:
        """The process running these requests became stuck: end those already cancelled here
        (their abort went to it before it was marked) now. Returns them. None: every open one."""
        incs = list(self._streams) if incarnations is None else incarnations
        cancelled = [i for i in incs if i in self._streams and self._streams[i].cancelled is not None]
        for inc in cancelled:
            source = self._streams[inc].cancelled
            assert source is not None
            self._end_here([inc], source)
        return cancelled

    def _end_here(self, incarnations: list[str], source: AbortSource) -> None:
        """Confirm these aborts without the core's word: the process that runs them is stuck
        (engine/liveness.py). The abort still went to it; when it comes back it applies it
        and frees their KV, and its late terminal outputs find no stream here (dropped)."""
        outs = []
        for inc in incarnations:
            s = self._streams.get(inc)
            if s is None:
                continue
            s.cancel(source)
            outs += [RequestOutput(s.request_id, i, inc, finished=True, finish_reason=FinishReason.ABORT,
                                   stop_detail=f"{source.value} (confirmed by the front end: the "
                                               "engine process is stuck)",
                                   usage=Usage(s.prompt_tokens, s.delivered[i]))
                     for i in sorted(s.open_samples)]
        self._on_batch(Batch(outs))

    async def abort_and_wait(self, incarnations: Iterable[str] | None = None,
                             source: AbortSource = AbortSource.CANCEL,
                             timeout: float | None = 30.0) -> dict[str, list[str | None]]:
        """Abort the given requests (all open ones if None) and return when every one of them
        has ended: incarnation -> finish reason per sample ('abort', or what it ended with)."""
        t0 = time.monotonic()
        incs = list(self._streams) if incarnations is None else list(incarnations)
        streams = {i: self._streams[i] for i in dict.fromkeys(incs) if i in self._streams}
        self.abort(list(streams), source, t0)
        if streams:
            waits = [asyncio.shield(s.done) for s in streams.values()]
            await asyncio.wait_for(asyncio.gather(*waits), timeout)
        return {rid: [r.value if r else None for r in s.finish_reasons] for rid, s in streams.items()}

    def fail(self, incarnations: Iterable[str], reason: str, source: AbortSource | None = None) -> int:
        """End these open streams while the engine lives on. source None: EngineDead(reason)
        (the one core died, --restart-core); an engine-initiated source (REPLICA: the Ray
        replica or P/D role running them died): EngineStopped(source, reason), an
        engine-initiated end (503 / SSE error event naming it), counted by source in the
        aborted-sequences metric. Returns how many were open."""
        streams = [self._streams[i] for i in incarnations if i in self._streams]
        for s in streams:
            if source is None:
                self._fail(s, EngineDead(reason))
                continue
            s.cancel(source)
            for _ in s.open_samples:
                self.observer.on_aborted(source.value)
            self._fail(s, EngineStopped(source, reason))
        return len(streams)

    async def utility(self, method: Utility | str, *args: Any) -> Any:
        """Run a core utility (snapshot, audit, reset_prefix_cache, LoRA load/unload) between
        steps."""
        method = Utility(method)
        if self.state in (EngineState.STARTING, EngineState.DEAD, EngineState.CLOSED):
            raise EngineUnavailable(self.unavailable_why())
        return await self.backend.utility(method, *args)

    # ---- engine-wide stops (docs/engine-stops.md) ---------------------------------------
    @property
    def held(self) -> bool:
        """Paused or asleep: new requests are not admitted (they wait or get 503)."""
        return self.paused is not None or self.asleep > 0

    async def _held(self, params: SamplingParams) -> None:
        if self.admission is Admission.REJECT:
            raise EngineUnavailable(self.unavailable_why())
        end = None if params.queue_timeout is None else time.monotonic() + params.queue_timeout
        # Never a hang: at most the queue timeout, and a drain or death wakes it. A loop: a
        # pause that came right after the resume holds it again.
        while self.held and self.state is EngineState.READY:
            try:
                await asyncio.wait_for(self._resumed.wait(),
                                       None if end is None else max(0.0, end - time.monotonic()))
            except TimeoutError:
                raise EngineUnavailable(f"{self.unavailable_why()}; the request waited its queue "
                                        f"timeout ({params.queue_timeout} s)") from None
        if self.state is not EngineState.READY:
            raise EngineUnavailable(self.unavailable_why())

    def unreached(self) -> list[str]:
        """Replicas or roles an engine-wide stop cannot reach now (dead, stuck, restarting)."""
        health = getattr(self.backend, "health", None)
        if health is None or not (hasattr(self.backend, "slots") or hasattr(self.backend, "split")):
            return []
        return [str(p.get("role", f"replica {p.get('replica', p.get('index', '?'))}"))
                for p in health() if p.get("state") != "healthy"]

    async def _all(self, method: Utility, args: dict[str, Any] | None = None) -> list[Any]:
        """A utility on every part of the engine (each replica, each role): their results."""
        if self.state is not EngineState.READY:
            raise EngineUnavailable(self.unavailable_why())
        got = await self.backend.utility(method, *([args] if args is not None else []))
        return got if isinstance(got, list) else [got]

    def missed(self) -> list[tuple[Utility, dict[str, Any] | None]]:
        """The utility calls that bring a freshly (re)started replica or role to the
        engine-wide state (messages.catch_up): the current weights and their version, then
        sleep, then the halt of a pause in mode keep. A pause in another mode needs none:
        admission is held here."""
        calls: list[tuple[Utility, dict[str, Any] | None]] = []
        if self.weights_path is not None:
            calls += [(Utility.STAGE_WEIGHTS, {"path": self.weights_path}),
                      (Utility.COMMIT_WEIGHTS, {"version": self.weight_version})]
        if self.asleep:
            calls.append((Utility.SLEEP, {"level": self.asleep}))
        if self._halted:
            calls.append((Utility.HALT, {"on": True}))
        return calls

    async def _halt(self, on: bool) -> None:
        # Off is always sent (idempotent in the core): a halt whose caller was cancelled
        # may have reached the core without this flag knowing it.
        if self._halted != on or not on:
            self._halted = on
            await self._all(Utility.HALT, {"on": on})

    async def _pause(self, mode: PauseMode, source: AbortSource, timeout: float | None) -> int:
        """Stop admitting, then apply `mode` to the open requests; returns how many ended
        by it (mode abort)."""
        self._resumed.clear()
        self.paused = mode
        if mode is PauseMode.KEEP:
            await self._halt(True)
            return 0
        await self._halt(False)  # a held request must be able to finish or end
        if mode is PauseMode.ABORT:
            return len(await self.abort_and_wait(None, source, timeout=timeout or 30.0))
        pending = [s.done for s in self._streams.values()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        return 0

    def _resume_admission(self) -> None:
        self.paused = None
        self._resumed.set()

    async def pause(self, mode: PauseMode | str = PauseMode.KEEP, timeout: float | None = None) -> dict:
        """Engine-wide pause (idempotent). abort: end every open request (an error for its
        client); keep: run no step, keep their KV and streams; wait: let them finish (up to
        `timeout`). In every mode nothing new is admitted until resume()."""
        mode = PauseMode(mode)
        async with self._control:
            t0 = time.monotonic()
            aborted = await self._pause(mode, AbortSource.PAUSE, timeout)
            return {"paused": mode.value, "aborted": aborted, "open": self.num_open,
                    "seconds": round(time.monotonic() - t0, 4), "unreached": self.unreached()}

    async def resume(self) -> dict:
        """Undo pause() (idempotent). Asleep: ValueError (wake_up resumes)."""
        async with self._control:
            if self.asleep:
                raise ValueError(f"the engine is asleep (level {self.asleep}): POST /wake_up")
            t0 = time.monotonic()
            await self._halt(False)
            self._resume_admission()
            return {"paused": None, "open": self.num_open, "seconds": round(time.monotonic() - t0, 4),
                    "unreached": self.unreached()}

    async def sleep(self, level: int = 1, mode: PauseMode | str = PauseMode.ABORT,
                    timeout: float | None = None) -> dict:
        """Pause by `mode` (abort or wait: the KV of kept requests would be lost), then free
        the KV pool and prefix cache (level 2: the weights too). Idempotent."""
        mode = PauseMode(mode)
        if level not in (1, 2):
            raise ValueError(f"level: must be 1 or 2, got {level}")
        if mode is PauseMode.KEEP:
            raise ValueError("mode: sleep frees the KV of the requests in flight; use abort or wait")
        async with self._control:
            t0 = time.monotonic()
            aborted = 0 if self.asleep else await self._pause(mode, AbortSource.SLEEP, timeout)
            if self.num_open:
                raise TimeoutError(f"{self.num_open} requests did not finish; the engine is "
                                   "paused (mode wait), not asleep")
            freed = sum(await self._all(Utility.SLEEP, {"level": level})) if self.asleep < level else 0
            self.asleep = max(self.asleep, level)
            return {"asleep": self.asleep, "aborted": aborted, "freed_bytes": freed,
                    "seconds": round(time.monotonic() - t0, 4), "unreached": self.unreached()}

    async def wake_up(self) -> dict:
        """Allocate what sleep freed and admit again (idempotent)."""
        async with self._control:
            t0 = time.monotonic()
            if self.asleep:
                await self._all(Utility.WAKE)
                self.asleep = 0
            await self._halt(False)
            self._resume_admission()
            return {"asleep": 0, "seconds": round(time.monotonic() - t0, 4), "unreached": self.unreached()}

    async def update_weights(self, path: str, mode: PauseMode | str = PauseMode.KEEP,
                             timeout: float | None = None, recompute: bool | None = None) -> dict:
        """Serve the weights at `path` (same architecture): they are loaded and checked first
        (ValueError naming a mismatch: nothing changed), then the open requests are paused by
        `mode`, the weights swapped between steps, and the engine resumes unless it was
        paused before. Every later output carries the new weight version. recompute (None:
        `update_recompute`): the requests still in flight at the swap are preempted by
        recompute, their KV computed again under the new weights before their next token."""
        mode = PauseMode(mode)
        recompute = self.update_recompute if recompute is None else recompute
        async with self._control:
            if self.asleep:
                raise ValueError(f"the engine is asleep (level {self.asleep}): POST /wake_up first")
            t0 = time.monotonic()
            staged = await self._all(Utility.STAGE_WEIGHTS, {"path": path})
            bad = [s["error"] for s in staged if isinstance(s, dict) and "error" in s]
            if bad:
                await self._all(Utility.DROP_STAGED)
                raise ValueError(bad[0])
            was_paused = self.paused
            aborted = await self._pause(mode, AbortSource.UPDATE, timeout)
            try:
                self.weight_version = max(await self._all(Utility.COMMIT_WEIGHTS,
                                                          {"recompute": True} if recompute else None))
                self.weights_path = path
            finally:
                if was_paused is None:
                    await self._halt(False)
                    self._resume_admission()
            return {"weight_version": self.weight_version, "path": path, "mode": mode.value,
                    "recompute": recompute, "aborted": aborted, "seconds": round(time.monotonic() - t0, 4),
                    "unreached": self.unreached()}

    # ---- stopping -------------------------------------------------------------------------
    async def drain(self, timeout: float) -> int:
        """Stop admitting, let open requests finish for up to `timeout` seconds, then abort the
        rest (source: shutdown) and wait for their terminal outputs. Returns how many were
        aborted."""
        if self.state in (EngineState.STARTING, EngineState.READY):
            self.state = EngineState.DRAINING
        self._resumed.set()  # requests held by a pause see the drain and get 503
        pending = [s.done for s in self._streams.values()]
        if pending and timeout > 0:
            await asyncio.wait(pending, timeout=timeout)
        left = list(self._streams)
        if left and self.state not in (EngineState.DEAD, EngineState.CLOSED):
            log.info("drain timeout: aborting %d open requests", len(left))
            try:
                await self.abort_and_wait(left, AbortSource.SHUTDOWN, timeout=10.0)
            except TimeoutError:
                log.error("%d requests did not end after the shutdown abort", len(self._streams))
        return len(left)

    async def close(self) -> None:
        """Stop the core. Streams still open end with EngineDead."""
        if self.state is EngineState.CLOSED:
            return
        self.state = EngineState.CLOSED
        self._resumed.set()
        for s in list(self._streams.values()):
            self._fail(s, EngineDead("the engine was shut down"))
        await self.backend.close()  # also after a death: sockets and threads must go

    def unavailable_why(self) -> str:
        if self.state is EngineState.READY and self.asleep:
            return f"the engine is asleep (level {self.asleep}) until POST /wake_up"
        if self.state is EngineState.READY and self.paused is not None:
            return f"the engine is paused (mode {self.paused.value}) until POST /resume"
        if self.state is EngineState.STARTING:
            return "the model is still loading"
        if self.state is EngineState.DRAINING:
            return "the server is shutting down"
        if self.state is EngineState.DEAD:
            return f"the engine core is dead: {self.dead_reason}"
        return "the engine is closed"

    # ---- from the core ----------------------------------------------------------------------
    def _on_batch(self, batch: Batch) -> None:
        if batch.snapshot is not None:
            self.snapshot = batch.snapshot
        now = time.monotonic()
        obs = self.observer
        for out in batch.outputs:
            s = self._streams.get(out.incarnation)
            if s is None:
                continue  # its stream already ended (engine declared dead meanwhile)
            if out.new_token_ids:
                obs.on_tokens(len(out.new_token_ids))
                last = s.last_token_at[out.index]
                if last is None:
                    obs.on_first_token(now - s.arrival)
                else:
                    obs.on_token_gap((now - last) / len(out.new_token_ids))
                s.last_token_at[out.index] = now
            if s.push(out):
                reason = out.finish_reason.value if out.finish_reason else FinishReason.ERROR.value
                obs.on_sample_end(reason, out.usage)
                if out.finish_reason is FinishReason.ABORT:
                    obs.on_aborted(s.cancelled.value if s.cancelled else AbortSource.CANCEL.value)
                if s.finished:
                    self._ended(s)
        for timing in batch.timings:
            obs.on_abort_timing(timing)

    def _ended(self, s: RequestStream) -> None:
        if self._streams.get(s.incarnation) is s:
            del self._streams[s.incarnation]
        self._finished[s.incarnation] = [r.value if r else None for r in s.finish_reasons]
        while len(self._finished) > self._remember:
            self._finished.popitem(last=False)
        self.observer.on_request_end(s.prompt_tokens)

    def _on_full(self, s: RequestStream, full: bool) -> None:
        """A stream filled up (pause its request, start the stall clock) or drained."""
        if self._streams.get(s.incarnation) is not s or self.state in (EngineState.DEAD, EngineState.CLOSED):
            return
        try:
            self.backend.pause([s.incarnation], full)
        except EngineDead:
            return
        if full:
            asyncio.get_running_loop().call_later(self.stall_timeout, self._check_stall, s)

    def _check_stall(self, s: RequestStream) -> None:
        if self._streams.get(s.incarnation) is not s or not s.full:
            return
        idle = time.monotonic() - s.last_read
        if idle >= self.stall_timeout:
            log.info("request %s: its client read nothing for %.0f s; aborting", s.incarnation, idle)
            self.abort([s.incarnation], AbortSource.STALLED, time.monotonic())
        else:
            asyncio.get_running_loop().call_later(self.stall_timeout - idle, self._check_stall, s)

    def _fail(self, s: RequestStream, exc: BaseException) -> None:
        for i in sorted(s.open_samples):
            s.finish_reasons[i] = FinishReason.ERROR
            self.observer.on_sample_end(FinishReason.ERROR.value, None)
        s.fail(exc)
        self._ended(s)

    def _on_dead(self, reason: str) -> None:
        if self.state in (EngineState.DEAD, EngineState.CLOSED):
            return
        log.error("engine core died: %s", reason)
        self.state = EngineState.DEAD
        self.dead_reason = reason
        self._resumed.set()
        for s in list(self._streams.values()):
            self._fail(s, EngineDead(reason))
        for cb in self.on_dead:
            cb(reason)


class LocalCore:
    """In-process mode: the core steps in a daemon thread of this process."""

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, *,
                 progress: bool = True) -> None:
        self.model = model
        self.config = config
        self.progress = progress
        self.tokenizer: Tokenizer | None = None
        self.loop: CoreLoop | None = None
        self._thread: threading.Thread | None = None

    async def start(self, on_batch: Callable[[Batch], None],
                    on_dead: Callable[[str], None]) -> CoreInfo:
        from stopline.engine.core import EngineCore  # torch: only when a core is made here

        aloop = asyncio.get_running_loop()
        core = await asyncio.to_thread(EngineCore, self.model, self.config, progress=self.progress)
        self.tokenizer = core.tokenizer

        def emit(batch: Batch) -> None:
            try:
                aloop.call_soon_threadsafe(on_batch, batch)
            except RuntimeError:
                pass  # the event loop is closed: nobody is listening any more

        self.loop = CoreLoop(core, emit)
        self._thread = threading.Thread(target=self._run, args=(aloop, on_dead),
                                        name="stopline-core", daemon=True)
        self._thread.start()
        return self.loop.info(with_tokenizer=False)

    def _run(self, aloop: asyncio.AbstractEventLoop, on_dead: Callable[[str], None]) -> None:
        assert self.loop is not None
        try:
            self.loop.run()
        except BaseException as exc:  # noqa: BLE001 - any failure ends the core; clients must know
            log.exception("engine core loop failed")
            try:
                aloop.call_soon_threadsafe(on_dead, f"engine core loop failed: {exc!r}")
            except RuntimeError:
                pass

    async def add(self, request_id: str, incarnation: str, prompt_token_ids: list[int],
                  params: SamplingParams, arrival: float) -> None:
        assert self.loop is not None  # start() ran: the engine admits only once ready
        self.loop.add(request_id, prompt_token_ids, params, arrival, incarnation=incarnation)

    def abort(self, incarnations: list[str], source: AbortSource, t0: float) -> None:
        assert self.loop is not None
        self.loop.abort(incarnations, source, t0)

    def pause(self, incarnations: list[str], paused: bool) -> None:
        assert self.loop is not None
        self.loop.pause(incarnations, paused)

    async def utility(self, method: Utility, *args: Any) -> Any:
        assert self.loop is not None
        return await asyncio.wrap_future(self.loop.call(method, *args))

    async def close(self) -> None:
        if self.loop is not None:
            self.loop.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
