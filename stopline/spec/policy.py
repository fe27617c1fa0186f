"""The auto mode's arithmetic: measured step costs and measured acceptance -> how far to draft.

A plain step of B decodes takes t ms (measured per B); each verify row beyond a request's
own decode row adds c ms (measured per bucket of B, as the step time beyond the plain step's,
per draft). A request whose drafts are accepted with probability a each expects
E(k) = 1 + a + ... + a^k tokens from k drafts, against 1 without. The batch makes B tokens in
t ms; drafting k for one request adds E(k) - 1 tokens for k * c ms, which pays only if
E(k) - 1 > k * c * B / t. Each request takes the k that gains the most, or none.
"""

from __future__ import annotations

EWMA = 0.2  # weight of the newest measurement
STALE_STEPS = 512  # a cost measured longer ago than this is measured again
MEASURES = 3  # verify steps of a batch size before their cost is trusted
# A verify row is taken to cost at least this share of an average decode row of its batch:
# on a busy host one measurement can show a verify step cheaper than the plain one.
FLOOR = 0.1


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify of k drafts yields when each is accepted with probability alpha."""
    return sum(alpha ** i for i in range(k + 1))


def bucket(decodes: int) -> int:
    """Batch sizes whose verify rows cost alike: powers of two."""
    return max(1, decodes).bit_length()


class StepCosts:
    def __init__(self) -> None:
        self.plain: dict[int, float] = {}  # decodes -> ms of a step of only that many decodes
        self.extra: dict[int, float] = {}  # bucket -> ms a verify row adds
        self.measured_at: dict[int, int] = {}  # bucket -> step of the last verify measurement
        self.measures: dict[int, int] = {}  # bucket -> verify steps measured

    def plain_ms(self, decodes: int) -> float | None:
        if decodes in self.plain:
            return self.plain[decodes]
        if not self.plain:
            return None
        return self.plain[min(self.plain, key=lambda b: abs(b - decodes))]

    def extra_ms(self, decodes: int, step: int) -> float | None:
        """None where no verify step of this size was measured lately (measure it)."""
        b = bucket(decodes)
        if step - self.measured_at.get(b, -STALE_STEPS - 1) > STALE_STEPS:
            self.measures[b] = 0
        if self.measures.get(b, 0) < MEASURES:
            return None
        plain = self.plain_ms(decodes)
        floor = FLOOR * plain / max(decodes, 1) if plain is not None else 0.0
        return max(self.extra[b], floor)

    def observe(self, decodes: int, drafts: int, ms: float, step: int) -> None:
        """A step of only decode and verify rows: `decodes` requests, `drafts` draft rows."""
        if decodes <= 0:
            return
        if drafts == 0:
            old = self.plain.get(decodes)
            self.plain[decodes] = ms if old is None else (1 - EWMA) * old + EWMA * ms
            return
        base = self.plain_ms(decodes)
        if base is None:
            return
        per = max(0.0, (ms - base) / drafts)
        b = bucket(decodes)
        old = self.extra.get(b)
        self.extra[b] = per if old is None or not self.measures.get(b) else (1 - EWMA) * old + EWMA * per
        self.measured_at[b] = step
        self.measures[b] = self.measures.get(b, 0) + 1


def best_k(alpha: float, most: int, extra_ms: float, tokens_per_ms: float) -> int:
    """The number of drafts (0 to most) that adds the most tokens per ms of their cost."""
    best, gain = 0, 0.0
    for k in range(1, most + 1):
        g = expected_tokens(alpha, k) - 1 - k * extra_ms * tokens_per_ms
        if g > gain:
            best, gain = k, g
    return best
