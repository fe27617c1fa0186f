"""The compile service: grammars compile off the step thread, once per grammar, with a
deadline, and stop when nobody waits for them any more.

- Shared: requests whose grammar text is the same (the key is its SHA-256) subscribe to one
  compile; each gets its own matcher, a copy of the compiled one. Compiled grammars stay in
  an LRU cache, so a schema sent again never compiles again.
- Deadline: a subscriber not served within `deadline_s` of subscribing gets a clear error.
  A compile that itself ran past the deadline marks its grammar as timed out.
- Remembered failures: a grammar that failed or timed out is refused at once next time.
- Stoppable: the last subscriber leaving drops a compile still queued and kills one that is
  running. llguidance's compile can't be interrupted inside the engine's process (one Rust
  call, limits checked late), so it runs first in a child process (probe.py) that can be
  killed; only a grammar that compiled there in time is built again here.
- Nothing runs on the caller's thread: `subscribe` and `poll` never wait.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import llguidance

from stopline.grammar.matcher import Matcher, short
from stopline.grammar.probe import STOPPED, Probe
from stopline.grammar.vocab import GrammarVocab

DEFAULT_DEADLINE_S = 5.0


def grammar_key(grammar: str) -> str:
    return hashlib.sha256(grammar.encode("utf-8")).hexdigest()


class GrammarError(Exception):
    """The grammar can't be used: invalid, over a limit, or too slow to compile."""


@dataclass
class Compiled:
    """A compiled grammar; each request gets its own matcher from it."""

    key: str
    base: llguidance.LLMatcher
    vocab: GrammarVocab
    seconds: float

    def matcher(self) -> Matcher:
        return Matcher(self.base.deep_copy(), self.vocab)


@dataclass(eq=False)
class _Entry:
    key: str
    grammar: str
    future: Future | None = None
    subscribers: int = 0
    started: float | None = None  # when the compile itself began (its deadline counts from here)
    done: bool = False
    error: str | None = None  # a failure not the grammar's own (not remembered)


@dataclass(eq=False)
class Ticket:
    """One subscriber's claim on a compile."""

    key: str
    deadline: float  # time.monotonic() by which it must be served
    _result: Compiled | GrammarError | None = field(default=None, repr=False)
    _entry: _Entry | None = field(default=None, repr=False)  # the compile it waits on


class CompileService:
    def __init__(self, vocab: GrammarVocab | Callable[[], GrammarVocab], *,
                 deadline_s: float = DEFAULT_DEADLINE_S, limits: dict[str, Any] | None = None,
                 probe: bool = True, cache_size: int = 64,
                 on_done: Callable[[], None] | None = None) -> None:
        """vocab: the vocabulary, or a function that builds it (~1 s for SmolLM2), called on
        the compile thread so that nobody waits for it but the first compile."""
        if not deadline_s > 0:
            raise ValueError(f"grammar compile deadline must be > 0 seconds, got {deadline_s!r}")
        self._make_vocab = vocab
        self.vocab: GrammarVocab | None = vocab if isinstance(vocab, GrammarVocab) else None
        self.deadline_s = deadline_s
        self.limits = dict(limits or {})  # llguidance.LLParserLimits keywords
        self.on_done = on_done  # called on the compile thread when a compile ends (wakes the engine)
        # One compile thread: compiles queue behind each other (each is short, and a slow one
        # is cut off at its deadline), so a grammar storm can't take the engine's cores.
        self._pool = ThreadPoolExecutor(1, "stopline-grammar")
        self._use_probe = probe
        self._probe: Probe | None = None
        self._start_error: str | None = None
        self._warm_at: float | None = None  # when grammar support had started
        # The vocabulary and the probe's tokenizer build while the engine starts, on the
        # compile thread (the only one that touches the probe).
        self._warm = self._pool.submit(self._start)
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}  # compiles queued or running
        self._ok: OrderedDict[str, Compiled] = OrderedDict()
        self._failed: OrderedDict[str, str] = OrderedDict()
        self._cache_size = cache_size
        self.compiles = 0  # compiles begun
        self.stopped = 0  # compiles killed: nobody waited any more, or past the deadline
        self.compile_seconds: list[float] = []

    # ---- callers (the engine thread) ----------------------------------------------------
    def subscribe(self, grammar: str) -> Ticket:
        key = grammar_key(grammar)
        t = Ticket(key, time.monotonic() + self.deadline_s)
        with self._lock:
            if key in self._ok:
                self._ok.move_to_end(key)
                t._result = self._ok[key]
                return t
            if key in self._failed:
                t._result = GrammarError(self._failed[key])
                return t
            e = self._entries.get(key)
            if e is None:
                e = self._entries[key] = _Entry(key, grammar)
                e.future = self._pool.submit(self._compile, e)
            e.subscribers += 1
            t._entry = e
        return t

    def poll(self, t: Ticket) -> Compiled | GrammarError | None:
        """The compiled grammar, the reason it can't be had, or None (not yet)."""
        if t._result is not None or t._entry is None:
            return t._result
        e = t._entry
        with self._lock:
            if t.key in self._ok:
                t._result = self._ok[t.key]
            elif t.key in self._failed:
                t._result = GrammarError(self._failed[t.key])
            elif e.done and e.error is not None:
                t._result = GrammarError(e.error)
            elif time.monotonic() >= t.deadline and self._warm_at is not None:
                # The deadline is the compile's: time spent starting grammar support (the
                # vocabulary and the probe, once per engine) does not count against it.
                if t.deadline < self._warm_at + self.deadline_s:
                    t.deadline = self._warm_at + self.deadline_s
                else:
                    t._result = GrammarError(self._timeout_message())
        if t._result is not None:
            self._leave(t)
        return t._result

    def unsubscribe(self, t: Ticket) -> None:
        """The subscriber is gone (cancelled, failed elsewhere). Idempotent."""
        self._leave(t)

    def pending(self) -> int:
        """Compiles queued or running (0 when idle: nothing leaks)."""
        with self._lock:
            return len(self._entries)

    def wait_warm(self, timeout: float | None = None) -> None:
        """Block until the compile process is up (tests, benchmarks)."""
        if self._warm is not None:
            self._warm.result(timeout)

    def close(self) -> None:
        with self._lock:
            for e in self._entries.values():
                e.subscribers = 0  # a running compile sees nobody waits, and stops
                if e.future is not None:
                    e.future.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._probe is not None:
            self._probe.close()

    # ---- internals ----------------------------------------------------------------------
    def _start(self) -> None:
        try:
            if self.vocab is None:
                self.vocab = self._make_vocab()  # type: ignore[operator]
            if self._use_probe:
                v = self.vocab
                self._probe = Probe(v.source, v.n_vocab, list(v.eos_ids), self.limits)
                why = self._probe.wait_ready(lambda: False)
                if why is not None:
                    self._start_error = why
        except Exception as exc:  # noqa: BLE001 - every compile reports it instead
            self._start_error = f"grammar support failed to start: {exc!r}"
        self._warm_at = time.monotonic()

    def _timeout_message(self) -> str:
        return f"the grammar did not compile within {self.deadline_s:g} s"

    def _leave(self, t: Ticket) -> None:
        with self._lock:
            e, t._entry = t._entry, None
            if e is None:
                return
            e.subscribers -= 1
            if e.subscribers <= 0 and e.future is not None and e.future.cancel():
                # Never started: nothing ran, nothing to remember.
                if self._entries.get(e.key) is e:
                    del self._entries[e.key]

    def _remember_failure(self, key: str, message: str) -> None:
        self._failed[key] = message
        self._failed.move_to_end(key)
        while len(self._failed) > 4 * self._cache_size:
            self._failed.popitem(last=False)

    def _late(self, e: _Entry) -> bool:
        return e.started is not None and time.monotonic() - e.started >= self.deadline_s

    def _end(self, e: _Entry, *, failure: str | None = None, remember: bool = True,
             compiled: Compiled | None = None, abandoned: bool = False) -> None:
        with self._lock:
            if abandoned and e.subscribers > 0:
                # Someone subscribed after the stop was decided: start over for them.
                e.started = None
                e.future = self._pool.submit(self._compile, e)
                return
            e.done = True
            if self._entries.get(e.key) is e:
                del self._entries[e.key]
            if compiled is not None:
                self._ok[e.key] = compiled
                while len(self._ok) > self._cache_size:
                    self._ok.popitem(last=False)
            elif failure is not None and remember:
                self._remember_failure(e.key, failure)
            elif failure is not None:
                e.error = failure
        if self.on_done is not None:
            self.on_done()

    def _compile(self, e: _Entry) -> None:
        def nobody() -> bool:
            return e.subscribers <= 0

        if self._start_error is not None or self.vocab is None:
            self._end(e, failure=self._start_error or "grammar support did not start", remember=False)
            return
        if self._probe is not None:
            why = self._probe.wait_ready(nobody)
            if why == STOPPED:
                self._end(e, abandoned=True)
                return
            if why is not None:
                self._end(e, failure=why, remember=False)
                return
        with self._lock:
            e.started = time.monotonic()
            self.compiles += 1
        if self._probe is not None:
            err, seconds = self._probe.check(e.grammar, lambda: nobody() or self._late(e))
            if err == STOPPED:
                with self._lock:
                    self.stopped += 1
                if self._late(e):
                    self._end(e, failure=self._timeout_message())
                else:
                    self._end(e, abandoned=True)
                return
            if err is not None:
                self._end(e, failure=f"invalid grammar: {short(err)}")
                return
            if nobody():
                self._end(e, abandoned=True)
                return
        t0 = time.monotonic()
        try:
            m = llguidance.LLMatcher(self.vocab.ll, e.grammar, log_level=0,
                                     limits=llguidance.LLParserLimits(**self.limits))
            err = m.get_error() if m.is_error() else None
        except Exception as exc:  # the binding raises on misuse only; report it the same way
            m, err = None, f"{type(exc).__name__}: {exc}"
        seconds = time.monotonic() - t0
        with self._lock:
            self.compile_seconds.append(seconds)
        if err is not None:
            self._end(e, failure=f"invalid grammar: {short(err)}")
        elif self._late(e):
            self._end(e, failure=self._timeout_message())
        else:
            self._end(e, compiled=Compiled(e.key, m, self.vocab, seconds))


__all__ = ["Compiled", "CompileService", "GrammarError", "Ticket", "grammar_key"]
