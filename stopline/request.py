"""Request state: status, finish reasons, sampling parameters, and the legal transitions.

Every status change goes through `Request.move_to`, which checks the transition table below,
so an illegal move (say, a finished request scheduled again) fails loudly at the point it
happens instead of showing up later as a leaked block.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # admitted to the engine, holds no blocks
    # Its grammar compiles off the step thread; it joins the queue once that is done (or
    # ends with an error if the compile fails or passes its deadline). Holds no blocks.
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    RUNNING = "running"  # holds blocks; prefilling until its computed tokens reach num_tokens
    PREEMPTED = "preempted"  # blocks released; resumes by recomputing its tokens
    SWAPPED = "swapped"  # blocks copied to host swap space; resumes by copying back
    FINISHED = "finished"  # terminal; see Request.finish_reason

    @property
    def is_finished(self) -> bool:
        return self is RequestStatus.FINISHED


_LEGAL: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset(
        {RequestStatus.RUNNING, RequestStatus.WAITING_FOR_GRAMMAR, RequestStatus.FINISHED}
    ),
    RequestStatus.WAITING_FOR_GRAMMAR: frozenset({RequestStatus.WAITING, RequestStatus.FINISHED}),
    RequestStatus.RUNNING: frozenset(
        {RequestStatus.PREEMPTED, RequestStatus.SWAPPED, RequestStatus.FINISHED}
    ),
    RequestStatus.PREEMPTED: frozenset({RequestStatus.RUNNING, RequestStatus.FINISHED}),
    RequestStatus.SWAPPED: frozenset({RequestStatus.RUNNING, RequestStatus.FINISHED}),
    RequestStatus.FINISHED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A request was moved between two states the state machine does not connect."""


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client cancel, disconnect, shutdown
    TIMEOUT = "timeout"  # queue timeout or deadline
    PREEMPTED = "preempted"  # preempted too often to ever finish
    ERROR = "error"  # something that concerns this request failed


class AbortSource(str, enum.Enum):
    CANCEL = "cancel"  # an explicit cancel call
    DISCONNECT = "disconnect"  # the client went away
    SHUTDOWN = "shutdown"  # the engine is stopping
    DEADLINE = "deadline"  # queue timeout or total deadline passed
    STALLED = "stalled"  # the client read nothing for the stall timeout
    SIBLING = "sibling"  # another engine request of the same HTTP request failed
    # The engine's own stops (docs/engine-stops.md): the client gets an error, not a success.
    PAUSE = "pause"  # POST /pause?mode=abort
    SLEEP = "sleep"  # POST /sleep with mode abort
    UPDATE = "update"  # POST /update_weights with mode abort
    REPLICA = "replica"  # the replica or role serving it died
    UNLOAD = "unload"  # its LoRA adapter was unloaded with the abort policy

    @property
    def engine_initiated(self) -> bool:
        """The engine ended it on its own (not the client, not its deadline): an error."""
        return self in _ENGINE_SOURCES


_ENGINE_SOURCES = frozenset({AbortSource.SHUTDOWN, AbortSource.PAUSE, AbortSource.SLEEP,
                             AbortSource.UPDATE, AbortSource.REPLICA})


class InvalidRequest(ValueError):
    """The request cannot be served as given; nothing was allocated for it."""


class UnknownAdapter(InvalidRequest):
    """The request names a model that is neither the base model nor a loaded LoRA adapter."""


@dataclass
class ReasoningSpec:
    """A request whose model thinks before it answers: the thinking sits between `start_ids`
    and `end_ids` (the markers as the tokenizer encodes them) and is delivered apart from the
    answer. `opened`: the prompt ends inside the thinking (the template wrote the start
    marker), else the output may open it. `max_thinking_tokens`: the budget; past it the
    engine writes the end marker itself and the answer follows (None: no budget)."""

    start_ids: Sequence[int]
    end_ids: Sequence[int]
    opened: bool = True
    max_thinking_tokens: int | None = None


@dataclass
class SamplingParams:
    """How to sample and when to stop. Validated by `validate()` before admission."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: sampled token plus top-k alternatives
    # The prompt's own tokens scored (echo + logprobs): each token's log-probability given
    # the ones before it, plus top-k alternatives. The first token has none. Such a prompt
    # skips the prefix cache: a cached block's logits were never computed.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    queue_timeout: float | None = None  # seconds a request may wait before its first step
    deadline: float | None = None  # seconds from arrival to terminal output
    priority: int = 0  # lower value = more important (used by the priority victim policy)
    # An llguidance grammar (stopline.grammar.formats / tools make one from response_format
    # and tools): every sampled token must keep the output a prefix of its language.
    grammar: str | None = None
    # token id -> added to its logit before sampling (OpenAI's logit_bias: <= 300, [-100, 100])
    logit_bias: Mapping[int, float] | None = None
    reasoning: ReasoningSpec | None = None  # the model thinks first (see ReasoningSpec)
    # The LoRA adapter (its served model name) this request runs under; None: the base model.
    lora: str | None = None

    def validate(self) -> None:
        def bad(name: str, why: str) -> InvalidRequest:
            return InvalidRequest(f"{name}: {why}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 0):
            raise bad("max_tokens", f"must be an integer >= 0, got {self.max_tokens!r}")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            # 0 scores a prompt without generating: without prompt logprobs it would do nothing.
            raise bad("max_tokens", "0 is only meaningful with prompt logprobs (echo with logprobs)")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"{self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise bad("top_k", f"must be >= 0 (0 disables it), got {self.top_k!r}")
        if not (0 <= self.min_p <= 1):
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if not (-2 <= self.presence_penalty <= 2):
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        if not (-2 <= self.frequency_penalty <= 2):
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or not 0 <= k <= 20):
                raise bad(name, f"must be an integer in [0, 20], got {k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise bad("grammar", "must be a non-empty grammar string")
        if self.logit_bias:
            if len(self.logit_bias) > 300:
                raise bad("logit_bias", f"at most 300 entries, got {len(self.logit_bias)}")
            for tok, v in self.logit_bias.items():
                if not isinstance(tok, int) or tok < 0 or not (-100 <= v <= 100):
                    raise bad("logit_bias", f"token ids >= 0 with values in [-100, 100], got {tok!r}: {v!r}")
        r = self.reasoning
        if r is not None:
            if not r.end_ids or (not r.opened and not r.start_ids):
                raise bad("reasoning", "the thinking markers must be non-empty")
            if r.max_thinking_tokens is not None and (not isinstance(r.max_thinking_tokens, int)
                                                      or r.max_thinking_tokens < 0):
                raise bad("max_thinking_tokens", f"must be an integer >= 0, got {r.max_thinking_tokens!r}")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise bad("lora", f"must be an adapter's name, got {self.lora!r}")
        for name in ("queue_timeout", "deadline"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise bad(name, f"must be > 0 seconds, got {v!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) alternatives, best first


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # Tokens the engine computed for this request that the client never received
    # (computed in the step in flight when it was aborted or finished).
    undelivered_tokens: int = 0
    # Speculative decoding: drafts verified for this request, and what became of them.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0
    discarded_draft_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, those of the thinking (markers included)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


_internal_ids = itertools.count()
NOT_YET = 1 << 62  # a reasoning boundary the output has not reached


@dataclass(eq=False)
class Request:
    """One sequence the scheduler runs. A family with n > 1 has one Request per sample."""

    request_id: str  # the caller's id; may be reused once the terminal output is out
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    index: int = 0  # sample index within its family
    family: Family | None = None
    internal_id: int = field(default_factory=lambda: next(_internal_ids))
    # Unique per admission (shared by a family's samples): aborts and outputs name it, so a
    # late abort can never reach a newer request that reuses request_id.
    incarnation: str = ""

    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_detail: str | None = None  # what matched, or where an abort came from
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # With params.prompt_logprobs: the score of prompt token q + 1 given tokens 0..q, for
    # q < num_prompt_scored; delivered once, with the first output.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    # Its KV state (block table, computed, cached and hashed counts, prefix hashes, swap
    # slots) is the KV manager's (stopline/kv/manager.py), read through it.

    # Bookkeeping for the stop path.
    first_scheduled: float | None = None
    inflight_samples: int = 0  # tokens the step in flight will sample for this request
    num_preemptions: int = 0
    epoch: int = 0  # bumped by every preemption: a step result for an older epoch is void
    aborted_at: float | None = None  # time.monotonic() of the accepted abort
    paused: bool = False  # its client's stream is full: it takes no step until read
    # Tokens computed for it that the client never gets: those cut from its stream at an
    # abort (the output side's count) and those of the step in flight when it ended (the
    # lifecycle's): each field has one writer.
    undelivered: int = 0
    undelivered_in_flight: int = 0
    # Speculative decoding's per-request counts (see Usage).
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_rejected: int = 0
    spec_discarded: int = 0
    seed: int = 0  # resolved at admission so that sampling is reproducible after preemption
    text: str = ""  # detokenized output (stop strings already cut)
    num_detokenized: int = 0  # output tokens already turned into text
    sent_text_len: int = 0
    sent_tokens: int = 0
    # Reasoning (params.reasoning), written by the output processor alone: output tokens
    # [think_begin, think_end) are the thinking, [answer_begin, ...) the answer, the rest
    # markers. NOT_YET: that boundary is still ahead. Output tokens never change on
    # preemption, so neither do these: a resumed request is in the phase it left.
    think_begin: int = 0
    think_end: int = 0
    answer_begin: int = 0
    reasoning_text: str = ""  # detokenized thinking
    sent_reasoning_len: int = 0
    # n > 1: the first sample prefills the prompt; the others wait, holding references to
    # its blocks, and fork from it when it samples its first token.
    fork_leader: Request | None = None
    forks_pending: list[Request] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def scores_prompt(self) -> bool:
        """Prompt logprobs were asked for and some prompt position is still unscored."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.prompt_len - 1

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens if self.params.max_tokens is not None else 1 << 30

    def move_to(self, status: RequestStatus) -> None:
        if status not in _LEGAL[self.status]:
            raise IllegalTransition(
                f"request {self.request_id!r}: {self.status.value} -> {status.value} is not allowed"
            )
        self.status = status

    def usage(self, cached_tokens: int = 0) -> Usage:
        """cached_tokens: its prompt tokens the prefix cache served (the KV manager's count)."""
        return Usage(
            prompt_tokens=self.prompt_len,
            completion_tokens=self.sent_tokens,
            cached_tokens=cached_tokens,
            undelivered_tokens=self.undelivered + self.undelivered_in_flight,
            draft_tokens=self.spec_drafted,
            accepted_draft_tokens=self.spec_accepted,
            rejected_draft_tokens=self.spec_rejected,
            discarded_draft_tokens=self.spec_discarded,
            reasoning_tokens=min(self.sent_tokens, self.answer_begin),
        )

    @property
    def thinking(self) -> bool:
        """In the thinking (or not yet past the place where it may open)."""
        return self.answer_begin == NOT_YET


@dataclass(eq=False)
class Family:
    """The n samples of one prompt. Admitted together, aborted together."""

    request_id: str
    members: list[Request]
    incarnation: str = ""

    def live(self) -> list[Request]:
        return [r for r in self.members if not r.status.is_finished]
