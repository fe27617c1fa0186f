"""Fixed-size statistics: counters and fixed-bucket histograms.

A long-running server records something for every request; anything kept per request (a
list entry per abort) grows its memory forever. Everything here has a size fixed at
construction.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Histogram:
    """Counts of observations per bucket; `bounds` are the buckets' inclusive upper ends
    (the last bucket, past the largest bound, is unbounded)."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    max: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.max = max(self.max, value)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def quantile(self, q: float) -> float | None:
        """Upper bound of the bucket holding the q-quantile (the max for the last bucket)."""
        n = self.count
        if not n:
            return None
        rank = q * n
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return self.bounds[i] if i < len(self.bounds) else self.max
        return self.max


# Steps from an abort to its request being quiet / its blocks reclaimed: 0, 1, or more.
STEP_BOUNDS = (0, 1, 2, 4, 8)
# Seconds from an abort to its blocks' reclaim.
SECONDS_BOUNDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

# Seconds to fill one token's grammar mask (SmolLM2's JSON masks: tens of microseconds).
MASK_BOUNDS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


@dataclass
class StopStats:
    """Counters of the stop path, read by the metrics endpoint and the benchmarks."""

    finished: Counter = field(default_factory=Counter)  # finish reason -> count
    aborts: Counter = field(default_factory=Counter)  # (source, state) -> count
    preemptions: Counter = field(default_factory=Counter)  # mode -> count
    recomputed_tokens: int = 0
    swapped_blocks: int = 0
    window_freed_blocks: int = 0  # blocks a sliding window passed, given back while their request ran
    # The P/D split's KV blocks, ("sent" by a prefill role or "received" by a decode role, KV
    # layer group) -> blocks: a windowed group ships only the blocks its window still reads.
    transfer_blocks: Counter = field(default_factory=Counter)
    tokens_after_abort: int = 0  # computed by a step in flight when the abort was accepted
    abort_to_quiet_steps: Histogram = field(default_factory=lambda: Histogram(STEP_BOUNDS))
    abort_to_reclaim_steps: Histogram = field(default_factory=lambda: Histogram(STEP_BOUNDS))
    reclaim_seconds: Histogram = field(default_factory=lambda: Histogram(SECONDS_BOUNDS))
    # Speculative decoding (docs/speculative.md): every draft is drafted once and then, once
    # its step is processed, exactly one of accepted, rejected or discarded (by reason:
    # cancel, preempt, stop, error); until then it is in flight.
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_rejected: int = 0
    spec_discarded: Counter = field(default_factory=Counter)  # reason -> tokens
    spec_verify_steps: int = 0  # verify runs processed (one per speculating request and step)
    # The ownership audit on sampled busy steps (EngineConfig.audit_every): runs, failures and
    # the seconds they took (its cost, docs/soak.md).
    audits: int = 0
    audit_failures: int = 0
    audit_seconds: float = 0.0
