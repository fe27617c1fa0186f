"""stopline's tokenizer as llguidance sees it.

llguidance needs every token's bytes, which ids are special and which end a sequence. It
reads them from the tokenizer's own `tokenizer.json` (the Rust `tokenizers` serialization,
which stopline builds from GGUF metadata as well), so no hub file is involved. Building it
walks the whole vocabulary into a token trie (~1 s for SmolLM2's 49,152 tokens on 2 cores),
so it is built once per tokenizer and shared.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import llguidance

from stopline.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True)
class GrammarVocab:
    """The llguidance tokenizer for one model, and the width of the masks it makes."""

    ll: llguidance.LLTokenizer
    n_vocab: int  # mask width in tokens: the model's logit width (may exceed the tokenizer's)
    eos_ids: tuple[int, ...]
    source: str  # the tokenizer.json it was built from (the compile probe builds its own)

    @property
    def mask_words(self) -> int:
        """int32 words of one packed mask (one bit a token)."""
        return (self.n_vocab + 31) // 32


_cache: weakref.WeakKeyDictionary[Tokenizer, dict[int, GrammarVocab]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def grammar_vocab(tokenizer: Tokenizer, n_vocab: int | None = None) -> GrammarVocab:
    """The (cached) GrammarVocab of `tokenizer`. `n_vocab` is the model's logit width; ids
    past the tokenizer's own vocabulary (padding rows) are never allowed by a mask."""
    width = tokenizer.vocab_size if n_vocab is None else int(n_vocab)
    if width < tokenizer.vocab_size:
        raise ValueError(f"n_vocab {width} is smaller than the tokenizer's {tokenizer.vocab_size} tokens")
    with _lock:
        per = _cache.setdefault(tokenizer, {})
        v = per.get(width)
        if v is None:
            eos = list(tokenizer.eos_token_ids)
            source = tokenizer.backend.to_str()
            ll = llguidance.LLTokenizer(source, n_vocab=width, eos_token=eos)
            v = per[width] = GrammarVocab(ll, width, tuple(eos), source)
        return v
