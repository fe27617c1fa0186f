"""What each path imports against what pyproject.toml declares for it (issue 40).

A module-level import of a package only an extra installs breaks `stopline --help` for
everyone on the base install; a package imported but declared nowhere breaks a fresh
environment. Both are caught here, statically over the package's source and by running the
command line with every package the base install lacks made unimportable.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

import stopline
from stopline.extras import EXTRA_OF

ROOT = Path(stopline.__file__).parent
PYPROJECT = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]
# Benchmarks' modules run only under `stopline bench`; what they import at module level may
# come from the bench extra (the blocked-import test proves the parsers don't import them).
MODULE_LEVEL_EXTRAS = {"bench": {"bench"}}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(reqs: list[str]) -> set[str]:
    return {_norm(Requirement(r).name) for r in reqs}


BASE = _declared(PYPROJECT["dependencies"])
EXTRAS = {k: _declared(v) for k, v in PYPROJECT["optional-dependencies"].items()}


def _dists_of_import() -> dict[str, set[str]]:
    return {top: {_norm(d) for d in dists} for top, dists in md.packages_distributions().items()}


def _closure(names: set[str]) -> set[str]:
    """Distributions these pull in on a base install (no extras of theirs), installed ones only."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for r in map(Requirement, reqs):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(_norm(r.name))
    return seen


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, top-level module, at module level?) for each third-party import of a file."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = set()
    for node in tree.body:  # module body, and the bodies of its top-level if/try blocks
        top_level.add(node)
        for block in ("body", "orelse", "finalbody", "handlers"):
            for sub in getattr(node, block, []) if isinstance(node, (ast.If, ast.Try)) else []:
                top_level.add(sub)
                top_level.update(getattr(sub, "body", []))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for n in names:
            top = n.split(".")[0]
            if top not in sys.stdlib_module_names and top not in ("stopline", "__future__"):
                found.append((node.lineno, top, node in top_level))
    return found


def test_every_import_is_declared_where_its_path_needs_it():
    owners = _dists_of_import()
    every_extra = set().union(*EXTRAS.values())
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        layer = path.relative_to(ROOT).parts[0].removesuffix(".py")
        module_level_ok = BASE.union(*(EXTRAS[e] for e in MODULE_LEVEL_EXTRAS.get(layer, ())))
        for line, top, at_module_level in _imports(path):
            dists = owners.get(top)
            assert dists, f"{path}:{line}: {top} is imported but not installed here"
            allowed = module_level_ok if at_module_level else BASE | every_extra
            if not dists & allowed:
                where = "at module level" if at_module_level else "in a function"
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {top} ({', '.join(sorted(dists))}) "
                           f"{where}, declared in none of its allowed requirement lists")
    assert not bad, "\n".join(bad)


def test_the_extras_table_matches_pyproject():
    owners = _dists_of_import()
    for module, extra in EXTRA_OF.items():
        assert extra in EXTRAS, f"extras.py names extra {extra!r}, pyproject has none"
        assert owners.get(module, set()) & EXTRAS[extra], f"{module} is not in the {extra} extra"
        assert not owners.get(module, set()) & _closure(BASE), f"{module} comes with the base install"


def test_the_static_check_sees_a_module_level_optional_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\nimport httpx\ntry:\n    import ray\nexcept ImportError:\n    pass\n"
                   "def f():\n    import openai\n")
    assert _imports(src) == [(2, "httpx", True), (4, "ray", True), (8, "openai", False)]


# Run inside a child: every top-level module of an installed distribution that the base
# install would not have raises ModuleNotFoundError, as on a fresh machine with
# `pip install -e .` only.
_CHILD = r"""
import importlib.abc, json, sys
blocked = set(json.loads(sys.argv[1])) - {m.split(".")[0] for m in sys.modules}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not in the base install)",
                                      name=name)
        return None

sys.meta_path.insert(0, Block())
import contextlib, io
from stopline import cli
results = []
for argv in json.loads(sys.argv[2]):  # each: [exit code, its stdout, its stderr]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:
            code = exc.code
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def _not_in_base() -> list[str]:
    base = _closure(BASE)
    return sorted(top for top, dists in _dists_of_import().items()
                  if not dists & base and top != "stopline")


def _run_base(*argvs: list[str]) -> list[tuple[int, str, str]]:
    """`stopline ARGV` for each argv, in one child with the base install's packages only."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(_not_in_base()), json.dumps(argvs)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return [tuple(r) for r in json.loads(out.stdout.splitlines()[-1])]


def test_the_blocker_blocks_what_the_base_install_lacks():
    blocked = _not_in_base()
    assert {"httpx", "openai", "ray", "transformers", "matplotlib", "pytest"} <= set(blocked)
    assert not {"torch", "fastapi", "uvicorn", "zmq", "llguidance"} & set(blocked)
    out = subprocess.run([sys.executable, "-c", _CHILD.replace("from stopline import cli", "import httpx"),
                          json.dumps(blocked), "[]"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "blocked: not in the base install" in out.stderr


def test_every_parser_builds_on_the_base_install():
    from stopline.cli import _BENCHES, _COMMANDS

    argvs = [["--help"], *([name, "--help"] for name, *_ in _COMMANDS),
             *(["bench", name, "--help"] for name, *_ in _BENCHES)]
    assert len(argvs) > 10
    for argv, (code, out, err) in zip(argvs, _run_base(*argvs), strict=True):
        assert code == 0, f"stopline {' '.join(argv)}:\n{err[-3000:]}"
        assert out.startswith("usage: stopline"), out[:300]


def test_a_command_that_needs_an_extra_names_it_in_one_line():
    replicas, soak = _run_base(["serve", "--replicas", "2", "--port", "1"],
                               ["bench", "soak", "--requests", "1"])
    assert replicas[0] == 2 and replicas[2].splitlines() == [
        "error: --replicas needs the 'ray' package: pip install 'stopline[ray]'"], replicas
    assert soak[0] == 2 and soak[2].splitlines() == [
        "error: stopline bench soak needs the 'httpx' package: pip install 'stopline[bench]'"], soak


def test_generate_runs_on_the_base_install(tiny_model_dir):
    [(code, out, err)] = _run_base(["generate", "hello", "--model", str(tiny_model_dir),
                                    "--max-tokens", "3", "--raw"])
    assert code == 0, err[-3000:]
    assert "3 tokens" in err and "finish_reason=length" in err


def test_the_front_door_reads_the_readme_first_command():
    spec = importlib.util.spec_from_file_location("front_door", ROOT.parent / "tools" / "front_door.py")
    front_door = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(front_door)
    cmd = front_door.readme_command()
    assert cmd.endswith("&& stopline serve") and "pip install -e ." in cmd
    assert "pip install torch==2.13.0" in cmd  # an unpinned torch pulls several GB of CUDA


def test_replicas_that_never_started_close_without_ray(monkeypatch):
    import asyncio

    from stopline.cluster.cores import RayCores

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises, as on the base install
    asyncio.run(RayCores(None, None, replicas=2).close())


def test_data_a_benchmark_reads_ships_in_the_package():
    from stopline.bench.floors import HELDOUT

    assert HELDOUT.is_relative_to(ROOT) and HELDOUT.stat().st_size > 0
    globs = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(HELDOUT.match(f"{pkg.split('.', 1)[1].replace('.', '/')}/{g}")
               for pkg, gs in globs.items() for g in gs if pkg.startswith("stopline."))
