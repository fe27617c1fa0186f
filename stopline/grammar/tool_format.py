"""The text a model writes to call a tool, how tools and past calls are shown to it, and the
parser that turns its output back into OpenAI `tool_calls`.

SmolLM2's chat template has no tool syntax, so stopline defines one (the Hermes / Qwen2.5
convention, which small instruct models have seen most): the tools are listed in a system
message, and each call is a JSON object between tags on lines of their own:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several calls follow each other, separated by a newline. A tool's result goes back to the
model as a user turn `<tool_response>...</tool_response>`; an assistant turn that called
tools is shown with its calls in this same format, so a second turn reads like the first.
The grammars in tools.py produce exactly this text, and `parse` reads exactly it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
SEPARATOR = "\n"  # between two calls

PREAMBLE = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
INSTRUCTIONS = (
    "\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
)


def call_text(name: str, arguments: Mapping[str, Any] | str) -> str:
    """One call as the model writes it."""
    args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that lists the tools and the call format."""
    lines = "\n".join(json.dumps(dict(t), ensure_ascii=False) for t in tools)
    return PREAMBLE + lines + INSTRUCTIONS


def assistant_text(content: str | None, tool_calls: Sequence[Mapping[str, Any]]) -> str:
    """An assistant turn that called tools, as the model would have written it."""
    parts = [content] if content else []
    for c in tool_calls:
        fn = c.get("function") or {}
        parts.append(call_text(fn.get("name", ""), fn.get("arguments") or "{}"))
    return SEPARATOR.join(parts)


def tool_result_text(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON string, as OpenAI sends it

    def body(self) -> dict[str, Any]:
        """OpenAI's shape of one entry of `message.tool_calls`."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _read_call(text: str, start: int) -> tuple[ToolCall, int] | None:
    """The call whose opening tag ends at `start`, and where its closing tag ends."""
    i = start
    while i < len(text) and text[i].isspace():
        i += 1
    try:
        obj, end = json.JSONDecoder().raw_decode(text, i)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    j = end
    while j < len(text) and text[j].isspace():
        j += 1
    if not text.startswith(CLOSE, j):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False)), j + len(CLOSE)


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output. Text around the calls is the content (None if
    empty); an unfinished or malformed call stays in the content as text. The same parser
    as streaming, so both give the same answer."""
    sp = StreamParser()
    content, _ = sp.feed(text)
    content += sp.finish()
    return (content or None), sp.calls


class StreamParser:
    """Splits streamed text into content deltas and tool-call deltas as they complete, so
    that the deltas add up to what `parse` gives for the whole text.

    Content is passed on at once, except a tail that may be the start of `<tool_call>` and
    trailing whitespace (dropped if a call follows); once a call opens, its text is held
    until the call closes, then sent as one `delta.tool_calls` entry (id, name and the
    whole arguments string)."""

    def __init__(self) -> None:
        self._buf = ""  # text not yet passed on
        self._ws = ""  # whitespace held before an open call
        self._in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool_calls deltas) for the next piece of output."""
        self._buf += text
        content = ""
        deltas: list[dict[str, Any]] = []
        while True:
            if not self._in_call:
                at = self._buf.find(OPEN)
                if at < 0:
                    cut = len(self._buf) - _partial_tag(self._buf)
                    head = self._buf[:cut]
                    sent = head.rstrip()
                    content += sent
                    self._buf = self._buf[len(sent):]
                    return content, deltas
                head = self._buf[:at]
                sent = head.rstrip()
                content += sent
                self._ws = head[len(sent):]
                self._buf = self._buf[at:]
                self._in_call = True
            got = _read_call(self._buf, len(OPEN))
            if got is None:
                return content, deltas
            call, end = got
            deltas.append({"index": len(self.calls), **call.body()})
            self.calls.append(call)
            self._buf = self._buf[end:]
            self._ws = ""
            self._in_call = False

    def finish(self) -> str:
        """The content held back at the end of the output: trailing whitespace (none after
        a call), or the text of an unfinished call."""
        rest = self._ws + self._buf if self._in_call else self._buf
        self._buf = self._ws = ""
        return rest.rstrip() if self.calls else rest


def _partial_tag(s: str) -> int:
    """Length of the longest tail of s that is a proper prefix of OPEN."""
    for n in range(min(len(OPEN) - 1, len(s)), 0, -1):
        if OPEN.startswith(s[-n:]):
            return n
    return 0
