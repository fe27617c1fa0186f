"""Engine outputs -> OpenAI JSON: stream chunks, final responses, logprobs, usage.

The same engine output becomes a `text_completion` or a `chat.completion(.chunk)` depending on
the endpoint; everything else (finish reasons, usage, logprobs) is shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from stopline.engine.output import RequestOutput
from stopline.grammar import tool_format
from stopline.request import TokenLogprob
from stopline.server.errors import ApiError
from stopline.server.requests import grammar_refusal

# Reasons the engine reports that OpenAI's enum lacks; clients get them as they are, with the
# detail (abort source, error message) next to them.
_EXTRA_REASONS = {"abort", "timeout", "error", "preempted"}
_MIN_LOGPROB = -9999.0  # JSON has no -inf


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class TokenText:
    """Token id -> its text, for logprobs (cached: the same ids come back all the time)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return s


@dataclass
class Choice:
    """One sample of a non-streaming response, accumulated."""

    text: str = ""
    reasoning: str = ""  # the thinking of a thinking request
    tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_detail: str | None = None
    # [weight version, index of its first token] per run of tokens from one version: a
    # request that a weight update (mode keep) crossed has several.
    versions: list[list[int]] = field(default_factory=list)


def note_version(spans: list[list[int]], out: RequestOutput, before: int) -> None:
    """Add out's tokens (the sample had `before` tokens) to the runs of weight versions."""
    if (out.new_token_ids or not spans) and (not spans or spans[-1][0] != out.weight_version):
        spans.append([out.weight_version, before])


def version_fields(item: dict[str, Any], spans: list[list[int]]) -> None:
    """`weight_version`: the weights of the sample's last token; `weight_versions`, only when a
    weight update fell inside the sample: [[version, first token index], ...]."""
    if spans:
        item["weight_version"] = spans[-1][0]
    if len(spans) > 1:
        item["weight_versions"] = spans


@dataclass(frozen=True)
class Echo:
    """A completions prompt to echo before its choices' text (echo=true)."""

    text: str
    token_ids: list[int]


@dataclass
class UsageSum:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    accepted_drafts: int = 0
    rejected_drafts: int = 0
    drafted: int = 0
    reasoning_tokens: int | None = None  # None: the request doesn't think

    def add(self, out: RequestOutput) -> None:
        if out.usage is not None:
            self.completion_tokens += out.usage.completion_tokens
            if self.reasoning_tokens is not None:
                self.reasoning_tokens += out.usage.reasoning_tokens
            self.cached_tokens = max(self.cached_tokens, out.usage.cached_tokens)
            self.drafted += out.usage.draft_tokens
            self.accepted_drafts += out.usage.accepted_draft_tokens
            self.rejected_drafts += out.usage.rejected_draft_tokens

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        details: dict[str, int] = {}
        if self.drafted:  # OpenAI's names for predicted-output tokens; drafts are the same idea
            details |= {"accepted_prediction_tokens": self.accepted_drafts,
                        "rejected_prediction_tokens": self.rejected_drafts}
        if self.reasoning_tokens is not None:
            details["reasoning_tokens"] = self.reasoning_tokens
        if details:
            body["completion_tokens_details"] = details
        return body


class Formatter:
    def __init__(self, *, chat: bool, request_id: str, created: int, model: str, n: int,
                 token_text: TokenText, include_usage: bool = False, tool_calls: bool = False,
                 continuous_usage: bool = False, echo: list[Echo] | None = None,
                 logprobs: bool = False, reasoning: bool = False) -> None:
        """tool_calls: the request has tools, so the output is read for tool calls
        (tool_format.py): `message.tool_calls` / `delta.tool_calls`, and finish_reason
        "tool_calls" when the model stopped after calling. echo: one per prompt (choice i
        belongs to prompt i // (n / len(echo))): its text, and with logprobs its tokens'
        scores (the first null), go before the choice's own. logprobs: they were asked for.
        reasoning: the request thinks: its thinking is `reasoning_content`, apart from the
        content, and usage counts `reasoning_tokens`."""
        self.reasoning = reasoning and chat
        self.chat = chat
        self.tool_calls = tool_calls and chat
        self._parsers = [tool_format.StreamParser() for _ in range(n)] if self.tool_calls else []
        self.id = request_id
        self.created = created
        self.model = model
        self.n = n
        self.token_text = token_text
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage and include_usage
        self.prompt_tokens = 0  # set by the caller for continuous usage
        self.streamed = 0  # completion tokens sent so far (continuous usage)
        self._versions: dict[int, list[list[int]]] = {}  # sample -> runs of weight versions
        self._counts: dict[int, int] = {}  # sample -> tokens so far
        self._offsets = [0] * n  # text offset per sample, for completion logprobs
        self.echo = echo if echo and not chat else None
        self.logprobs = logprobs
        self._echoed = [False] * n

    # ---- streaming --------------------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if self.continuous_usage:
            obj["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.streamed,
                            "total_tokens": self.prompt_tokens + self.streamed}
        elif self.include_usage:
            obj["usage"] = None
        return obj

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant role (and, where the answer may
        be calls, a null content, as OpenAI opens a stream of calls: never an empty one)."""
        if not self.chat:
            return []
        delta = {"role": "assistant", "content": None if self.tool_calls else ""}
        return [self._chunk([{"index": i, "delta": dict(delta), "logprobs": None, "finish_reason": None}])
                for i in range(self.n)]

    def usage_sum(self, prompt_tokens: int) -> UsageSum:
        return UsageSum(prompt_tokens, reasoning_tokens=0 if self.reasoning else None)

    def chunk(self, out: RequestOutput) -> dict[str, Any] | None:
        self.streamed += len(out.new_token_ids)
        spans = self._versions.setdefault(out.index, [])
        note_version(spans, out, self._counts.get(out.index, 0))
        self._counts[out.index] = self._counts.get(out.index, 0) + len(out.new_token_ids)
        if not out.new_text and not out.new_token_ids and not out.finished and not out.new_reasoning:
            return None
        choice: dict[str, Any] = {"index": out.index}
        reason = self._reason(out) if out.finished else None
        if self.tool_calls:
            sp = self._parsers[out.index]
            text, calls = sp.feed(out.new_text)
            if out.finished:
                text += sp.finish(reason)
            delta: dict[str, Any] = {}
            if out.new_reasoning:
                delta["reasoning_content"] = out.new_reasoning
            if text:  # never an empty content: a token inside a call is in `calls` or held
                delta["content"] = text
            if calls:
                delta["tool_calls"] = calls
            if not delta and not out.finished and not out.new_logprobs:
                return None  # held back: markup, or a call's head before its name
            choice["delta"] = delta
            if reason == "stop" and sp.calls and sp.all_complete:
                reason = "tool_calls"
        elif self.chat:
            choice["delta"] = {"reasoning_content": out.new_reasoning} if out.new_reasoning else {}
            if out.new_text or not (out.finished or out.new_reasoning):
                choice["delta"]["content"] = out.new_text
        else:
            choice["text"] = out.new_text
        echo = self._echo_once(out.index)
        if echo is not None:
            choice["text"] = echo.text + out.new_text
        if self.logprobs and (out.new_logprobs or echo is not None):
            choice["logprobs"] = self._logprobs(out.index, out.new_logprobs, echo, out.prompt_logprobs)
        else:
            choice["logprobs"] = self._logprobs(out.index, out.new_logprobs) if out.new_logprobs else None
        choice["finish_reason"] = reason
        self._detail(choice, out.finish_reason.value if out.finish_reason else None, out.stop_detail)
        if out.finished:
            version_fields(choice, spans)
        return self._chunk([choice])

    def usage_chunk(self, usage: UsageSum) -> dict[str, Any]:
        obj = self._chunk([])
        obj["usage"] = usage.body()
        return obj

    # ---- whole responses ---------------------------------------------------------------------
    def response(self, choices: list[Choice], usage: UsageSum) -> dict[str, Any]:
        body = []
        for i, c in enumerate(choices):
            item: dict[str, Any] = {"index": i}
            reason = c.finish_reason
            if self.tool_calls:
                content, calls = tool_format.parse(c.text, reason)
                item["message"] = {"role": "assistant", "content": content}
                if calls:
                    item["message"]["tool_calls"] = [call.body() for call in calls]
                    if reason == "stop" and all(call.complete for call in calls):
                        reason = "tool_calls"
            elif self.chat:
                item["message"] = {"role": "assistant", "content": c.text}
            if self.reasoning:
                item["message"]["reasoning_content"] = c.reasoning
            else:
                item["text"] = c.text
            echo = self._echo_once(i)
            if echo is not None:
                item["text"] = echo.text + c.text
            if self.logprobs and (c.logprobs or echo is not None):
                item["logprobs"] = self._logprobs(i, c.logprobs, echo, c.prompt_logprobs)
            else:
                item["logprobs"] = self._logprobs(i, c.logprobs) if c.logprobs else None
            item["finish_reason"] = reason
            self._detail(item, c.finish_reason, c.stop_detail)
            version_fields(item, c.versions)
            body.append(item)
        out = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": body,
               "usage": usage.body()}
        versions = [c.versions[-1][0] for c in choices if c.versions]
        if versions:
            out["weight_version"] = max(versions)
        return out

    def check_outcome(self, choices: list[Choice]) -> None:
        """A non-streaming request that ended abnormally gets an HTTP error, not a 200."""
        reasons = {c.finish_reason for c in choices}
        refused = next((e for c in choices if (e := self.grammar_error(c.finish_reason, c.stop_detail))),
                       None)
        if refused is not None and not any(c.tokens for c in choices):
            raise refused
        if "error" in reasons:
            detail = next(c.stop_detail for c in choices if c.finish_reason == "error")
            raise ApiError(500, f"the request failed: {detail}", code="request_failed")
        if "preempted" in reasons:
            detail = next(c.stop_detail for c in choices if c.finish_reason == "preempted")
            raise ApiError(503, f"the request could not be served: {detail}", code="preempted",
                           headers={"Retry-After": "1"})
        if reasons == {"timeout"} and not any(c.tokens for c in choices):
            raise ApiError(503, "the request timed out before it was scheduled", code="queue_timeout",
                           headers={"Retry-After": "1"})

    def grammar_error(self, reason: str | None, detail: str | None) -> ApiError | None:
        """The 400 for a sample the engine ended because its grammar could not be compiled
        (invalid, over a limit, past its deadline): the request as sent can't be served."""
        return grammar_refusal(reason, detail, "tools" if self.tool_calls else "response_format")

    def refusal(self, first: RequestOutput) -> ApiError | None:
        """grammar_error for a stream's first output (before the stream starts)."""
        return self.grammar_error(self._reason(first), first.stop_detail)

    # ---- pieces -----------------------------------------------------------------------------
    @staticmethod
    def _reason(out: RequestOutput) -> str | None:
        return out.finish_reason.value if out.finish_reason is not None else None

    @staticmethod
    def _detail(choice: dict[str, Any], reason: str | None, detail: str | None) -> None:
        if reason in _EXTRA_REASONS and detail:
            choice["stop_detail"] = detail

    def _echo_once(self, index: int) -> Echo | None:
        """The prompt choice `index` echoes, the first time it is asked for."""
        if self.echo is None or self._echoed[index]:
            return None
        self._echoed[index] = True
        return self.echo[index * len(self.echo) // self.n]

    def _logprobs(self, index: int, lps: list[TokenLogprob], echo: Echo | None = None,
                  prompt: list[TokenLogprob] | None = None) -> dict[str, Any]:
        text = self.token_text
        if self.chat:
            content = []
            for lp in lps:
                tok = text(lp.token_id)
                content.append({"token": tok, "logprob": max(lp.logprob, _MIN_LOGPROB),
                                "bytes": list(tok.encode()),
                                "top_logprobs": [{"token": text(t), "logprob": max(v, _MIN_LOGPROB),
                                                  "bytes": list(text(t).encode())} for t, v in lp.top]})
            return {"content": content}
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        if echo is not None:
            # The prompt's tokens: the first has no score; a prompt whose scores never came
            # (it ended before its prefill did) has none at all.
            scores: list[TokenLogprob | None] = [None, *(prompt or [])]
            at = 0
            for k, t in enumerate(echo.token_ids):
                tok = text(t)
                lp = scores[k] if k < len(scores) else None
                tokens.append(tok)
                values.append(None if lp is None else max(lp.logprob, _MIN_LOGPROB))
                tops.append(None if lp is None else {text(a): max(v, _MIN_LOGPROB) for a, v in lp.top})
                offsets.append(at)
                at += len(tok)
            self._offsets[index] = len(echo.text)
        for lp in lps:
            tok = text(lp.token_id)
            tokens.append(tok)
            values.append(max(lp.logprob, _MIN_LOGPROB))
            tops.append({text(t): max(v, _MIN_LOGPROB) for t, v in lp.top})
            offsets.append(self._offsets[index])
            self._offsets[index] += len(tok)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
