"""Continuous batching: which requests run in the next step, and how many tokens each.

The scheduler decides; it never frees anything itself. Preempting a victim or failing a
request that can never fit goes through the lifecycle (stopline/lifecycle.py), the one
owner of the stop path.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import TYPE_CHECKING

from stopline.config import EngineConfig
from stopline.kv.block_pool import BlockPool, extend_hashes
from stopline.request import FinishReason, Request, RequestStatus
from stopline.sched.plan import ScheduledChunk, StepPlan
from stopline.sched.victims import pick_victim

if TYPE_CHECKING:
    from stopline.lifecycle import Lifecycle


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool, max_model_len: int) -> None:
        self.config = config
        self.pool = pool
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()  # preempted requests re-enter at the front
        self.running: list[Request] = []
        self.lifecycle: Lifecycle  # set by the engine (the two refer to each other)
        self.next_step_id = 0
        # Cap on prefill tokens per step, set from measured step cost (interruptible steps).
        self.prefill_cap: int | None = None
        self.headroom = config.admission_headroom

    # ---- queue upkeep -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def requeue_front(self, req: Request) -> None:
        self.waiting.appendleft(req)

    def compact(self) -> None:
        """Drop finished requests from the queues: one O(n) pass per step, however many
        requests the lifecycle ended since the last one."""
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        if any(r.status.is_finished or r.status is RequestStatus.RUNNING for r in self.waiting):
            self.waiting = deque(r for r in self.waiting
                                 if not r.status.is_finished and r.status is not RequestStatus.RUNNING)

    @property
    def num_waiting(self) -> int:
        return sum(1 for r in self.waiting if not r.status.is_finished)

    def has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    # ---- blocks -------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.pool.block_size)

    # ---- the step -----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self.compact()
        plan = StepPlan(self.next_step_id)
        self.next_step_id += 1
        budget = self.config.max_num_batched_tokens
        has_decodes = any(not r.is_prefilling for r in self.running if r.fork_leader is None)
        prefill_left = budget
        if self.prefill_cap is not None and (has_decodes or len(self.waiting) > 1):
            prefill_left = min(budget, self.prefill_cap)
        scheduled: set[int] = set()

        # 1. Requests already running, oldest first: decodes and ongoing prefills.
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or req.fork_leader is not None:
                continue
            prefilling = req.is_prefilling
            if prefilling:
                n = min(req.num_tokens - req.num_computed, budget, prefill_left)
                if n <= 0:
                    continue
            else:
                n = 1
            if not self._grow(req, req.num_computed + n, scheduled):
                continue
            self._add_chunk(plan, req, n)
            scheduled.add(req.internal_id)
            budget -= n
            if prefilling:
                prefill_left -= n

        # 2. Admit waiting (and preempted) requests in arrival order while they fit.
        growth = sum(self._growth(r) for r in self.running if r.status is RequestStatus.RUNNING)
        while self.waiting and budget > 0 and prefill_left > 0:
            req = self.waiting[0]
            if req.status.is_finished:
                self.waiting.popleft()
                continue
            if self._live_running() >= self.config.max_num_seqs:
                break
            why = self._never_fits(req)
            if why is not None:
                self.waiting.popleft()
                self.lifecycle.fail(req, FinishReason.ERROR, why)
                continue
            if not self._admit(req, growth):
                break
            growth += self._growth(req) * (1 + len(req.forks_pending))
            self.waiting.popleft()
            n = min(req.num_tokens - req.num_computed, budget, prefill_left)
            self._add_chunk(plan, req, n)
            scheduled.add(req.internal_id)
            budget -= n
            prefill_left -= n
        # Headroom raised by preemption relaxes again while the pool keeps up.
        self.headroom = max(self.config.admission_headroom, self.headroom * 0.98)
        return plan

    def _growth(self, req: Request) -> int:
        """Blocks req will need for its next admission_lookahead tokens, beyond its table."""
        upto = min(req.num_tokens + self.config.admission_lookahead, req.prompt_len + req.max_tokens)
        return max(0, self.blocks_for(upto) - max(len(req.block_ids), self.blocks_for(req.num_tokens)))

    def _live_running(self) -> int:
        return sum(1 for r in self.running if r.status is RequestStatus.RUNNING)

    def _add_chunk(self, plan: StepPlan, req: Request, n: int) -> None:
        start = req.num_computed
        req.num_computed += n
        req.last_scheduled_step = plan.step_id
        if req.first_scheduled is None:
            req.first_scheduled = time.monotonic()
        sample = req.num_computed == req.num_tokens
        req.inflight_samples = (1 + len(req.forks_pending)) if sample else 0
        req.inflight_tokens = n
        plan.chunks.append(ScheduledChunk(req, start, n, sample=sample))

    def _grow(self, req: Request, upto: int, scheduled: set[int]) -> bool:
        """Make req's block table cover `upto` tokens, preempting others if needed.

        Returns False if req itself could not be given room (it was preempted or failed).
        """
        need = self.blocks_for(upto) - len(req.block_ids)
        if need <= 0:
            return True
        while not self.pool.can_allocate(need):
            cands = [r for r in self.running
                     if r.status is RequestStatus.RUNNING and r is not req
                     and r.internal_id not in scheduled and r.fork_leader is None
                     and not r.forks_pending]
            deficit = need - self.pool.num_available
            victim = pick_victim(self.config.victim_policy, cands, deficit, self.pool.refcount)
            if victim is None:
                break
            self.lifecycle.preempt(victim)
            self.headroom = min(0.5, self.headroom + 0.05)
        if self.pool.can_allocate(need):
            req.block_ids += self.pool.allocate(need)
            return True
        if scheduled:
            # Others in this step hold the blocks it needs; they will finish and free them.
            self.lifecycle.preempt(req)
        else:
            # Never preempt the last runnable request: nothing could ever make room for it.
            self.lifecycle.fail(
                req, FinishReason.LENGTH if req.output_token_ids else FinishReason.ERROR,
                f"the KV pool ({self.pool.num_blocks} blocks of {self.pool.block_size}) "
                f"cannot hold {upto} tokens",
            )
        return False

    def block_hashes(self, req: Request, n_blocks: int) -> list[int]:
        """Chained hashes of req's first n_blocks full blocks (prompt, then output), each
        computed once per request: a request at the head of the queue is looked up again at
        every step until it fits."""
        if len(req.block_hashes) < n_blocks:
            extend_hashes(req.block_hashes, req.all_token_ids, self.pool.block_size, n_blocks)
        return req.block_hashes[:n_blocks]

    def _never_fits(self, req: Request) -> str | None:
        need = self.blocks_for(req.num_tokens + 1) + len(req.forks_pending)
        if need > self.pool.num_blocks:
            return (f"request needs {need} KV blocks of {self.pool.block_size} tokens; "
                    f"the pool has {self.pool.num_blocks}")
        return None

    def _admit(self, req: Request, growth: int = 0) -> bool:
        """Give a waiting request its blocks for every token it has (prompt, or for a
        preempted one everything it must recompute: it is admitted only when the whole
        re-prefill fits, so a resumption always makes progress). growth: blocks the running
        requests need for their next tokens (see _growth), kept free along with its own.
        False: not now."""
        lookahead = growth + self._growth(req) * (1 + len(req.forks_pending)) if self.running else 0
        if req.status is RequestStatus.SWAPPED:
            return self.lifecycle.swap_in(req, self.pool.num_available - lookahead)
        members = [req] + req.forks_pending
        total = self.blocks_for(req.num_tokens)
        hits: list[int] = []
        if self.config.enable_prefix_caching:
            # Never cover the last token: its logits must be computed. A preempted request
            # also finds its own generated blocks, if nobody has needed their room since.
            n_full = (req.num_tokens - 1) // self.pool.block_size
            hits = self.pool.lookup(self.block_hashes(req, n_full))
        hits_free = sum(1 for b in hits if self.pool.refcount[b] == 0)
        # Each forked sample needs its own copy of the last, partial prompt block.
        partial = 1 if req.prompt_len % self.pool.block_size else 0
        fork_blocks = (len(members) - 1) * partial
        need = total - len(hits) + hits_free + fork_blocks
        reserve = math.ceil(self.headroom * self.pool.num_blocks) + lookahead if self.running else 0
        if not self.pool.can_allocate(need + reserve):
            return False
        self.pool.touch(hits)
        req.block_ids = hits + self.pool.allocate(total - len(hits))
        req.num_computed = len(hits) * self.pool.block_size
        req.num_hashed_blocks = len(hits)
        if req.status is RequestStatus.WAITING:
            req.num_cached = req.num_computed
        else:
            redo = req.num_tokens - req.num_computed
            req.num_recomputed += redo
            self.lifecycle.stats.recomputed_tokens += redo
        for m in members[1:]:
            shared = req.block_ids[: req.prompt_len // self.pool.block_size]
            self.pool.touch(shared)
            m.block_ids = list(shared) + (self.pool.allocate(1) if partial else [])
            m.move_to(RequestStatus.RUNNING)
            self.running.append(m)
        req.move_to(RequestStatus.RUNNING)
        self.running.append(req)
        return True
