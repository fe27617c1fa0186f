"""From sampled tokens to client-facing outputs: detokenize, check stops, assemble deltas.

`check_stop` is the only place that decides a request is done by its own output (EOS, stop
token, stop string, max_tokens, context limit); it hands the decision to the lifecycle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from stopline.request import FinishReason, Request, TokenLogprob, Usage
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
    new_text: str = ""
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

    def append(self, req: Request, token: int, logprob: TokenLogprob | None) -> Stop | None:
        """Token phase: record a sampled token; decide the stops that need no text."""
        req.output_token_ids.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        p = req.params
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if token in self.eos and not p.ignore_eos:
                return Stop(FinishReason.STOP, "eos")
            if token in p.stop_token_ids:
                return Stop(FinishReason.STOP, f"stop_token_id:{token}")
        if n_out >= req.max_tokens:
            return Stop(FinishReason.LENGTH, "max_tokens")
        if req.num_tokens >= self.max_model_len:
            return Stop(FinishReason.LENGTH, "max_model_len")
        return None

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
        while req.num_detokenized < end:
            token = req.output_token_ids[req.num_detokenized]
            req.num_detokenized += 1
            old_len = len(req.text)
            req.text += detok.push(token)
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
        out.new_token_ids += req.output_token_ids[req.sent_tokens:]
        out.new_logprobs += req.logprobs[req.sent_tokens:]
        req.sent_tokens = len(req.output_token_ids)
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent and not req.scores_prompt:
            out.prompt_logprobs = list(req.prompt_logprobs)
            req.prompt_logprobs_sent = True
        return out

    def step_output(self, req: Request) -> None:
        out = self.delta(req, final=False)
        if out.new_token_ids or out.new_text:
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
