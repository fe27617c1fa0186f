"""From sampled tokens to client-facing outputs: detokenize, check stops, assemble deltas.

`check_stop` is the only place that decides a request is done by its own output (EOS, stop
token, stop string, max_tokens, context limit); it hands the decision to the lifecycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stopline.model.tokenizer import IncrementalDetokenizer, Tokenizer
from stopline.request import FinishReason, Request, TokenLogprob, Usage


@dataclass
class RequestOutput:
    """What a client receives for one sample of a request in one step."""

    request_id: str
    index: int
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_detail: str | None = None
    usage: Usage | None = None  # set on the terminal output


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.detok: dict[int, IncrementalDetokenizer] = {}
        self.pending: dict[int, RequestOutput] = {}

    def start(self, req: Request) -> None:
        self.detok[req.internal_id] = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=req.params.skip_special_tokens,
            prompt_token_ids=req.prompt_token_ids)

    def on_token(self, req: Request, token: int, logprob: TokenLogprob | None) -> tuple[FinishReason, str] | None:
        """Append a token to a live request; returns a stop decision if it should end."""
        req.output_token_ids.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        old_len = len(req.text)
        req.text += self.detok[req.internal_id].push(token)
        return self.check_stop(req, token, old_len)

    def check_stop(self, req: Request, token: int, old_len: int) -> tuple[FinishReason, str] | None:
        p = req.params
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if token in self.eos and not p.ignore_eos:
                return FinishReason.STOP, "eos"
            if token in p.stop_token_ids:
                return FinishReason.STOP, f"stop_token_id:{token}"
            if p.stop:
                longest = max(len(s) for s in p.stop)
                # Only a match that ends in the new text is new with this token.
                begin = max(0, old_len - longest + 1)
                hits = [(req.text.find(s, begin), s) for s in p.stop]
                hits = [(i, s) for i, s in hits if i >= 0]
                if hits:
                    idx, s = min(hits)
                    req.text = req.text[:idx]
                    return FinishReason.STOP, s
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, "max_tokens" if n_out >= req.max_tokens else "max_model_len"
        return None

    def delta(self, req: Request, final: bool) -> RequestOutput:
        """Everything of req not yet sent; text that could still be the start of a stop
        string is held back until the request ends."""
        out = self.pending.pop(req.internal_id, None) or RequestOutput(req.request_id, req.index)
        visible = len(req.text)
        if not final and req.params.stop:
            visible = max(req.sent_text_len, visible - (max(len(s) for s in req.params.stop) - 1))
        out.new_text += req.text[req.sent_text_len:visible]
        req.sent_text_len = max(req.sent_text_len, visible)
        out.new_token_ids += req.output_token_ids[req.sent_tokens:]
        out.new_logprobs += req.logprobs[req.sent_tokens:]
        req.sent_tokens = len(req.output_token_ids)
        return out

    def step_output(self, req: Request) -> None:
        out = self.delta(req, final=False)
        if out.new_token_ids or out.new_text:
            self.pending[req.internal_id] = out

    def terminal(self, req: Request) -> None:
        """The one terminal output of a request (called by the lifecycle)."""
        detok = self.detok.get(req.internal_id)
        cut_by_stop_string = req.finish_reason is FinishReason.STOP and req.stop_detail in req.params.stop
        if detok is not None and not cut_by_stop_string:
            req.text += detok.flush()  # bytes held back waiting for the rest of a character
        out = self.delta(req, final=True)
        out.finished = True
        out.finish_reason = req.finish_reason
        out.stop_detail = req.stop_detail
        out.usage = req.usage()
        self.pending[req.internal_id] = out
        self.detok.pop(req.internal_id, None)

    def collect(self) -> list[RequestOutput]:
        outs = list(self.pending.values())
        self.pending.clear()
        return outs
