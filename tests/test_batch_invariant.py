"""Row-invariant linear layers: calibration, tile plans, and the property itself."""

import pytest
import torch

import stopline.model.batch_invariant as bi
from stopline.config import EngineConfig
from stopline.model.batch_invariant import (
    InvariantLinear,
    calibrate,
    probe_heights,
    rms_norm,
    tile_plan,
)

BACKENDS = ["blas"] + (["onednn"] if bi.onednn_available("cpu") else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(96, 64), (960, 576), (576, 1536), (3072, 576)])
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(shape, backend):
    # A plain F.linear fails this on MKL: 1 row, 2..15 rows and 16+ rows take three kernels.
    torch.manual_seed(0)
    lin = InvariantLinear(torch.randn(shape) * 0.05, max_rows=128, backend=backend)
    assert lin.backend == backend
    x = torch.randn(128, shape[1])
    alone = torch.cat([lin(x[i:i + 1]) for i in range(128)])
    for n in (2, 3, 7, 15, 16, 17, 33, 57, 64, 100, 128):
        start = (n * 3) % (128 - n + 1)
        assert torch.equal(lin(x[start:start + n]), alone[start:start + n]), n


def test_calibration_keeps_only_row_counts_that_agree():
    w_t = torch.randn(64, 48)

    def odd_kernel(x):  # a library whose kernel for 17..40 rows sums in another order
        # Row by row, so every other height agrees by construction: whether MKL's own
        # kernels agree depends on the CPU (on a Zen 5 host, 2 and 3 rows differ).
        y = torch.cat([torch.matmul(r[None], w_t) for r in x])
        return y + 1e-3 if 17 <= x.shape[0] <= 40 else y

    kept = calibrate(odd_kernel, 64, 64)
    assert all(h not in kept for h in range(17, 41))
    assert set(range(2, 17)) <= set(kept) and 64 in kept
    assert set(kept) == {h for h in probe_heights(64) if h >= 2 and not 17 <= h <= 40}


def test_a_lone_seed_class_falls_back_to_the_class_of_sixteen():
    w_t = torch.randn(32, 16)

    def two_is_odd(x):
        y = torch.matmul(x, w_t)
        return y + 1e-3 if x.shape[0] < 16 else y

    kept = calibrate(two_is_odd, 32, 64)
    assert kept[0] == 16 and 64 in kept


@pytest.mark.parametrize("heights", [tuple(h for h in probe_heights(512) if h >= 2),
                                     (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 208, 256),
                                     (16,)])
def test_tile_plan_covers_every_row_with_allowed_heights(heights):
    for n in range(1, 700):
        plan = tile_plan(n, heights)
        assert sum(used for used, _ in plan) == n
        assert all(h in heights and 0 < used <= h for used, h in plan)


@pytest.mark.parametrize("kernel", ["native", "fused", "float64"])
@pytest.mark.parametrize("width", [576, 100])
def test_rms_norm_gives_a_row_the_same_bits_alone_and_in_any_batch(monkeypatch, kernel, width):
    if kernel == "native":
        if bi.try_kernels() is None:
            pytest.skip("stopline's C kernels are not built here")
    else:
        monkeypatch.setattr(bi, "try_kernels", lambda: None)
    if kernel == "fused" and not bi._fused_norm_ok("cpu", torch.get_num_threads(), width):
        pytest.skip("the probe keeps the fused kernel away from this width here")
    monkeypatch.setattr(bi, "_fused_norm_ok", lambda *_: kernel == "fused")
    torch.manual_seed(1)
    x, w = torch.randn(100, width) * 3, torch.randn(width)
    alone = torch.cat([rms_norm(x[i:i + 1].clone(), w, 1e-5) for i in range(100)])
    for n in (2, 5, 16, 31, 64, 100):  # 64 and up: the C kernel's rows on two threads
        assert torch.equal(rms_norm(x[:n].clone(), w, 1e-5), alone[:n]), n
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    torch.testing.assert_close(alone.double(), ref, rtol=1e-5, atol=1e-5)


def test_rms_norm_falls_back_to_float64_when_the_fused_kernel_is_not_row_invariant(monkeypatch):
    def drifting(x, shape, w, eps):  # a kernel whose rows change with the batch size
        y = torch.nn.functional.layer_norm(x, shape, w, None, eps)
        return y + 1e-4 * x.shape[0]

    bi._fused_norm_ok.cache_clear()
    monkeypatch.setattr(bi.F, "rms_norm", drifting)
    try:
        assert not bi._fused_norm_ok("cpu", torch.get_num_threads(), 576)
    finally:
        bi._fused_norm_ok.cache_clear()


def test_backend_rule_and_bad_names():
    small, large = torch.zeros(1536, 576), torch.zeros(3072, 576)
    want_large = "onednn" if bi.onednn_available("cpu") else "blas"
    assert bi.pick_backend(small) == "blas" and bi.pick_backend(large) == want_large
    assert bi.pick_backend(large, "blas") == "blas"
    with pytest.raises(ValueError, match="linear backend must be one of"):
        bi.pick_backend(small, "mkl")
    with pytest.raises(ValueError, match="linear_backend"):
        EngineConfig(linear_backend="cublas")


def test_onednn_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(bi, "onednn_available", lambda device: False)
    assert bi.pick_backend(torch.zeros(3072, 576)) == "blas"  # auto falls back quietly
    with pytest.raises(ValueError, match="needs a CPU build of torch with oneDNN"):
        bi.pick_backend(torch.zeros(8, 8), "onednn")


def test_the_backend_is_a_command_line_setting():
    import argparse

    from stopline.args import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args([])).linear_backend == "auto"
    assert engine_config(p.parse_args(["--linear-backend", "blas"])).linear_backend == "blas"
    with pytest.raises(SystemExit):
        p.parse_args(["--linear-backend", "mkl"])


def test_engines_with_other_step_budgets_keep_the_same_heights():
    """An engine whose steps carry at most 5 rows must pad like one that carries 100: where 2
    and 3 rows take another kernel (MKL on a Zen 5 host), probing only up to 5 rows would keep
    {2, 3} and give a lone decode other bits than the larger engine gives it."""
    w_t = torch.randn(64, 48)

    def odd_kernel(x):
        y = torch.cat([torch.matmul(r[None], w_t) for r in x])
        return y + 1e-3 if x.shape[0] in (2, 3) else y

    small, large = calibrate(odd_kernel, 64, 5), calibrate(odd_kernel, 64, 100)
    assert 2 not in small and 3 not in small
    assert [h for h in small if h <= 64] == [h for h in large if h <= 64]
    assert tile_plan(1, small) == tile_plan(1, large) == ((1, 4),)
