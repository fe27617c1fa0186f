"""Incremental detokenization for streaming: token ids in, text deltas out."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stopline.tokenizer.tokenizer import Tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-char alphabet used by byte-level BPE vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
          *range(ord("\u00ae"), ord("\u00ff") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


CHAR_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, one request at a time.

    Byte-level BPE tokens are byte strings that may cut a multi-byte character (emoji, CJK) at
    any point, even several characters deep; decoding a token alone gives U+FFFD. For those
    vocabularies we keep each token's raw bytes and feed them to an incremental UTF-8 decoder,
    which holds back exactly the bytes of an unfinished character: O(1) per token and the same
    text as a full decode (invalid bytes become U+FFFD the same way).

    Other decoders (SentencePiece-style: "▁" spaces, <0xNN> byte fallback) go the vLLM way: two
    offsets into the ids, decoding only a small window of recent tokens per push and holding
    text back while it ends in U+FFFD. Byte-fallback tokens are single bytes, so an unfinished
    character can hold back at most 3 tokens; after that a U+FFFD is real and is emitted.
    """

    _MAX_HELD = 4
    _CONTEXT = 5  # prompt tokens kept as decode context (leading-space handling)

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._pieces: list[str] = []
        self._text_cache: str | None = ""
        self.num_tokens = 0
        self._utf8: codecs.IncrementalDecoder | None = None
        if tokenizer.is_byte_level:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._skip_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        else:
            self._ids: list[int] = list(prompt_token_ids[-self._CONTEXT:]) if prompt_token_ids else []
            self._prefix = 0
            self._read = len(self._ids)
            self._prefix_text = self._decode(self._prefix, self._read)

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every returned delta)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._pieces)
        return self._text_cache

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly completed text ('' if held back)."""
        self.num_tokens += 1
        token_id = int(token_id)
        if self._utf8 is not None:
            if token_id in self._skip_ids:
                return ""
            return self._emit(self._utf8.decode(self._tok.token_bytes(token_id)))
        return self._emit(self._push_window(token_id))

    def extend(self, token_ids: Sequence[int]) -> str:
        """Push several tokens; return the combined delta."""
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """At end of stream: emit whatever is held back (an unfinished char becomes U+FFFD)."""
        if self._utf8 is not None:
            return self._emit(self._utf8.decode(b"", final=True))
        if self._read >= len(self._ids):
            return ""
        new_text = self._decode(self._prefix, len(self._ids))
        delta = new_text[len(self._prefix_text):]
        self._advance()
        return self._emit(delta)

    # -- window path --

    def _decode(self, start: int, end: int) -> str:
        return self._tok.decode(self._ids[start:end], self._skip) if end > start else ""

    def _push_window(self, token_id: int) -> str:
        self._ids.append(token_id)
        new_text = self._decode(self._prefix, len(self._ids))
        held = len(self._ids) - self._read
        if new_text.endswith("\ufffd") and held < self._MAX_HELD:
            return ""
        delta = new_text[len(self._prefix_text):] if len(new_text) > len(self._prefix_text) else ""
        self._advance()
        return delta

    def _advance(self) -> None:
        self._prefix = self._read
        self._read = len(self._ids)
        if self._prefix > 64:  # drop history before the window: memory and slices stay O(window)
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        self._prefix_text = self._decode(self._prefix, self._read)

    def _emit(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
            self._text_cache = None
        return delta
