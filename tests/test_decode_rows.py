"""DecodeRows: decoding sequences read their K/V from rows kept current, not gathered blocks.

The rows must always equal the cache they copy (through joins, leaves, re-layouts and a NaN
left behind by a previous owner), and an engine with them must produce exactly what the
gathering path produces.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.kv.decode_rows import DecodeRows, RowMismatch, RowPlan
from stopline.kv.kv_cache import KVCache, gather_blocks
from stopline.model.loaders.loader import load_model
from stopline.request import AbortSource, SamplingParams
from tests.tiny_model import make_tiny_llama_dir

LAYERS, HK, D, BS, TILE = 2, 2, 8, 4, 8


class Seqs:
    """Sequences growing in a random cache the way the engine's decodes do."""

    def __init__(self, num_blocks: int = 64) -> None:
        self.kv = KVCache(LAYERS, num_blocks, BS, HK, D)
        self.free = list(range(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.gen = torch.Generator().manual_seed(0)

    def add(self, key: int, n: int) -> None:
        """A sequence that has n - 1 tokens in the cache and computes its n-th this step."""
        self.tables[key] = [self.free.pop() for _ in range(-(-n // BS))]
        self.lens[key] = n
        for pos in range(n - 1):
            self._write(key, pos)

    def drop(self, key: int) -> None:
        self.free += self.tables.pop(key)
        del self.lens[key]

    def _write(self, key: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        slot = self.tables[key][pos // BS] * BS + pos % BS
        kv = torch.randn(2, LAYERS, HK, D, generator=self.gen)
        for li in range(LAYERS):
            self.kv.k[li][:, slot] = kv[0, li]
            self.kv.v[li][:, slot] = kv[1, li]
        return kv[0], kv[1]

    def step(self, rows: DecodeRows, grow: bool = True) -> RowPlan:
        """One decode step: write every sequence's new token, then update the rows."""
        keys = list(self.lens)
        if grow:
            for k in keys:
                self.lens[k] += 1
                if self.lens[k] > len(self.tables[k]) * BS:  # the scheduler's block for it
                    self.tables[k].append(self.free.pop())
        plan = rows.plan(keys, [self.lens[k] for k in keys], [self.tables[k] for k in keys])
        assert plan is not None
        new = [self._write(k, self.lens[k] - 1) for k in keys]
        for li in range(LAYERS):
            kn = torch.stack([n[0][li] for n in new])
            vn = torch.stack([n[1][li] for n in new])
            kb, vb = rows.update(li, self.kv.k[li], self.kv.v[li], kn, vn, plan)
            for key, row in zip(keys, plan.rows.tolist(), strict=True):
                n = self.lens[key]
                blocks = torch.tensor(self.tables[key])
                for buf, cache in ((kb, self.kv.k[li]), (vb, self.kv.v[li])):
                    want = gather_blocks(cache.view(HK, -1, BS, D), blocks).view(HK, -1, D)[:, :n]
                    assert torch.equal(buf[row, :, :n], want), (key, li)
                    assert torch.isfinite(buf[row]).all()
            masked = plan.masked[:, 0, 0]
            for key, row in zip(keys, plan.rows.tolist(), strict=True):
                assert (~masked[row]).sum() == self.lens[key]
        return plan


def rows_for(max_bytes: int = 1 << 30, verify: bool = False) -> DecodeRows:
    return DecodeRows(LAYERS, HK, D, BS, TILE, 16, max_bytes, verify=verify)


def test_rows_follow_the_cache_through_joins_leaves_and_relayouts() -> None:
    rng = random.Random(1)
    s, rows = Seqs(num_blocks=512), rows_for()
    for key in range(5):
        s.add(key, rng.randint(1, 20))
    s.step(rows, grow=False)
    next_key = 5
    widths = set()
    for _ in range(60):
        if rng.random() < 0.2 and len(s.lens) > 1:
            s.drop(rng.choice(list(s.lens)))
        if rng.random() < 0.25:
            s.add(next_key, rng.randint(1, 30))
            next_key += 1
        s.step(rows)
        widths.add(rows.width)
    # The width moved up and down many times; the rows moved only now and then (leaves).
    assert len(widths) >= 4 and rows.relayouts < 10


def test_a_row_is_cleared_when_it_changes_hands() -> None:
    s, rows = Seqs(), rows_for()
    s.add(0, 9)
    s.add(1, 3)
    s.step(rows, grow=False)
    row = rows.owner[0]
    for li in range(LAYERS):  # the first owner's row ends in NaN past anything a new owner has
        rows.k[li][row, :, 5:] = float("nan")
    s.drop(0)
    s.add(2, 2)
    s.step(rows)
    assert rows.owner[2] == row  # the same row, finite beyond its new owner's 3 tokens
    assert all(torch.isfinite(t[row, :, :rows.width]).all() for t in rows.k + rows.v)
    for _ in range(2 * TILE):  # and as the width grows over columns the NaN still holds
        s.step(rows)  # (each step checks the rows it hands out are finite)
    assert rows.width > TILE


def test_rows_are_compacted_when_departures_leave_mostly_holes() -> None:
    s, rows = Seqs(num_blocks=512), rows_for()
    for key in range(12):
        s.add(key, 5)
    s.step(rows, grow=False)
    for key in range(11):  # all but the one in the highest row leave
        s.drop(key)
    before, storage = rows.relayouts, rows.k[0].data_ptr()
    plan = s.step(rows)  # checks every row against the cache, as the other steps do
    assert rows.compactions == 1 and rows.owner == {11: 0}
    assert plan.fill is None  # moved within the buffers, not copied from the cache again
    assert rows.relayouts == before and rows.k[0].data_ptr() == storage  # no new buffers


def test_compaction_fills_scattered_holes_in_place_and_rows_stay_exact() -> None:
    rng = random.Random(3)
    s, rows = Seqs(num_blocks=1024), rows_for()
    for key in range(16):
        s.add(key, rng.randint(1, 3 * TILE))
    s.step(rows, grow=False)
    storage = [t.data_ptr() for t in rows.k + rows.v]
    for key in rng.sample(range(16), 11):  # 5 stay, scattered over the 16 rows
        s.drop(key)
    s.step(rows)  # every row checked against the cache
    assert rows.compactions == 1 and sorted(rows.owner.values()) == list(range(5))
    for key in range(16, 20):  # joiners take the rows above; the width grows over them
        s.add(key, rng.randint(1, 4 * TILE))
    for _ in range(2 * TILE):
        s.step(rows)
    assert [t.data_ptr() for t in rows.k + rows.v] == storage and rows.relayouts == 1


def test_the_width_moves_within_the_capacity_without_moving_the_rows() -> None:
    s, rows = Seqs(num_blocks=512), rows_for()
    for key in range(3):
        s.add(key, 2 * TILE - key)
    s.step(rows, grow=False)
    before, width, storage = rows.relayouts, rows.width, rows.k[0].data_ptr()
    plan = s.step(rows)  # the longest row outgrows the width: checked against the cache
    assert rows.width > width and plan.widen == (width, rows.width, 3)
    s.add(3, 6 * TILE)  # a long joiner widens the rows, then leaves
    s.step(rows)
    wide = rows.width
    s.drop(3)
    plan = s.step(rows)
    assert rows.width < wide and plan.fill is None and plan.widen is None  # narrowed
    assert rows.relayouts == before and rows.k[0].data_ptr() == storage  # nothing moved


def test_debug_check_catches_a_row_that_drifted_and_passes_poison_through() -> None:
    s, rows = Seqs(), rows_for(verify=True)
    s.add(0, 6)
    s.add(1, 6)
    s.step(rows, grow=False)
    rows.k[0][rows.owner[1], 0, 2] += 1.0  # a bug in the rows: the check names it
    with pytest.raises(RowMismatch, match="layer 0 K"):
        s.step(rows)
    # Poison (NaN) in the cache under a live sequence is taken into its row, as a gather would.
    s2, rows2 = Seqs(), rows_for(verify=True)
    s2.add(0, 6)
    s2.add(1, 6)
    s2.step(rows2, grow=False)
    s2.kv.poison([s2.tables[0][0]])
    s2.lens = {k: n + 1 for k, n in s2.lens.items()}
    keys = [0, 1]
    plan = rows2.plan(keys, [s2.lens[k] for k in keys], [s2.tables[k] for k in keys])
    kb, _ = rows2.update(0, s2.kv.k[0], s2.kv.v[0], torch.zeros(2, HK, D), torch.zeros(2, HK, D), plan)
    assert torch.isnan(kb[rows2.owner[0], :, :BS]).all()
    assert torch.isfinite(kb[rows2.owner[1]]).all()


def test_rows_that_would_not_fit_fall_back_to_gathering() -> None:
    rows = rows_for(max_bytes=2 * LAYERS * HK * D * 4 * 2 * 16)  # two rows of 16 positions
    assert rows.plan([0, 1], [10, 12], [[0, 1, 2], [3, 4, 5]]) is not None
    assert rows.plan([0, 1], [10, 20], [[0, 1, 2], [3, 4, 5, 6, 7]]) is None
    assert rows.k == [] and rows.owner == {}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_llama_dir(tmp_path_factory.mktemp("rows") / "tiny", seed=5, init_std=0.1,
                               vocab_size=384)
    return load_model(str(path), progress=False)


def run(tiny, decode_rows: bool, **kw) -> tuple[dict, EngineCore]:
    cfg = dict(num_blocks=96, block_size=4, max_num_seqs=8, max_num_batched_tokens=48,
               debug=True, target_step_ms=None, decode_rows=decode_rows, attention_backend="torch")
    cfg.update(kw)
    eng = EngineCore(tiny, EngineConfig(**cfg))
    rng = random.Random(7)
    pending = [([rng.randrange(3, 380) for _ in range(rng.randint(1, 40))], rng.randint(1, 50))
               for _ in range(24)]
    out: dict = {}
    i = 0
    while pending or eng.has_unfinished():
        if pending and rng.random() < 0.5:  # arrivals while others decode: churn in the rows
            prompt, max_tokens = pending.pop()
            eng.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                           ignore_eos=True, logprobs=2))
            i += 1
        for o in eng.step():
            toks, lps = out.setdefault(o.request_id, ([], []))
            toks += o.new_token_ids
            lps += [(lp.logprob, lp.top) for lp in o.new_logprobs]
    assert eng.pool.num_used == 0
    return out, eng


@pytest.mark.parametrize("kw", [{}, {"num_blocks": 40, "preemption_mode": "swap", "admission_lookahead": 0}])
def test_engine_with_rows_matches_the_gathering_engine_bit_for_bit(tiny, kw) -> None:
    """Same tokens and the same float logprobs: attention read the same numbers in the
    same order. The second case preempts (by swap; admission keeps no room back), so rows
    leave and come back."""
    with_rows, eng = run(tiny, True, **kw)
    gathered, _ = run(tiny, False, **kw)
    assert with_rows == gathered
    assert sum(len(t) for t, _ in with_rows.values()) > 300
    rows = eng.runner.rows
    assert rows is not None and 0 < rows.relayouts < eng.steps // 3
    assert rows.k == [] and rows.owner == {}  # idle: the copies are freed
    if kw:
        assert sum(eng.lifecycle.stats.preemptions.values()) > 0


def test_the_rows_can_be_turned_off_from_the_command_line(tiny) -> None:
    import argparse

    from stopline.args import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args([])).decode_rows is True
    cfg = engine_config(p.parse_args(["--no-decode-rows", "--num-blocks", "32",
                                      "--attention-backend", "torch"]))
    assert cfg.decode_rows is False and cfg.attention_backend == "torch"
    assert EngineCore(tiny, cfg).runner.rows is None


def test_an_aborted_decode_loses_its_row_and_the_others_are_undisturbed(tiny) -> None:
    """Abort one of three decoding requests: its row is free after the next step, the
    survivors' tokens equal a gathering engine's under the same abort, and the idle audit
    (debug mode, every step) finds no rows left."""
    def go(decode_rows: bool) -> tuple[dict, EngineCore]:
        eng = EngineCore(tiny, EngineConfig(num_blocks=96, block_size=4, max_num_seqs=8,
                                            debug=True, target_step_ms=None, decode_rows=decode_rows,
                                            attention_backend="torch"))
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        incs = [eng.add_request(f"r{i}", list(range(5, 5 + n)), params)
                for i, n in enumerate((7, 12, 20))]
        out: dict = {}
        for step in range(200):
            if step == 6:
                victim = eng.families.get(incs[1]).members[0]
                eng.abort([incs[1]], AbortSource.CANCEL, time.monotonic())
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if step == 6 and decode_rows:
                assert eng.runner.rows is not None
                assert victim.internal_id not in eng.runner.rows.owner
            if not eng.has_unfinished():
                break
        return out, eng

    with_rows, eng = go(True)
    gathered, _ = go(False)
    assert with_rows == gathered and len(with_rows["r0"]) == 30 and len(with_rows["r1"]) < 30
    assert eng.runner.rows.k == []


def test_the_next_columns_are_backed_ahead_of_the_width_a_few_rows_a_step() -> None:
    from stopline.kv import decode_rows

    s = Seqs(num_blocks=512)
    rows = DecodeRows(LAYERS, HK, D, BS, 64, 16, 1 << 30)  # 64-key tiles: room to grow
    for key in range(6):
        s.add(key, 3)
    s.step(rows, grow=False)
    width, unit = rows.width, rows.unit
    for t in rows.k + rows.v:  # garbage where the next unit will be
        t[:6, :, width:width + unit] = float("nan")
    s.step(rows)  # a few rows a step, not all at once
    assert 0 < sum(bool((rows.k[0][r, :, width:width + unit] == 0).all()) for r in range(6)) < 6
    for _ in range(decode_rows._PRETOUCH_STEPS):
        s.step(rows)
    assert rows.width == width  # still inside the first unit: nothing read these columns
    assert all((t[:6, :, width:width + unit] == 0).all() for t in rows.k + rows.v)


def test_columns_are_not_pretouched_where_memory_is_not_lazy() -> None:
    s = Seqs(num_blocks=512)
    rows = DecodeRows(LAYERS, HK, D, BS, 64, 16, 1 << 30)
    rows._reserve = False  # as on a GPU: exact sizes, backed when allocated
    for key in range(2):
        s.add(key, 3)
    s.step(rows, grow=False)
    width = rows.width
    assert rows.capacity > width  # headroom a pretouch could have written into
    rows.k[0][:2, :, width:].fill_(float("nan"))
    for _ in range(4):
        s.step(rows)
    assert torch.isnan(rows.k[0][:2, :, width:]).all()
