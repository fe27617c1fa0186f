"""Applying a step's outcome: the one place where what the worker computed becomes tokens,
stops, failures and outputs.

The worker (worker/step.py) hands back a `StepOutcome`; the core has already applied the
aborts that arrived during the forward, so an aborted request's token is void here like a
preempted one's (its status or epoch moved). For each chunk, in plan order: record its
prompt logprobs, register its full blocks in the prefix cache, let the role take a request
whose prompt is done (a split's prefill side), end a request that generates nothing, fail a
broken row; then each verify run, then each plain token, in chunk order. Every token goes
through the one stop check (output.py) and its grammar's commit; the text phase (detokenize,
stop strings, emit) runs at once, or, with async scheduling, while the next forward runs.
"""

from __future__ import annotations

from collections.abc import Callable

from stopline.engine.families import detach_fork
from stopline.engine.grammars import GrammarHolder
from stopline.engine.output import OutputProcessor, Stop
from stopline.kv.manager import KVManager
from stopline.lifecycle import Lifecycle
from stopline.request import FinishReason, Request, RequestStatus
from stopline.sched import scheduler
from stopline.sched.plan import ScheduledChunk
from stopline.spec.drafts import Drafts
from stopline.worker.sampler import Sampled
from stopline.worker.step import BROKEN, ChunkOutcome, StepOutcome


class StepApplier:
    def __init__(self, lifecycle: Lifecycle, kv: KVManager, outputs: OutputProcessor,
                 grammar: GrammarHolder, drafts: Drafts, *, defer_text: bool,
                 prefilled: Callable[[Request], bool] = lambda req: False) -> None:
        """defer_text: leave the text phase of a running request to `text_phase` (async
        scheduling). prefilled(req): req's prompt is computed; True if it is taken
        elsewhere (a split's prefill role ships its KV) and samples nothing here."""
        self.lifecycle = lifecycle
        self.kv = kv
        self.outputs = outputs
        self.grammar = grammar
        self.drafts = drafts
        self.defer_text = defer_text
        self.prefilled = prefilled
        self.text_pending: list[Request] = []

    def apply(self, outcome: StepOutcome) -> None:
        verifies: list[tuple[ScheduledChunk, ChunkOutcome]] = []
        samples: list[tuple[Request, Sampled | str]] = []
        for ch, out in zip(outcome.plan.chunks, outcome.chunks, strict=True):
            req = ch.req
            scheduler.landed(req)
            self.kv.landed(req)
            if req.status is not RequestStatus.RUNNING or req.epoch != ch.epoch:
                continue  # ended or preempted while the step ran: its result is void
            if ch.drafts:
                verifies.append((ch, out))
                continue
            if out.bad_prompt:
                self.lifecycle.fail(req, FinishReason.ERROR, BROKEN)
                continue
            if out.prompt_logprobs is not None and ch.score_from == len(req.prompt_logprobs):
                req.prompt_logprobs += out.prompt_logprobs  # not already scored by an earlier run
            self.kv.register(req)
            if ch.sample and self.prefilled(req):
                continue  # shipped whole, as it stands (a split's prefill side)
            self.kv.slide(req, ch.start + ch.num_tokens)  # blocks the window passed go back
            if not ch.sample:
                continue
            if req.params.max_tokens == 0:  # scored, nothing to generate
                self._end_unsampled(req)
                continue
            if out.bad:
                self.lifecycle.fail(req, FinishReason.ERROR, BROKEN)
                continue
            samples += out.samples
        for ch, out in verifies:
            self._verify(ch, out)
        for req, _ in samples:
            if req.fork_leader is not None:
                # The family's first token: every sample forks before any token is taken, so
                # a leader that stops on its first token no longer takes its samples along.
                self._fork(req)
        for req, s in samples:
            self._take(req, s)

    def _take(self, req: Request, s: Sampled | str) -> None:
        if req.status is not RequestStatus.RUNNING:
            return
        if isinstance(s, str):  # its grammar can't advance: end it now, never hang
            self.lifecycle.fail(req, FinishReason.ERROR, f"grammar: {s}")
            return
        before = len(req.output_token_ids)
        try:
            stop = self.outputs.append(req, s.token_id, s.logprob)
        except Exception as exc:  # a stop check that fails ends only its own request
            self.lifecycle.fail(req, FinishReason.ERROR, f"output processing failed: {exc!r}")
            return
        why = self.grammar.commit(req, before)
        if why is not None:
            self.lifecycle.fail(req, FinishReason.ERROR, f"grammar: {why}")
            return
        if stop is None and self.grammar.complete(req):
            stop = Stop(FinishReason.STOP, "grammar complete")  # only EOS could follow
        self._to_text(req, stop)

    def _verify(self, ch: ScheduledChunk, out: ChunkOutcome) -> None:
        """Accept the longest prefix of ch's drafts that equals what the sampler drew. Each
        token goes through the one stop check before the next is looked at: nothing after a
        stop is delivered. The run ends at the first token that differs from its draft (that
        token is still the sampler's: delivered), at a stop, or after the last draft. Then
        the rejected positions are rewound: the computed count back, and blocks only they opened
        released."""
        req, drafts = ch.req, ch.drafts
        first_out = len(req.output_token_ids)
        accepted = 0
        stop: Stop | None = None
        failed = None
        for j, s in enumerate(out.run):
            before = len(req.output_token_ids)
            try:
                stop = self.outputs.append(req, s.token_id, s.logprob)
            except Exception as exc:
                failed = f"output processing failed: {exc!r}"
                break
            # The output check wrote other tokens than the sampler's (a thinking budget's end
            # marker): the drafts' K/V from here on belong to tokens that are not the output.
            written = req.output_token_ids[before:] != [s.token_id]
            if written or j == len(drafts) or s.token_id != drafts[j]:
                break
            accepted += 1
            if stop is not None:
                break
        else:
            if out.bad:
                failed = BROKEN
        # Valid K/V: the decode token's and the accepted drafts'.
        self.kv.accept(req, ch.start + 1 + accepted)
        self.kv.register(req)
        self.kv.slide(req, ch.start + 1 + accepted)
        # Drafts after a failure, or after a stop on an accepted draft, were never compared
        # (discarded); drafts after a mismatch are rejected.
        stopped_on_draft = stop is not None and len(req.output_token_ids) - first_out == accepted
        unverified = len(drafts) - accepted if failed or stopped_on_draft else 0
        self.drafts.settle(req, len(drafts), accepted, unverified, "error" if failed else "stop", first_out)
        if failed is not None:
            self.lifecycle.fail(req, FinishReason.ERROR, failed)
            return
        self._to_text(req, stop)

    def _end_unsampled(self, req: Request) -> None:
        """max_tokens 0: the prompt is scored; every sample ends at once with no tokens."""
        for m in list(req.forks_pending):
            self._fork(m)
            m.prompt_logprobs = list(req.prompt_logprobs)
            self.lifecycle.finish(m, FinishReason.LENGTH, "max_tokens")
        self.lifecycle.finish(req, FinishReason.LENGTH, "max_tokens")

    def _fork(self, sample: Request) -> None:
        leader = sample.fork_leader
        assert leader is not None  # only samples that wait for a leader fork
        self.kv.fork(sample, leader)
        sample.prompt_logprobs = list(leader.prompt_logprobs)  # the prompt is the same
        detach_fork(sample)

    # ---- the text phase ---------------------------------------------------------------------
    def _to_text(self, req: Request, stop: Stop | None) -> None:
        if stop is None and self.defer_text:
            self.text_pending.append(req)  # detokenized while the next forward runs
        else:
            self._text(req, stop)

    def _text(self, req: Request, stop: Stop | None) -> None:
        """Text phase of one request: detokenize, check stop strings, emit or finish."""
        try:
            cut = self.outputs.catch_up(req)
            if cut is not None:
                self.drafts.truncated(req)  # a stop string inside an accepted run
            stop = cut or stop
        except Exception as exc:
            self.lifecycle.fail(req, FinishReason.ERROR, f"output processing failed: {exc!r}")
            return
        if stop is not None:
            self.lifecycle.finish(req, *stop)
        else:
            self.outputs.step_output(req)

    def text_phase(self) -> bool:
        """The deferred text phases; True if there were any."""
        pending, self.text_pending = self.text_pending, []
        for req in pending:
            # Not aborted meanwhile. A request preempted since its token was sampled still
            # gets its stop check and output now, as it would have without preemption.
            if not req.status.is_finished:
                self._text(req, None)
        return bool(pending)
