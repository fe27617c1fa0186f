"""The worker's step: a plan goes down, a `StepOutcome` comes back.

`StepWorker.run(plan)` runs the forward (runner.py) and everything that reads its logits:
which rows are broken (NaN or infinite), the prompt logprobs, each sampled token with its
grammar mask, and each verify run sampled row by row against the request's history plus the
drafts before the row, so speculation stays lossless to the bit. The engine core applies
the outcome in one place (engine/apply.py) and never touches logits. With async scheduling
the same `run` is called on the forward thread: there is one sampling path.

Reading requests here is safe on either thread: a chunk's row is sampled whatever its
request becomes meanwhile, and the core voids the outcome of a request that ended or was
preempted (its epoch moved) while the step ran.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from stopline.kv.decode_rows import DecodeRows
from stopline.request import Request, RequestStatus, TokenLogprob
from stopline.sched.plan import ScheduledChunk, StepPlan
from stopline.worker.runner import StepResult
from stopline.worker.sampler import Sampled, SampleTask, nonfinite_rows, sample, score_tokens

BROKEN = "the model produced NaN or infinite logits"


class Forward(Protocol):
    """What runs a step's forward pass: the model runner, or a test's scripted stand-in."""

    rows: DecodeRows | None

    def execute(self, plan: StepPlan, interrupt: threading.Event | None = None) -> StepResult: ...


class Masks(Protocol):
    """Where grammar masks come from (the engine's grammar holder)."""

    def masks(self, reqs: Sequence[Request]) -> tuple[dict[int, torch.Tensor], dict[int, str]]: ...


@dataclass
class ChunkOutcome:
    """What one scheduled chunk produced."""

    # Prompt logprobs of the chunk's scored positions (None: none scored, or broken rows).
    prompt_logprobs: list[TokenLogprob] | None = None
    bad_prompt: bool = False  # a scoring row is broken: the request fails, nothing is kept
    # A plain sampling chunk: one draw per sample (the request and the samples waiting to
    # fork from it), or why its grammar can't advance.
    samples: list[tuple[Request, Sampled | str]] = field(default_factory=list)
    # A verify chunk: row j drawn as if drafts[:j] were accepted, up to the first token that
    # differs from its draft, or through the last row.
    run: list[Sampled] = field(default_factory=list)
    bad: bool = False  # the row after `run` (the sampled row, for a plain chunk) is broken


@dataclass
class StepOutcome:
    plan: StepPlan
    chunks: list[ChunkOutcome]  # one per plan.chunks, in order

    @property
    def failed(self) -> list[int]:
        """Chunk indices whose rows were broken."""
        return [i for i, c in enumerate(self.chunks) if c.bad or c.bad_prompt]


class Worker(Protocol):
    """What the core calls to run a step: StepWorker, or a test's scripted outcomes."""

    rows: DecodeRows | None

    def run(self, plan: StepPlan, interrupt: threading.Event | None = None) -> StepOutcome: ...


def _live(ch: ScheduledChunk) -> bool:
    """False: the request ended or was preempted before its rows were read (its outcome is
    void, the core drops it); the rows are skipped."""
    return ch.req.status is RequestStatus.RUNNING and ch.req.epoch == ch.epoch


class StepWorker:
    def __init__(self, forward: Forward, eos_token_ids: Collection[int], masks: Masks | None = None) -> None:
        self.forward = forward
        self.eos = frozenset(eos_token_ids)
        self.grammar = masks

    @property
    def rows(self) -> DecodeRows | None:
        return self.forward.rows

    def run(self, plan: StepPlan, interrupt: threading.Event | None = None) -> StepOutcome:
        result = self.forward.execute(plan, interrupt)
        logits = result.logits
        bad_rows = result.bad_rows if result.bad_rows is not None else nonfinite_rows(logits)
        outs = [ChunkOutcome() for _ in plan.chunks]
        tasks: list[SampleTask] = []
        owners: list[int] = []  # chunk index of each task
        for ci, ch in enumerate(plan.chunks):
            out = outs[ci]
            if not _live(ch):
                continue
            if ch.num_scored:
                self._score(ch, result.score_index[ci], logits, bad_rows, out)
            if out.bad_prompt or not ch.sample or ch.req.params.max_tokens == 0:
                continue
            row = result.logit_index[ci]
            if ch.drafts:
                self._verify(ch, row, logits, bad_rows, out)
            elif row in bad_rows:
                out.bad = True
            else:
                members = [ch.req, *ch.req.forks_pending]
                tasks += [SampleTask(row, m) for m in members]
                owners += [ci] * len(members)
        for ci, task, s in zip(owners, tasks, self._sample(logits, tasks), strict=True):
            outs[ci].samples.append((task.req, s))
        return StepOutcome(plan, outs)

    @staticmethod
    def _score(ch: ScheduledChunk, row0: int, logits: torch.Tensor, bad_rows: set[int],
               out: ChunkOutcome) -> None:
        if any(row0 + j in bad_rows for j in range(ch.num_scored)):
            out.bad_prompt = True
            return
        req = ch.req
        nxt = req.prompt_token_ids[ch.score_from + 1:ch.score_from + 1 + ch.num_scored]
        out.prompt_logprobs = score_tokens(logits[row0:row0 + ch.num_scored], nxt,
                                           req.params.prompt_logprobs or 0)

    def _verify(self, ch: ScheduledChunk, row0: int, logits: torch.Tensor, bad_rows: set[int],
                out: ChunkOutcome) -> None:
        """Row j of a verify chunk holds the logits after the decode token and j drafts:
        exactly what plain decoding would have had there had it drawn those drafts. So it
        is sampled as plain decoding would sample it (the counter-based key of that token,
        penalties over that history, min_tokens), one row at a time, and the run ends at
        the first draw that differs from its draft (still the sampler's token) or after the
        last row. Structured requests never draft (spec/drafts.py), so no mask applies."""
        drafts = ch.drafts
        for j in range(len(drafts) + 1):
            if row0 + j in bad_rows:
                out.bad = True
                return
            s = sample(logits, [SampleTask(row0 + j, ch.req, drafts[:j])], self.eos)[0]
            out.run.append(s)
            if j == len(drafts) or s.token_id != drafts[j]:
                return

    def _sample(self, logits: torch.Tensor, tasks: list[SampleTask]) -> list[Sampled | str]:
        """sample() with each structured request's grammar mask; a task whose grammar can't
        advance gets the reason instead of a token (its request fails in this step)."""
        if not tasks:
            return []
        if self.grammar is None:
            return list(sample(logits, tasks, self.eos))
        masks, stuck = self.grammar.masks([t.req for t in tasks])
        if not stuck:
            return list(sample(logits, tasks, self.eos, masks))
        keep = [i for i in range(len(tasks)) if i not in stuck]
        got = sample(logits, [tasks[i] for i in keep], self.eos,
                     {j: masks[i] for j, i in enumerate(keep) if i in masks}) if keep else []
        drawn = dict(zip(keep, got, strict=True))
        return [stuck[i] if i in stuck else drawn[i] for i in range(len(tasks))]
