"""The step plan: what the scheduler decided for one step, and all the model runner reads.

The plan is the only thing that crosses from the scheduler to the forward pass. With async
scheduling the forward runs on another thread while this one may end requests, so a chunk
carries its own copies of what the runner reads (tokens and block table): a request that
ends meanwhile can't change the step in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stopline.request import Request


@dataclass
class ScheduledChunk:
    req: Request
    start: int  # first position computed in this step
    num_tokens: int
    sample: bool  # the chunk reaches the request's last token: a new token is sampled
    token_ids: list[int] = field(default_factory=list)  # the tokens at [start, start + num_tokens)
    block_ids: list[int] = field(default_factory=list)  # the table covering them (a copy)
    group_tables: list[list[int]] = field(default_factory=list)  # layer groups 1 ..'s (copies)
    epoch: int = 0  # the request's epoch when scheduled: a result for an older one is void
    # Speculative decoding: the drafted tokens at the end of token_ids. The chunk then needs
    # logits at its last len(drafts) + 1 rows: one per token that may be accepted.
    drafts: list[int] = field(default_factory=list)
    # Prompt logprobs: positions [score_from, score_from + num_scored) need their logits to
    # score the prompt token after each.
    score_from: int = 0
    num_scored: int = 0

    @property
    def num_logits(self) -> int:
        return (1 + len(self.drafts)) if self.sample else 0


@dataclass
class StepPlan:
    step_id: int
    chunks: list[ScheduledChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def requests(self) -> list[Request]:
        return [c.req for c in self.chunks]
