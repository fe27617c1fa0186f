"""AsyncEngine: the asyncio face of an engine core, for the HTTP server and async callers.

The core runs elsewhere — a thread of this process (`LocalCore`, the in-process mode) or its
own process behind ZMQ (`ProcCore` in transport.py) — and this class keeps the per-request
streams: outputs of each step are dispatched to them on the event loop, every admitted
request gets exactly one terminal output per sample, and if the core dies every open stream
ends with `EngineDead` at once.

`abort()` is immediate (it returns after handing the abort to the core, without waiting);
`abort_and_wait()` is the confirmed form: it returns when every request it aborted has ended.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from stopline.engine.core_loop import CoreLoop
from stopline.engine.messages import AbortTiming, Batch, CoreInfo
from stopline.engine.output import RequestOutput
from stopline.engine.snapshot import Snapshot
from stopline.engine.streams import (
    EngineDead,
    EngineOverloaded,
    EngineUnavailable,
    RequestStream,
)
from stopline.request import AbortSource, FinishReason, InvalidRequest, SamplingParams, Usage

if TYPE_CHECKING:
    from stopline.config import EngineConfig
    from stopline.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("stopline.async_engine")

__all__ = ["AsyncEngine", "CoreBackend", "EngineDead", "EngineObserver", "EngineOverloaded",
           "EngineUnavailable", "LocalCore", "RequestStream"]


class CoreBackend(Protocol):
    """Where the engine core runs. All methods are called on the event loop thread."""

    tokenizer: Tokenizer | None

    async def start(self, on_batch: Callable[[Batch], None],
                    on_dead: Callable[[str], None]) -> CoreInfo: ...

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  arrival: float) -> None: ...  # raises InvalidRequest if the core refuses

    def abort(self, request_ids: list[str], source: AbortSource, t0: float) -> None: ...

    async def utility(self, method: str) -> Any: ...

    async def close(self) -> None: ...


class EngineObserver:
    """Hooks for metrics; called on the event loop thread. The default does nothing."""

    def on_first_token(self, seconds: float) -> None: ...
    def on_token_gap(self, seconds: float) -> None: ...
    def on_sample_end(self, reason: str, usage: Usage | None) -> None: ...
    def on_request_end(self, prompt_tokens: int) -> None: ...
    def on_abort_timing(self, timing: AbortTiming) -> None: ...


class AsyncEngine:
    def __init__(self, backend: CoreBackend, *, max_waiting: int | None = None,
                 observer: EngineObserver | None = None, remember_finished: int = 10_000) -> None:
        self.backend = backend
        self.max_waiting = max_waiting
        self.observer = observer or EngineObserver()
        self.state = "starting"  # starting | ready | draining | dead | closed
        self.dead_reason: str | None = None
        self.info: CoreInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self.snapshot = Snapshot()
        self.on_dead: list[Callable[[str], None]] = []
        self._streams: dict[str, RequestStream] = {}
        # Recently ended ids -> finish reasons, so that cancelling one answers "finished"
        # instead of "unknown" (bounded: an old id eventually becomes unknown).
        self._finished: OrderedDict[str, list[str | None]] = OrderedDict()
        self._remember = remember_finished

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def in_process(cls, model: str | None = None, config: EngineConfig | None = None, *,
                   progress: bool = True, **kwargs: Any) -> AsyncEngine:
        """The core steps in a thread of this process."""
        return cls(LocalCore(model, config, progress=progress), **kwargs)

    @classmethod
    def in_subprocess(cls, model: str | None = None, config: EngineConfig | None = None, *,
                      progress: bool = True, core_threads: int | None = None,
                      **kwargs: Any) -> AsyncEngine:
        """The core runs in its own process and talks ZMQ. core_threads: torch threads there
        (None: all CPUs but one when there are more than two)."""
        from stopline.engine.proc.transport import ProcCore

        return cls(ProcCore(model, config, progress=progress, threads=core_threads), **kwargs)

    async def start(self) -> CoreInfo:
        """Load the model and start the core; returns when requests can be admitted."""
        try:
            self.info = await self.backend.start(self._on_batch, self._on_dead)
        except BaseException as exc:
            if self.state == "starting":
                self._on_dead(f"engine core failed to start: {exc}")
            raise
        self.tokenizer = self.backend.tokenizer
        if self.state == "starting":
            self.state = "ready"
        return self.info

    # ---- state ----------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def num_open(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests admitted here that have not produced any output yet (queued or in their
        first prefill)."""
        return sum(1 for s in self._streams.values() if not s.started)

    def open_ids(self) -> list[str]:
        return list(self._streams)

    def status(self, request_id: str) -> str | list[str | None] | None:
        """'open', the finish reasons of a recently ended request, or None if unknown."""
        if request_id in self._streams:
            return "open"
        return self._finished.get(request_id)

    # ---- requests -------------------------------------------------------------------------
    async def add(self, request_id: str, prompt_token_ids: Sequence[int],
                  params: SamplingParams | None = None, *, arrival: float | None = None) -> RequestStream:
        """Admit a request and return its stream. Raises InvalidRequest (400),
        EngineOverloaded (429) or EngineUnavailable (503); nothing is queued then."""
        if self.state != "ready":
            raise EngineUnavailable(self.unavailable_why())
        params = params or SamplingParams()
        params.validate()
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise EngineOverloaded(f"{self.num_waiting} requests are waiting for their first step "
                                   f"(limit {self.max_waiting})")
        arrival = time.monotonic() if arrival is None else arrival
        prompt = list(prompt_token_ids)
        stream = RequestStream(request_id, params.n, len(prompt), arrival)
        # Registered before the core sees it: its outputs can't arrive before its stream exists.
        self._streams[request_id] = stream
        try:
            await self.backend.add(request_id, prompt, params, arrival)
        except BaseException:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not stream.done.done():
                stream.done.set_result(None)
            raise
        return stream

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; leaving the loop early aborts it."""
        stream = await self.add(request_id, prompt_token_ids, params)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id, AbortSource.CANCEL)

    def abort(self, request_ids: str | Iterable[str], source: AbortSource = AbortSource.CANCEL,
              t0: float | None = None) -> list[str]:
        """Abort now, without waiting; returns the ids that were open. From this call on, the
        streams hand out no token; each still gets its terminal output."""
        t0 = time.monotonic() if t0 is None else t0
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        open_ids = [rid for rid in dict.fromkeys(ids) if rid in self._streams]
        for rid in open_ids:
            self._streams[rid].cancel(source)
        if open_ids and self.state not in ("dead", "closed"):
            self.backend.abort(open_ids, source, t0)
        return open_ids

    async def abort_and_wait(self, request_ids: Iterable[str] | None = None,
                             source: AbortSource = AbortSource.CANCEL,
                             timeout: float | None = 30.0) -> dict[str, list[str | None]]:
        """Abort the given requests (all open ones if None) and return when every one of them
        has ended: id -> finish reason per sample ('abort', or what it ended with first)."""
        t0 = time.monotonic()
        ids = list(self._streams) if request_ids is None else list(request_ids)
        streams = {rid: self._streams[rid] for rid in dict.fromkeys(ids) if rid in self._streams}
        self.abort(list(streams), source, t0)
        if streams:
            waits = [asyncio.shield(s.done) for s in streams.values()]
            await asyncio.wait_for(asyncio.gather(*waits), timeout)
        return {rid: [r.value if r else None for r in s.finish_reasons] for rid, s in streams.items()}

    async def utility(self, method: str) -> Any:
        """Run a core utility ('snapshot', 'audit', 'reset_prefix_cache') between steps."""
        if self.state in ("starting", "dead", "closed"):
            raise EngineUnavailable(self.unavailable_why())
        return await self.backend.utility(method)

    # ---- stopping -------------------------------------------------------------------------
    async def drain(self, timeout: float) -> int:
        """Stop admitting, let open requests finish for up to `timeout` seconds, then abort the
        rest (source: shutdown) and wait for their terminal outputs. Returns how many were
        aborted."""
        if self.state in ("starting", "ready"):
            self.state = "draining"
        pending = [s.done for s in self._streams.values()]
        if pending and timeout > 0:
            await asyncio.wait(pending, timeout=timeout)
        left = list(self._streams)
        if left and self.state not in ("dead", "closed"):
            log.info("drain timeout: aborting %d open requests", len(left))
            try:
                await self.abort_and_wait(left, AbortSource.SHUTDOWN, timeout=10.0)
            except TimeoutError:
                log.error("%d requests did not end after the shutdown abort", len(self._streams))
        return len(left)

    async def close(self) -> None:
        """Stop the core. Streams still open end with EngineDead."""
        if self.state == "closed":
            return
        self.state = "closed"
        for s in list(self._streams.values()):
            self._fail(s, EngineDead("the engine was shut down"))
        await self.backend.close()  # also after a death: sockets and threads must go

    def unavailable_why(self) -> str:
        if self.state == "starting":
            return "the model is still loading"
        if self.state == "draining":
            return "the server is shutting down"
        if self.state == "dead":
            return f"the engine core is dead: {self.dead_reason}"
        return "the engine is closed"

    # ---- from the core ----------------------------------------------------------------------
    def _on_batch(self, batch: Batch) -> None:
        if batch.snapshot is not None:
            self.snapshot = batch.snapshot
        now = time.monotonic()
        obs = self.observer
        for out in batch.outputs:
            s = self._streams.get(out.request_id)
            if s is None:
                continue  # its stream already ended (engine declared dead meanwhile)
            if out.new_token_ids:
                last = s.last_token_at[out.index]
                if last is None:
                    obs.on_first_token(now - s.arrival)
                else:
                    obs.on_token_gap((now - last) / len(out.new_token_ids))
                s.last_token_at[out.index] = now
            if s.push(out):
                reason = out.finish_reason.value if out.finish_reason else FinishReason.ERROR.value
                obs.on_sample_end(reason, out.usage)
                if s.finished:
                    self._ended(s)
        for timing in batch.timings:
            obs.on_abort_timing(timing)

    def _ended(self, s: RequestStream) -> None:
        if self._streams.get(s.request_id) is s:
            del self._streams[s.request_id]
        self._finished[s.request_id] = [r.value if r else None for r in s.finish_reasons]
        while len(self._finished) > self._remember:
            self._finished.popitem(last=False)
        self.observer.on_request_end(s.prompt_tokens)

    def _fail(self, s: RequestStream, exc: BaseException) -> None:
        for i in sorted(s.open_samples):
            s.finish_reasons[i] = FinishReason.ERROR
            self.observer.on_sample_end(FinishReason.ERROR.value, None)
        s.fail(exc)
        self._ended(s)

    def _on_dead(self, reason: str) -> None:
        if self.state in ("dead", "closed"):
            return
        log.error("engine core died: %s", reason)
        self.state = "dead"
        self.dead_reason = reason
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

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  arrival: float) -> None:
        assert self.loop is not None
        self.loop.add(request_id, prompt_token_ids, params, arrival)

    def abort(self, request_ids: list[str], source: AbortSource, t0: float) -> None:
        assert self.loop is not None
        self.loop.abort(request_ids, source, t0)

    async def utility(self, method: str) -> Any:
        assert self.loop is not None
        return await asyncio.wrap_future(self.loop.call(method))

    async def close(self) -> None:
        if self.loop is not None:
            self.loop.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
