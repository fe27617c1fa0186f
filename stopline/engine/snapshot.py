"""A point-in-time copy of the engine's gauges and counters.

Taken on the thread that steps the engine, between steps, so it never sees a half-applied
step; the frontend reads the latest copy, so `/metrics` never waits for a step to end.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec

from stopline.lifecycle import state_name

if TYPE_CHECKING:
    from stopline.engine.core import EngineCore

# lifecycle.state_name -> the gauge a sequence counts toward
_GAUGE = {"running": "running", "prefilling": "running", "waiting": "waiting",
          "preempted": "preempted", "swapped": "preempted"}


class Snapshot(msgspec.Struct, frozen=True):
    """Counts are per sequence: a request with n samples counts n."""

    running: int = 0
    waiting: int = 0
    preempted: int = 0  # preempted (recompute) or swapped out, waiting to resume
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    finished: dict[str, int] = msgspec.field(default_factory=dict)  # finish reason -> count
    aborts: list[tuple[str, str, int]] = msgspec.field(default_factory=list)  # (source, state, n)
    preemptions: dict[str, int] = msgspec.field(default_factory=dict)  # mode -> count
    recomputed_tokens: int = 0
    tokens_after_abort: int = 0
    steps: int = 0
    taken_at: float = 0.0  # time.monotonic()


def take_snapshot(core: EngineCore) -> Snapshot:
    gauges = {"running": 0, "waiting": 0, "preempted": 0}
    for req in core.live_requests():
        gauges[_GAUGE.get(state_name(req), "running")] += 1
    stats = core.lifecycle.stats
    return Snapshot(
        running=gauges["running"],
        waiting=gauges["waiting"],
        preempted=gauges["preempted"],
        kv_blocks_total=core.pool.num_blocks,
        kv_blocks_used=core.pool.num_used,
        kv_blocks_cached=core.pool.num_cached,
        finished=dict(stats.finished),
        aborts=[(src, state, n) for (src, state), n in stats.aborts.items()],
        preemptions=dict(stats.preemptions),
        recomputed_tokens=stats.recomputed_tokens,
        tokens_after_abort=stats.tokens_after_abort,
        steps=core.steps,
        taken_at=time.monotonic(),
    )
