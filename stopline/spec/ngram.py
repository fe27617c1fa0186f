"""Prompt lookup: the next tokens after the latest earlier occurrence of the last n tokens.

An index from each n-gram (n from NGRAM_MIN to NGRAM_MAX) to where its latest occurrence
ends, extended as the request's tokens grow: a lookup is a dict probe per n, not a scan of
the whole context every step.
"""

from __future__ import annotations

from collections.abc import Sequence

NGRAM_MIN = 2
NGRAM_MAX = 4


class NgramIndex:
    def __init__(self) -> None:
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence
        self.upto = 0  # occurrences ending at positions < upto are indexed

    def _extend(self, tokens: Sequence[int], upto: int) -> None:
        for end in range(max(self.upto, NGRAM_MIN), upto):
            for n in range(NGRAM_MIN, min(NGRAM_MAX, end) + 1):
                self.ends[tuple(tokens[end - n:end])] = end
        self.upto = max(self.upto, upto)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest n-gram matching the end of tokens, at its
        latest earlier occurrence; [] if none matches."""
        length = len(tokens)
        if k <= 0 or length <= NGRAM_MIN:
            return []
        # Occurrences ending before the last token: the suffix itself is not a match.
        self._extend(tokens, length)
        for n in range(min(NGRAM_MAX, length - 1), NGRAM_MIN - 1, -1):
            end = self.ends.get(tuple(tokens[length - n:]))
            if end is not None and end < length:
                # Past the end of the tokens, the match's continuation is the tokens since
                # it: a loop of period length - end continues as it went (a run of one token,
                # a repeated line).
                period = length - end
                return [tokens[end + i % period] for i in range(k)]
        return []
