"""The KV manager is the one owner and writer of each request's KV state (issue 42, item 3):
block tables and KV counters live in it, not on Request, and no other module writes them."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import stopline
from stopline.kv.manager import SeqKV
from stopline.request import Request

PKG = Path(stopline.__file__).parent
OWNER = PKG / "kv" / "manager.py"
KV_FIELDS = {"block_ids", "num_computed", "num_cached", "num_hashed_blocks", "block_hashes",
             "swap_slots", "inflight_tokens", "last_scheduled_step"}


def test_request_carries_no_kv_state():
    assert not KV_FIELDS & {f.name for f in dataclasses.fields(Request)}


def test_no_module_but_the_manager_writes_kv_state():
    """No attribute store of a SeqKV field, and no use of SeqKV or the manager's table of
    states, anywhere in the package but kv/manager.py."""
    written = {f.name for f in dataclasses.fields(SeqKV)} - {"cached", "inflight"}  # common words
    bad = []
    for path in PKG.rglob("*.py"):
        if path == OWNER:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr in written:
                bad.append(f"{path.relative_to(PKG)}:{node.lineno} writes .{node.attr}")
            if isinstance(node, ast.Name) and node.id == "SeqKV":
                bad.append(f"{path.relative_to(PKG)}:{node.lineno} names SeqKV")
            if isinstance(node, ast.Attribute) and node.attr == "seqs":
                bad.append(f"{path.relative_to(PKG)}:{node.lineno} reaches the manager's states")
    assert not bad, bad


def test_the_fits_the_pool_rule_is_written_once():
    """Only the KV manager compares a request's blocks with the pool's size."""
    rule = ("> self.pool.num_blocks", "> self.kv.pool.num_blocks")
    bad = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
           if p != OWNER and any(r in p.read_text() for r in rule)]
    assert not bad, bad
