"""The int8 KV cache (`--kv-cache-dtype int8`, fast numerics only; docs/numerics.md "The int8
KV cache"): the C writer quantizes each (kv head, token) row as the torch reference
`quantize_rows` does, bit for bit; the C attention over an int8 cache gives, bit for bit, its
float32 arithmetic over the dequantized rows (`dequantize`, torch's q * scale), within a
stated bound of a float64 torch attention; an engine stays batch-invariant (alone vs 24
concurrent, chunked, preempted by swap and by recompute); swap, prefix copies, the debug
poison and the P/D wire move quants and scales together; a block holds about a quarter of
the float32 bytes."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from stopline import LLM
from stopline.args import add_engine_args, engine_config
from stopline.config import AttentionBackend, EngineConfig, KVCacheDtype
from stopline.kv.kv_cache import KVCache, dequantize, make_cache, quantize_rows
from stopline.model.kernels.native import has_bf16, try_kernels
from tests.engine_support import (
    assert_batch_invariant,
    greedy,
    random_prompts,
    sharp_tiny_dir,
    signature,
    signatures_alone,
)
from tests.tiny_model import make_tiny_gguf

NATIVE = try_kernels() is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="stopline's C kernels are not built here")
FAST = NATIVE and has_bf16()
needs_fast = pytest.mark.skipif(not FAST, reason="no AVX512-BF16 or no C kernels on this host")
MAX_NEW = 16
LENGTHS = [1, 3, 5, 8, 12, 16, 17, 20, 24, 31, 32, 33, 40, 47, 50, 63, 64, 65, 70, 80, 96, 100, 120, 150]


# --- configuration and sizing ---------------------------------------------------------------

def test_int8_needs_fast_numerics() -> None:
    assert EngineConfig().kv_cache_dtype is KVCacheDtype.AUTO
    assert EngineConfig(numerics="fast", kv_cache_dtype="int8").kv_cache_dtype is KVCacheDtype.INT8
    with pytest.raises(ValueError, match="--kv-cache-dtype int8.*--numerics fast"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, int8"):
        EngineConfig(kv_cache_dtype="fp8")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["--numerics", "fast", "--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="--numerics fast"):
        engine_config(p.parse_args(["--kv-cache-dtype", "int8"]))


def test_int8_block_is_about_a_quarter_and_the_pool_holds_more() -> None:
    f32 = KVCache.bytes_per_block(30, 16, 3, 64)
    i8 = KVCache.bytes_per_block(30, 16, 3, 64, torch.int8)
    assert (f32, i8) == (2 * 30 * 16 * 3 * 64 * 4, 2 * 30 * 16 * 3 * (64 + 4))
    cfg = dict(kv_cache_memory_gb=0.01, block_size=16, numerics="fast")
    _, kf, _ = make_cache(EngineConfig(**cfg), 4, 3, 64)
    _, kq, _ = make_cache(EngineConfig(**cfg, kv_cache_dtype="int8"), 4, 3, 64)
    assert kq.quantized and not kf.quantized and kq.k[0].dtype == torch.int8
    assert kq.num_blocks == int(0.01 * 2**30) // KVCache.bytes_per_block(4, 16, 3, 64, torch.int8)
    assert kq.num_blocks > 3.7 * kf.num_blocks
    assert kq.nbytes <= 0.01 * 2**30 + KVCache.bytes_per_block(4, 16, 3, 64, torch.int8)  # + the null block


# --- the arithmetic ---------------------------------------------------------------------------

def _rows(n: int, d: int, seed: int) -> torch.Tensor:
    """Rows of every kind quantization meets: ordinary, wide-ranging, all zero, tiny, with a
    NaN, with an infinity, a single nonzero value, ties at .5 after scaling."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.logspace(-3, 3, n)[:, None]
    x[1] = 0
    x[2, 5] = float("nan")
    x[3, 0] = float("-inf")
    x[4] = 0
    x[4, 7] = -3.0
    x[5] = torch.arange(d) - d / 2 + 0.5  # max 63.5 or less: x * (127 / max) hits .5s
    x[6] = 1e-40  # subnormal
    return x


@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_quantize_rows_is_the_stated_arithmetic(d: int) -> None:
    x = _rows(40, d, seed=d)
    q, s = quantize_rows(x)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    ok = torch.isfinite(x).all(-1) & (x.abs().amax(-1) > 0)
    assert torch.equal(s[ok], x[ok].abs().amax(-1) / 127)
    assert torch.isnan(s[2]) and torch.isnan(s[3]) and (q[2:4] == 0).all()
    assert s[1] == 0 and (q[1] == 0).all()
    assert q[4, 7] == -127 and (q[4].abs().sum() == 127)
    back = dequantize(q, s)
    assert torch.isnan(back[2:4]).all()  # a NaN row reads back NaN: its request fails loudly
    err = (back[ok] - x[ok]).abs() / (x[ok].abs().amax(-1, keepdim=True))
    assert err.max() <= 0.5 / 127 * (1 + 1e-5)  # within half a quantization step


@needs_native
@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("n", [1, 7, 40])
def test_c_writer_quantizes_as_the_reference(d: int, n: int) -> None:
    """rope_store into an int8 cache: the same q as into a float32 cache, and each k (after
    rotation) and v row stored as quantize_rows gives it, bit for bit, NaN rows included."""
    from stopline.model.kernels.layer_ops import rope_store

    hq, hk, slots = 6, 2, 128
    g = torch.Generator().manual_seed(d + n)
    qkv = torch.randn(n, (hq + 2 * hk) * d, generator=g) * 3
    qkv[0, hq * d + 3] = float("nan")  # row 0's first k head
    pos = torch.randint(0, 50, (n,), generator=g)
    cos, sin = torch.randn(50, d, generator=g), torch.randn(50, d, generator=g)
    at = torch.randperm(slots, generator=g)[:n]
    kc, vc = torch.zeros(hk, slots, d, dtype=torch.int8), torch.zeros(hk, slots, d, dtype=torch.int8)
    ks, vs = torch.zeros(hk, slots), torch.zeros(hk, slots)
    kf, vf = torch.zeros(hk, slots, d), torch.zeros(hk, slots, d)
    q8 = rope_store(qkv, pos, cos, sin, at, kc, vc, hq, ks, vs)
    q32 = rope_store(qkv, pos, cos, sin, at, kf, vf, hq)
    assert torch.equal(q8, q32)
    for cache, scale, ref in ((kc, ks, kf), (vc, vs, vf)):
        want_q, want_s = quantize_rows(ref[:, at])
        assert torch.equal(cache[:, at], want_q)
        assert torch.equal(scale[:, at].nan_to_num(-1.0), want_s.nan_to_num(-1.0))
    assert torch.isnan(ks[0, at[0]]) and not torch.isnan(ks[1, at[0]])
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[at] = False
    assert (kc[:, untouched] == 0).all() and (ks[:, untouched] == 0).all()


def _attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: list[int], scale: float,
                 window: int) -> torch.Tensor:
    """Plain float64 attention of each row over its keys (k, v: [hk, ctx, d] in position
    order)."""
    n, heads, d = q.shape
    hk = k.shape[0]
    out = torch.empty(n, heads, d, dtype=torch.float64)
    for i, nk in enumerate(keys):
        lo = max(0, nk - window) if window else 0
        for h in range(heads):
            kk, vv = k[h // (heads // hk), lo:nk].double(), v[h // (heads // hk), lo:nk].double()
            p = torch.softmax((q[i, h].double() * scale) @ kk.T, dim=-1)
            out[i, h] = p @ vv
    return out.reshape(n, heads * d)


@needs_native
@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window", [0, 37])
def test_c_attention_over_int8_is_its_float_arithmetic_over_the_dequantized_rows(d: int, group: int,
                                                                                    window: int) -> None:
    """Bit for bit the C kernel's float32 result over a float cache holding q * scale (which
    test_paged_attention.py ties to torch), within 2e-6 of float64 attention over those
    values, and a row's bits the same alone as among others."""
    from stopline.model.kernels.paged_attention import PagedRows, paged_attention

    hk, bs, nb = 2, 16, 24
    g = torch.Generator().manual_seed(d * 10 + group)
    slots = (nb + 1) * bs
    kq, ks = quantize_rows(torch.randn(hk, slots, d, generator=g) * 2)
    vq, vs = quantize_rows(torch.randn(hk, slots, d, generator=g))
    kd, vd = dequantize(kq, ks), dequantize(vq, vs)
    table = torch.randperm(nb, generator=g).tolist()
    keys = [1, 5, 16, 17, 100, 255, nb * bs]
    rows = PagedRows.build(keys, [0] * len(keys), table)
    q = torch.randn(len(keys), hk * group, d, generator=g)
    scale = d ** -0.5
    got = paged_attention(q, kq, vq, rows, bs, scale, window, ks, vs)
    assert torch.equal(got, paged_attention(q, kd, vd, rows, bs, scale, window))
    for i in (0, 4, len(keys) - 1):
        alone = paged_attention(q[i:i + 1], kq, vq, PagedRows.build(keys[i:i + 1], [0], table), bs, scale,
                                window, ks, vs)
        assert torch.equal(alone, got[i:i + 1])
    slot = torch.tensor([b * bs + o for b in table for o in range(bs)])
    ref = _attention64(q, kd[:, slot], vd[:, slot], keys, scale, window)
    assert (got.double() - ref).abs().max() <= 2e-6 * ref.abs().max()


@needs_native
def test_poisoned_int8_block_reads_nan() -> None:
    """Debug mode's poison of a freed block: quants 0, scales NaN, so a stale read is NaN."""
    from stopline.model.kernels.paged_attention import PagedRows, paged_attention

    kv = KVCache(2, 4, 16, 2, 32, torch.int8)
    kv.store(0, torch.arange(64), torch.randn(2, 64, 32), torch.randn(2, 64, 32))
    kv.poison([1])
    assert torch.isnan(kv.k_scale[0][:, 16:32]).all() and (kv.k[0][:, 16:32] == 0).all()
    out = paged_attention(torch.randn(2, 4, 32), kv.k[0], kv.v[0], PagedRows.build([16, 20], [0, 0], [0, 1]),
                          16, 0.2, 0, *kv.scales(0))
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()
    kv.zero([1])
    assert (kv.k_scale[0][:, 16:32] == 0).all()


def test_swap_and_copies_move_quants_and_scales_bytes_for_bytes() -> None:
    """read_blocks (swap out, the P/D sender) gives quants then scales; write_blocks (swap in)
    puts back the same bytes; copy_block (a fork's last block) copies both; a block's swap
    bytes are about a quarter of float32's."""
    kv = KVCache(3, 6, 4, 2, 16, torch.int8)
    for li in range(3):
        kv.store(li, torch.arange(24), torch.randn(2, 24, 16), torch.randn(2, 24, 16))
    before = [t.clone() for t in kv.k + kv.v + kv.k_scale + kv.v_scale]
    data = kv.read_blocks([1, 4])
    assert [t.dtype for t in data] == [torch.int8] * 6 + [torch.float32] * 6
    swap_bytes = sum(t.numel() * t.element_size() for t in data)
    f32 = KVCache(3, 6, 4, 2, 16)
    assert swap_bytes == 2 * 2 * 3 * 4 * 2 * (16 + 4)
    assert swap_bytes / sum(t.numel() * t.element_size() for t in f32.read_blocks([1, 4])) == 20 / 64
    kv.zero([1, 4])
    assert not torch.equal(kv.k[0], before[0])
    kv.write_blocks([1, 4], data)
    after = kv.k + kv.v + kv.k_scale + kv.v_scale
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    kv.copy_block(1, 5)
    for t in after:
        assert torch.equal(kv.block(t, 5), kv.block(t, 1))
    with pytest.raises(ValueError, match="int8"):
        f32.write_blocks([0, 1], data[:6])


def test_the_wire_ships_quants_and_scales_and_refuses_a_float_receiver() -> None:
    from stopline.disagg.epochs import BlockEpochs
    from stopline.disagg.wire import BadTransfer, pack, unpack, write
    from stopline.kv.block_pool import BlockPool

    def side(dtype: torch.dtype) -> tuple[BlockPool, KVCache, BlockEpochs]:
        pool, cache = BlockPool(4, 4), KVCache(2, 4, 4, 2, 16, dtype)
        pool.on_allocate = cache.zero
        return pool, cache, BlockEpochs(pool)

    spool, src, sep = side(torch.int8)
    rpool, dst, rep = side(torch.int8)
    sent = spool.allocate(2)
    for li in range(2):
        src.store(li, torch.arange(16), torch.randn(2, 16, 16), torch.randn(2, 16, 16))
    rpool.allocate(1)
    got = rpool.allocate(2)
    head, data = unpack(pack("r", src, sep, sep.refs(sent)))
    assert head.dtypes == ["int8"] * 4 + ["float32"] * 4
    write(dst, rep, rep.refs(got), head, data)
    for a, b in zip(src.read_blocks(sent), dst.read_blocks(got), strict=True):
        assert torch.equal(a, b)
    fpool, f32, fep = side(torch.float32)
    fgot = fpool.allocate(2)
    with pytest.raises(BadTransfer, match="8 tensors for a cache of 2 layers \\(4 tensors\\)"):
        write(f32, fep, fep.refs(fgot), head, data)
    with pytest.raises(BadTransfer, match="same --kv-cache-dtype"):
        write(f32, fep, fep.refs(fgot), head, data[:4])


# --- the engine -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as a Q4_1 GGUF: fast mode's int8 kernel where the CPU has VNNI."""
    hf = sharp_tiny_dir(tmp_path_factory)
    return make_tiny_gguf(hf, tmp_path_factory.mktemp("kv8") / "tiny-q4_1.gguf", qtype="Q4_1")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(len(LENGTHS), LENGTHS, seed=11)


def _engine(model_dir: Path, kv: str = "int8", **kw) -> LLM:
    kw.setdefault("num_blocks", 2048)
    kw.setdefault("target_step_ms", None)
    return LLM(model=str(model_dir), progress=False, numerics="fast", kv_cache_dtype=kv,
               enable_prefix_caching=False, **kw)


@pytest.fixture(scope="module")
def alone(model_dir: Path, prompts) -> list[list[tuple]]:
    llm = _engine(model_dir)
    assert llm.engine.kv.quantized and llm.engine.model.numerics == "fast"
    assert llm.engine.model.decoder is not None  # the fused C decoder reads the int8 cache
    return signatures_alone(llm, prompts, MAX_NEW)


@needs_fast
@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 5},
                                {"num_blocks": 40, "preemption_mode": "swap"},
                                {"num_blocks": 40, "preemption_mode": "recompute"}],
                         ids=["concurrent", "chunked", "swapped", "recomputed"])
def test_int8_alone_vs_24_concurrent(model_dir: Path, prompts, alone, kw: dict) -> None:
    assert_batch_invariant(_engine(model_dir, **kw), prompts, alone, MAX_NEW, preempted="num_blocks" in kw)


@needs_fast
def test_int8_layer_loop_equals_the_fused_decoder(model_dir: Path, prompts, alone) -> None:
    """The Python layer loop (rope_store and paged_attention's int8 forms) gives the fused C
    decoder's bits."""
    llm = _engine(model_dir)
    llm.engine.model.decoder = None
    res = [signature(llm.generate([p], greedy(MAX_NEW, logprobs=3))[0].outputs[0]) for p in prompts[:8]]
    assert res == alone[:8]


@needs_fast
def test_int8_rounds_the_cache_yet_mostly_agrees(model_dir: Path, prompts, alone) -> None:
    """int8 really changes the arithmetic (logprobs differ from the float32 cache's), yet the
    tiny model's sharp greedy tokens mostly agree."""
    f32 = _engine(model_dir, kv="auto")
    assert not f32.engine.kv.quantized
    sigs = [signature(f32.generate([p], greedy(MAX_NEW, logprobs=3))[0].outputs[0]) for p in prompts[:8]]
    assert sigs != alone[:8]
    same = sum(s[0][0] == a[0][0] for s, a in zip(sigs, alone[:8], strict=True))
    assert same >= 7, f"only {same} of 8 first tokens agree between the float32 and int8 caches"


@needs_fast
def test_int8_on_a_model_with_local_and_global_layers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Gemma 3 (torch glue, windowed C attention, two KV groups): its K/V go through
    KVCache.store's quantization, and a request alone equals it among others."""
    from tests.tiny_families import make_family_dir

    d = make_family_dir(tmp_path_factory.mktemp("kv8_gemma"), "gemma3")
    ps = random_prompts(6, [3, 17, 40, 70, 90, 33], seed=5)
    llm = LLM(model=str(d), progress=False, numerics="fast", kv_cache_dtype="int8", num_blocks=512,
              target_step_ms=None, enable_prefix_caching=False)
    assert llm.engine.kv.quantized and len(llm.engine.kv.groups) == 2
    one = [signature(llm.generate([p], greedy(12, logprobs=2))[0].outputs[0]) for p in ps]
    many = [signature(r.outputs[0]) for r in llm.generate(ps, greedy(12, logprobs=2))]
    assert one == many


@needs_fast
def test_a_prefill_decode_split_ships_the_int8_blocks(tiny_model_dir) -> None:
    """Both roles on int8 caches: the transfer carries quants and scales, and the split's
    tokens and logprobs equal one engine's."""
    from stopline.engine.core import EngineCore
    from stopline.model.loaders.loader import load_model
    from tests.disagg_support import config, make_pair
    from tests.engine_support import drive

    loaded = load_model(str(tiny_model_dir), progress=False)
    kw = dict(numerics="fast", kv_cache_dtype="int8")
    prompts = random_prompts(4, [3, 9, 17, 26], seed=3)
    reqs = [(f"g{i}", p, greedy(8, logprobs=2)) for i, p in enumerate(prompts)]
    want = drive(EngineCore(loaded, config(**kw)), reqs)
    pair = make_pair(loaded, **kw)
    try:
        assert pair.p.kv.quantized and pair.d.kv.quantized
        for rid, prompt, params in reqs:
            pair.add(rid, prompt, params)
        pair.settle()
        pair.assert_idle()
        assert pair.d.role.imported_blocks == sum((len(p) - 1) // 4 for p in prompts)
        for key, r in want.items():
            assert pair.out[key].token_ids == r.token_ids, key
            assert pair.out[key].logprobs == r.logprobs, key
    finally:
        pair.close()


@pytest.fixture(scope="module")
def alone_torch(model_dir: Path, prompts) -> list[list[tuple]]:
    llm = _engine(model_dir, attention_backend="torch")
    assert llm.engine.kv.quantized and llm.engine.model.attention is AttentionBackend.TORCH
    return signatures_alone(llm, prompts, MAX_NEW)


@needs_fast
@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 5}, {"decode_rows": False},
                                {"num_blocks": 40, "preemption_mode": "swap", "debug": True}],
                         ids=["concurrent", "chunked", "gathering", "swapped-debug"])
def test_int8_on_torch_attention_alone_vs_24_concurrent(model_dir: Path, prompts, alone_torch, kw: dict) -> None:
    """torch's attention reads the int8 cache too: gathered blocks dequantized, DecodeRows
    holding the dequantized rows (in debug mode checked against the cache every layer), the
    gathering path giving DecodeRows' bits."""
    llm = _engine(model_dir, attention_backend="torch", **kw)
    assert (llm.engine.runner.rows is not None) == kw.get("decode_rows", True)
    assert_batch_invariant(llm, prompts, alone_torch, MAX_NEW, preempted="num_blocks" in kw, batched=False)


@needs_fast
def test_sleep_frees_the_scales_too_and_wake_reads_the_new_ones(model_dir: Path, prompts, alone) -> None:
    """The engine's sleep drops quants and scales (`free_memory`'s bytes count both); woken,
    the fused decoder's table points at the new tensors and a request's output is unchanged."""
    llm = _engine(model_dir)
    kv = llm.engine.kv
    assert signature(llm.generate([prompts[5]], greedy(MAX_NEW, logprobs=3))[0].outputs[0]) == alone[5]
    nbytes = kv.nbytes
    layers, slots = len(kv.k), kv.k[0].shape[1]
    assert nbytes == 2 * layers * slots * kv.k[0].shape[0] * (kv.k[0].shape[2] + 4)
    assert kv.free_memory() == nbytes and kv.nbytes == 0 and not kv.k_scale
    kv.restore_memory()
    assert kv.nbytes == nbytes and all((s == 0).all() for s in kv.k_scale + kv.v_scale)
    assert signature(llm.generate([prompts[5]], greedy(MAX_NEW, logprobs=3))[0].outputs[0]) == alone[5]


@needs_native
@pytest.mark.parametrize("d", [16, 64, 128])
def test_c_writer_meets_every_kind_of_row_as_the_reference(d: int) -> None:
    """The v rows go into the cache unrotated: feed the C writer the rows of every kind
    (zero, tiny, subnormal, ties at .5, NaN, infinity, wide-ranging) and compare bits."""
    from stopline.model.kernels.layer_ops import rope_store

    rows = _rows(40, d, seed=d + 1)
    hq, hk = 1, 1
    qkv = torch.zeros(40, (hq + 2 * hk) * d)
    qkv[:, 2 * d:] = rows
    vc = torch.zeros(1, 64, d, dtype=torch.int8)
    vs = torch.zeros(1, 64)
    at = torch.arange(40) + 3
    rope_store(qkv, torch.zeros(40, dtype=torch.int64), torch.ones(1, d), torch.zeros(1, d), at,
               torch.zeros_like(vc), vc, hq, torch.zeros_like(vs), vs)
    want_q, want_s = quantize_rows(rows)
    assert torch.equal(vc[0, at], want_q)
    assert torch.equal(vs[0, at].nan_to_num(-1.0), want_s.nan_to_num(-1.0))


def test_the_wire_ships_each_groups_quants_and_scales() -> None:
    """A model of two layer groups with pools of their own sizes (Gemma 3's global and local
    layers): each group's quants and scales arrive at its blocks, byte for byte."""
    from stopline.disagg.epochs import BlockEpochs
    from stopline.disagg.wire import pack_groups, unpack, write_groups
    from stopline.kv.block_pool import BlockPool

    def side() -> tuple[list[BlockPool], KVCache, list[BlockEpochs]]:
        cache = KVCache(3, 8, 4, 2, 16, torch.int8, layer_group=[0, 1, 0], group_blocks=[8, 5])
        pools = [BlockPool(8, 4), BlockPool(5, 4)]
        for g, p in enumerate(pools):
            p.on_allocate = lambda blocks, g=g: cache.zero(blocks, group=g)
        return pools, cache, [BlockEpochs(p) for p in pools]

    spools, src, seps = side()
    rpools, dst, reps = side()
    sent = [spools[0].allocate(3), spools[1].allocate(2)]
    for li in range(3):
        n = src.k[li].shape[1]
        src.store(li, torch.arange(n), torch.randn(2, n, 16), torch.randn(2, n, 16))
    rpools[1].allocate(1)
    got = [rpools[0].allocate(3), rpools[1].allocate(2)]
    head, data = unpack(pack_groups("r", src, seps, [(0, 0, seps[0].refs(sent[0])), (8, 1, seps[1].refs(sent[1]))]))
    assert len(data) == 12 and head.dtypes == (["int8"] * 4 + ["float32"] * 4 + ["int8"] * 2 + ["float32"] * 2)
    write_groups(dst, reps, [reps[0].refs(got[0]), reps[1].refs(got[1])], head, data)
    for g in (0, 1):
        for a, b in zip(src.read_blocks(sent[g], group=g), dst.read_blocks(got[g], group=g), strict=True):
            assert torch.equal(a, b)
