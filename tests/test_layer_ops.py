"""The C glue of a decoder layer (layer_ops.py) against the torch ops it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stopline.model.batch_invariant import rms_norm
from stopline.model.kernels import native
from stopline.model.kernels.layer_ops import add_rms_norm, rope_store, silu_mul

pytestmark = pytest.mark.skipif(native.try_kernels() is None, reason="stopline's C kernels are not built here")


def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    for rows, width in ((1, 64), (11, 576), (70, 576), (3, 40)):  # 70: the threaded path; 40: a tail
        x, res = torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)
        w = torch.randn(width, generator=gen)
        want_x = x + res
        want = rms_norm(want_x, w, 1e-5)
        got = add_rms_norm(x, res, w, 1e-5)
        assert torch.equal(x, want_x) and torch.equal(got, want), (rows, width)


@pytest.mark.parametrize("d", [16, 64, 128])
def test_rope_store_rotates_like_torch_and_writes_the_cache(d):
    gen = torch.Generator().manual_seed(d)
    heads, kv_heads, rows, slots, max_pos = 6, 2, 9, 40, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen)
    pos = torch.randint(0, max_pos, (rows,), generator=gen)
    write = torch.randperm(slots, generator=gen)[:rows]
    cos, sin = torch.randn(max_pos, d, generator=gen), torch.randn(max_pos, d, generator=gen)
    kc, vc = torch.zeros(kv_heads, slots, d), torch.zeros(kv_heads, slots, d)
    q = rope_store(qkv, pos, cos, sin, write, kc, vc, heads)

    x = qkv[:, :(heads + kv_heads) * d].reshape(rows, heads + kv_heads, d)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    want = (x * c).add_(torch.roll(x, d // 2, dims=-1).mul_(s))  # LlamaModel._rope
    assert torch.equal(q, want[:, :heads])
    want_kc, want_vc = torch.zeros_like(kc), torch.zeros_like(vc)
    want_kc.index_copy_(1, write, want[:, heads:].transpose(0, 1))
    want_vc.index_copy_(1, write, qkv[:, (heads + kv_heads) * d:].reshape(rows, kv_heads, d).transpose(0, 1))
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)


def test_rope_store_refuses_a_mismatched_row():
    kc = torch.zeros(2, 8, 16)
    with pytest.raises(ValueError, match="rope_store"):
        rope_store(torch.zeros(1, 99), torch.zeros(1, dtype=torch.long), torch.zeros(4, 16),
                   torch.zeros(4, 16), torch.zeros(1, dtype=torch.long), kc, kc.clone(), 4)


def test_silu_mul_matches_torch_and_a_row_never_depends_on_the_batch():
    gen = torch.Generator().manual_seed(1)
    for inter in (1536, 40):  # 40: a masked tail
        gu = torch.randn(70, 2 * inter, generator=gen) * 6
        gu[0, :4] = torch.tensor([0.0, -200.0, 200.0, -90.0])  # exp's clamps and overflow
        got = silu_mul(gu)
        want = F.silu(gu[:, :inter].double()) * gu[:, inter:].double()
        torch.testing.assert_close(got.double(), want, rtol=3e-7, atol=1e-30)
        assert torch.equal(torch.cat([silu_mul(gu[i:i + 1]) for i in range(70)]), got)
    gu = torch.ones(2, 32)
    gu[1, 3] = float("nan")
    out = silu_mul(gu)
    assert out[1, 3].isnan() and not out[0].isnan().any() and out[1].isnan().sum() == 1
