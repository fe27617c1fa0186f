"""Hand-built step results: an engine core whose forward pass is a script.

`ScriptedRunner` stands in for the model runner: every sampled row's logits are one-hot at
the token the script picks, so greedy sampling draws exactly that token. `OutcomeWorker`
stands in for the whole worker: each step's `StepOutcome` (tokens, broken rows) is built by
hand, with no logits at all. The engine's stop
path (scheduler, KV manager, lifecycle, holders, outputs) runs for real, in milliseconds,
with no forward pass. `hand_driven` builds the stop path's pieces alone, without even an
engine core, for the scheduler and KV manager tests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.kv.block_pool import BlockPool
from stopline.kv.kv_cache import KVCache, SwapSpace
from stopline.kv.manager import KVManager
from stopline.lifecycle import Lifecycle
from stopline.request import Request
from stopline.sched.plan import ScheduledChunk, StepPlan
from stopline.sched.queues import Queues
from stopline.sched.scheduler import Scheduler, landed
from stopline.stats import StopStats
from stopline.worker.runner import StepResult
from stopline.worker.sampler import Sampled
from stopline.worker.step import ChunkOutcome, StepOutcome

Script = Callable[[ScheduledChunk], int]


def next_token(vocab: int) -> Script:
    """A deterministic script: the next token depends on the request's tokens only."""
    def pick(ch: ScheduledChunk) -> int:
        req = ch.req
        return 3 + (sum(req.prompt_token_ids) * 31 + 7 * len(req.output_token_ids)) % (vocab - 3)
    return pick


class ScriptedRunner:
    rows = None

    def __init__(self, vocab: int, script: Script) -> None:
        self.vocab = vocab
        self.script = script
        self.before: Callable[[StepPlan], None] | None = None  # runs inside execute, first
        self.calls = 0

    def execute(self, plan: StepPlan, interrupt: threading.Event | None = None) -> StepResult:
        self.calls += 1
        if self.before is not None:
            self.before(plan)
        index: dict[int, int] = {}
        picks: list[int] = []
        for ci, ch in enumerate(plan.chunks):
            if ch.sample:
                index[ci] = len(picks)
                picks.append(self.script(ch))
        logits = torch.full((len(picks), self.vocab), -20.0)
        for row, tok in enumerate(picks):
            logits[row, tok] = 20.0
        return StepResult(plan, logits, index)


def scripted_engine(loaded, script: Script | None = None, **config: object) -> EngineCore:
    # No drafts: the script picks one token per sampling chunk, not one per verify row.
    cfg = dict(block_size=4, num_blocks=64, max_num_seqs=16, max_num_batched_tokens=32,
               target_step_ms=None, debug=True, speculative="off")
    cfg.update(config)
    vocab = loaded.config.vocab_size
    return EngineCore(loaded, EngineConfig(**cfg),
                      runner=ScriptedRunner(vocab, script or next_token(vocab)))


Outcome = Callable[[ScheduledChunk], "int | ChunkOutcome"]


class OutcomeWorker:
    """The worker's stand-in: `outcome(ch)` gives each sampling chunk's token (for every
    sample of it), or a whole ChunkOutcome (a broken row, a verify run)."""

    rows = None

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.before: Callable[[StepPlan], None] | None = None  # runs inside run, first
        self.steps = 0

    def run(self, plan: StepPlan, interrupt: threading.Event | None = None) -> StepOutcome:
        self.steps += 1
        if self.before is not None:
            self.before(plan)
        outs = []
        for ch in plan.chunks:
            got = self.outcome(ch) if ch.sample else ChunkOutcome()
            if isinstance(got, int):
                got = ChunkOutcome(samples=[(m, Sampled(got, None)) for m in [ch.req, *ch.req.forks_pending]])
            outs.append(got)
        return StepOutcome(plan, outs)


def outcome_engine(loaded, outcome: Outcome, **config: object) -> EngineCore:
    cfg = dict(block_size=4, num_blocks=64, max_num_seqs=16, max_num_batched_tokens=32,
               target_step_ms=None, debug=True, speculative="off")
    cfg.update(config)
    return EngineCore(loaded, EngineConfig(**cfg), worker=OutcomeWorker(outcome))


class HandDriven:
    """The scheduler, KV manager and lifecycle alone, stepped by hand: `step(tokens)` plans a
    step and completes it with the given sampled tokens (by request), as the core would."""

    def __init__(self, num_blocks: int = 16, block_size: int = 4, swap: bool = False,
                 window: int = 0, more: Sequence[int] = (), local_blocks: int | None = None,
                 **config: object) -> None:
        """window: the layers' sliding window (KVManager's): blocks it passed go back as
        steps complete, as the core's apply does. more: the windows of further layer
        groups (one layer each, a pool of local_blocks each, num_blocks if None: `pools`)."""
        cfg = dict(block_size=block_size, num_blocks=num_blocks, max_num_seqs=8,
                   max_num_batched_tokens=64, target_step_ms=None, debug=True,
                   admission_lookahead=0, preemption_mode="swap" if swap else "recompute")
        cfg.update(config)
        self.config = EngineConfig(**cfg)
        self.pool = BlockPool(num_blocks, block_size)
        self.stats = StopStats()
        sizes = [num_blocks] + [local_blocks or num_blocks for _ in more]
        self.pools = [self.pool] + [BlockPool(n, block_size) for n in sizes[1:]]
        layer_group = list(range(len(self.pools))) if more else None
        self.cache = (KVCache(len(self.pools), num_blocks, block_size, 1, 2, layer_group=layer_group,
                              group_blocks=sizes) if swap else None)
        self.swap = SwapSpace(sum(sizes)) if swap else None
        self.kv = KVManager(self.pool, self.cache, self.swap, self.stats, window=window,
                            more=list(zip(self.pools[1:], more, strict=True)))
        self.queues = Queues()
        holders = [self.queues, self.kv]
        self.lifecycle = Lifecycle(self.config, self.kv, holders, self.stats)
        self.sched = Scheduler(self.config, self.kv, self.queues, self.lifecycle)
        self.live: list[Request] = []

    def add(self, rid: str, prompt_len: int, max_tokens: int = 8, first_token: int = 3) -> Request:
        from stopline.request import SamplingParams

        req = Request(rid, list(range(first_token, first_token + prompt_len)),
                      SamplingParams(max_tokens=max_tokens, temperature=0.0), incarnation=rid)
        self.sched.add(req)
        self.live.append(req)
        return req

    def plan(self) -> StepPlan:
        return self.sched.schedule()

    def complete(self, plan: StepPlan, token: int = 7) -> None:
        """The step's result: every sampling chunk draws `token`; blocks fenced by it return."""
        for ch in plan.chunks:
            req = ch.req
            landed(req)
            self.kv.landed(req)
            if req.status.is_finished or req.epoch != ch.epoch:
                continue
            self.kv.register(req)
            self.kv.slide(req, ch.start + ch.num_tokens)
            if ch.sample:
                req.output_token_ids.append(token)
        self.kv.step_processed(plan.step_id)

    def audit(self) -> None:
        self.live = [r for r in self.live if not r.status.is_finished]
        self.lifecycle.audit(self.live)
