"""A decoder layer's element-wise steps as single C calls (`csrc/layer_ops.c`, `csrc/rms_norm.c`).

On a few rows a layer's glue (rotary embedding, K/V writes, residual adds, SiLU gate) was ~15
torch ops, each ~10-25 us of dispatch and a parallel region; about 5 ms of an 11-row decode
step. These run it in three calls. Each output element depends only on its own row.

They are used with the native paged attention, whose K/V live only in the cache (the torch
attention path also needs the step's K/V as tensors and keeps torch's ops). Bits: the adds,
norms and rotary products are the same IEEE operations in the same order as the torch path;
SiLU uses stopline's own exp (see `csrc/simd_math.h`), so the gate's last bit can differ
from torch's.
"""

from __future__ import annotations

import torch

from stopline.model.kernels.native import kernels


def add_rms_norm(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x += res (in place), then rms_norm(x) * w. x, res: [N, hidden] contiguous float32."""
    res = res.contiguous()  # held: the C call reads it by address
    y = torch.empty_like(x)
    kernels().stopline_add_rms_norm(x.data_ptr(), res.data_ptr(), w.data_ptr(), y.data_ptr(),
                                    x.shape[0], x.shape[1], eps)
    return y


def rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               slots: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, heads: int,
               ks: torch.Tensor | None = None, vs: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate q and k of qkv ([N, (heads + 2 * kv_heads) * d]) at their positions, write k and
    v into one layer's cache (kc, vc: [kv_heads, slots, d]) at `slots`, and return q
    [N, heads, d]. positions, slots: int64; cos, sin: the model's [max_position, d] tables.
    ks, vs: an int8 cache's row scales [kv_heads, slots] (kc, vc int8): each k and v row is
    quantized as kv_cache.quantize_rows does, bit for bit."""
    hk, nslots, d = kc.shape
    n = qkv.shape[0]
    if qkv.shape[1] != (heads + 2 * hk) * d or positions.dtype != torch.int64 or slots.dtype != torch.int64:
        raise ValueError(f"rope_store: qkv {tuple(qkv.shape)} for {heads} + 2 x {hk} heads of {d}, "
                         f"positions {positions.dtype}, slots {slots.dtype}")
    qkv = qkv.contiguous()
    q = qkv.new_empty(n, heads, d)
    if ks is not None:
        if (kc.dtype, vc.dtype) != (torch.int8, torch.int8) or vs is None or d % 16 or d > 128 \
                or ks.shape != (hk, nslots) or vs.shape != ks.shape:
            raise ValueError(f"rope_store into an int8 cache: K/V int8 [Hk, slots, d], d a multiple of 16 "
                             f"up to 128, scales [Hk, slots]; got {kc.dtype} {tuple(kc.shape)}")
        kernels().stopline_rope_store_q8(qkv.data_ptr(), n, heads, hk, d, positions.data_ptr(), cos.data_ptr(),
                                         sin.data_ptr(), slots.data_ptr(), kc.data_ptr(), vc.data_ptr(),
                                         ks.data_ptr(), vs.data_ptr(), nslots, q.data_ptr())
        return q
    kernels().stopline_rope_store(qkv.data_ptr(), n, heads, hk, d, positions.data_ptr(), cos.data_ptr(),
                                  sin.data_ptr(), slots.data_ptr(), kc.data_ptr(), vc.data_ptr(), nslots,
                                  q.data_ptr())
    return q


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up] of gu ([N, 2 * inter])."""
    gu = gu.contiguous()
    inter = gu.shape[1] // 2
    out = gu.new_empty(gu.shape[0], inter)
    kernels().stopline_silu_mul(gu.data_ptr(), gu.shape[0], inter, out.data_ptr())
    return out
