"""The thread that steps an EngineCore: in a thread of the API process (in-process mode) or
as the main thread of the engine-core process.

It sleeps on an event while the engine is idle (no polling), steps while there is work, and
after every step emits one `Batch`: the step's outputs, the abort timings that completed,
and a fresh snapshot. Adds and aborts may come from any thread; they go straight into the
core's inbox (EngineCore.add_request / abort are thread-safe), so an abort is accepted at
once even while a long forward runs, and that forward stops early if all of its requests
are aborted.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stopline.engine import memtrace
from stopline.engine.messages import AbortTiming, Batch, CoreInfo, Utility
from stopline.engine.output import RequestOutput
from stopline.engine.snapshot import take_snapshot
from stopline.request import AbortSource, FinishReason, SamplingParams

if TYPE_CHECKING:
    from stopline.engine.core import EngineCore

log = logging.getLogger("stopline.core_loop")


@dataclass
class _AbortClock:
    source: str
    t0: float
    accepted: float
    step_at_accept: int
    quiet: float = 0.0


class CoreLoop:
    # Utility calls (messages.Utility) run on the stepping thread between steps, where the
    # core is consistent.

    def __init__(self, core: EngineCore, emit: Callable[[Batch], None]) -> None:
        self.core = core
        self.emit = emit
        self._work = threading.Event()
        self._stopping = False
        self._lock = threading.Lock()  # orders abort acceptance against step starts
        self._step_no = 0
        self._step_started: float | None = None  # monotonic start of the step running now
        # When the loop last left an idle wait or began an iteration; None while it waits idle
        # (no work, or every request paused). A loop stuck anywhere else (a step, a utility
        # call, a lock) grows the age a heartbeat reports: liveness is progress.
        self._busy_since: float | None = None
        self._pending: dict[str, _AbortClock] = {}  # accepted, not yet seen to end
        self._reclaiming: dict[str, _AbortClock] = {}  # ended, blocks maybe behind the fence
        self._calls: list[tuple[str, tuple, Future]] = []
        self._ended: dict[str, float] = {}  # aborted incarnation -> when its terminal came out
        # Called before each step on the stepping thread (the core process lets its input
        # thread in here: see core_proc.Doorbell).
        self.before_step: Callable[[], None] | None = None
        # With async scheduling the core hands out outputs mid-step (while the next forward
        # runs): send them at once rather than at the end of the step.
        core.output_sink = self._sink
        core.taken_sink = self._taken
        core.wake = self._work.set
        # Engine-wide pause, mode keep (Utility.HALT): no step runs, aborts still apply.
        self.halted = False

    # ---- any thread -----------------------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
            arrival: float | None = None, incarnation: str | None = None) -> str:
        """Returns the incarnation. Raises InvalidRequest (nothing queued) if the core
        refuses the request."""
        inc = self.core.add_request(request_id, prompt_token_ids, params, arrival=arrival,
                                    incarnation=incarnation)
        self._work.set()
        return inc

    def abort(self, incarnations: list[str], source: AbortSource, t0: float) -> None:
        incs = list(incarnations)
        now = time.monotonic()
        with self._lock:
            for inc in incs:
                if inc not in self._pending:
                    self._pending[inc] = _AbortClock(source.value, t0, now, self._step_no)
            self.core.abort(incs, source, t0)
        self._work.set()

    def pause(self, incarnations: Iterable[str], paused: bool) -> None:
        self.core.pause(list(incarnations), paused)
        self._work.set()

    def call(self, method: Utility | str, *args: Any) -> Future:
        """Run a utility method between steps; the future gets its result."""
        fut: Future = Future()
        try:
            method = Utility(method)
        except ValueError:
            fut.set_exception(ValueError(f"unknown utility method {method!r}"))
            return fut
        with self._lock:
            self._calls.append((method, args, fut))
        self._work.set()
        return fut

    def info(self, with_tokenizer: bool = True) -> CoreInfo:
        core = self.core
        return CoreInfo(
            source=core.loaded.source, max_model_len=core.max_model_len,
            vocab_size=core.model_config.vocab_size, num_blocks=core.pool.num_blocks,
            block_size=core.pool.block_size, load_seconds=core.loaded.load_seconds,
            tokenizer_state=core.tokenizer.to_state() if with_tokenizer else {}, pid=os.getpid())

    def step_age(self) -> float:
        """Seconds inside the current iteration of the loop (a step, and the utility calls
        before it), 0 while it waits idle: a heartbeat's answer (a process that has work and
        does not step is stuck, see engine/liveness.py)."""
        started = self._step_started
        if started is None:
            started = self._busy_since
        return 0.0 if started is None else max(time.monotonic() - started, 1e-6)

    def stop(self) -> None:
        self._stopping = True
        self._work.set()

    # ---- the stepping thread --------------------------------------------------------------
    def run(self) -> None:
        """Step until stop(). Exceptions from the core propagate: the caller decides what a
        dead core means for its clients."""
        core = self.core
        self.emit(Batch(snapshot=take_snapshot(core)))
        while not self._stopping:
            self._busy_since = time.monotonic()
            self._run_calls()
            if self.halted or core.residency.asleep:
                # Paused (keep) or asleep: no step; an abort that came in still ends its
                # request now (nothing is in flight, so its blocks go back at once).
                outputs = core.residency.halted_tick()
                if outputs:
                    self._note_ended(outputs)
                    self._send(Batch(outputs, self._timings(), take_snapshot(core)))
                # Held on purpose, not stuck: a heartbeat must not see a step this long (a
                # sleeping standby core would be killed as stuck otherwise).
                self._busy_since = None
                self._work.wait()
                self._work.clear()
                continue
            if not core.has_unfinished():
                self._busy_since = None
                self._work.wait()
                self._work.clear()
                continue
            if core.all_paused():
                # Every request waits for its client to read, or for the other role of a
                # split (whose link wakes us): no step to take. Wake for a message, at the
                # core's own deadline (wake_at), or after a second for request deadlines.
                self._busy_since = None
                self._work.wait(max(0.0, min(1.0, core.wake_at() - time.monotonic())))
                self._work.clear()
                self._busy_since = time.monotonic()
                if (core.all_paused() and not self._deadline_passed()
                        and time.monotonic() < core.wake_at()):
                    continue
            self._step_started = time.monotonic()
            if self.before_step is not None:
                self.before_step()
            with self._lock:
                self._step_no += 1
            outputs = core.step()
            self._step_started = None
            self._note_ended(outputs)
            self._send(Batch(outputs, self._timings(), take_snapshot(core)))
        self._run_calls()

    def _send(self, batch: Batch) -> None:
        # Stamped as they leave: a weight update runs between steps, after the outputs
        # computed before it were flushed (Utility.COMMIT_WEIGHTS).
        for o in batch.outputs:
            o.weight_version = self.core.residency.weight_version
        self.emit(batch)

    def _deadline_passed(self) -> bool:
        now = time.monotonic()
        return any(r.params.deadline is not None and now - r.arrival > r.params.deadline
                   for r in self.core.live_requests())

    def _run_calls(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for method, args, fut in calls:
            if not fut.set_running_or_notify_cancel():
                continue  # its caller gave up (a cancelled await): nobody wants the result
            try:
                fut.set_result(self._utility(method, args))
            except Exception as exc:  # a failing utility call fails only its caller
                fut.set_exception(exc)

    def _utility(self, method: Utility, args: tuple) -> Any:
        core = self.core
        kw: dict[str, Any] = args[0] if args and isinstance(args[0], dict) else {}  # engine stops' args
        if method is Utility.HALT:
            core.flush_text()
            self.halted = core.residency.halted = bool(kw.get("on", True))
            return self.halted
        if method is Utility.SLEEP:
            return core.residency.sleep(int(kw.get("level", 1)))
        if method is Utility.WAKE:
            return core.residency.wake_up()
        if method is Utility.STAGE_WEIGHTS:
            try:
                return core.residency.stage_weights(str(kw["path"]))
            except (ValueError, OSError) as exc:  # the caller's 400, across every transport
                return {"error": str(exc)}
        if method is Utility.COMMIT_WEIGHTS:
            core.flush_text()  # what the old weights computed leaves stamped with their version
            version = core.residency.commit_weights(bool(kw.get("recompute", False)))
            if "version" in kw:  # a restarted part catching up (messages.catch_up)
                version = core.residency.weight_version = int(kw["version"])
            return version
        if method is Utility.DROP_STAGED:
            return core.residency.drop_staged()
        if method is Utility.SNAPSHOT:
            return take_snapshot(self.core)
        if method is Utility.AUDIT:
            self.core.audit()
            return None
        if method is Utility.TRANSFERS:
            return self.core.role.transfers()  # only a split's decode role receives any
        if method is Utility.LOAD_LORA:
            return self.core.residency.load_lora(*args)
        if method is Utility.UNLOAD_LORA:
            return self.core.residency.unload_lora(*args)
        if method is Utility.TRACEMALLOC:
            return memtrace.growth(int(kw.get("top", 15)))
        if method is Utility.LORAS:
            return {n: [a.path, len(self.core.adapters.refs.get(n, ()))]
                    for n, a in self.core.adapters.loaded.items()}
        return self.core.kv_manager.reset_prefix_cache()  # Utility.RESET_PREFIX_CACHE

    def _sink(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._note_ended(outputs)
            self._send(Batch(outputs))

    def _taken(self, incarnations: list[str]) -> None:
        self.emit(Batch(taken=incarnations))

    def _note_ended(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for o in outputs:
            if o.finished and o.finish_reason is FinishReason.ABORT:
                self._ended.setdefault(o.incarnation, now)

    def _timings(self) -> list[AbortTiming]:
        """Close the clocks of aborts that ended a request in this step. An abort accepted
        before this step began and still not ended was for an unknown or finished request:
        it did nothing, so it is not timed."""
        now = time.monotonic()
        ended, self._ended = self._ended, {}
        with self._lock:
            for inc in list(self._pending):
                clock = self._pending[inc]
                if inc in ended:
                    clock.quiet = ended[inc]
                    self._reclaiming[inc] = self._pending.pop(inc)
                elif clock.step_at_accept < self._step_no:
                    del self._pending[inc]
        if not self._reclaiming or self.core.kv_manager.deferred:
            return []  # blocks still behind the fence: measured at a later boundary
        done = [AbortTiming(inc, c.source, c.accepted - c.t0, c.quiet - c.t0, now - c.t0)
                for inc, c in self._reclaiming.items()]
        self._reclaiming.clear()
        return done
