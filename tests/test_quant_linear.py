"""The quantized-weight kernel: exact dequantization, the library's bits, and the fallbacks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import stopline.model.batch_invariant as bi
from stopline import LLM, SamplingParams
from stopline.config import EngineConfig
from stopline.model.batch_invariant import InvariantLinear
from stopline.model.kernels import native
from stopline.model.kernels.quant_linear import (
    SUPER,
    QuantWeight,
    can_pack,
    kquant_dequantize,
    q5_0_as_q8_0,
)
from tests.tiny_model import kquant_blocks, make_tiny_gguf

BACKENDS = ["blas"] + (["onednn"] if bi.onednn_available("cpu") else [])


@pytest.fixture(scope="module", autouse=True)
def c_kernels() -> None:
    try:
        native.kernels()
    except native.NativeUnavailable as e:
        pytest.skip(f"the C kernels cannot run here: {e}")


def _quantized(fmt: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """GGML blocks of a random weight and gguf's own dequantization of them. gguf cannot
    quantize to the K-quants, so theirs are random bytes with finite f16 scales."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    if fmt in SUPER:
        raw = kquant_blocks(fmt, n, k, seed)
    else:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        raw = gguf.quants.quantize(w, qtype)
    deq = gguf.quants.dequantize(raw, qtype)
    return raw, torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32))


@pytest.mark.parametrize(("fmt", "shape"), [
    (fmt, shape) for fmt in ("q4_1", "q8_0", "q4_k", "q6_k")
    for shape in [(32, 32), (96, 64), (960, 576), (576, 1536), (64, 1024)]
    if can_pack(fmt, *shape)])  # K-quants: K a multiple of 256
def test_the_kernel_dequantizes_exactly_like_gguf(fmt, shape):
    n, k = shape
    raw, deq = _quantized(fmt, n, k)
    if fmt in SUPER:  # the test's own reading of the blocks, in gguf's order of operations
        assert np.array_equal(kquant_dequantize(fmt, raw, k), deq.numpy())
    qw = QuantWeight.from_raw(fmt, raw, k)
    # The identity's rows pick out one input each: every output is one weight, unrounded.
    assert torch.equal(qw(torch.eye(k), kc=k).t(), deq)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (3072, 576), (96, 64)])
def test_kernel_rows_carry_the_library_bits_at_every_batch_size(fmt, backend, shape):
    n, k = shape
    raw, deq = _quantized(fmt, n, k, seed=1)
    lin = InvariantLinear(deq, max_rows=96, backend=backend,
                          quant=QuantWeight.from_raw(fmt, raw, k), quant_max_rows=72)
    assert lin.kc() is not None, "no block order of the kernel matched the library"
    x = torch.randn(96, k)
    library = lin._library(x)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(20)])  # the kernel, one row at a time
    assert torch.equal(alone, library[:20])
    # The kernel takes rows in even chunks of up to 12 over whole panels (1..12: one chunk,
    # 13..24: two, ..., 61..72: six); 73 and up: the library.
    for rows in (2, 3, 8, 9, 11, 12, 13, 15, 16, 23, 24, 25, 31, 36, 37, 47, 49, 56, 64, 71, 72, 73, 96):
        assert torch.equal(lin(x[:rows]), library[:rows]), rows


# "auto" gives BLAS up to oneDNN where the kernel cannot match BLAS's order (K = 1024
# and 2048 on the Intel Xeon test host), so Gemma's shapes are asked of "auto" and oneDNN, not BLAS.
KQUANT_CASES = [("auto", (640, 1024)), ("auto", (640, 2048)), ("auto", (64, 256)), ("blas", (64, 256))] + (
    [("onednn", (640, 1024)), ("onednn", (640, 2048))] if bi.onednn_available("cpu") else [])


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
@pytest.mark.parametrize(("backend", "shape"), KQUANT_CASES)
def test_kquant_rows_carry_the_library_bits_at_every_batch_size(fmt, backend, shape):
    """Gemma 3 270M's o (Q4_K, 1024 -> 640) and down (Q6_K, 2048 -> 640) shapes: a row's
    bits are the library's on the dequantized weight, alone or among up to 72 rows."""
    n, k = shape
    raw, deq = _quantized(fmt, n, k, seed=1)
    lin = InvariantLinear(deq, max_rows=96, backend=backend,
                          quant=QuantWeight.from_raw(fmt, raw, k), quant_max_rows=72)
    assert lin.kc() is not None, "no block order of the kernel matched the library"
    x = torch.randn(96, k)
    library = lin._library(x)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(13)])
    assert torch.equal(alone, library[:13])
    for rows in (2, 5, 12, 13, 25, 37, 72):
        assert torch.equal(lin(x[:rows]), library[:rows]), rows
        # A row's result does not depend on its place in the batch either.
        assert torch.equal(lin(x[rows:2 * rows].flip(0)).flip(0), library[rows:2 * rows]), rows


def test_kquant_kernel_sums_like_a_plain_reference():
    """The kernel's arithmetic written plainly: the weights as gguf dequantizes them, each
    output one fma chain over k from zero per block of kc, the blocks' sums added in order."""
    n, k, kc = 64, 512, 256
    for fmt in ("q4_k", "q6_k"):
        raw, deq = _quantized(fmt, n, k, seed=2)
        x = torch.randn(5, k)
        got = QuantWeight.from_raw(fmt, raw, k)(x, kc)
        xd, wd = x.double(), deq.double()
        want = torch.zeros(5, n)
        for k0 in range(0, k, kc):
            acc = torch.zeros(5, n)
            for j in range(k0, k0 + kc):  # fma: the exact product plus acc, rounded once
                acc = (xd[:, j:j + 1] * wd[:, j] + acc.double()).float()
            want = acc if k0 == 0 else want + acc
        assert torch.equal(got, want), fmt


def test_q5_0_blocks_are_q8_0_blocks_of_the_same_weights():
    raw, deq = _quantized("q5_0", 64, 256, seed=3)
    q8 = q5_0_as_q8_0(raw)
    assert np.array_equal(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0), deq.numpy())
    assert torch.equal(QuantWeight.from_raw("q8_0", q8, 256)(torch.eye(256), kc=256).t(), deq)


def test_a_library_order_the_kernel_cannot_match_keeps_the_library():
    raw, deq = _quantized("q4_1", 64, 64)
    lin = InvariantLinear(deq, max_rows=32, backend="blas",
                          quant=QuantWeight.from_raw("q4_1", raw, 64), quant_max_rows=8)
    w_t = deq.t().contiguous()
    lin._mm = lambda x: x @ w_t + 1e-3  # a library no block order reproduces
    assert lin.kc() is None
    x = torch.randn(4, 64)
    assert torch.equal(lin(x), x @ w_t + 1e-3)


def test_shapes_the_kernel_does_not_take():
    assert can_pack("q4_1", 64, 64) and can_pack("q8_0", 32, 96)
    assert not can_pack("q4_1", 48, 64)  # rows not a whole panel of 32
    assert not can_pack("q4_1", 64, 48)  # inputs not whole blocks
    assert not can_pack("q6_k", 64, 64)
    with pytest.raises(ValueError, match="cannot pack"):
        QuantWeight.from_raw("q4_1", np.zeros((48, 40), np.uint8), 64)
    qw = QuantWeight.from_raw("q4_1", _quantized("q4_1", 32, 32)[0], 32)
    with pytest.raises(ValueError, match="float32 CPU rows of 32"):
        qw(torch.zeros(2, 64), kc=32)
    with pytest.raises(ValueError, match="multiple of 32"):
        qw(torch.zeros(2, 32), kc=48)


@pytest.mark.parametrize(("fmt", "k"), [("q4_1", 64), ("q4_k", 256), ("q6_k", 256)])
def test_turned_off_the_library_runs_everything(monkeypatch, fmt, k):
    """The fallback where the CPU grants no AVX-512 (or STOPLINE_NATIVE=0): every row on the
    library with the dequantized weights, K-quants too."""
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    native.reset()
    try:
        with pytest.raises(native.NativeUnavailable, match="STOPLINE_NATIVE=0"):
            native.kernels()
        with pytest.warns(UserWarning, match="kernels are off"):
            assert native.try_kernels() is None
        raw, deq = _quantized(fmt, 64, k)
        lin = InvariantLinear(deq, max_rows=8, quant=QuantWeight.from_raw(fmt, raw, k))
        assert lin.kc() is None
        x = torch.randn(3, k)
        assert torch.equal(lin(x), lin._library(x))
        assert torch.equal(lin(x[1:2]), lin._library(x)[1:2])
    finally:
        monkeypatch.delenv(native.ENV_SWITCH)
        native.reset()


def test_a_failed_build_says_why_and_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails every build
    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(tmp_path))
    native.reset()
    try:
        with pytest.raises(native.NativeUnavailable, match="false failed to build the kernels"):
            native.kernels()
        with pytest.raises(native.NativeUnavailable):  # the outcome is kept, not retried
            native.kernels()
        assert list((tmp_path / "native").iterdir()) == []  # no half-written library
    finally:
        monkeypatch.delenv("CC")
        monkeypatch.delenv("STOPLINE_CACHE_DIR")
        native.reset()


@pytest.fixture(scope="module")
def q4_gguf(tiny_model_dir, tmp_path_factory):
    return make_tiny_gguf(tiny_model_dir, tmp_path_factory.mktemp("q4") / "tiny-q4_1.gguf", qtype="Q4_1")


def test_gguf_blocks_load_and_cache_in_hf_row_order(q4_gguf, tmp_path):
    from stopline.model.loaders.loader import load_model

    first = load_model(q4_gguf, progress=False, cache_dir=tmp_path)
    again = load_model(q4_gguf, progress=False, cache_dir=tmp_path)
    assert not first.from_cache and again.from_cache
    assert set(first.blocks) == set(again.blocks)
    matrices = {n for n, w in first.weights.items() if w.dim() == 2}
    assert set(first.blocks) == matrices  # every matrix is Q4_1 in this file
    for name, (fmt, raw) in first.blocks.items():
        assert fmt == "q4_1" and torch.equal(again.blocks[name][1], raw)
        k = first.weights[name].shape[1]
        if can_pack(fmt, raw.shape[0], k):  # Q/K rows unpermuted with their blocks
            assert torch.equal(QuantWeight.from_raw(fmt, raw, k)(torch.eye(k), kc=k).t(),
                               first.weights[name]), name


def test_engine_greedy_is_the_same_with_and_without_the_kernel(q4_gguf, stopline_cache_dir):
    prompts = ["the quick brown fox", "a", "one two three four five six seven", "zebra", "hello world"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    from stopline.model.loaders.loader import load_model

    loaded = load_model(q4_gguf, progress=False, cache_dir=stopline_cache_dir)
    runs = {}
    for rows in (16, 0):
        llm = LLM(loaded, config=EngineConfig(quant_max_rows=rows, num_blocks=64), progress=False)
        model = llm.engine.model
        lins = [model.lm_head, *(v for layer in model.layers for v in layer.values()
                                 if isinstance(v, InvariantLinear))]
        assert all((lin.kc() is not None) == (rows > 0) for lin in lins)
        # With the kernel on every linear, a lone decode runs as one row, not two copies.
        assert model.one_row_ok == (rows > 0)
        sizes = []
        prepare = llm.engine.runner.prepare

        def recording(*a, prepare=prepare, sizes=sizes, **kw):
            inputs, index = prepare(*a, **kw)
            sizes.append(inputs.token_ids.shape[0])
            return inputs, index

        llm.engine.runner.prepare = recording
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        sizes.clear()
        alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
        assert batched == alone
        assert min(sizes) == (1 if rows > 0 else 2)
        runs[rows] = batched
    assert runs[16] == runs[0]


def test_quant_max_rows_is_a_command_line_setting_and_refuses_negatives():
    import argparse

    from stopline.args import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args([])).quant_max_rows == EngineConfig().quant_max_rows == 512
    assert engine_config(p.parse_args(["--quant-max-rows", "0"])).quant_max_rows == 0
    with pytest.raises(ValueError, match="quant_max_rows must be >= 0"):
        engine_config(p.parse_args(["--quant-max-rows", "-1"]))


@pytest.mark.parametrize("kernel", ["exact", "amx"])
def test_the_gemm_timer_runs_and_compares_two_builds(kernel: str) -> None:
    """bench/quant_time.py (not a test of speed): it runs, and compared with itself as the
    'other build' it reports the same bits at a panel's row counts and past one chunk, for
    the exact kernel and (--amx) the fast mode's AMX block kernels."""
    import subprocess
    import sys
    from pathlib import Path

    if native.try_kernels() is None:
        pytest.skip("the C kernels are not built here")
    if kernel == "amx" and not native.amx_ready():
        pytest.skip("no AMX tiles on this CPU or OS")
    script = Path(__file__).resolve().parents[1] / "bench" / "quant_time.py"
    extra = ["--amx"] if kernel == "amx" else []
    done = subprocess.run([sys.executable, str(script), "--rows", "1", "13", "--layers", "1", "--rounds", "1",
                           "--against", native.kernels()._name, *extra], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stdout.splitlines() if " rows: " in ln]
    assert len(lines) == 2 and all("same bits" in ln for ln in lines), done.stdout


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q5_0"])
def test_the_gguf_loader_keeps_the_gemma_formats_blocks(fmt):
    """A GGUF tensor of each format the Gemma 3 Q4_K_M file holds besides Q8_0 comes out of the
    loader as blocks a kernel reads (Q5_0 as Q8_0), giving the loader's float32 weights."""
    from stopline.model.loaders.gguf import GGUFTensorInfo, dequantize, raw_blocks

    n, k = 64, 512
    raw, _ = _quantized(fmt, n, k, seed=4)
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    t = GGUFTensorInfo("blk.0.ffn_down.weight", int(qtype), (n, k), np.ascontiguousarray(raw).reshape(-1))
    got_fmt, blocks = raw_blocks(t)
    assert got_fmt == ("q8_0" if fmt == "q5_0" else fmt)
    w = torch.from_numpy(dequantize(t))
    assert torch.equal(QuantWeight.from_raw(got_fmt, blocks, k)(torch.eye(k), kc=k).t(), w)
