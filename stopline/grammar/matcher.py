"""One request's grammar state: what it has consumed, which tokens it allows next.

A thin wrapper over llguidance's LLMatcher that keeps the count of consumed tokens (the
audit checks it equals the request's committed tokens after every step) and turns the
library's error state into return values the engine acts on in the same step.
"""

from __future__ import annotations

import llguidance
import torch

from stopline.grammar.vocab import GrammarVocab

_ERROR_CHARS = 400  # llguidance's messages may quote the grammar at length


def short(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= _ERROR_CHARS else message[:_ERROR_CHARS] + "..."


class Matcher:
    def __init__(self, ll: llguidance.LLMatcher, vocab: GrammarVocab) -> None:
        self._m = ll
        self.vocab = vocab
        self.consumed = 0  # tokens consumed since the start (rolled-back ones subtracted)

    @property
    def error(self) -> str | None:
        """Why the grammar cannot go on, or None."""
        return short(self._m.get_error()) if self._m.is_error() else None

    def consume(self, token: int) -> bool:
        """Advance by one sampled token. False (and the matcher is in its error state) if the
        grammar does not allow it."""
        ok = self._m.consume_token(int(token))
        if ok:
            self.consumed += 1
        return ok

    def consume_all(self, tokens: list[int]) -> bool:
        """Advance by several tokens (re-feeding after a reset); all or an error state."""
        for t in tokens:
            if not self.consume(t):
                return False
        return True

    def fill(self, out: torch.Tensor) -> bool:
        """Write the next token's mask into `out` (a contiguous int32 row of
        vocab.mask_words). False if no token is allowed: the grammar cannot advance."""
        if out.dtype != torch.int32 or not out.is_contiguous() or out.numel() != self.vocab.mask_words:
            raise ValueError(f"mask row must be {self.vocab.mask_words} contiguous int32 words")
        self._m.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)
        if self._m.is_error():
            return False
        return bool(out.any())

    def check_row(self, out: torch.Tensor) -> bool:
        """After a batched fill (fill_batch) wrote `out`: False if no token is allowed."""
        return not self._m.is_error() and bool(out.any())

    def is_accepting(self) -> bool:
        """The output so far is a complete answer (EOS may come now)."""
        return self._m.is_accepting()

    def is_stopped(self) -> bool:
        """Nothing but EOS may follow: the grammar is complete."""
        return self._m.is_stopped()

    def rollback(self, n: int) -> None:
        """Undo the last n consumed tokens."""
        if not 0 <= n <= self.consumed:
            raise ValueError(f"cannot roll back {n} of {self.consumed} consumed tokens")
        if n and not self._m.rollback(n):
            raise RuntimeError(f"grammar rollback of {n} tokens failed: {self.error}")
        self.consumed -= n

    def reset(self) -> None:
        """Back to the start, as before the first token."""
        self._m.reset()
        self.consumed = 0

    def copy(self) -> Matcher:
        m = Matcher(self._m.deep_copy(), self.vocab)
        m.consumed = self.consumed
        return m


_executor: llguidance.LLExecutor | None = None  # llguidance's own thread pool, made once


def fill_batch(matchers: list[Matcher], out: torch.Tensor) -> list[bool]:
    """Fill out[i] with matchers[i]'s next-token mask in one call (llguidance computes the
    rows in parallel on its own threads; each row depends only on its own matcher, so the
    result is the same as filling them one by one). Per row: False if it cannot advance."""
    global _executor
    if not matchers:
        return []
    words = matchers[0].vocab.mask_words
    if (out.dtype != torch.int32 or not out.is_contiguous() or out.dim() != 2
            or out.shape[1] != words or out.shape[0] < len(matchers)):
        raise ValueError(f"mask buffer must be contiguous int32 [>= {len(matchers)}, {words}]")
    if _executor is None:
        _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(m._m, i) for i, m in enumerate(matchers)],
                                      out.data_ptr(), words * 4, len(matchers))
    return [m.check_row(out[i]) for i, m in enumerate(matchers)]
