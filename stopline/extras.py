"""Optional packages: which extra installs each, and a clear error when one is missing.

The base install serves and generates. Benchmarks and replicas need more; a command that
needs an extra says which in one line instead of a traceback. tests/test_dependencies.py
checks this table against pyproject.toml.
"""

from __future__ import annotations

import importlib.util

# import name -> the extra (`pip install 'stopline[EXTRA]'`) that installs it
EXTRA_OF: dict[str, str] = {
    "ray": "ray",
    "httpx": "bench",
    "openai": "bench",
    "transformers": "bench",
    "matplotlib": "bench",
}


class MissingExtra(Exception):
    """An optional package is not installed; the message names the extra to install."""

    def __init__(self, module: str, extra: str, what: str = "this command") -> None:
        self.module, self.extra = module, extra
        super().__init__(f"{what} needs the '{module}' package: pip install 'stopline[{extra}]'")


def require(*modules: str, what: str = "this command") -> None:
    """Raise MissingExtra for the first of `modules` that is not installed."""
    for m in modules:
        try:
            found = importlib.util.find_spec(m) is not None
        except ModuleNotFoundError:  # a finder that refuses the name outright
            found = False
        if not found:
            raise MissingExtra(m, EXTRA_OF[m], what)


def as_missing_extra(exc: ModuleNotFoundError, what: str = "this command") -> MissingExtra | None:
    """The MissingExtra an import failure stands for, or None for a module no extra provides."""
    top = (exc.name or "").split(".")[0]
    return MissingExtra(top, EXTRA_OF[top], what) if top in EXTRA_OF else None
