"""Each field of `Request` has one writing module (docs/design.md, "owned state").

The package is parsed, not run: every assignment, augmented assignment, `del` and mutating
call (append, remove, ...) on `<name>.<field>` (or `<name>.<field>[...]`) where `<name>` is
a request (`req`, `request` and the other names the package gives requests, any parameter
annotated `Request`, and `self` inside request.py) counts as a write by its module. A field
written by two modules fails, naming them and the lines.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import stopline

PACKAGE = Path(stopline.__file__).resolve().parent
# The names the package uses for a Request (a name bound to something else never writes a
# field that Request has: checked by the known-writers test below).
REQUEST_NAMES = frozenset({"req", "request", "sample", "leader", "m", "r", "member"})
MUTATORS = frozenset({"append", "extend", "clear", "pop", "insert", "remove", "sort", "reverse",
                      "update", "add", "discard"})

# The block tables and KV counters are not Request's: the KV manager owns them
# (kv/manager.py SeqKV; tests/test_kv_owner.py). Nothing may be listed here.
PENDING_KV: frozenset[str] = frozenset()

Writers = dict[str, dict[str, list[int]]]


def request_fields() -> set[str]:
    tree = ast.parse((PACKAGE / "request.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Request":
            return {s.target.id for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    raise AssertionError("no class Request in request.py")


def _annotated_request(a: ast.arg) -> bool:
    if a.annotation is None:
        return False
    words = ast.unparse(a.annotation).replace("'", " ").replace('"', " ").replace("|", " ").split()
    return "Request" in words


class _Writes(ast.NodeVisitor):
    def __init__(self, module: str, fields: set[str], out: Writers) -> None:
        self.module, self.fields, self.out = module, fields, out
        self.scopes = [set(REQUEST_NAMES) | ({"self"} if module == "stopline.request" else set())]

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        self.scopes.append(self.scopes[-1] | {a.arg for a in args if _annotated_request(a)})
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _target(self, target: ast.expr, line: int) -> None:
        for t in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
            while isinstance(t, ast.Subscript):  # req.block_ids[i] = ... writes block_ids
                t = t.value
            if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                    and t.value.id in self.scopes[-1] and t.attr in self.fields):
                self.out[t.attr].setdefault(self.module, []).append(line)

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self._target(t, node.lineno)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for t in node.targets:
            self._target(t, node.lineno)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._target(node.target, node.lineno)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._target(node.target, node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            self._target(node.func.value, node.lineno)
        self.generic_visit(node)


def writers() -> Writers:
    fields = request_fields()
    out: Writers = defaultdict(dict)
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(("stopline", *path.relative_to(PACKAGE).with_suffix("").parts))
        _Writes(module, fields, out).visit(ast.parse(path.read_text(), str(path)))
    return out


def test_each_request_field_has_one_writing_module() -> None:
    shared = {f: mods for f, mods in writers().items() if len(mods) > 1 and f not in PENDING_KV}
    assert not shared, "Request fields written by more than one module:\n" + "\n".join(
        f"  {f}: " + ", ".join(f"{m} (lines {ls})" for m, ls in mods.items()) for f, mods in sorted(shared.items()))


def test_pending_list_names_real_shared_kv_fields() -> None:
    """The allow-list shrinks as the KV manager takes its fields: an entry that is no longer
    shared (or no longer a field) must go."""
    w = writers()
    stale = {f for f in PENDING_KV if len(w.get(f, {})) < 2}
    assert not stale, f"remove from PENDING_KV (one writer now, or gone): {sorted(stale)}"


def test_known_writers_are_found() -> None:
    """The parser sees the writes it must: stream state on the output side, speculation's
    counters in spec/, status in request.py (move_to), the terminal reason in the lifecycle."""
    w = writers()
    for field, module in [("output_token_ids", "stopline.engine.output"), ("text", "stopline.engine.output"),
                          ("sent_tokens", "stopline.engine.output"), ("undelivered", "stopline.engine.output"),
                          ("spec_accepted", "stopline.spec.drafts"), ("spec_drafted", "stopline.spec.drafts"),
                          ("status", "stopline.request"), ("finish_reason", "stopline.lifecycle"),
                          ("undelivered_in_flight", "stopline.lifecycle"), ("paused", "stopline.engine.families"),
                          ("fork_leader", "stopline.engine.families"),
                          ("inflight_samples", "stopline.sched.scheduler")]:
        assert list(w[field]) == [module], (field, dict(w[field]))


def test_a_second_writer_is_caught(tmp_path: Path) -> None:
    """The checker itself: a module that writes another's field is reported."""
    code = ("def f(req):\n    req.text += 'x'\n"
            "def g(child: 'Request'):\n    child.sent_tokens = 1\n    child.logprobs.append(None)\n")
    out: Writers = defaultdict(dict)
    _Writes("stopline.elsewhere", request_fields(), out).visit(ast.parse(code))
    assert out["text"] == {"stopline.elsewhere": [2]}
    assert out["sent_tokens"] == {"stopline.elsewhere": [4]}
    assert out["logprobs"] == {"stopline.elsewhere": [5]}
