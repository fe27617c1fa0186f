"""THE stop path. Four doors (finish, abort, fail, preempt), one exit (`_release`).

Nothing else in stopline frees a request's resources. `_release` runs in a fixed order:
auxiliary per-request state first (swap slots, family membership), then the KV blocks,
last, because once another request writes a block it can't be taken back. Blocks that a
step still in flight may write wait behind the fence (`deferred`) until that step has been
processed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from stopline.config import EngineConfig, PreemptionMode
from stopline.kv.block_pool import BlockPool, LedgerError
from stopline.kv.kv_cache import KVCache, SwapSpace
from stopline.request import AbortSource, FinishReason, Request, RequestStatus
from stopline.sched.scheduler import Scheduler


@dataclass
class StopStats:
    """Counters the metrics endpoint and the benchmarks read."""

    finished: Counter = field(default_factory=Counter)  # finish reason -> count
    aborts: Counter = field(default_factory=Counter)  # (source, state) -> count
    preemptions: Counter = field(default_factory=Counter)  # mode -> count
    recomputed_tokens: int = 0
    swapped_blocks: int = 0
    tokens_after_abort: int = 0  # computed by a step in flight when the abort was accepted
    abort_to_quiet_steps: list[int] = field(default_factory=list)
    abort_to_reclaim_steps: list[int] = field(default_factory=list)
    reclaim_seconds: list[float] = field(default_factory=list)


def state_name(req: Request) -> str:
    if req.status is RequestStatus.RUNNING:
        if req.fork_leader is not None:
            return "waiting"
        return "prefilling" if req.was_prefilling else "running"
    return req.status.value


class Lifecycle:
    def __init__(self, config: EngineConfig, pool: BlockPool, scheduler: Scheduler,
                 kv: KVCache | None, swap: SwapSpace | None,
                 emit: Callable[[Request], None]) -> None:
        self.config = config
        self.pool = pool
        self.sched = scheduler
        self.kv = kv
        self.swap = swap
        self.emit = emit  # sends the one terminal output of a request
        self.stats = StopStats()
        self.last_processed_step = -1
        # Measured costs for automatic preemption: a token of prefill (the engine sets it
        # from its step times), and a swap out and back (calibrate_swap).
        self.ms_per_recomputed_token: float | None = None
        self.ms_per_swap: float | None = None  # fixed, whatever the blocks
        self.ms_per_swapped_block: float | None = None
        # (fence step, blocks, keep cached, abort time or None)
        self.deferred: list[tuple[int, list[int], bool, float | None]] = []

    # ---- doors ----------------------------------------------------------------------------
    def finish(self, req: Request, reason: FinishReason, detail: str | None = None) -> None:
        """Normal termination: EOS, stop token or string, max_tokens."""
        self._end(req, reason, detail, keep_cached=True)

    def abort(self, req: Request, source: AbortSource) -> bool:
        """Client cancel, disconnect, shutdown, deadline. Idempotent: False if already over."""
        if req.status.is_finished:
            return False
        self.stats.aborts[(source.value, state_name(req))] += 1
        reason = FinishReason.TIMEOUT if source is AbortSource.DEADLINE else FinishReason.ABORT
        self._end(req, reason, source.value, keep_cached=self.config.keep_aborted_prefix,
                  aborted_at=time.monotonic())
        return True

    def fail(self, req: Request, reason: FinishReason, message: str) -> None:
        """Abnormal termination of one request: error, timeout, too many preemptions."""
        self._end(req, reason, message, keep_cached=False)

    def preempt(self, req: Request) -> None:
        """Take a running request's blocks for others; it resumes later, exactly where it was."""
        if req.status is not RequestStatus.RUNNING:
            raise LedgerError(f"preempt of {req.request_id!r} in state {req.status.value}")
        req.num_preemptions += 1
        if req.num_preemptions > self.config.max_preemptions:
            self.fail(req, FinishReason.PREEMPTED,
                      f"preempted {req.num_preemptions - 1} times; the KV pool is too contended")
            return
        mode = self._mode_for(req)
        self.stats.preemptions[mode.value] += 1
        if mode is PreemptionMode.SWAP:
            assert self.kv is not None and self.swap is not None
            data = self.kv.read_blocks(req.block_ids)
            req.swap_slots = self.swap.store(data, len(req.block_ids))
            self.stats.swapped_blocks += len(req.block_ids)
            req.move_to(RequestStatus.SWAPPED)
        else:
            req.move_to(RequestStatus.PREEMPTED)
            req.num_computed = 0
            req.num_hashed_blocks = 0
        blocks, req.block_ids = req.block_ids, []
        # The victim's prefix stays cached: preemption frees room by eviction when needed.
        self._free_blocks(req, blocks, keep_cached=True, aborted_at=None)
        self.sched.requeue_front(req)

    def swap_in(self, req: Request, available: int) -> bool:
        """Bring a swapped request back if its blocks fit. Called by the scheduler."""
        n = len(req.swap_slots)
        # Room for what it computes next too (its last sampled token may open a new block).
        total = max(n, -(-req.num_tokens // self.pool.block_size))
        if total > available:
            return False
        assert self.kv is not None and self.swap is not None
        blocks = self.pool.allocate(total)
        self.kv.write_blocks(blocks[:n], self.swap.load(req.swap_slots))
        self.swap.release(req.swap_slots)
        req.swap_slots = []
        req.block_ids = blocks
        req.num_hashed_blocks = 0  # re-registered as the new blocks' contents are identical
        req.move_to(RequestStatus.RUNNING)
        self.sched.running.append(req)
        return True

    def _mode_for(self, req: Request) -> PreemptionMode:
        mode = self.config.preemption_mode
        if mode is PreemptionMode.RECOMPUTE or self.swap is None:
            return PreemptionMode.RECOMPUTE
        if not self.swap.can_hold(len(req.block_ids)) or req.status is not RequestStatus.RUNNING:
            return PreemptionMode.RECOMPUTE
        if req.last_scheduled_step > self.last_processed_step:
            return PreemptionMode.RECOMPUTE  # a step in flight still writes its blocks
        if mode is PreemptionMode.SWAP:
            return PreemptionMode.SWAP
        # AUTO: recompute costs a forward pass over every computed token; a swap copies each
        # block out and back. The first is measured as the engine runs, the second at start;
        # until both are known, the guess is that a token of forward costs about as much as
        # copying a few blocks. (SmolLM2 on 2 CPU cores: ~1 ms a token against ~0.6 ms a
        # block of 16 tokens, so nearly every victim is swapped.)
        per_token, fixed, per_block = self.ms_per_recomputed_token, self.ms_per_swap, self.ms_per_swapped_block
        if per_token is None or fixed is None or per_block is None:
            return PreemptionMode.SWAP if req.num_computed > 4 * self.pool.block_size else PreemptionMode.RECOMPUTE
        swap_ms = fixed + per_block * len(req.block_ids)
        return PreemptionMode.SWAP if swap_ms < per_token * req.num_computed else PreemptionMode.RECOMPUTE

    def calibrate_swap(self) -> None:
        """Time blocks out to the swap space and back before any request holds them (a few
        ms), as a fixed cost per swap plus a cost per block: the copies are one op per layer
        and kind whatever the block count."""
        if self.kv is None or self.swap is None or self.pool.num_used:
            return
        n = min(8, self.pool.num_blocks)

        def round_trip(blocks: list[int]) -> float:
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                self.kv.write_blocks(blocks, [t.to("cpu") for t in self.kv.read_blocks(blocks)])
                best = min(best, (time.perf_counter() - t0) * 1000)
            return best

        one, many = round_trip([0]), round_trip(list(range(n)))
        self.ms_per_swapped_block = max(0.0, (many - one) / (n - 1)) if n > 1 else one
        self.ms_per_swap = max(0.0, one - self.ms_per_swapped_block)

    # ---- the one exit -------------------------------------------------------------------
    def _end(self, req: Request, reason: FinishReason, detail: str | None, keep_cached: bool,
             aborted_at: float | None = None) -> None:
        if req.status.is_finished:
            return
        req.finish_reason = reason
        req.stop_detail = detail
        in_flight = req.last_scheduled_step > self.last_processed_step
        if in_flight and req.inflight_samples:
            # The step in flight computes tokens this request will never deliver.
            req.undelivered += req.inflight_samples
            if aborted_at is not None:
                self.stats.tokens_after_abort += req.inflight_samples
        if aborted_at is not None:
            # Quiet: taking part in no step. At most the one already running.
            self.stats.abort_to_quiet_steps.append(1 if in_flight else 0)
        self._release(req, keep_cached, aborted_at)
        req.move_to(RequestStatus.FINISHED)
        self.stats.finished[reason.value] += 1
        self.emit(req)

    def _release(self, req: Request, keep_cached: bool, aborted_at: float | None) -> None:
        # 1. Auxiliary state.
        if req.swap_slots and self.swap is not None:
            self.swap.release(req.swap_slots)
            req.swap_slots = []
        leader = req.fork_leader
        if leader is not None and req in leader.forks_pending:
            leader.forks_pending.remove(req)
        req.fork_leader = None
        for m in req.forks_pending:  # a leader ending before its fork takes its samples along
            m.fork_leader = None
        # 2. KV blocks, last (behind the fence).
        blocks, req.block_ids = req.block_ids, []
        self._free_blocks(req, blocks, keep_cached, aborted_at)
        # Scheduler queues drop finished requests on their next compact().

    def _free_blocks(self, req: Request, blocks: list[int], keep_cached: bool,
                     aborted_at: float | None) -> None:
        keep = keep_cached and self.config.enable_prefix_caching
        if req.last_scheduled_step > self.last_processed_step:
            self.deferred.append((req.last_scheduled_step, blocks, keep, aborted_at))
            return
        self.pool.release(blocks, keep_cached=keep)
        if aborted_at is not None:
            self.stats.abort_to_reclaim_steps.append(0)
            self.stats.reclaim_seconds.append(time.monotonic() - aborted_at)

    def step_processed(self, step_id: int) -> None:
        """The outputs of step `step_id` are handled: what it fenced can go back."""
        self.last_processed_step = step_id
        if not self.deferred:
            return
        still = []
        now = time.monotonic()
        for fence, blocks, keep, aborted_at in self.deferred:
            if fence > step_id:
                still.append((fence, blocks, keep, aborted_at))
                continue
            self.pool.release(blocks, keep_cached=keep)
            if aborted_at is not None:
                self.stats.abort_to_reclaim_steps.append(1)
                self.stats.reclaim_seconds.append(now - aborted_at)
        self.deferred = still

    def held_tables(self, live: Sequence[Request]) -> Iterator[list[int]]:
        """Every holder of block references, for the ledger audit."""
        for r in live:
            yield r.block_ids
        for _, blocks, _, _ in self.deferred:
            yield blocks
