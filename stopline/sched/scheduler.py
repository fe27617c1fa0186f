"""Continuous batching: which requests run in the next step, and how many tokens each.

The scheduler decides; it never allocates or frees anything itself. Blocks come from the KV
manager (stopline/kv/manager.py); preempting a victim or failing a request that can never
fit goes through the lifecycle (stopline/lifecycle.py). Neither of those calls back here:
the queues they touch are a holder of their own (queues.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from stopline.config import EngineConfig
from stopline.kv.manager import KVManager
from stopline.lifecycle import Lifecycle
from stopline.request import FinishReason, Request, RequestStatus
from stopline.sched.plan import ScheduledChunk, StepPlan
from stopline.sched.queues import Queues
from stopline.sched.victims import pick_victim
from stopline.spec.drafts import Drafts


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVManager, queues: Queues,
                 lifecycle: Lifecycle, drafts: Drafts | None = None) -> None:
        """drafts: speculative decoding's state (none: no drafts)."""
        self.config = config
        self.drafts = drafts if drafts is not None and drafts.enabled else None
        self.kv = kv
        self.queues = queues
        self.lifecycle = lifecycle
        self.next_step_id = 0
        # Cap on prefill tokens per step, set from measured step cost (interruptible steps).
        self.prefill_cap: int | None = None
        self.ms_per_prefill_token: float | None = None  # the measured cost (`measured`)
        self.headroom = config.admission_headroom
        # Whether a waiting request's LoRA adapter is (made) resident; False: it waits for a
        # slot while the others are admitted (engine/adapters.py `Adapters.resident`).
        self.resident: Callable[[Request], bool] = lambda req: True

    def add(self, req: Request) -> None:
        self.queues.add(req)

    def measured(self, plan: StepPlan, elapsed_ms: float) -> None:
        """A step ran in elapsed_ms. Cost per row of the step, decode rows included: the cap
        gives the prefill rows about target_step_ms on top of the decodes. Measured from 16
        prefill rows up, or from the cap itself: a threshold above the cap would freeze the
        estimate once one slow step had pushed the cap below it."""
        n_prefill = sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1)
        if n_prefill >= min(16, self.prefill_cap or 16):
            per_tok = elapsed_ms / plan.num_tokens
            prev = self.ms_per_prefill_token
            self.ms_per_prefill_token = per_tok if prev is None else 0.7 * prev + 0.3 * per_tok
            self.lifecycle.ms_per_recomputed_token = self.ms_per_prefill_token

    # ---- the step -----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        if self.ms_per_prefill_token and self.config.target_step_ms:
            self.prefill_cap = max(self.config.block_size,
                                   int(self.config.target_step_ms / self.ms_per_prefill_token))
        q = self.queues
        plan = StepPlan(self.next_step_id)
        self.next_step_id += 1
        budget = self.config.max_num_batched_tokens
        has_decodes = any(not self.kv.prefilling(r) for r in q.running if r.fork_leader is None)
        prefill_left = budget
        if self.prefill_cap is not None and (has_decodes or len(q.waiting) > 1):
            prefill_left = min(budget, self.prefill_cap)
        scheduled: set[int] = set()
        if self.drafts is not None:
            decodes = sum(1 for r in q.running if r.status is RequestStatus.RUNNING and not r.paused
                          and r.fork_leader is None and not self.kv.prefilling(r))
            self.drafts.begin_step(plan.step_id, decodes)

        # 1. Requests already running, oldest first: decodes and ongoing prefills. A paused
        # one (its client's stream is full) keeps its place and takes no step.
        for req in list(q.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or req.fork_leader is not None or req.paused:
                continue
            prefilling = self.kv.prefilling(req)
            if prefilling:
                n = min(req.num_tokens - self.kv.computed(req), budget, prefill_left)
                if n <= 0:
                    continue
                n = self.kv.room(req, self.kv.computed(req), n)  # a windowed pool's room
            else:
                n = 1
            if not self._grow(req, self.kv.computed(req) + n, scheduled):
                continue
            drafts = self._drafts(req, budget - n) if not prefilling else []
            self._add_chunk(plan, req, n, drafts)
            scheduled.add(req.internal_id)
            budget -= n + len(drafts)
            if prefilling:
                prefill_left -= n

        # 2. Admit waiting (and preempted) requests in arrival order while they fit. Every
        # sample of a family counts toward max_num_seqs. A paused one (preempted while its
        # client's stream was full) waits for its reader without holding back the others.
        growth = sum(self._growth(r) for r in q.running)
        i = 0  # paused requests passed over; whoever is admitted or failed leaves the queue
        while i < len(q.waiting) and budget > 0 and prefill_left > 0:
            req = q.waiting[i]
            if req.paused:
                i += 1
                continue
            if q.num_running + 1 + len(req.forks_pending) > self.config.max_num_seqs:
                break
            short = self.kv.short(req.num_tokens, len(req.forks_pending))
            if short is not None:
                self.lifecycle.fail(req, FinishReason.ERROR,
                                    f"request needs {short[0]} KV blocks of "
                                    f"{self.kv.block_size} tokens; the pool has {short[1]}")
                continue
            if not self.resident(req):  # base rows and resident adapters' requests go on
                i += 1
                continue
            if not self._admit(req, growth, min(budget, prefill_left)):
                break
            growth += self._growth(req) * (1 + len(req.forks_pending))
            # A windowed group took blocks for this chunk only, maybe fewer (kv.admit).
            n = min(req.num_tokens, self.kv.covered(req), self.kv.computed(req) + min(budget, prefill_left))
            n -= self.kv.computed(req)
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
        have = max(len(self.kv.table(req)), self.kv.blocks_for(req.num_tokens))
        return max(0, self.kv.blocks_for(upto) - have)

    def _drafts(self, req: Request, room: int) -> list[int]:
        """Drafts for a decode, if the step has room for their rows and the pool for their
        slots: drafts never preempt anyone (a rejected draft's slots are given back)."""
        if self.drafts is None or req.forks_pending or room <= 0:
            return []
        drafts = self.drafts.propose(req, room)
        if not drafts:
            return []
        upto = self.kv.computed(req) + 1 + len(drafts)
        # A block of room left per running request (in every group that grows): the drafts'
        # slots must not be the ones the others grow into this step.
        if not self.kv.can_grow(req, upto, spare=len(self.queues.running)):
            return []
        if not self.kv.grow(req, upto):
            return []
        return drafts

    def _add_chunk(self, plan: StepPlan, req: Request, n: int, drafts: list[int] | None = None) -> None:
        drafts = drafts or []
        start = self.kv.computed(req)
        end = start + n
        p = req.prompt_len
        if end <= p:
            tokens = req.prompt_token_ids[start:end]
        elif start >= p:
            tokens = req.output_token_ids[start - p:end - p]
        else:
            tokens = req.prompt_token_ids[start:] + req.output_token_ids[:end - p]
        sample = end == req.num_tokens
        if drafts and self.drafts is not None:  # verified in this step: their K/V go in after the decode's
            tokens = tokens + drafts
            end += len(drafts)
            n += len(drafts)
            self.drafts.scheduled(req, drafts)
        self.kv.advance(req, n)
        req.inflight_samples = (1 + len(req.forks_pending)) if sample else 0
        first = time.monotonic() if req.first_scheduled is None else None
        for r in (req, *req.forks_pending):  # samples waiting to fork share the leader's step
            self.kv.fence_at(r, plan.step_id)
            if first is not None:
                r.first_scheduled = first
        score_from = num_scored = 0
        if req.scores_prompt:  # positions q < p - 1 score prompt token q + 1; earlier ones are done
            score_from = max(start, len(req.prompt_logprobs))
            num_scored = max(0, min(end, p - 1) - score_from)
        nb = self.kv.blocks_for(end)
        plan.chunks.append(ScheduledChunk(req, start, n, sample, tokens, list(self.kv.table(req)[:nb]),
                                          self.kv.group_tables(req, nb), req.epoch, drafts,
                                          score_from, num_scored))

    def _grow(self, req: Request, upto: int, scheduled: set[int]) -> bool:
        """Make req's block table cover `upto` tokens, preempting others if needed.

        Returns False if req itself could not be given room (it was preempted or failed).
        """
        q = self.queues
        while not self.kv.grow(req, upto):
            cands = [r for r in q.running
                     if r is not req and r.internal_id not in scheduled
                     and r.fork_leader is None and not r.forks_pending]
            group, deficit = self.kv.deficit(req, upto)  # the pool that lacks most
            victim = pick_victim(self.config.victim_policy, cands, deficit, self.kv, group)
            if victim is None:
                break
            self.lifecycle.preempt(victim)
            self.headroom = min(0.5, self.headroom + 0.05)
        else:
            return True
        if any(self.kv.table(r) for r in q.running if r is not req and r.fork_leader is not req):
            # Others hold the blocks it needs (scheduled this step, or a family waiting to
            # fork): they finish or fork and make room; it resumes then.
            self.lifecycle.preempt(req)
        else:
            # Nothing but req holds blocks: nothing could ever make room for it.
            self.lifecycle.fail(
                req, FinishReason.LENGTH if req.output_token_ids else FinishReason.ERROR,
                f"the KV pool ({self.kv.pools[self.kv.deficit(req, upto)[0]].num_blocks} blocks of "
                f"{self.kv.block_size}) cannot hold {upto} tokens",
            )
        return False

    def _admit(self, req: Request, growth: int = 0, chunk: int | None = None) -> bool:
        """Give a waiting request its blocks for every token it has (prompt, or
        for a preempted one everything it must recompute: it is admitted only when the whole
        re-prefill fits, so a resumption always makes progress); a windowed group's for its
        first chunk (of at most `chunk` tokens). growth: blocks the running requests need for
        their next tokens (see _growth), kept free along with its own in group 0's pool.
        False: not now."""
        q = self.queues
        lookahead = growth + self._growth(req) * (1 + len(req.forks_pending)) if q.running else 0
        if req.status is RequestStatus.SWAPPED:
            if not self.kv.swap_in(req, lookahead):
                return False
        else:
            reserve = math.ceil(self.headroom * self.kv.pool.num_blocks) + lookahead if q.running else 0
            if not self.kv.admit(req, reserve, chunk):
                return False
            if req.status is not RequestStatus.WAITING:
                self.lifecycle.stats.recomputed_tokens += req.num_tokens - self.kv.computed(req)
        q.start(req)
        for r in (req, *req.forks_pending):
            r.move_to(RequestStatus.RUNNING)
        return True


# The scheduler's per-request mark (Request.inflight_samples) changes only here and in
# _add_chunk: the applier calls this when a step's results arrive. (The tokens in flight
# and the fence are the KV manager's: KVManager.landed, KVManager.fork.)
def landed(req: Request) -> None:
    """The step that scheduled req has come back: it samples nothing in flight any more."""
    req.inflight_samples = 0
