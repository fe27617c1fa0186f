"""Chat templates: HF's Jinja templates rendered in a sandbox, with the helpers HF provides
(`raise_exception`, `tojson`, `strftime_now`, the `generation` tag)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed (including `raise_exception`)."""


def read_json(p: Path) -> dict[str, Any]:
    if not p.is_file():
        return {}
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def hf_chat_template(path: Path, tcfg: Mapping[str, Any]) -> str | None:
    """The default chat template, wherever this transformers version put it."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    tmpl: Any = tcfg.get("chat_template")
    if tmpl is None:
        tmpl = read_json(path / "chat_template.json").get("chat_template")
    if isinstance(tmpl, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default") or next(iter(named.values()), None)
    return tmpl if isinstance(tmpl, str) else None


# ---- jinja environment, matching transformers' chat template rendering --------------------------

class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker); renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes, which would corrupt tool schemas in prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses dunder/underscore attributes (sandbox hardening, like HF)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set attribute {name!r}")


_ENV: jinja2.sandbox.ImmutableSandboxedEnvironment | None = None


def jinja_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    global _ENV
    if _ENV is None:
        # Chat templates ship with model files, i.e. untrusted code: sandboxed, immutable env.
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["namespace"] = _TemplateNamespace
        _ENV = env
    return _ENV


# ---- streaming detokenization -----------------------------------------------------------------
