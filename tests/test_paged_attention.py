"""The C paged attention (model/kernels/paged_attention.py): right, row-invariant, NaN-faithful, and
what the engine does with it."""

from __future__ import annotations

import math

import pytest
import torch

from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.model.kernels import native
from stopline.model.kernels.paged_attention import PagedRows, paged_attention
from stopline.request import SamplingParams
from tests.tiny_model import make_tiny_llama_dir

pytestmark = pytest.mark.skipif(native.try_kernels() is None, reason="stopline's C kernels are not built here")

BS = 16


def cache(hk: int, d: int, blocks: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(hk, blocks * BS, d, generator=gen), torch.randn(hk, blocks * BS, d, generator=gen))


def reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: list[int], n: int) -> torch.Tensor:
    """Float64 attention of one row [heads, d] over keys 0..n-1."""
    hk, _, d = kc.shape
    slots = torch.tensor([table[j // BS] * BS + j % BS for j in range(n)])
    k, v = kc[:, slots].double(), vc[:, slots].double()
    qh = q.double().view(hk, -1, d)
    p = torch.softmax(torch.einsum("hgd,hnd->hgn", qh, k) / math.sqrt(d), dim=-1)
    return torch.einsum("hgn,hnd->hgd", p, v).reshape(-1)


# 1, 2, 3, 4, 8 and 9 query heads a KV head: every way the value pass splits a group
@pytest.mark.parametrize("d,heads,hk", [(16, 4, 2), (32, 2, 2), (64, 9, 3), (128, 8, 1), (64, 8, 2),
                                       (64, 8, 1), (16, 9, 1)])
def test_matches_float64_reference(d, heads, hk) -> None:
    kc, vc = cache(hk, d, 64)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1)).tolist()
    tables = perm[:40] + perm[40:64]
    lens = [1, 15, 16, 17, 33, 300, 640, 24 * BS]  # tails of 16 lanes, block edges, long rows
    at = [0, 40, 0, 40, 0, 0, 0, 40]
    q = torch.randn(len(lens), heads, d, generator=torch.Generator().manual_seed(2))
    out = paged_attention(q, kc, vc, PagedRows.build(lens, at, tables), BS, 1 / math.sqrt(d))
    for i, n in enumerate(lens):
        want = reference(q[i], kc, vc, tables[at[i]:], n)
        assert torch.allclose(out[i].double(), want, atol=2e-6, rtol=1e-5), (i, n)


def test_a_rows_bits_do_not_depend_on_the_other_rows_or_how_a_prompt_is_chunked() -> None:
    """A position alone, among other sequences' rows, and inside prefill chunks of every
    split: the same bits (what exact resumption after preemption relies on)."""
    kc, vc = cache(3, 64, 80, seed=3)
    gen = torch.Generator().manual_seed(4)
    table = torch.randperm(80, generator=gen)[:20].tolist()
    other = [b for b in range(80) if b not in table][:30]
    n = 200
    q = torch.randn(n, 9, 64, generator=gen)
    scale = 0.125
    whole = paged_attention(q, kc, vc, PagedRows.build(list(range(1, n + 1)), [0] * n, table), BS, scale)
    for split in (1, 7, 64, 199):
        a = paged_attention(q[:split], kc, vc, PagedRows.build(list(range(1, split + 1)), [0] * split, table),
                            BS, scale)
        b = paged_attention(q[split:], kc, vc,
                            PagedRows.build(list(range(split + 1, n + 1)), [0] * (n - split), table), BS, scale)
        assert torch.equal(torch.cat([a, b]), whole), split
    for pos in (0, 16, 150, 199):  # as a lone decode row, and as a decode among others
        alone = paged_attention(q[pos:pos + 1], kc, vc, PagedRows.build([pos + 1], [0], table), BS, scale)
        mixed_q = torch.cat([torch.randn(5, 9, 64, generator=gen), q[pos:pos + 1]])
        mixed = paged_attention(mixed_q, kc, vc, PagedRows.build([300, 3, 17, 64, 480, pos + 1],
                                                                 [20, 20, 20, 20, 20, 0], table + other),
                                BS, scale)
        assert torch.equal(alone[0], whole[pos]) and torch.equal(mixed[5], whole[pos]), pos


@pytest.mark.parametrize("n", [15, 31, 47])
def test_a_score_has_the_same_bits_in_a_full_group_of_16_keys_and_in_the_tail(n) -> None:
    """Keys are scored 16 at a time with one shared reduction tree, and one by one after the
    last full 16. A row of n keys and the same row with one more key that can't count (its
    score is -1000, so its weight is exactly 0, and its value is zero) score keys n-15..n-1
    on the two paths; the outputs are the same bits only if every score is."""
    gen = torch.Generator().manual_seed(n)
    kc, vc = cache(1, 64, 8, seed=n)
    sign = torch.randint(0, 2, (64,), generator=gen) * 2.0 - 1
    q = torch.randn(1, 3, 64, generator=gen).abs() * sign
    kc[0, n] = -1e4 * sign  # every head's score about -1e4 * 0.125 * 50
    vc[0, n] = 0.0
    table = list(range(8))
    short = paged_attention(q, kc, vc, PagedRows.build([n], [0], table), BS, 0.125)
    longer = paged_attention(q, kc, vc, PagedRows.build([n + 1], [0], table), BS, 0.125)
    assert not torch.isnan(short).any() and torch.equal(short, longer)


def test_nan_in_a_read_key_or_value_reaches_the_row_and_only_rows_that_read_it() -> None:
    """Debug mode poisons freed blocks with NaN: a row reading one must fail, as through a
    gather; a row whose keys end before the poison must not."""
    kc, vc = cache(2, 16, 8)
    q = torch.randn(3, 4, 16)
    rows = PagedRows.build([40, 33, 40], [0, 0, 0], [5, 6, 7])
    for buf in (kc, vc):
        poisoned = buf.clone()
        poisoned[1, 7 * BS + 3] = float("nan")  # key 35 of the sequence, kv head 1
        k, v = (poisoned, vc) if buf is kc else (kc, poisoned)
        out = paged_attention(q, k, v, rows, BS, 0.25).view(3, 2, -1)
        nan = torch.isnan(out).any(-1)
        assert nan.tolist() == [[False, True], [False, False], [False, True]]


@pytest.mark.parametrize("bad", ["dtype", "head_dim", "nkeys", "rows", "strides"])
def test_bad_inputs_are_refused(bad) -> None:
    kc, vc = cache(2, 16, 4)
    q = torch.randn(2, 4, 16)
    rows = PagedRows.build([3, 4], [0, 0], [1, 2])
    if bad == "dtype":
        q = q.double()
    elif bad == "head_dim":
        q, kc, vc = torch.randn(2, 4, 24), torch.randn(2, 64, 24), torch.randn(2, 64, 24)
    elif bad == "nkeys":
        with pytest.raises(ValueError, match="at least one key"):
            PagedRows.build([3, 0], [0, 0], [1, 2])
        return
    elif bad == "rows":
        rows = PagedRows.build([3], [0], [1, 2])
    else:
        q = torch.randn(2, 16, 4).transpose(1, 2)
    with pytest.raises(ValueError, match="paged attention"):
        paged_attention(q, kc, vc, rows, BS, 0.25)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from stopline.model.loaders.loader import load_model

    path = make_tiny_llama_dir(tmp_path_factory.mktemp("paged") / "tiny", seed=3, init_std=0.1, vocab_size=384)
    return load_model(str(path), progress=False)


def test_the_engine_reads_the_cache_in_place_by_default(tiny) -> None:
    eng = EngineCore(tiny, EngineConfig(num_blocks=64, block_size=4, debug=True))
    assert eng.model.attention == "native" and eng.runner.rows is None  # no K/V copies kept
    torch_eng = EngineCore(tiny, EngineConfig(num_blocks=64, block_size=4, attention_backend="torch"))
    assert torch_eng.model.attention == "torch" and torch_eng.runner.rows is not None
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = {}
    for e in (eng, torch_eng):
        e.add_request("a", list(range(5, 30)), params)
        e.add_request("b", list(range(40, 47)), params)
        out: dict = {}
        while e.has_unfinished():
            for o in e.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        got[e.model.attention] = out
        assert e.pool.num_used == 0
    # Different bits, the same model: greedy tokens agree on this model (HF is the oracle
    # for both in test_engine_oracle).
    assert got["native"] == got["torch"] and len(got["native"]["a"]) == 12


def test_native_attention_where_it_cannot_run_is_an_error_and_auto_falls_back(tiny, monkeypatch) -> None:
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    native.reset()
    try:
        with pytest.raises(ValueError, match="attention_backend 'native' can't run here: turned off"):
            EngineCore(tiny, EngineConfig(num_blocks=64, block_size=4, attention_backend="native"))
        with pytest.warns(UserWarning, match="C kernels are off"):
            eng = EngineCore(tiny, EngineConfig(num_blocks=64, block_size=4))
        assert eng.model.attention == "torch" and eng.runner.rows is not None
    finally:
        monkeypatch.delenv(native.ENV_SWITCH)
        native.reset()
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")


def test_the_backend_is_a_command_line_setting() -> None:
    import argparse

    from stopline.args import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args([])).attention_backend == "auto"
    assert engine_config(p.parse_args(["--attention-backend", "torch"])).attention_backend == "torch"


def test_a_block_table_outside_the_pool_fails_the_step_not_the_process(tiny, monkeypatch) -> None:
    """The kernel reads wherever a table points; an entry past the pool (a bug upstream) ends
    the step's requests with an error instead of reading out of bounds."""
    eng = EngineCore(tiny, EngineConfig(num_blocks=64, block_size=4))
    eng.add_request("a", list(range(5, 30)), SamplingParams(temperature=0.0, max_tokens=4))
    monkeypatch.setattr(eng.kv, "nulls", [2])  # the pool's bound: its blocks now lie "outside"
    outs = eng.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("a", True, "error")]
    assert "outside the KV pool" in outs[0].stop_detail
    assert not eng.has_unfinished() and eng.pool.num_used == 0


def test_the_attention_timer_runs_and_compares_two_builds() -> None:
    """bench/attention_time.py (not a test of speed): it runs, and compared with itself as the
    'other build' it reports the same bits."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "attention_time.py"
    lib = native.kernels()._name
    done = subprocess.run([sys.executable, str(script), "--rows", "3", "--keys", "20", "40", "--rounds", "1",
                           "--against", lib], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stdout.splitlines() if " keys: " in ln]
    assert len(lines) == 2 and all("same bits" in ln for ln in lines), done.stdout
