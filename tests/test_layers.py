"""Imports point down the layers only (docs/design.md, "Layers").

Every module of the package is parsed (imports under TYPE_CHECKING and inside functions
count too) and each import of another stopline package must be one its layer may use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import stopline

ROOT = Path(stopline.__file__).parent

BASE = {"config", "errors", "request", "stats"}
# package (first name under stopline/) -> the packages it may import
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "config": set(),
    "stats": set(),
    "extras": set(),
    "args": BASE,
    "request": {"errors"},
    "tokenizer": {"errors"},
    "kv": BASE,
    "model": BASE | {"kv", "tokenizer"},
    "grammar": BASE | {"tokenizer"},
    "lifecycle": BASE | {"kv"},
    "spec": BASE,
    "sched": BASE | {"kv", "lifecycle", "spec"},
    "worker": BASE | {"kv", "model", "sched.plan", "grammar"},
    "engine": BASE | {"kv", "lifecycle", "sched", "spec", "worker", "model", "tokenizer", "grammar"},
    "server": BASE | {"engine", "tokenizer", "grammar", "__init__"},
    "cluster": BASE | {"engine", "tokenizer"},
    "bench": BASE | {"args", "extras", "cluster", "disagg", "engine", "model", "tokenizer", "server", "kv",
              "__init__"},
    "cli": BASE | {"args", "extras", "cluster", "disagg", "engine", "model", "server", "bench", "tokenizer"},
    "disagg": BASE | {"kv", "lifecycle", "sched", "engine"},
    "__init__": BASE | {"engine"},
}


def _layer(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return rel.parts[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "stopline":
            mods = ["stopline"]  # the package's own __init__ (its version, its API)
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        else:
            continue
        for m in mods:
            if m == "stopline":
                found.append((node.lineno, "stopline.__init__"))
            elif m.startswith("stopline."):
                found.append((node.lineno, m))
    return found


def _allowed(layer: str, target: str) -> bool:
    parts = target.split(".")[1:]
    top = parts[0]
    if top == layer:
        return True
    allowed = ALLOWED[layer]
    return top in allowed or ".".join(parts[:2]) in allowed


def test_every_import_points_down():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        layer = _layer(path)
        assert layer in ALLOWED, f"{path}: package {layer!r} has no place in the layer table"
        for line, target in _imports(path):
            if not _allowed(layer, target):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {layer} imports {target}")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_the_check_sees_an_upward_import(tmp_path):
    """The checker itself: a model module importing the scheduler is caught."""
    assert not _allowed("model", "stopline.sched.plan")
    assert not _allowed("lifecycle", "stopline.sched.scheduler")
    assert not _allowed("worker", "stopline.sched.scheduler")
    assert _allowed("worker", "stopline.sched.plan")
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from stopline.engine.core import EngineCore\n")
    assert _imports(src) == [(3, "stopline.engine.core"), (3, "stopline.engine.core.EngineCore")]


def test_the_design_page_shows_this_table():
    """docs/design.md's layer table is this one, row for row, so the drawing cannot drift."""
    page = (ROOT.parent / "docs" / "design.md").read_text()
    rows = {}
    for line in page.split("## Layers", 1)[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            imports = set() if cells[2] == "nothing" else {c.strip(" `") for c in cells[2].split(",")}
            rows[cells[0].strip("`")] = imports
    assert rows == ALLOWED


def test_the_package_imports_no_script_folder():
    """bench/*.py and tools/*.py are standalone scripts beside the package (docs/design.md):
    the package never imports them, so they can't become a second home of its benchmarks."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            bad += [f"{path.relative_to(ROOT.parent)}:{node.lineno}: {n}" for n in names
                    if n.split(".")[0] in ("bench", "tools", "tests")]
    assert not bad, "\n".join(bad)
