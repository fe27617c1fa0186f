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

# Bounds on the per-request detail (the web console's pool picture), so that a big pool or a
# long queue never makes the per-step snapshot expensive: past them the lists are cut (and
# `pool_map` says so); the counts above stay exact.
MAP_BLOCKS = 4096  # block ids listed in all (owned by live requests plus cached)
LIVE_ROWS = 256  # live sequences listed

# lifecycle.state_name -> the gauge a sequence counts toward
_GAUGE = {"running": "running", "prefilling": "running", "waiting": "waiting",
          "waiting_for_grammar": "waiting", "preempted": "preempted", "swapped": "preempted"}


class LiveSeq(msgspec.Struct, frozen=True, array_like=True):
    """One live sequence: who it is, where it stands, which KV blocks its table holds."""

    incarnation: str  # unique per admission (the server uses the response id)
    index: int  # sample index within its request (n > 1)
    state: str  # lifecycle.state_name
    tokens: int  # prompt plus output so far
    num_blocks: int
    block_ids: list[int]  # empty when the pool map is cut (see pool_map)
    lora: str = ""  # its LoRA adapter; "": the base model


class Snapshot(msgspec.Struct, frozen=True):
    """Counts are per sequence: a request with n samples counts n."""

    running: int = 0
    waiting: int = 0
    preempted: int = 0  # preempted (recompute) or swapped out, waiting to resume
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    # Every KV layer group's pool (docs/sliding-window.md), group 0 first: [window (0: every
    # block kept), total, used, cached]; the kv_blocks_* fields above are group 0's.
    kv_groups: list[list[int]] = msgspec.field(default_factory=list)
    # The P/D split's KV blocks by (direction "sent" | "received", layer group) (StopStats).
    transfer_blocks: list[tuple[str, int, int]] = msgspec.field(default_factory=list)
    finished: dict[str, int] = msgspec.field(default_factory=dict)  # finish reason -> count
    aborts: list[tuple[str, str, int]] = msgspec.field(default_factory=list)  # (source, state, n)
    preemptions: dict[str, int] = msgspec.field(default_factory=dict)  # mode -> count
    recomputed_tokens: int = 0
    tokens_after_abort: int = 0
    steps: int = 0
    busy_steps: int = 0
    busy_seconds: float = 0.0
    execute_seconds: float = 0.0
    block_size: int = 0
    live: list[LiveSeq] = msgspec.field(default_factory=list)  # at most LIVE_ROWS
    cached_block_ids: list[int] = msgspec.field(default_factory=list)  # refcount 0, hashed
    pool_map: bool = True  # block_ids and cached_block_ids list every owned and cached block
    # Speculative decoding (docs/speculative.md): drafted = accepted + rejected + discarded
    # + the drafts of the step in flight.
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_rejected: int = 0
    spec_discarded: dict[str, int] = msgspec.field(default_factory=dict)  # reason -> tokens
    spec_verify_steps: int = 0
    # Structured output: counts per MASK_BOUNDS bucket (+ the unbounded one) of the seconds
    # to fill one token's mask, their sum, and the grammar compiles not yet ended.
    grammar_mask_counts: list[int] = msgspec.field(default_factory=list)
    grammar_mask_sum: float = 0.0
    grammar_compiles_pending: int = 0
    # The sampled busy-time audit (EngineConfig.audit_every): runs, failures, seconds spent.
    audits: int = 0
    audit_failures: int = 0
    audit_seconds: float = 0.0
    # LoRA adapters (docs/lora.md), every one ever loaded: name -> [references now (0 once
    # unloaded), requests admitted, tokens of ended requests, loads, unloads].
    loras: dict[str, list[int]] = msgspec.field(default_factory=dict)
    taken_at: float = 0.0  # time.monotonic()
    # Engine-wide stops (docs/engine-stops.md): the weights served, halted (pause mode keep),
    # the sleep level.
    weight_version: int = 0
    halted: bool = False
    asleep: int = 0


def take_snapshot(core: EngineCore) -> Snapshot:
    gauges = {"running": 0, "waiting": 0, "preempted": 0}
    pool = core.pool
    # List block ids only while they are few: the work stays O(MAP_BLOCKS) however big the
    # pool (hashed blocks are owned or cached, so the cached scan is bounded too). Shared
    # prefix blocks appear in every table that holds them, hence a budget on ids listed.
    budget = MAP_BLOCKS if pool.num_used + pool.num_cached <= MAP_BLOCKS else -1
    complete = budget >= 0
    live = []
    for req in core.live_requests():
        state = state_name(req, core.kv_manager)
        gauges[_GAUGE.get(state, "running")] += 1
        if len(live) >= LIVE_ROWS:
            complete = False
            continue
        blocks = core.kv_manager.live_blocks(req)
        budget -= len(blocks)
        if budget < 0:
            complete = False
        live.append(LiveSeq(req.incarnation, req.index, state, req.num_tokens, len(blocks),
                            list(blocks) if budget >= 0 else [], req.params.lora or ""))
    cached = ([b for b in pool.hash_to_block.values() if pool.refcount[b] == 0]
              if pool.num_used + pool.num_cached <= MAP_BLOCKS else [])
    stats = core.lifecycle.stats
    return Snapshot(
        running=gauges["running"],
        waiting=gauges["waiting"],
        preempted=gauges["preempted"],
        kv_blocks_total=pool.num_blocks,
        kv_blocks_used=pool.num_used,
        kv_blocks_cached=pool.num_cached,
        kv_groups=[[w, p.num_blocks, p.num_used, p.num_cached]
                   for w, p in zip(core.kv_manager.windows, core.kv_manager.pools, strict=True)],
        transfer_blocks=[(d, g, n) for (d, g), n in sorted(stats.transfer_blocks.items())],
        finished=dict(stats.finished),
        aborts=[(src, state, n) for (src, state), n in stats.aborts.items()],
        preemptions=dict(stats.preemptions),
        recomputed_tokens=stats.recomputed_tokens,
        tokens_after_abort=stats.tokens_after_abort,
        steps=core.steps,
        busy_steps=core.busy_steps,
        busy_seconds=core.busy_seconds,
        execute_seconds=core.execute_seconds,
        block_size=pool.block_size,
        live=live,
        cached_block_ids=cached,
        pool_map=complete,
        spec_drafted=stats.spec_drafted,
        spec_accepted=stats.spec_accepted,
        spec_rejected=stats.spec_rejected,
        spec_discarded=dict(stats.spec_discarded),
        spec_verify_steps=stats.spec_verify_steps,
        grammar_mask_counts=list(core.grammar.mask_seconds.counts),
        grammar_mask_sum=core.grammar.mask_seconds.total,
        grammar_compiles_pending=core.grammar.pending_compiles(),
        audits=stats.audits,
        audit_failures=stats.audit_failures,
        audit_seconds=stats.audit_seconds,
        loras=_loras(core),
        taken_at=time.monotonic(),
        weight_version=core.residency.weight_version, halted=core.residency.halted,
        asleep=core.residency.asleep,
    )


def _loras(core: EngineCore) -> dict[str, list[int]]:
    a = core.adapters
    names = set(a.loaded) | set(a.loads)
    return {n: [len(a.refs.get(n, ())), a.requests[n], a.tokens[n], a.loads[n], a.unloads[n],
                a.evictions[n], int(a.is_resident(n))]
            for n in sorted(names)}
