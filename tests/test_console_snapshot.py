"""The snapshot's per-request detail (the console's pool picture), on an in-process core.

The picture is only worth showing if it is the ledger: every owned block appears in the
table of a live sequence, cached blocks are exactly the hashed unowned ones, and past the
bounds the lists are cut and say so, while the counts stay exact.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from stopline.config import EngineConfig
from stopline.engine import snapshot as snap_mod
from stopline.engine.core import EngineCore
from stopline.engine.snapshot import Snapshot, take_snapshot
from stopline.request import AbortSource, SamplingParams
from tests.engine_support import random_prompts

BS = 16


@pytest.fixture(scope="module")
def core(tiny_model_dir: Path) -> EngineCore:
    return EngineCore(str(tiny_model_dir), EngineConfig(num_blocks=64, block_size=BS, max_num_seqs=2),
                      progress=False)


def _check_ledger(core: EngineCore, s: Snapshot) -> None:
    owned = {b for q in s.live for b in q.block_ids}
    assert s.pool_map
    assert owned == {b for b in range(core.pool.num_blocks) if core.pool.refcount[b] > 0}
    assert len(owned) == s.kv_blocks_used
    assert sorted(s.cached_block_ids) == sorted(
        b for b in range(core.pool.num_blocks)
        if core.pool.refcount[b] == 0 and core.pool.block_hash[b] is not None)
    assert len(s.cached_block_ids) == s.kv_blocks_cached
    for q in s.live:
        assert q.num_blocks == len(q.block_ids)


def test_live_sequences_and_pool_map(core: EngineCore) -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = random_prompts(3, [40, 20, 33], seed=1)
    incs = [core.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    core.step()
    s = take_snapshot(core)
    _check_ledger(core, s)
    states = {q.incarnation: q.state for q in s.live}
    assert set(states) == set(incs)
    assert len(states) == 3 and list(states.values()).count("waiting") == 1  # max_num_seqs=2
    assert (s.running, s.waiting) == (2, 1)
    # The wire form (msgpack, as the core process sends it) round-trips.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=Snapshot) == s

    core.abort([incs[0]], AbortSource.CANCEL, time.monotonic())
    for _ in range(3):
        core.step()
        _check_ledger(core, take_snapshot(core))
    while core.has_unfinished():
        core.step()
    s = take_snapshot(core)
    _check_ledger(core, s)
    assert s.live == [] and s.kv_blocks_used == 0 and s.kv_blocks_cached > 0  # prefixes stay cached


def test_bounds_cut_the_lists_not_the_counts(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
    for i, p in enumerate(random_prompts(2, [50], seed=2)):
        core.add_request(f"b{i}", p, SamplingParams(max_tokens=8, ignore_eos=True))
    core.step()
    monkeypatch.setattr(snap_mod, "MAP_BLOCKS", 3)
    s = take_snapshot(core)
    assert not s.pool_map and s.cached_block_ids == []
    assert all(q.block_ids == [] and q.num_blocks > 0 for q in s.live)
    assert s.kv_blocks_used == sum(q.num_blocks for q in s.live)
    monkeypatch.setattr(snap_mod, "MAP_BLOCKS", 4096)
    monkeypatch.setattr(snap_mod, "LIVE_ROWS", 1)
    s = take_snapshot(core)
    assert not s.pool_map and len(s.live) == 1 and s.running == 2
    while core.has_unfinished():
        core.step()


def test_every_layer_groups_pool(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A model of two KV layer groups (tiny Gemma 3: global layers, local ones of window 16):
    the snapshot lists each group's pool, as its ledger has it, not group 0's alone; past the
    window the local group holds fewer blocks than the global one."""
    from tests.tiny_families import make_family_dir

    gemma = make_family_dir(tmp_path_factory.mktemp("snap_gemma"), "gemma3")
    core = EngineCore(str(gemma), EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8),
                      progress=False)
    core.add_request("long", random_prompts(1, [40], seed=3)[0], SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(8):
        core.step()
    s = take_snapshot(core)
    kv = core.kv_manager
    assert s.kv_groups == [[w, p.num_blocks, p.num_used, p.num_cached]
                           for w, p in zip(kv.windows, kv.pools, strict=True)]
    assert [g[0] for g in s.kv_groups] == [0, 16] and [g[1] for g in s.kv_groups] == [64, 64]
    assert 0 < s.kv_groups[1][2] < s.kv_groups[0][2] == s.kv_blocks_used  # the window slid
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=Snapshot) == s
    while core.has_unfinished():
        core.step()
    s = take_snapshot(core)
    assert [g[2] for g in s.kv_groups] == [0, 0] and s.kv_groups[1][3] > 0
