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
import re
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
    arguments: str  # a JSON string, as OpenAI sends it: the model's own text of the value
    complete: bool = True  # False: the output ended inside the call (its arguments are cut)

    def body(self) -> dict[str, Any]:
        """OpenAI's shape of one entry of `message.tool_calls`."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# Reasons whose output is not an answer: what the parser still holds is dropped, never sent.
_NOT_ANSWERS = frozenset({"abort", "timeout", "error", "preempted"})

# A call as the grammars in tools.py write it: its head up to the end of its name, then the
# key up to the first character of its arguments object. A call whose text does not start so
# is read whole at its closing tag instead.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_KEY = re.compile(r'\s*,\s*"arguments"\s*:\s*\{')


def parse(text: str, reason: str | None = "stop") -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output that ended with finish reason `reason`: what a
    stream of the same text delivers, added up (the same parser), so the two agree. One
    difference: a call still open at a cancel, a deadline or a failure is left out, since
    nothing of it was delivered yet (a stream had sent its start before the end)."""
    sp = StreamParser()
    content, _ = sp.feed(text)
    content += sp.finish(reason)
    calls = [c for c in sp.calls if c.complete] if reason in _NOT_ANSWERS else sp.calls
    return (content or None), calls


class StreamParser:
    """Splits streamed text into content deltas and OpenAI `delta.tool_calls` entries.

    Content is passed on at once, except a tail that may be the start of `<tool_call>` and
    trailing whitespace (dropped if a call follows). Inside a call, the text up to the end of
    its name is held; then one entry opens the call (index, id, type, name, empty arguments)
    and the arguments' JSON text follows in pieces as it is written. The closing `}` and tag are
    markup, never sent. What an output ends holding is its finish reason's to decide
    (`finish`): markup is never content."""

    def __init__(self) -> None:
        self._buf = ""  # text not yet passed on
        self._state = "text"  # text / head (call open, name not read) / key / args / tail
        self._head = ""  # the text of an open call up to the end of its name
        self._depth = 0  # JSON nesting inside the arguments
        self._in_str = False
        self._esc = False
        self.calls: list[ToolCall] = []  # every call opened, the last maybe still open

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool_calls deltas) for the next piece of output."""
        self._buf += text
        content = ""
        deltas: list[dict[str, Any]] = []
        while True:
            if self._state == "text":
                at = self._buf.find(OPEN)
                if at < 0:
                    cut = len(self._buf) - _partial_tag(self._buf)
                    sent = self._buf[:cut].rstrip()
                    content += sent
                    self._buf = self._buf[len(sent):]
                    return content, _merged(deltas)
                head = self._buf[:at]
                sent = head.rstrip()
                content += sent
                self._buf = self._buf[at + len(OPEN):]
                self._state = "head"
            elif self._state == "head":
                m = _HEAD.match(self._buf)
                if m is None:
                    whole = _read_call(self._buf)
                    if whole is None:
                        return content, _merged(deltas)  # not closed yet (or never will be)
                    call, end = whole
                    deltas.append({"index": len(self.calls), **call.body()})
                    self.calls.append(call)
                    self._buf = self._buf[end:]
                    self._state = "text"
                    continue
                # The name is known: the call opens, its arguments empty so far (OpenAI's first
                # delta of a call).
                call = ToolCall(new_call_id(), json.loads(m.group(1)), "", complete=False)
                deltas.append({"index": len(self.calls), **call.body()})
                self.calls.append(call)
                self._head, self._buf = self._buf[:m.end()], self._buf[m.end():]
                self._state = "key"
            elif self._state == "key":
                m = _KEY.match(self._buf)
                if m is None:
                    end = self._buf.find(CLOSE)
                    if end < 0:
                        return content, _merged(deltas)
                    # Not the grammars' shape (arguments first, other keys): read it whole.
                    whole = _read_call(self._head + self._buf)
                    if whole is not None:
                        call, at = whole
                        self.calls[-1].arguments = call.arguments
                        self.calls[-1].complete = True
                        deltas.append({"index": len(self.calls) - 1,
                                       "function": {"arguments": call.arguments}})
                        self._buf = (self._head + self._buf)[at:]
                    else:
                        self._buf = self._buf[end + len(CLOSE):]
                    self._state = "text"
                    continue
                self._buf = self._buf[m.end() - 1:]  # from the arguments' "{"
                self._depth, self._in_str, self._esc = 0, False, False
                self._state = "args"
            elif self._state == "args":
                n = self._scan(self._buf)
                piece, self._buf = self._buf[:n], self._buf[n:]
                if piece:
                    self.calls[-1].arguments += piece
                    deltas.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
                if self._depth > 0:
                    return content, _merged(deltas)
                self.calls[-1].complete = True  # what is left is markup
                self._state = "tail"
            else:  # tail: the object's "}" and the closing tag
                end = self._buf.find(CLOSE)
                if end < 0:
                    return content, _merged(deltas)
                self._buf = self._buf[end + len(CLOSE):]
                self._state = "text"

    def finish(self, reason: str | None = "stop") -> str:
        """The content held back at the end of an output that ended with `reason`. After a
        cancel, a deadline or a failure nothing more is sent: held text is not an answer. A
        call left open is never content: one whose name was read stays a call, cut (OpenAI's
        answer at max_tokens, its arguments maybe still empty); the head of one whose name was
        not, or an opening tag cut short, is dropped."""
        rest = self._buf if self._state == "text" else ""
        self._buf = ""
        self._state = "text"
        if reason in _NOT_ANSWERS:
            return ""
        if reason == "length" and _partial_tag(rest):
            # A call's opening tag cut by max_tokens, and the whitespace that led to it.
            rest = rest[:len(rest) - _partial_tag(rest)].rstrip()
        return rest.rstrip() if self.calls else rest

    @property
    def all_complete(self) -> bool:
        return all(c.complete for c in self.calls)

    def _scan(self, text: str) -> int:
        """How much of `text` belongs to the arguments: up to the `}` that closes them."""
        for i, ch in enumerate(text):
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return len(text)


def _merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per call per chunk: argument pieces joined onto the entry before them."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"] and "id" not in d:
            out[-1]["function"]["arguments"] += d["function"]["arguments"]
        else:
            out.append(d)
    return out


def _read_call(text: str) -> tuple[ToolCall, int] | None:
    """A whole call (the text after its opening tag), and where its closing tag ends."""
    i = len(text) - len(text.lstrip())
    try:
        obj, end = json.JSONDecoder().raw_decode(text, i)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    j = end + len(text[end:]) - len(text[end:].lstrip())
    if not text.startswith(CLOSE, j):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False)), j + len(CLOSE)


def _partial_tag(s: str) -> int:
    """Length of the longest tail of s that is a proper prefix of OPEN."""
    for n in range(min(len(OPEN) - 1, len(s)), 0, -1):
        if OPEN.startswith(s[-n:]):
            return n
    return 0
