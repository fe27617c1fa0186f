"""The documented bounds of every list and string the API takes (docs/api.md lists them).

Checked on the parsed body before anything reaches the engine: breaking one is a 400 whose
`param` names the field, and nothing else changes. Bounds that depend on the model (token
ids inside the vocabulary, the context length) are the engine's checks (SamplingParams and
the core's prompt validation), which also answer 400 before queueing. The body size is
`Settings.max_body_bytes` (413, read_body in serving.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stopline.server.errors import ApiError


@dataclass(frozen=True)
class Limits:
    stop_count: int = 4  # OpenAI: up to 4 stop sequences
    stop_chars: int = 256
    stop_token_ids: int = 256
    logit_bias_entries: int = 300  # OpenAI's bound
    logit_bias_value: float = 100.0  # values in [-100, 100]
    n: int = 64
    best_of: int = 64
    max_tokens: int = 1 << 20  # the context length is the real bound (engine check)
    top_logprobs: int = 20
    messages: int = 2048
    message_chars: int = 1 << 20  # the body size bounds it too
    name_chars: int = 256
    prompts: int = 64  # prompts in one completions request
    tool_calls: int = 128  # per assistant message
    user_chars: int = 256
    model_chars: int = 256


LIMITS = Limits()

ROLES = ("system", "developer", "user", "assistant", "tool")


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def _count(param: str, items: Any, bound: int) -> None:
    if items is not None and len(items) > bound:
        raise _bad(param, f"at most {bound} entries, got {len(items)}")


def _chars(param: str, text: str | None, bound: int) -> None:
    if text is not None and len(text) > bound:
        raise _bad(param, f"at most {bound} characters, got {len(text)}")


def check(req: Any, limits: Limits = LIMITS) -> None:
    """Raise a 400 ApiError naming the first field of `req` (a parsed request) out of bounds."""
    _chars("model", req.model, limits.model_chars)
    _chars("user", req.user, limits.user_chars)
    if not 1 <= req.n <= limits.n:
        raise _bad("n", f"must be between 1 and {limits.n}, got {req.n}")
    if req.max_tokens is not None and req.max_tokens > limits.max_tokens:
        raise _bad("max_tokens", f"at most {limits.max_tokens}, got {req.max_tokens}")
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    _count("stop", stop, limits.stop_count)
    for s in stop or ():
        _chars("stop", s, limits.stop_chars)
    _count("stop_token_ids", req.stop_token_ids, limits.stop_token_ids)
    _check_logit_bias(req.logit_bias, limits)
    top = getattr(req, "top_logprobs", None)
    if top is not None and not 0 <= top <= limits.top_logprobs:
        raise _bad("top_logprobs", f"must be in [0, {limits.top_logprobs}], got {top}")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and not 1 <= best_of <= limits.best_of:
        raise _bad("best_of", f"must be between 1 and {limits.best_of}, got {best_of}")
    prompt = getattr(req, "prompt", None)
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        _count("prompt", prompt, limits.prompts)
    messages = getattr(req, "messages", None)
    if messages is not None:
        check_messages(messages, limits)


def _check_logit_bias(bias: dict[str, float] | None, limits: Limits) -> None:
    if bias is None:
        return
    _count("logit_bias", bias, limits.logit_bias_entries)
    for key, value in bias.items():
        if not key.isdigit():
            raise _bad("logit_bias", f"keys must be token ids (decimal strings), got {key!r}")
        if not -limits.logit_bias_value <= value <= limits.logit_bias_value:
            raise _bad("logit_bias", f"values must be in [-{limits.logit_bias_value:g}, "
                       f"{limits.logit_bias_value:g}], got {value} for token {key}")


def check_vocab(bias: dict[str, float] | None, vocab_size: int) -> None:
    """logit_bias keys inside the vocabulary (the model's bound, known once it has loaded)."""
    for key in bias or {}:
        if int(key) >= vocab_size:
            raise _bad("logit_bias", f"token id {key} is outside the vocabulary (size {vocab_size})")


def check_messages(messages: list[Any], limits: Limits) -> None:
    _count("messages", messages, limits.messages)
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise _bad(f"messages.{i}.role", f"must be one of {', '.join(ROLES)}, got {m.role!r}")
        if isinstance(m.content, str):
            _chars(f"messages.{i}.content", m.content, limits.message_chars)
        elif m.content is not None:
            _chars(f"messages.{i}.content", "".join(p.text or "" for p in m.content),
                   limits.message_chars)
        _chars(f"messages.{i}.name", m.name, limits.name_chars)
        _count(f"messages.{i}.tool_calls", m.tool_calls, limits.tool_calls)
