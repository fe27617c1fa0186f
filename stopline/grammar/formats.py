"""OpenAI `response_format` (and stopline's extensions) -> an llguidance grammar.

OpenAI's types:
  {"type": "text"}                                   no grammar
  {"type": "json_object"}                            any JSON object
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}}
stopline's extensions (send them with the openai client's `extra_body=`):
  {"type": "regex", "regex": "[0-9]{3}-[0-9]{4}"}    the whole output matches the regex
  {"type": "grammar", "grammar": "start: ..."}       a Lark grammar (llguidance's dialect)
                                                     or a llama.cpp GBNF grammar
  {"type": "choice", "choice": ["yes", "no"]}        exactly one of the strings

JSON is written compactly with one space after ',' and ':' (`{"a": 1, "b": [2, 3]}`): a
grammar that allows free whitespace lets a small model loop on newlines until max_tokens. A
schema may ask for other spacing with llguidance's "x-guidance" key.

`strict: true` enforces the schema exactly and refuses a keyword llguidance can't enforce;
without it, such keywords are ignored (the rest is still enforced).

Errors are InvalidRequest whose message starts with the offending parameter, which the
server answers with a 400 naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import llguidance

from stopline.request import InvalidRequest

# Compact JSON with the spaces models write anyway; see the module docstring.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": "}
MAX_CHOICES = 10_000

_TYPES = ("text", "json_object", "json_schema", "regex", "grammar", "choice")


def json_schema_grammar(schema: Mapping[str, Any] | bool, *, strict: bool = True,
                        param: str = "response_format.json_schema.schema") -> str:
    """The grammar of JSON values valid against `schema`."""
    if schema is True:
        schema = {}
    if not isinstance(schema, Mapping):
        raise InvalidRequest(f"{param}: must be a JSON object (a JSON Schema)")
    options = {**JSON_OPTIONS, "lenient": not strict}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(dict(schema), defaults=options)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"{param}: not a usable JSON Schema: {exc}") from None


def regex_grammar(regex: Any, param: str = "response_format.regex") -> str:
    if not isinstance(regex, str) or not regex:
        raise InvalidRequest(f"{param}: must be a non-empty string")
    return llguidance.LLMatcher.grammar_from_regex(regex)


def lark_grammar(text: Any, param: str = "response_format.grammar") -> str:
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest(f"{param}: must be a non-empty string (a Lark or GBNF grammar)")
    try:
        return llguidance.grammar_from("grammar", text)
    except ValueError as exc:  # GBNF that does not convert
        raise InvalidRequest(f"{param}: {exc}") from None


def choice_grammar(choices: Any, param: str = "response_format.choice") -> str:
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise InvalidRequest(f"{param}: must be a non-empty list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise InvalidRequest(f"{param}: {len(choices)} choices; at most {MAX_CHOICES}")
    lark = "start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
    return llguidance.LLMatcher.grammar_from_lark(lark)


def response_format_grammar(rf: Any) -> str | None:
    """The grammar a `response_format` asks for, or None for plain text."""
    if rf is None:
        return None
    if not isinstance(rf, Mapping):
        raise InvalidRequest("response_format: must be an object with a 'type'")
    kind = rf.get("type", "text")
    if kind not in _TYPES:
        raise InvalidRequest(f"response_format.type: {kind!r} is not one of {', '.join(_TYPES)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, strict=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, Mapping):
            raise InvalidRequest("response_format.json_schema: must be an object with a 'schema'")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidRequest("response_format.json_schema.name: must be a string")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequest("response_format.json_schema.strict: must be a boolean")
        schema = spec.get("schema", {"type": "object"})
        return json_schema_grammar(schema, strict=bool(strict))
    if kind == "regex":
        return regex_grammar(rf.get("regex"))
    if kind == "grammar":
        return lark_grammar(rf.get("grammar"))
    return choice_grammar(rf.get("choice"))
