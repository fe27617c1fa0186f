"""Which requests think, and how much: the markers of the model's thinking (from its chat
template or --reasoning-parser) and a request's budget (max_thinking_tokens, or
reasoning_effort mapped to one) -> `ReasoningSpec`, which the engine's output check acts on
(engine/output.py). Shared by chat completions and /v1/messages (and /v1/responses)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stopline.request import ReasoningSpec
from stopline.server.errors import ApiError

# Marker pairs the families' templates write (Qwen3, DeepSeek-R1, SmolLM3, QwQ: the same pair).
KNOWN = (("<think>", "</think>"),)
# reasoning_effort -> thinking tokens at most
EFFORT_BUDGETS = {"none": 0, "minimal": 128, "low": 512, "medium": 2048, "high": 8192}


@dataclass(frozen=True)
class Markers:
    start: str
    end: str


def markers(setting: str, chat_template: str | None) -> Markers | None:
    """--reasoning-parser: "auto" (a known pair the chat template writes), "none", or
    "START,END" (the family's own markers)."""
    if setting == "none":
        return None
    if setting == "auto":
        for start, end in KNOWN:
            if chat_template and start in chat_template and end in chat_template:
                return Markers(start, end)
        return None
    start, sep, end = setting.partition(",")
    if not sep or not start or not end:
        raise ValueError(f"--reasoning-parser: 'auto', 'none' or 'START,END', got {setting!r}")
    return Markers(start, end)


def budget(effort: Any, max_thinking_tokens: Any, param: str = "reasoning_effort") -> int | None:
    """A request's thinking budget (None: only max_tokens bounds it)."""
    if max_thinking_tokens is not None:
        if not isinstance(max_thinking_tokens, int) or max_thinking_tokens < 0:
            raise ApiError(400, f"max_thinking_tokens: must be an integer >= 0, got {max_thinking_tokens!r}",
                           param="max_thinking_tokens", code="invalid_value")
        return max_thinking_tokens
    if effort is None:
        return None
    if effort not in EFFORT_BUDGETS:
        raise ApiError(400, f"{param}: one of {', '.join(EFFORT_BUDGETS)}, got {effort!r}",
                       param=param, code="invalid_value")
    return EFFORT_BUDGETS[effort]


def spec(found: Markers | None, tokenizer: Any, prompt: str, limit: int | None) -> ReasoningSpec | None:
    """The request's thinking, given its rendered prompt: opened when the prompt ends with the
    start marker (the template opened it); none when it ends with the end marker (the
    template closed it: thinking off) or the model has no markers."""
    if found is None:
        return None
    tail = prompt.rstrip()
    if tail.endswith(found.end):
        return None
    return ReasoningSpec(tokenizer.encode(found.start, add_special_tokens=False),
                         tokenizer.encode(found.end, add_special_tokens=False),
                         opened=tail.endswith(found.start), max_thinking_tokens=limit)
