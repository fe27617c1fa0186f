"""Draft tokens as per-request state: a holder of the one release (stopline/lifecycle.py).

For each request it holds the n-gram index over its tokens and the drafts of the verify
step in flight. Every draft is counted once as drafted and then once as what became of it:
accepted or rejected when its step is processed, or discarded when the step's result is
void (the request was cancelled, preempted or failed meanwhile) or comes after a stop
inside the accepted run. Only accepted and rejected drafts were verified, so only they
enter the acceptance the auto mode steers by (docs/speculative.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from stopline.config import EngineConfig, SpecMode
from stopline.request import FinishReason, Request
from stopline.spec.ngram import NgramIndex
from stopline.spec.policy import StepCosts, best_k
from stopline.stats import StopStats

FIRST = 0.5  # the acceptance a request's drafts are assumed to have before any is verified
PRIOR = 2.0  # ... weighted as this many verified drafts
EXPLORE_DRAFTS = 4  # drafts of the one request per step that measures verify rows' cost


@dataclass
class _State:
    index: NgramIndex = field(default_factory=NgramIndex)
    inflight: int = 0  # drafts in the step in flight
    accepted: int = 0  # verified drafts accepted ...
    misses: int = 0  # ... and verify runs ended by a rejected draft (the acceptance's estimate)
    run: tuple[int, int] = (0, 0)  # the last run's accepted drafts: output indices [a, b)
    runs: int = 0  # verify runs processed


def _reason(req: Request) -> str:
    if req.finish_reason in (FinishReason.ABORT, FinishReason.TIMEOUT):
        return "cancel"
    if req.finish_reason is FinishReason.ERROR:
        return "error"
    return "stop"


class Drafts:
    name = "drafts"

    def __init__(self, config: EngineConfig, stats: StopStats, max_model_len: int) -> None:
        self.mode = SpecMode(config.speculative)
        self.most = config.speculative_tokens
        self.stats = stats
        self.max_model_len = max_model_len
        self.costs = StepCosts()
        self.state: dict[int, _State] = {}
        self.step = 0
        self.decodes = 0  # decodes in the step being scheduled
        self.exploring = False  # a request of this step already measures verify rows' cost

    @property
    def enabled(self) -> bool:
        return self.mode is not SpecMode.OFF

    # ---- scheduling ---------------------------------------------------------------------
    def begin_step(self, step: int, decodes: int) -> None:
        self.step, self.decodes = step, decodes
        self.exploring = False

    def alpha(self, req: Request) -> float:
        """The chance that a draft of req is accepted: its own verified drafts, with FIRST as
        the prior. Not the engine's: one request quoting its prompt says nothing of the next
        one's text, and a stream of free answers must not stop a quote from ever drafting."""
        st = self.state.get(req.internal_id)
        if st is None or not st.runs:
            return FIRST
        return (st.accepted + PRIOR * FIRST) / (st.accepted + st.misses + PRIOR)

    def propose(self, req: Request, room: int) -> list[int]:
        """Drafts for req's next step (room: rows the step has left beside its decode row)."""
        # Structured output does not speculate yet: a draft's tokens would have to advance the
        # grammar's matcher one by one and roll it back when rejected.
        if not self.enabled or req.params.grammar is not None:
            return []
        most = min(self.most, room, req.max_tokens - len(req.output_token_ids) - 1,
                   self.max_model_len - req.num_tokens - 1)
        if most <= 0:
            return []
        st = self.state.setdefault(req.internal_id, _State())
        if self.mode is SpecMode.ON:
            return st.index.propose(req.all_token_ids, most)
        plain = self.costs.plain_ms(self.decodes)
        if plain is None:
            return []  # measure a plain step first
        extra = self.costs.extra_ms(self.decodes, self.step)
        if extra is None:  # measure what verify rows cost at this batch size: one request a step
            if self.exploring:
                return []
            draft = st.index.propose(req.all_token_ids, min(most, EXPLORE_DRAFTS))
            self.exploring = bool(draft)
            return draft
        # Ask the index only when a draft could pay at all: in a full batch of free answers no
        # draft does, and a lookup per request per step is then pure overhead.
        tokens_per_ms = self.decodes / max(plain, 1e-6)
        alpha = self.alpha(req)
        if best_k(alpha, most, extra, tokens_per_ms) == 0:
            return []
        draft = st.index.propose(req.all_token_ids, most)
        return draft[:best_k(alpha, len(draft), extra, tokens_per_ms)]

    def scheduled(self, req: Request, drafts: list[int]) -> None:
        self.state.setdefault(req.internal_id, _State()).inflight = len(drafts)
        self.stats.spec_drafted += len(drafts)
        req.spec_drafted += len(drafts)

    # ---- results ------------------------------------------------------------------------
    def settle(self, req: Request, drafted: int, accepted: int, unverified: int, reason: str,
               first_out: int) -> None:
        """The verify step of req was processed: `accepted` drafts matched the sampled tokens;
        the last `unverified` were never compared (a stop or a failure came first: discarded
        for `reason`); the rest were rejected. first_out: the output index of the run's
        first token."""
        st = self.state.setdefault(req.internal_id, _State())
        st.inflight = 0
        st.runs += 1
        rejected = drafted - accepted - unverified
        st.accepted += accepted
        st.misses += 1 if rejected else 0
        st.run = (first_out, first_out + accepted)
        self.stats.spec_verify_steps += 1
        self.stats.spec_accepted += accepted
        self.stats.spec_rejected += rejected
        req.spec_accepted += accepted
        req.spec_rejected += rejected
        self._discard(req, unverified, reason)

    def truncated(self, req: Request) -> None:
        """A stop string cut req's output inside its last run: the accepted drafts after the
        cut were never delivered, so they count as discarded, not accepted."""
        st = self.state.get(req.internal_id)
        if st is None:
            return
        a, b = st.run
        cut = max(0, b - max(a, len(req.output_token_ids)))
        if cut:
            st.run = (a, b - cut)
            self.stats.spec_accepted -= cut
            req.spec_accepted -= cut
            self._discard(req, cut, "stop")

    def _discard(self, req: Request, n: int, reason: str) -> None:
        if n > 0:
            self.stats.spec_discarded[reason] += n
            req.spec_discarded += n

    def observe(self, rows: list[tuple[int, int]], t0: float) -> None:
        """A processed step, as (tokens, drafts) per row, begun at perf_counter() t0. The auto
        mode learns the cost of steps of decode and verify rows only (a prefill's rows cost
        otherwise), sampling included: a verify samples its rows one by one."""
        if not self.enabled or any(n > 1 + d for n, d in rows):
            return
        ms = (time.perf_counter() - t0) * 1000
        self.costs.observe(len(rows), sum(d for _, d in rows), ms, self.step)

    # ---- holder -------------------------------------------------------------------------
    def release(self, req: Request) -> None:
        """req ended: drafts of a step in flight will never be verified."""
        st = self.state.pop(req.internal_id, None)
        if st is not None:
            self._discard(req, st.inflight, _reason(req))

    def preempt(self, req: Request) -> None:
        """Drafts in flight are void (the epoch voids the step's result); the index stays, since
        the request keeps its tokens."""
        st = self.state.get(req.internal_id)
        if st is not None and st.inflight:
            self._discard(req, st.inflight, "preempt")
            st.inflight = 0

    def holds(self, req: Request) -> bool:
        return req.internal_id in self.state
