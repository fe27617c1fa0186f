"""The fast numerics mode (docs/numerics.md): its kernels equal plain torch references of the
same arithmetic bit for bit (bf16, and int8 activations against Q4_1/Q8_0 blocks), and an
engine in fast mode is batch-invariant (alone vs 24 concurrent, chunked, preempted) on every
kernel this host has, like exact mode (tests/test_engine_invariance.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from stopline import LLM
from stopline.config import EngineConfig, Numerics
from stopline.model.kernels.bf16_linear import BF16Weight, reference, resolve
from stopline.model.kernels.int8_linear import Int8Weight, has_vnni
from stopline.model.kernels.int8_linear import reference as int8_reference
from stopline.model.kernels.native import amx_ready, has_bf16, try_kernels
from tests.engine_support import (
    assert_batch_invariant,
    greedy,
    random_prompts,
    sharp_tiny_dir,
    signature,
    signatures_alone,
)
from tests.tiny_model import kquant_blocks, make_tiny_gguf

FAST = has_bf16() and try_kernels() is not None
needs_fast = pytest.mark.skipif(not FAST, reason="no AVX512-BF16 or no C kernels on this host")
AMX = FAST and amx_ready()
needs_amx = pytest.mark.skipif(not AMX, reason="no AMX-BF16 (or its tile state refused) on this host")
INT8 = FAST and has_vnni()
needs_int8 = pytest.mark.skipif(not INT8, reason="no AVX512-VNNI (or no C kernels) on this host")
MAX_NEW = 24
LENGTHS = [1, 3, 5, 8, 12, 16, 17, 20, 24, 31, 32, 33, 40, 47, 50, 63, 64, 65, 70, 80, 96, 100, 120, 150]


@needs_fast
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (13, 577, 70), (30, 576, 96), (25, 1536, 64)])
def test_kernel_equals_reference(m: int, k: int, n: int) -> None:
    """The AVX512-BF16 kernel (the fast mode's where AMX is absent or off)."""
    gen = torch.Generator().manual_seed(m * k + n)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    y = BF16Weight.from_float(w, amx=False)(x)
    assert y.shape == (m, n)
    assert torch.equal(y, reference(x, w))
    # Rows alone and in every split equal the batch: no row depends on its neighbours.
    assert torch.equal(torch.cat([BF16Weight.from_float(w, amx=False)(x[i:i + 1]) for i in range(m)]), y)
    assert not torch.equal(y, x @ w.T)  # it really rounds to bf16: not the fp32 product


@needs_amx
@pytest.mark.parametrize("k,n", [(64, 32), (576, 96), (1536, 64)])
def test_amx_kernel_rows_never_depend_on_the_batch(k: int, n: int) -> None:
    """tdpbf16ps sums a tile's pairs in its own order, so the AMX kernel is not the reference's
    chain; what it must give is every row the same bits at every batch size and cut into tiles
    (1, 2, 15-17 rows, 31-33, 100), each close to the exact product of the bf16 values."""
    gen = torch.Generator().manual_seed(k + n)
    x, w = torch.randn(100, k, generator=gen), torch.randn(n, k, generator=gen)
    weight = BF16Weight.from_float(w, amx=True)
    y = weight(x)
    alone = torch.cat([weight(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(alone, y)
    for m in (2, 15, 16, 17, 31, 32, 33):
        assert torch.equal(weight(x[m:2 * m]), y[m:2 * m]), f"{m} rows"
    plain = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T
    assert torch.allclose(y.double(), plain, rtol=0, atol=1e-5 * k ** 0.5 * 4)
    assert not torch.equal(y, reference(x, w))  # really the tiles, not the AVX kernel


@needs_fast
@pytest.mark.parametrize("amx", [False, True], ids=["avx512", "amx"])
@pytest.mark.parametrize("n,k", [(32, 32), (96, 64), (960, 576), (64, 1536)])
def test_q4_1_kernel_gives_the_bf16_kernels_bits(n: int, k: int, amx: bool) -> None:
    """Few rows read a Q4_1 weight from its blocks, more its bf16 copy: the same bits, so the
    switch between them is invisible to a row."""
    import dataclasses

    import gguf
    import numpy as np

    if amx and not AMX:
        pytest.skip("no AMX-BF16 on this host")
    w = np.random.default_rng(n + k).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    deq = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)))
    weight = BF16Weight.from_float(deq, raw, amx=amx)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(k))
    from_blocks = dataclasses.replace(weight, q4_max_rows=64)(x)
    assert torch.equal(from_blocks, dataclasses.replace(weight, q4=None)(x))
    if not amx:
        assert torch.equal(from_blocks, reference(x, deq))
    assert torch.equal(weight(x[:3]), from_blocks[:3])  # 3 rows take the blocks by default


@needs_amx
def test_amx_block_kernel_takes_any_row_count() -> None:
    """Called with more than its 32-row tiles (the Python side never does), the Q4_1 block
    kernel runs passes of 32 rows instead of leaving y unwritten: the bf16 copy's bits."""
    import dataclasses

    import gguf
    import numpy as np

    from stopline.model.kernels.native import kernels

    n, k, m = 96, 64, 45
    w = np.random.default_rng(7).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    deq = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)))
    weight = BF16Weight.from_float(deq, raw, amx=True)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    xb = x.to(torch.bfloat16).contiguous()
    y = torch.full((m, n), float("nan"))
    kernels().stopline_amx_q4_1_gemm(xb.data_ptr(), weight.q4.data_ptr(), y.data_ptr(), m, k, n)
    assert torch.equal(y, dataclasses.replace(weight, q4=None)(x))


@needs_amx
@pytest.mark.parametrize("n,k", [(32, 32), (96, 64), (64, 576)])
def test_q8_0_blocks_give_the_bf16_copys_bits(n: int, k: int) -> None:
    """On AMX a Q8_0 weight (SmolLM2's LM head) is read from its blocks up to 32 rows: the
    same bits as its bf16 copy."""
    import dataclasses

    import gguf
    import numpy as np

    w = np.random.default_rng(n * k).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    deq = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)))
    weight = BF16Weight.from_float(deq, q8_raw=raw, amx=True)
    assert weight.q8 is not None
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(n))
    copy = dataclasses.replace(weight, q8=None)
    for m in (1, 5, 16, 17, 32):
        assert torch.equal(weight(x[:m]), copy(x[:m])), f"{m} rows"
    assert torch.equal(weight(x), copy(x))  # 40 rows: the copy either way
    assert BF16Weight.from_float(deq, q8_raw=raw, amx=False).q8 is None


@needs_amx
def test_amx_off_by_env(monkeypatch) -> None:
    """STOPLINE_AMX=0 keeps the fast mode on the AVX512-BF16 kernel (a new weight takes it);
    a K the tiles cannot cut takes it too."""
    w = torch.randn(32, 64)
    assert BF16Weight.from_float(w).amx
    monkeypatch.setenv("STOPLINE_AMX", "0")
    assert not BF16Weight.from_float(w).amx
    assert not BF16Weight.from_float(torch.randn(32, 48)).amx
    with pytest.raises(ValueError, match="AMX cannot run"):
        BF16Weight.from_float(torch.randn(32, 48), amx=True)


def _blocks(fmt: str, n: int, k: int, seed: int):
    """GGML blocks of a random [n, k] weight, and the weight they dequantize to."""
    import gguf
    import numpy as np

    qtype = getattr(gguf.GGMLQuantizationType, fmt.upper())
    if fmt in ("q4_k", "q6_k"):
        raw = kquant_blocks(fmt, n, k, seed)
    else:
        w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
        raw = gguf.quants.quantize(w, qtype)
    return raw, torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype)))


INT8_CASES = [(fmt, *shape) for fmt in ("q4_1", "q8_0")
              for shape in [(1, 32, 32), (7, 96, 64), (13, 960, 576), (40, 64, 1536)]] + [
    # the K-quants' rows are whole super-blocks of 256: Gemma 3 270M's o and down shapes too
    (fmt, *shape) for fmt in ("q4_k", "q6_k") for shape in [(1, 32, 256), (7, 640, 1024), (13, 640, 2048)]]


@needs_int8
@pytest.mark.parametrize("fmt,m,n,k", INT8_CASES)
def test_int8_kernel_equals_reference(fmt: str, m: int, n: int, k: int) -> None:
    """Block weights against int8 activations (the fast mode's kernel for them on VNNI): the
    torch reference's bits, every row the same alone as in the batch, and close to (not equal
    to) the float product."""
    raw, deq = _blocks(fmt, n, k, seed=m + n + k)
    weight = Int8Weight.from_raw(fmt, raw, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    y = weight(x)
    assert y.shape == (m, n)
    assert torch.equal(y, int8_reference(x, fmt, raw))
    assert torch.equal(torch.cat([weight(x[i:i + 1]) for i in range(m)]), y)
    if m > 2:
        assert torch.equal(torch.cat([weight(x[:2]), weight(x[2:])]), y)
    full = x @ deq.T
    assert not torch.equal(y, full)
    assert (y - full).abs().max() <= 0.02 * full.abs().max()


@needs_int8
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_fast_kquant_weight_follows_what_the_cpu_grants(fmt: str, monkeypatch) -> None:
    """A K-quant linear in fast mode: the int8 kernel where VNNI runs; with it refused
    (STOPLINE_INT8=0, as on a CPU without VNNI) the bf16 kernel on the bf16 copy. Either way
    a row's bits do not depend on the batch."""
    from stopline.model.llama import fast_weight

    raw, deq = _blocks(fmt, 64, 512, seed=5)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(2))
    int8 = fast_weight(deq, {fmt: torch.from_numpy(raw)})
    assert isinstance(int8, Int8Weight) and int8.fmt == fmt
    assert torch.equal(int8(x), int8_reference(x, fmt, raw))
    monkeypatch.setenv("STOPLINE_INT8", "0")
    bf16 = fast_weight(deq, {fmt: torch.from_numpy(raw)})
    assert not isinstance(bf16, Int8Weight)
    y = bf16(x)
    assert torch.equal(torch.cat([bf16(x[i:i + 1]) for i in range(9)]), y)
    assert torch.equal(torch.cat([bf16(x[:4]), bf16(x[4:])]), y)


def _extreme_q4_1(n: int, k: int, seed: int):
    """Q4_1 blocks whose quant bytes are mostly 0x00, 0x0f, 0xf0 and 0xff (the largest and
    smallest nibbles in either half), with finite f16 scales and minima."""
    import numpy as np

    rng = np.random.default_rng(seed)
    raw = rng.choice(np.array([0x00, 0x0F, 0xF0, 0xFF, 0x7F, 0x80], dtype=np.uint8), size=(n, k // 32, 20))
    raw[..., 0:4] = (rng.standard_normal((n, k // 32, 2)) * 0.01).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


@needs_int8
@pytest.mark.parametrize("prefetch", [0, 4096])
@pytest.mark.parametrize("fmt", ["q4_1", "q4_k", "q8_0", "q6_k"])
def test_int8_few_row_panels_give_the_many_row_panels_bits(fmt: str, prefetch: int) -> None:
    """At 1-3 rows the int8 kernel runs int8_few.c's panels (Q4_1 and Q4_K: both nibbles
    through vpdpbusd as they are, the high half's sum shifted out; all three: a prefetch
    where it is on), at 4-6 rows int8_gemm.c's i8_panel: a row gets the reference's bits
    either way, alone, in a 2- or 3-row call and in a 6-row one, with the integer sums at
    their extremes (every q -127 or 127, nibbles 0 or 15), prefetching or not."""
    n, k = 96, 768
    if fmt == "q4_1":
        raw = _extreme_q4_1(n, k, seed=3)
    elif fmt == "q8_0":
        raw, _ = _blocks(fmt, n, k, seed=3)
    else:
        raw = kquant_blocks(fmt, n, k, seed=3)
    weight = Int8Weight.from_raw(fmt, raw, k)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, k, generator=gen)
    x[0] = -1.0  # every q -127: the largest negative sums
    x[1] = torch.where(torch.rand(k, generator=gen) < 0.5, -3.0, 3.0)
    x[2, : k // 2] = 2.0
    lib = try_kernels()
    old = lib.stopline_int8_prefetch(prefetch)
    try:
        six = weight(x)  # i8_panel, one chunk of 6
        assert torch.equal(six, int8_reference(x, fmt, raw))
        for m in (1, 2, 3):
            for start in range(0, 6 - m + 1):
                assert torch.equal(weight(x[start:start + m]), six[start:start + m]), (m, start)
    finally:
        lib.stopline_int8_prefetch(old)


def test_int8_prefetch_follows_the_env_and_the_vendor(monkeypatch) -> None:
    """STOPLINE_INT8_PREFETCH wins (a bad value is ignored); unset, Intel gets 4096 bytes."""
    from stopline.model.kernels import native

    monkeypatch.setenv(native.PREFETCH_SWITCH, "0")
    assert native.int8_prefetch() == 0
    monkeypatch.setenv(native.PREFETCH_SWITCH, "2560")
    assert native.int8_prefetch() == 2560
    monkeypatch.setenv(native.PREFETCH_SWITCH, "lots")
    monkeypatch.setattr(native, "_vendor", lambda: "GenuineIntel")
    assert native.int8_prefetch() == 4096
    monkeypatch.delenv(native.PREFETCH_SWITCH)
    monkeypatch.setattr(native, "_vendor", lambda: "AuthenticAMD")
    assert native.int8_prefetch() == 0


@needs_int8
def test_int8_nonfinite_input_spoils_only_its_row() -> None:
    """A NaN or an infinity in a row's input makes that row's outputs NaN (so the engine's
    bad-row check sees it), as float arithmetic would; the other rows keep their bits."""
    raw, _ = _blocks("q4_1", 64, 96, seed=3)
    weight = Int8Weight.from_raw("q4_1", raw, 96)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(5))
    clean = weight(x)
    x[1, 5], x[2, 70] = float("nan"), float("inf")
    y = weight(x)
    assert y[1].isnan().all() and y[2].isnan().all()
    assert torch.equal(y[[0, 3]], clean[[0, 3]])
    assert torch.equal(y.nan_to_num(7.0), int8_reference(x, "q4_1", raw).nan_to_num(7.0))


@needs_int8
def test_int8_weight_refuses_what_it_cannot_take() -> None:
    raw, _ = _blocks("q4_1", 64, 96, seed=3)
    weight = Int8Weight.from_raw("q4_1", raw, 96)
    with pytest.raises(ValueError, match="int8 linear takes 2-d CPU rows of 96"):
        weight(torch.randn(2, 64))
    with pytest.raises(ValueError, match="cannot pack a q4_1 weight"):
        Int8Weight.from_raw("q4_1", raw[:40], 96)


def test_numerics_setting_is_checked() -> None:
    assert EngineConfig(numerics="fast").numerics is Numerics.FAST
    with pytest.raises(ValueError, match="numerics"):
        EngineConfig(numerics="fastest")


def test_fast_off_cpu_falls_back_loudly() -> None:
    with pytest.warns(RuntimeWarning, match="running 'exact'"):
        assert resolve("fast", "meta") == "exact"
    assert resolve("exact", "cpu") == "exact"


@pytest.fixture(scope="module", params=["amx", "avx512", "int8"])
def kernel(request) -> Iterator[str]:
    """The engine tests run on each fast kernel this host has: AMX tiles, AVX512-BF16 (forced
    by STOPLINE_AMX=0, as on a CPU without AMX), and int8 activations against block weights
    (VNNI; STOPLINE_INT8=0 turns it off for the other two)."""
    import os

    if request.param == "amx" and not AMX:
        pytest.skip("no AMX-BF16 on this host")
    if request.param == "int8" and not INT8:
        pytest.skip("no AVX512-VNNI on this host")
    old = {name: os.environ.get(name) for name in ("STOPLINE_AMX", "STOPLINE_INT8")}
    os.environ["STOPLINE_AMX"] = "1" if request.param == "amx" else "0"
    os.environ["STOPLINE_INT8"] = "1" if request.param == "int8" else "0"
    yield request.param
    for name, value in old.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module", params=["f32", "q4_1"])
def model_dir(request, kernel: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as float32 (every batch on the bf16 weights) and as a Q4_1 GGUF (batches
    of up to Q4_MAX_ROWS rows on its blocks, larger ones on the bf16 copy)."""
    hf = sharp_tiny_dir(tmp_path_factory)
    if request.param == "f32" and kernel == "int8":
        pytest.skip("float weights take the bf16 kernels: the avx512 case")
    if request.param == "f32":
        return hf
    return make_tiny_gguf(hf, tmp_path_factory.mktemp("q4") / "tiny-q4_1.gguf", qtype="Q4_1")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(len(LENGTHS), LENGTHS, seed=7)


def _engine(model_dir: Path, **kw) -> LLM:
    kw.setdefault("num_blocks", 2048)
    kw.setdefault("target_step_ms", None)
    return LLM(model=str(model_dir), progress=False, numerics="fast", enable_prefix_caching=False, **kw)


@pytest.fixture(scope="module")
def alone(model_dir: Path, kernel: str, prompts) -> list[list[tuple]]:
    llm = _engine(model_dir)
    assert llm.engine.model.numerics == "fast"
    fast = llm.engine.model.layers[0]["gate_up"].fast
    if kernel == "int8":
        assert isinstance(fast, Int8Weight) and isinstance(llm.engine.model.lm_head.fast, Int8Weight)
    else:
        assert isinstance(fast, BF16Weight)
        assert (fast.q4 is not None) == (model_dir.suffix == ".gguf")
        assert fast.amx == (kernel == "amx")
    return signatures_alone(llm, prompts, MAX_NEW)


@needs_fast
@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 5}, {"num_blocks": 40}],
                         ids=["concurrent", "chunked", "preempted"])
def test_fast_alone_vs_24_concurrent(model_dir: Path, prompts, alone, kw: dict) -> None:
    assert_batch_invariant(_engine(model_dir, **kw), prompts, alone, MAX_NEW, preempted="num_blocks" in kw)


@needs_fast
def test_fast_differs_from_exact_but_agrees_mostly(model_dir: Path, prompts, alone) -> None:
    """Fast really runs other arithmetic (its logprobs differ from exact's), yet on the tiny
    model's sharp logits its greedy tokens mostly agree."""
    exact = LLM(model=str(model_dir), progress=False, num_blocks=2048, enable_prefix_caching=False)
    sigs = [signature(exact.generate([p], greedy(MAX_NEW, logprobs=3))[0].outputs[0]) for p in prompts[:6]]
    assert sigs != alone[:6]
    first = sum(s[0][0] == a[0][0] for s, a in zip(sigs, alone[:6], strict=True))
    assert first >= 5, f"only {first} of 6 first tokens agree between exact and fast"


def test_fast_without_bf16_runs_exact_with_a_warning(model_dir: Path, prompts, monkeypatch) -> None:
    """A CPU without AVX512-BF16: the engine says so and runs exact, whose tokens it then gives."""
    import stopline.model.kernels.bf16_linear as bf16_linear

    monkeypatch.setattr(bf16_linear, "has_bf16", lambda: False)
    with pytest.warns(RuntimeWarning, match="lacks AVX512-BF16"):
        llm = _engine(model_dir)
    assert llm.engine.model.numerics == "exact"
    exact = LLM(model=str(model_dir), progress=False, num_blocks=2048, enable_prefix_caching=False)
    p = greedy(8, logprobs=3)
    assert signature(llm.generate([prompts[5]], p)[0].outputs[0]) == \
        signature(exact.generate([prompts[5]], p)[0].outputs[0])
