"""THE stop path. Four doors (finish, abort, fail, preempt), one exit (`release`).

Every piece of per-request state belongs to a holder (see `Holder`): the scheduler's queues,
the output processor's detokenizer, decode rows, the family table, swap slots, the KV
blocks. The engine declares the holders once, in release order; `release(req)` walks them
in that order and nothing else frees a request's state. Auxiliary state goes first, the KV
manager last, because once another request writes a block it can't be taken back (and the
KV manager frees behind the fence). Adding a per-request resource means registering one
holder.

Preemption is the one door that does not end a request: each holder gives up what a
preempted request can't keep (`Holder.preempt`: its blocks, its decode row, its place in the
running queue) and keeps the rest (detokenizer, family, stream offsets).

This module sits below the scheduler: it knows holders only by this protocol.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from stopline.config import EngineConfig, PreemptionMode
from stopline.kv.block_pool import LedgerError
from stopline.kv.manager import KVManager
from stopline.request import AbortSource, FinishReason, Request, RequestStatus
from stopline.stats import StopStats


class Holder(Protocol):
    """Per-request state with one way out."""

    name: str

    def release(self, req: Request) -> None:
        """req ended (its status is FINISHED): drop everything held for it. Idempotent."""

    def preempt(self, req: Request) -> None:
        """req was preempted (status PREEMPTED or SWAPPED): give up what it can't keep."""

    def holds(self, req: Request) -> bool:
        """Whether anything of req is still held here (the audit's question)."""


def state_name(req: Request, kv: KVManager) -> str:
    if req.status is RequestStatus.RUNNING:
        if req.fork_leader is not None:
            return "waiting"
        return "prefilling" if kv.was_prefilling(req) else "running"
    return req.status.value


class Lifecycle:
    def __init__(self, config: EngineConfig, kv: KVManager, holders: Sequence[Holder],
                 stats: StopStats) -> None:
        if not holders or holders[-1] is not kv:
            raise ValueError("the KV manager must be the last holder: blocks are freed last")
        self.config = config
        self.kv = kv
        self.holders = list(holders)
        self.stats = stats
        # Measured costs for automatic preemption: a token of prefill (the engine sets it
        # from its step times), and a swap out and back (the KV manager times it at start).
        self.ms_per_recomputed_token: float | None = None
        self.ms_per_swap: float | None = None  # fixed, whatever the blocks
        self.ms_per_swapped_block: float | None = None
        # Debug mode: requests ended since the last audit, to check that no holder kept any.
        self.ended: list[Request] | None = [] if config.debug or config.audit_every else None

    # ---- doors ----------------------------------------------------------------------------
    def finish(self, req: Request, reason: FinishReason, detail: str | None = None) -> None:
        """Normal termination: EOS, stop token or string, max_tokens."""
        self._end(req, reason, detail)

    def abort(self, req: Request, source: AbortSource) -> bool:
        """Client cancel, disconnect, stall, shutdown, deadline. Idempotent: False if over."""
        if req.status.is_finished:
            return False
        for r in (req, *req.forks_pending):  # samples waiting to fork end with their leader
            self.stats.aborts[(source.value, state_name(r, self.kv))] += 1
        req.aborted_at = time.monotonic()
        reason = FinishReason.TIMEOUT if source is AbortSource.DEADLINE else FinishReason.ABORT
        self._end(req, reason, source.value)
        return True

    def fail(self, req: Request, reason: FinishReason, message: str) -> None:
        """Abnormal termination of one request: error, timeout, too many preemptions."""
        self._end(req, reason, message)

    def preempt(self, req: Request, mode: PreemptionMode | None = None) -> None:
        """Take a running request's blocks for others; it resumes later, exactly where it was.
        A family leader whose samples have not forked yet takes them along. mode: forced
        (a weight update recomputing the KV of the requests in flight, engine/residency.py):
        not counted against max_preemptions, it is no sign of a contended pool."""
        if req.status is not RequestStatus.RUNNING:
            raise LedgerError(f"preempt of {req.incarnation!r} in state {req.status.value}")
        # A paused request (its client reads slowly) is not thrashing: it is not admitted
        # again until its client reads, so preemption never ends it (the stall timeout may).
        if not req.paused and mode is None:
            req.num_preemptions += 1
        if req.num_preemptions > self.config.max_preemptions:
            self.fail(req, FinishReason.PREEMPTED,
                      f"preempted {req.num_preemptions - 1} times; the KV pool is too contended")
            return
        mode = mode or self._mode_for(req)
        self.stats.preemptions[mode.value] += 1
        for r in [req, *req.forks_pending]:
            r.epoch += 1
            r.move_to(RequestStatus.SWAPPED if mode is PreemptionMode.SWAP and r is req
                      else RequestStatus.PREEMPTED)
            for h in self.holders:
                h.preempt(r)

    def _mode_for(self, req: Request) -> PreemptionMode:
        mode = self.config.preemption_mode
        # Swap-in rebuilds one table: a leader with samples waiting to fork recomputes.
        if mode is PreemptionMode.RECOMPUTE or req.forks_pending or not self.kv.can_swap(req):
            return PreemptionMode.RECOMPUTE
        if mode is PreemptionMode.SWAP:
            return PreemptionMode.SWAP
        # AUTO: recompute costs a forward pass over every computed token; a swap copies each
        # block out and back. The first is measured as the engine runs, the second at start;
        # until both are known, the guess is that a token of forward costs about as much as
        # copying a few blocks.
        per_token, fixed, per_block = self.ms_per_recomputed_token, self.ms_per_swap, self.ms_per_swapped_block
        if per_token is None or fixed is None or per_block is None:
            big = self.kv.computed(req) > 4 * self.kv.block_size
            return PreemptionMode.SWAP if big else PreemptionMode.RECOMPUTE
        swap_ms = fixed + per_block * len(self.kv.live_blocks(req))
        return PreemptionMode.SWAP if swap_ms < per_token * self.kv.computed(req) else PreemptionMode.RECOMPUTE

    def calibrate_swap(self) -> None:
        costs = self.kv.calibrate_swap()
        if costs is not None:
            self.ms_per_swap, self.ms_per_swapped_block = costs

    # ---- the one exit -------------------------------------------------------------------
    def _end(self, req: Request, reason: FinishReason, detail: str | None) -> None:
        if req.status.is_finished:
            return
        for sample in list(req.forks_pending):
            # A family before its fork is one request: its samples end with it. (Their
            # sampled tokens are counted on the leader, whose step samples for all.)
            sample.aborted_at = req.aborted_at
            self._end(sample, reason, detail)
        req.finish_reason = reason
        req.stop_detail = detail
        in_flight = self.kv.in_flight(req)
        if in_flight and req.inflight_samples:
            # The step in flight computes tokens this request will never deliver.
            req.undelivered_in_flight += req.inflight_samples
            if req.aborted_at is not None:
                self.stats.tokens_after_abort += req.inflight_samples
        if req.aborted_at is not None:
            # Quiet: taking part in no step. At most the one already running.
            self.stats.abort_to_quiet_steps.observe(1 if in_flight else 0)
        req.move_to(RequestStatus.FINISHED)
        self.release(req)
        self.stats.finished[reason.value] += 1
        if self.ended is not None:
            self.ended.append(req)

    def release(self, req: Request) -> None:
        """Walk every holder in the declared order; the KV manager is last."""
        for h in self.holders:
            h.release(req)

    # ---- checks -------------------------------------------------------------------------
    def audit(self, live: Sequence[Request]) -> None:
        """The ledger (blocks and swap slots against every live table), and that every
        request ended since the last audit is held by no holder. Raises LedgerError."""
        self.kv.audit(live)
        ended, self.ended = self.ended, ([] if self.ended is not None else None)
        for req in ended or ():
            for h in self.holders:
                if h.holds(req):
                    raise LedgerError(f"finished request {req.incarnation!r} is still held by {h.name}")
