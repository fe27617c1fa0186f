"""The grammar holder: each structured request's compile ticket while it waits for its
grammar, then its matcher (one per sample), kept in step with its committed tokens.

Registered first among the holders (lifecycle.py): its state goes before anything else when
a request ends. A cancel while compiling unsubscribes at once (the compile service stops the
compile when nobody else waits for it). Preemption keeps the matcher: recompute and swap
re-create KV state for tokens already committed, and the matcher has consumed exactly those
(`audit` checks consumed == committed after every step in debug mode).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from stopline.grammar import bitmask
from stopline.grammar.compiler import Compiled, CompileService, GrammarError, Ticket
from stopline.grammar.matcher import Matcher, fill_batch
from stopline.grammar.vocab import GrammarVocab, grammar_vocab
from stopline.kv.block_pool import LedgerError
from stopline.request import Family, Request, RequestStatus
from stopline.stats import MASK_BOUNDS, Histogram
from stopline.tokenizer.tokenizer import Tokenizer


class GrammarHolder:
    name = "grammar"

    def __init__(self, tokenizer: Tokenizer, n_vocab: int, *, deadline_s: float,
                 max_rows: int, probe: bool = True) -> None:
        self._tokenizer = tokenizer
        self._n_vocab = n_vocab
        self._deadline_s = deadline_s
        self._probe = probe
        self._svc: CompileService | None = None  # started by the first grammar request
        self._ready = threading.Event()  # a compile ended: a waiting family may go on
        self.waiting: dict[int, tuple[Family, Ticket]] = {}  # leader's internal_id ->
        self.matchers: dict[int, Matcher] = {}  # internal_id -> its matcher
        self._masks = bitmask.allocate(max_rows, n_vocab)
        # Seconds to fill one mask (a step's batched fill over its rows), fixed size.
        self.mask_seconds = Histogram(MASK_BOUNDS)

    @property
    def service(self) -> CompileService:
        if self._svc is None:
            def vocab() -> GrammarVocab:
                return grammar_vocab(self._tokenizer, self._n_vocab)
            self._svc = CompileService(vocab, deadline_s=self._deadline_s, probe=self._probe,
                                       on_done=self._ready.set)
        return self._svc

    # ---- waiting for the compile ------------------------------------------------------------
    def wait(self, fam: Family) -> None:
        """Subscribe a new family to its grammar; its members wait for it."""
        grammar = fam.members[0].params.grammar
        assert grammar is not None
        for m in fam.members:
            m.move_to(RequestStatus.WAITING_FOR_GRAMMAR)
        self.waiting[fam.members[0].internal_id] = (fam, self.service.subscribe(grammar))

    def poll(self, fail: Callable[[Request, str], None]) -> list[Family]:
        """Families whose grammar is ready now (their members hold matchers and are WAITING
        again); members of a family whose grammar failed are handed to `fail`."""
        ready: list[Family] = []
        if not self.waiting:
            return ready
        self._ready.clear()
        svc = self.service
        for key, (fam, ticket) in list(self.waiting.items()):
            got = svc.poll(ticket)
            if got is None:
                continue
            del self.waiting[key]
            live = fam.live()
            if isinstance(got, GrammarError):
                for m in live:
                    fail(m, str(got))
                continue
            assert isinstance(got, Compiled)
            for m in live:
                self.matchers[m.internal_id] = got.matcher()
                m.move_to(RequestStatus.WAITING)
            if live:
                ready.append(fam)
        return ready

    def idle_wait(self, timeout: float) -> None:
        """Nothing else to do: sleep until a compile ends (or timeout)."""
        if self.waiting:
            self._ready.wait(timeout)

    # ---- per step ---------------------------------------------------------------------------
    def masks(self, reqs: Sequence[Request]) -> tuple[dict[int, torch.Tensor], dict[int, str]]:
        """Masks for the sampling rows of reqs (by position in reqs), and the rows whose
        grammar can't advance (position -> why). Safe on the forward's thread: a request
        released meanwhile keeps its matcher object alive here until this returns."""
        out: dict[int, torch.Tensor] = {}
        stuck: dict[int, str] = {}
        # A thinking request's grammar holds its answer only: no mask while it thinks.
        rows = [(i, m) for i, req in enumerate(reqs)
                if (m := self.matchers.get(req.internal_id)) is not None and not req.thinking]
        if not rows:
            return out, stuck
        t0 = time.perf_counter()
        oks = fill_batch([m for _, m in rows], self._masks)
        per = (time.perf_counter() - t0) / len(rows)
        for n, ((i, m), ok) in enumerate(zip(rows, oks, strict=True)):
            self.mask_seconds.observe(per)
            if ok:
                out[i] = self._masks[n]
            else:
                stuck[i] = f"the grammar cannot advance: {m.error or 'no token is allowed next'}"
        return out, stuck

    def commit(self, req: Request, since: int) -> str | None:
        """Consume the answer's tokens committed from output index `since` on (a thinking
        request's thinking and markers are not the grammar's); why one could not be, or None."""
        m = self.matchers.get(req.internal_id)
        if m is None:
            return None
        for token in req.output_token_ids[max(since, req.answer_begin):]:
            if not m.consume(token):
                return f"the grammar refused token {token}: {m.error}"
        return None

    def complete(self, req: Request) -> bool:
        """Nothing but EOS may follow: the answer is whole, the request can finish now."""
        m = self.matchers.get(req.internal_id)
        return m is not None and m.is_stopped() and m.is_accepting()

    # ---- holder -----------------------------------------------------------------------------
    def release(self, req: Request) -> None:
        self.matchers.pop(req.internal_id, None)
        lead = _leader_id(req)
        item = self.waiting.get(lead)
        if item is not None and not item[0].live():
            # Nobody of the family waits any more: the compile stops unless others share it.
            del self.waiting[lead]
            self.service.unsubscribe(item[1])

    def preempt(self, req: Request) -> None:
        """Kept: the matcher has consumed the committed tokens, which preemption keeps."""

    def holds(self, req: Request) -> bool:
        return req.internal_id in self.matchers or req.internal_id in self.waiting

    def audit(self, live: Sequence[Request]) -> None:
        """Every live structured request's matcher has consumed exactly its committed tokens."""
        for req in live:
            m = self.matchers.get(req.internal_id)
            answer = max(0, len(req.output_token_ids) - req.answer_begin)
            if m is not None and m.consumed != answer:
                raise LedgerError(f"{req.incarnation!r}: grammar consumed {m.consumed} tokens, "
                                  f"{answer} committed to the answer")

    def pending_compiles(self) -> int:
        return self._svc.pending() if self._svc is not None else 0

    def close(self) -> None:
        if self._svc is not None:
            self._svc.close()


def _leader_id(req: Request) -> int:
    return req.family.members[0].internal_id if req.family is not None else req.internal_id
