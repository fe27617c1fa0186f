"""`tools`, `tool_choice` and `parallel_tool_calls` -> what the prompt shows and the grammar
that holds the model to it (the text format is tool_format.py's).

  tool_choice "none"       no grammar; the tools are not shown to the model
  "auto" (the default)     the model writes text, or text and then calls: a lazy grammar
                           leaves the text free and constrains everything from the first
                           `<tool_call>` on (the call must name a tool and match its schema)
  "required"               one or more calls, nothing else
  {"type": "function", "function": {"name": N}}   exactly one call of N
  parallel_tool_calls false: at most one call.

A function's `parameters` schema is enforced exactly when its `strict` is true; otherwise
keywords llguidance can't enforce are ignored (formats.py says the same for response_format).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stopline.grammar import tool_format
from stopline.grammar.formats import JSON_OPTIONS
from stopline.request import InvalidRequest

MAX_TOOLS = 128
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


@dataclass
class ToolPlan:
    """What a request's tools mean for its prompt, its grammar and its response."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # validated, as OpenAI's shape
    choice: str = "none"  # none / auto / required / function
    function: str | None = None  # the named function when choice == "function"
    parallel: bool = True
    grammar: str | None = None

    @property
    def parses_calls(self) -> bool:
        """Whether the output is read for tool calls."""
        return self.choice != "none"

    def system_text(self) -> str | None:
        """The text to show the model in a system message (None: show nothing)."""
        if self.choice == "none":
            return None
        shown = self.tools if self.function is None else \
            [t for t in self.tools if t["function"]["name"] == self.function]
        return tool_format.tools_prompt(shown)


def _tool(i: int, t: Any) -> dict[str, Any]:
    param = f"tools.{i}"
    if not isinstance(t, Mapping):
        raise InvalidRequest(f"{param}: must be an object")
    if t.get("type", "function") != "function":
        raise InvalidRequest(f"{param}.type: only 'function' tools are supported, got {t.get('type')!r}")
    fn = t.get("function")
    if not isinstance(fn, Mapping):
        raise InvalidRequest(f"{param}.function: must be an object with a 'name'")
    name = fn.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or not set(name) <= _NAME_CHARS:
        raise InvalidRequest(f"{param}.function.name: must be 1-64 characters of a-z, A-Z, 0-9, _ "
                             f"and -, got {name!r}")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping):
        raise InvalidRequest(f"{param}.function.parameters: must be a JSON Schema object")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(f"{param}.function.strict: must be a boolean")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise InvalidRequest(f"{param}.function.description: must be a string")
    out: dict[str, Any] = {"name": name, "parameters": dict(params)}
    if desc is not None:
        out["description"] = desc
    if strict is not None:
        out["strict"] = strict
    return {"type": "function", "function": out}


# Subtrees whose values are data, not schemas: a {"$ref": ...} inside them is not a reference.
_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})


def _rebase(node: Any, root: str, top: bool = True) -> Any:
    """A copy of schema `node` whose local `$ref`s ("#", "#/...") point below `root`, the
    pointer where it now lives. Its own `$id` goes (it would make it a document of its own,
    which the rebased pointers leave); a subschema with an `$id` is one, and stays as it is."""
    if isinstance(node, list):
        return [_rebase(v, root, False) for v in node]
    if not isinstance(node, Mapping) or (not top and "$id" in node):
        return node
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = root + v[1:]
        elif k in _DATA_KEYS:
            out[k] = v
        elif not (top and k == "$id"):
            out[k] = _rebase(v, root, False)
    return out


def _call_schema(tool: Mapping[str, Any], slot: str) -> dict[str, Any]:
    """One call's schema. The parameters are referenced from the root's `$defs` (at `slot`),
    not nested under `arguments`: their own `$ref`s ("#/$defs/Color", as Pydantic writes a
    nested model or an Enum) resolve against the document root, so the parameters move there
    whole and every local pointer is rebased into them."""
    fn = tool["function"]
    return {"type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": {"$ref": f"#/$defs/{slot}"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def _calls_lark(tools: Sequence[Mapping[str, Any]], parallel: bool, lazy: bool) -> str:
    strict = all(t["function"].get("strict", False) for t in tools)
    slots = [f"args{i}" for i in range(len(tools))]
    calls = [_call_schema(t, s) for t, s in zip(tools, slots, strict=True)]
    schema: dict[str, Any] = {"anyOf": calls} if len(calls) > 1 else calls[0]
    schema["$defs"] = {s: _rebase(t["function"]["parameters"], f"#/$defs/{s}")
                       for t, s in zip(tools, slots, strict=True)}
    schema["x-guidance"] = {**JSON_OPTIONS, "lenient": not strict}
    # A call's body after its opening tag; the lazy variant has the tag in `lead`.
    body = f"\"\\n\" %json {json.dumps(schema)} \"\\n{tool_format.CLOSE}\""
    more = f"(\"{tool_format.SEPARATOR.encode('unicode_escape').decode()}{tool_format.OPEN}\" body)*" \
        if parallel else ""
    if lazy:
        # TEXT alone is an answer without a call; `lead` ends at the first "<tool_call>"
        # (lazy: the shortest match), after which the grammar holds the model to a call.
        return ("%llguidance {}\n"
                "start: TEXT | lead body " + more + "\n"
                f"lead[lazy]: TEXT \"{tool_format.OPEN}\"\n"
                "TEXT: /(.|\\n)*/\n"
                f"body: {body}\n")
    return ("%llguidance {}\n"
            f"start: \"{tool_format.OPEN}\" body {more}\n"
            f"body: {body}\n")


def tool_plan(tools: Any, tool_choice: Any, parallel_tool_calls: Any = None) -> ToolPlan:
    """Validate the request's tool fields; the plan says what to show and to enforce."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequest("parallel_tool_calls: must be a boolean")
    parallel = parallel_tool_calls is not False
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise InvalidRequest("tools: must be a list of tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools: {len(tools)} tools; at most {MAX_TOOLS}")
    checked = [_tool(i, t) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise InvalidRequest(f"tools: the function name {dup!r} is used twice")
    plan = ToolPlan(checked, parallel=parallel)
    if tool_choice is None:
        tool_choice = "auto" if checked else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequest(f"tool_choice: {tool_choice!r} is not one of none, auto, required "
                                 "or {'type': 'function', 'function': {'name': ...}}")
        plan.choice = tool_choice
    elif isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequest("tool_choice: a named choice is {'type': 'function', "
                                 "'function': {'name': ...}}")
        if name not in names:
            raise InvalidRequest(f"tool_choice.function.name: {name!r} is not among the tools")
        plan.choice, plan.function, plan.parallel = "function", name, False
    else:
        raise InvalidRequest("tool_choice: must be a string or an object")
    if plan.choice == "none":
        return plan
    if not checked:
        raise InvalidRequest(f"tool_choice: {plan.choice!r} needs at least one tool in tools")
    chosen = checked if plan.function is None else [checked[names.index(plan.function)]]
    plan.grammar = _calls_lark(chosen, plan.parallel, lazy=plan.choice == "auto")
    return plan
