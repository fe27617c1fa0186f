"""From sampled tokens to client-facing outputs: detokenize, check stops, assemble deltas.

`append` and `catch_up` are the only place that decides a request is done by its own output
(EOS, stop token, stop string, max_tokens, context limit); they hand the decision to the
lifecycle. They also decide a thinking request's phase (params.reasoning): where its
thinking ends, and, past its budget, that the engine writes the end marker itself. Stop
strings apply to the answer only; the markers reach neither the thinking nor the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from stopline.request import NOT_YET, FinishReason, Request, TokenLogprob, Usage
from stopline.tokenizer.detokenizer import IncrementalDetokenizer
from stopline.tokenizer.tokenizer import Tokenizer


class Stop(NamedTuple):
    """A request's own output ended it."""

    reason: FinishReason
    detail: str  # "eos", "stop_token_id:N", "max_tokens", "max_model_len", or the stop string


@dataclass
class RequestOutput:
    """What a client receives for one sample of a request in one step."""

    request_id: str
    index: int
    incarnation: str = ""  # the admission this output belongs to (see Request.incarnation)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""  # the answer; a thinking request's thinking is in new_reasoning
    new_reasoning: str = ""
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Once, in the first output after the prompt is scored: the score of prompt tokens 1.. (the
    # first has none). None unless prompt logprobs were asked for.
    prompt_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_detail: str | None = None
    usage: Usage | None = None  # set on the terminal output
    # The weights its tokens came from (EngineCore.weight_version), stamped as it leaves the
    # core; a request that spans a weight update sees it change between outputs.
    weight_version: int = 0


class OutputProcessor:
    """Also a holder of the one release (lifecycle.py): a request's detokenizer lives here
    from its admission to its terminal output."""

    name = "outputs"

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int,
                 cached: Callable[[Request], int] = lambda req: 0) -> None:
        """cached(req): req's prompt tokens the prefix cache served (the KV manager's count,
        read before the KV manager releases it: it is the last holder)."""
        self.cached = cached
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.detok: dict[int, IncrementalDetokenizer] = {}
        self.pending: dict[int, RequestOutput] = {}

    def start(self, req: Request) -> None:
        self.detok[req.internal_id] = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=req.params.skip_special_tokens,
            prompt_token_ids=req.prompt_token_ids)
        r = req.params.reasoning
        # A grammar masks from the first token the output may open the thinking with: such
        # an output can't open it, and is all answer.
        if r is not None and not req.output_token_ids and (r.opened or req.params.grammar is None):
            req.think_begin = 0 if r.opened else NOT_YET
            req.think_end = req.answer_begin = NOT_YET

    def append(self, req: Request, token: int, logprob: TokenLogprob | None) -> Stop | None:
        """Token phase: record a sampled token; decide the stops that need no text. A
        thinking request past its budget gets its end marker instead of the sampled token."""
        if req.thinking and self._think(req, token, logprob is not None):
            return self._length(req)  # the engine wrote the end marker: no EOS or stop token
        req.output_token_ids.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        if req.thinking:
            self._phase(req)
        p = req.params
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if token in self.eos and not p.ignore_eos:
                return Stop(FinishReason.STOP, "eos")
            if token in p.stop_token_ids:
                return Stop(FinishReason.STOP, f"stop_token_id:{token}")
        return self._length(req)

    def _length(self, req: Request) -> Stop | None:
        n_out = len(req.output_token_ids)
        if n_out >= req.max_tokens:
            return Stop(FinishReason.LENGTH, "max_tokens")
        if req.num_tokens >= self.max_model_len:
            return Stop(FinishReason.LENGTH, "max_model_len")
        return None

    def _think(self, req: Request, token: int, logprobs: bool) -> bool:
        """A thinking request's next token, before it is recorded: True if the budget is
        spent and the end marker went in instead (cut to the room max_tokens leaves)."""
        r = req.params.reasoning
        out = req.output_token_ids
        n = len(out)
        if r is None or req.think_begin == NOT_YET or r.max_thinking_tokens is None \
                or n - req.think_begin < r.max_thinking_tokens:
            return False
        end = list(r.end_ids)
        have = _marker_begun(req, end)  # finish a marker the model began, don't repeat it
        forced = end[have:][:max(0, req.max_tokens - n)]
        out += forced
        if logprobs:
            req.logprobs += [TokenLogprob(t, 0.0, []) for t in forced]
        req.think_end = n - have
        req.answer_begin = req.think_end + len(end)
        return True

    def _phase(self, req: Request) -> None:
        """After a thinking request's token: did it open or close the thinking?"""
        r = req.params.reasoning
        assert r is not None
        out = req.output_token_ids
        n = len(out)
        if req.think_begin == NOT_YET:  # the output may open the thinking
            start = list(r.start_ids)
            if out != start[:n]:
                req.think_begin = req.think_end = req.answer_begin = 0  # it doesn't: all answer
            elif n == len(start):
                req.think_begin = n
            return
        end = list(r.end_ids)
        if n - len(end) >= req.think_begin and out[n - len(end):] == end:
            req.think_end = n - len(end)
            req.answer_begin = n

    def _settle(self, req: Request) -> None:
        """The request ends: an output that never opened its thinking is all answer."""
        if req.params.reasoning is not None and req.think_begin == NOT_YET:
            req.think_begin = req.think_end = req.answer_begin = 0

    def _held(self, req: Request) -> int:
        """Output tokens the text phase leaves for later: while the output may still open
        the thinking, all of it; while thinking, a tail that may be the end marker's start."""
        r = req.params.reasoning
        if r is None or not req.thinking:
            return 0
        if req.think_begin == NOT_YET:
            return len(req.output_token_ids)
        return _marker_begun(req, list(r.end_ids))

    def catch_up(self, req: Request, check: bool = True) -> Stop | None:
        """Text phase: detokenize the tokens not yet turned into text; a stop string that
        now matches ends the request there (the stop string itself is not output)."""
        detok = self.detok.get(req.internal_id)
        if detok is None:
            return None
        p = req.params
        longest = max((len(s) for s in p.stop), default=0)
        end = len(req.output_token_ids)
        if end and end >= p.min_tokens and req.output_token_ids[-1] in p.stop_token_ids:
            end -= 1  # the stop token ended the request: like a stop string, it is not output text
        if check:  # at the end (check False) nothing is held
            end = min(end, len(req.output_token_ids) - self._held(req))
        while req.num_detokenized < end:
            k = req.num_detokenized
            token = req.output_token_ids[k]
            req.num_detokenized += 1
            piece = detok.push(token)
            if k < req.answer_begin:
                if req.think_begin <= k < req.think_end:
                    req.reasoning_text += piece
                continue  # the thinking, or a marker: no stop string applies
            old_len = len(req.text)
            req.text += piece
            if check and p.stop and req.num_detokenized >= p.min_tokens:
                begin = max(0, old_len - longest + 1)  # only matches ending in the new text
                hits = [(i, s) for s in p.stop if (i := req.text.find(s, begin)) >= 0]
                if hits:
                    idx, s = min(hits)
                    req.text = req.text[:idx]
                    # Tokens after the one that completed the stop string (a speculative run
                    # accepts several at once) are neither delivered nor counted.
                    del req.output_token_ids[req.num_detokenized:]
                    del req.logprobs[req.num_detokenized:]
                    return Stop(FinishReason.STOP, s)
        return None

    def delta(self, req: Request, final: bool) -> RequestOutput:
        """Everything of req not yet sent; text that could still be the start of a stop
        string is held back until `final` (an end with an answer: stop or length)."""
        out = self.pending.pop(req.internal_id, None) or RequestOutput(req.request_id, req.index,
                                                                       req.incarnation)
        visible = len(req.text)
        if not final and req.params.stop:
            visible = max(req.sent_text_len, visible - (max(len(s) for s in req.params.stop) - 1))
        out.new_text += req.text[req.sent_text_len:visible]
        req.sent_text_len = max(req.sent_text_len, visible)
        out.new_reasoning += req.reasoning_text[req.sent_reasoning_len:]
        req.sent_reasoning_len = len(req.reasoning_text)
        out.new_token_ids += req.output_token_ids[req.sent_tokens:]
        out.new_logprobs += req.logprobs[req.sent_tokens:]
        req.sent_tokens = len(req.output_token_ids)
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent and not req.scores_prompt:
            out.prompt_logprobs = list(req.prompt_logprobs)
            req.prompt_logprobs_sent = True
        return out

    def step_output(self, req: Request) -> None:
        out = self.delta(req, final=False)
        if out.new_token_ids or out.new_text or out.new_reasoning:
            self.pending[req.internal_id] = out

    # ---- holder -------------------------------------------------------------------------
    def release(self, req: Request) -> None:
        """The request ended: its one terminal output, then its detokenizer goes."""
        if req.internal_id in self.detok:
            self.terminal(req)

    def preempt(self, req: Request) -> None:
        """Nothing: a preempted request keeps its text and stream offsets."""

    def holds(self, req: Request) -> bool:
        return req.internal_id in self.detok

    def terminal(self, req: Request) -> None:
        """The one terminal output of a request."""
        detok = self.detok.get(req.internal_id)
        aborted = req.finish_reason in (FinishReason.ABORT, FinishReason.TIMEOUT)
        # An end that is not an answer drops the text held back (the start of a stop string,
        # bytes of an unfinished character): it belongs to no answer, and after a cancel
        # nothing more reaches the client.
        drop_held = aborted or req.finish_reason in (FinishReason.ERROR, FinishReason.PREEMPTED)
        cut_by_stop_string = req.finish_reason is FinishReason.STOP and req.stop_detail in req.params.stop
        self._settle(req)
        if aborted:
            # Nothing reaches the client after an abort, not even a token computed before it
            # that was still waiting for its text phase (async scheduling).
            req.undelivered += len(req.output_token_ids) - req.sent_tokens
            del req.output_token_ids[req.sent_tokens:]
            del req.logprobs[req.sent_tokens:]
            req.num_detokenized = min(req.num_detokenized, req.sent_tokens)
            req.prompt_logprobs_sent = True  # unsent prompt scores stay unsent too
        elif detok is not None and not cut_by_stop_string:
            self.catch_up(req, check=False)  # tokens computed before the end, not yet text
            if not drop_held:
                req.text += detok.flush()  # bytes held back waiting for the rest of a character
        out = self.delta(req, final=not drop_held)
        out.finished = True
        out.finish_reason = req.finish_reason
        out.stop_detail = req.stop_detail
        out.usage = req.usage(self.cached(req))
        self.pending[req.internal_id] = out
        self.detok.pop(req.internal_id, None)

    def collect(self) -> list[RequestOutput]:
        outs = list(self.pending.values())
        self.pending.clear()
        return outs


def _marker_begun(req: Request, end: list[int]) -> int:
    """How many of the end marker's first tokens the thinking's tail already is."""
    out = req.output_token_ids
    n = len(out)
    return next((j for j in range(min(len(end) - 1, n - req.think_begin), 0, -1)
                 if out[n - j:] == end[:j]), 0)
