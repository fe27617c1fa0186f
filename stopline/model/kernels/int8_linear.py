"""Q4_1 and Q8_0 block weights against int8 activations, for the "fast" numerics mode on CPUs
with AVX512-VNNI (docs/numerics.md).

Each row of x is quantized per group of 32 inputs to int8 with one float32 scale (max|x| /
127, round to nearest even); each group's products with the weight's 4- or 8-bit quants are
summed exactly in int32 by vpdpbusd, and the groups' sums are scaled and added in float32 in
k order (csrc/int8_gemm.c has the formulas). Integer sums have no order, and the float chain
is one per output element, so a row's bits depend only on its own values: batch-invariant at
every row count, by construction, on every CPU that runs the kernel. `reference` is the same
arithmetic in plain torch, bit for bit.

A step of few rows reads ~5 bits a weight and does little more than read them, which is why
this mode's one-stream step sits near its bandwidth floor (docs/benchmarks.md). More than 18
rows of Q4_1 and Q4_K weights split each panel's nibbles once, Q8_0's start their sums at
-128 s (csrc/int8_rows.c); with
STOPLINE_INT8_AMX=1, 64 rows and more form their group sums on AMX-INT8 tiles where the OS
grants them (csrc/amx_i8_gemm.c). The same integers and the same float chain: the same bits.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

from stopline.model.kernels.native import NativeUnavailable, _cpu_flags, kernels
from stopline.model.kernels.quant_linear import (
    BLOCK_BYTES,
    GROUP,
    PANEL,
    SUPER,
    _f16_by_panel,
    _f32_by_panel,
    block_shape,
    can_pack,
    kquant_parts,
)

# STOPLINE_INT8=0 keeps block weights on the bf16 kernels in fast mode (as float weights are).
INT8_SWITCH = "STOPLINE_INT8"
# STOPLINE_INT8_AMX=1 sends 64 rows and more of Q4 weights to AMX-INT8 tiles where the OS
# grants them (off by default: no faster than the split panels where measured; the bits are
# the same either way).
AMX_SWITCH = "STOPLINE_INT8_AMX"


def has_vnni() -> bool:
    return "avx512_vnni" in _cpu_flags()


def int8_ready() -> bool:
    """Whether fast mode's block weights take this kernel: the CPU has AVX512-VNNI and
    STOPLINE_INT8 is not 0 (the C kernels being built is the caller's check)."""
    return os.environ.get(INT8_SWITCH, "1") != "0" and has_vnni()


def amx_granted() -> bool:
    """The CPU has AMX-INT8 and the OS grants this process the tile state."""
    return {"amx_tile", "amx_int8"} <= _cpu_flags() and kernels().stopline_amx_init() == 0


def use_amx(on: int | None = None) -> int:
    """Switch the kernel's many-row path (64 rows and up) onto AMX-INT8 tiles
    (csrc/amx_i8_gemm.c), and say how far: 0 off, 1 for Q4_1 and Q4_K weights, 2 for every
    format (Q8_0 and Q6_K measured slower on tiles: docs/benchmarks.md; for benchmarks and
    tests). None: 1 where STOPLINE_INT8_AMX is 1 and amx_granted(), else 0 (the default: on
    the one host measured, a VM on an Intel Xeon, the tiles were no faster than the split
    panels). Every setting gives the same bits, so it may change at any time."""
    if on is None:
        on = int(os.environ.get(AMX_SWITCH, "0") == "1" and amx_granted())
    kernels().stopline_i8_amx(on)
    return on


def use_split(on: bool) -> None:
    """Whether more than 18 rows take csrc/int8_rows.c (the default): a Q4_1 or Q4_K panel's
    nibbles split once a call rather than once a chunk of 6 rows, Q8_0's group sums started at
    -128 s rather than offset after. Off: the panels of int8_gemm.c. The same bits either way;
    for benchmarks and tests."""
    kernels().stopline_i8_split(int(on))


@functools.cache
def _amx_default() -> int:
    try:
        return use_amx()
    except NativeUnavailable:  # no kernels: nothing to switch (the caller says why, once)
        return 0


def pack(fmt: str, raw: np.ndarray, in_features: int) -> torch.Tensor:
    """The kernel's layout (csrc/int8_gemm.c) of GGML blocks [out_features, groups * bytes]."""
    n, k = raw.shape[0], in_features
    if not can_pack(fmt, n, k) or raw.shape[1] != k // block_shape(fmt)[0] * block_shape(fmt)[1]:
        raise ValueError(f"cannot pack a {fmt} weight of {tuple(raw.shape)} bytes for {n} x {k}")
    panels, groups = n // PANEL, k // GROUP
    if fmt in SUPER:  # float32 scales (and minima) multiplied out as gguf does (quant_linear)
        sc, mn, kq = kquant_parts(fmt, raw, k)
        if mn is not None:  # Q4_K: dw = d * sc, mw = -(dmin * m), nibbles as Q4_1's
            parts = [_f32_by_panel(sc, panels, groups), _f32_by_panel(-mn, panels, groups)]
            q = kq.reshape(n, groups, GROUP)
        else:  # Q6_K: the scales of k 0-15 and of k 16-31, quants + 128 as Q8_0's
            halves = sc.reshape(n, groups, 2)
            parts = [_f32_by_panel(halves[..., 0], panels, groups), _f32_by_panel(halves[..., 1], panels, groups)]
            q = (kq.astype(np.int16) + 128).astype(np.uint8).reshape(n, groups, GROUP)
    else:
        b = raw.reshape(n, groups, BLOCK_BYTES[fmt])
        parts = [_f16_by_panel(b, 0, panels, groups)]
        if fmt == "q4_1":
            parts.append(_f16_by_panel(b, 2, panels, groups))
            qs = b[..., 4:]
            q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [N, G, 32] in k order
        else:
            q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    # [P, 2 halves, 16 columns, G, 8 steps, 4 k] -> [P, G, 8 steps, 2 halves, 16 columns, 4 k]
    q = q.reshape(panels, 2, 16, groups, 8, 4).transpose(0, 3, 4, 1, 2, 5)
    if fmt in ("q4_1", "q4_k"):  # half 0 in the low nibble, half 1 in the high one
        q = q[:, :, :, 0] | (q[:, :, :, 1] << 4)
    parts.append(np.ascontiguousarray(q).reshape(panels, groups, -1))
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=-1)).reshape(-1))


@dataclass(frozen=True)
class Int8Weight:
    """A [out_features, in_features] weight in Q4_1, Q8_0, Q4_K or Q6_K blocks, in the int8
    kernel's layout."""

    out_features: int
    in_features: int
    fmt: str  # "q4_1", "q8_0", "q4_k" or "q6_k"
    packed: torch.Tensor  # uint8, flat

    @classmethod
    def from_raw(cls, fmt: str, raw: np.ndarray | torch.Tensor, in_features: int) -> Int8Weight:
        arr = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
        if has_vnni():
            _amx_default()  # once a process, before the first call (the fused decoder's too)
        return cls(arr.shape[0], in_features, fmt, pack(fmt, arr, in_features))

    def bytes_read(self, rows: int) -> int:
        """Weight bytes a call of `rows` rows reads (every row count reads the blocks)."""
        return self.packed.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T, x: [M, in] float32 on the CPU; returns float32 [M, out]."""
        if x.device.type != "cpu" or x.dim() != 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"int8 linear takes 2-d CPU rows of {self.in_features}, "
                             f"got {x.dtype} {tuple(x.shape)} on {x.device}")
        m, k = x.shape
        y = torch.empty(m, self.out_features)
        if m:
            x = x.float().contiguous()
            q = torch.empty(m, k, dtype=torch.int8)
            d, ds = torch.empty(m, k // GROUP), torch.empty(m, k // GROUP)
            s = torch.empty(m, k // GROUP, dtype=torch.int32)
            lib = kernels()
            lib.stopline_quantize_rows(x.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), ds.data_ptr(), s.data_ptr())
            if self.fmt == "q6_k":  # one sum a scale: per 16 k (exact in int32)
                s = q.view(m, k // 16, 16).sum(-1, dtype=torch.int32)
            self._fn(q.data_ptr(), d.data_ptr(), ds.data_ptr(), s.data_ptr(), self.packed.data_ptr(),
                     y.data_ptr(), m, k, self.out_features)
        return y

    @functools.cached_property
    def _fn(self):  # looked up once: called ~120 times a step
        if not has_vnni():
            raise RuntimeError("this CPU lacks AVX512-VNNI; the int8 kernel cannot run")
        return getattr(kernels(), f"stopline_{self.fmt}_i8_gemm")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's quantization of x [M, K] in torch: int8 q, and per group of 32 the scale
    d, d * sum(q) and sum(q). A group holding a NaN or an infinity gets d = NaN and q = 0."""
    g = x.float().reshape(x.shape[0], -1, GROUP)
    amax = g.abs().amax(-1)
    bad = ~torch.isfinite(g).all(-1)
    d = amax / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    inv = torch.where(bad, torch.zeros_like(d), inv)
    d = torch.where(bad, torch.full_like(d, float("nan")), d)
    q = torch.round(g * inv[..., None]).clamp(-128, 127).to(torch.int32)
    s = q.sum(-1)
    return q.reshape(x.shape).to(torch.int8), d, d * s.float(), s


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 fma(a, b, c), one rounding: the product is exact in float64, the sum rounded
    to odd in float64 (exact error by two-sum), then to float32: a correct single rounding."""
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    bp = s - p
    err = (p - (s - bp)) + (c - bp)
    even = (s.view(torch.int64) & 1) == 0
    bump = (err != 0) & even & torch.isfinite(s)
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    return torch.where(bump, torch.nextafter(s, toward), s).float()


def reference(x: torch.Tensor, fmt: str, raw: np.ndarray) -> torch.Tensor:
    """The kernel's arithmetic in plain torch, for tests: y [M, N] from x [M, K] and the GGML
    blocks raw [N, K / 32 * bytes]."""
    n, k = raw.shape[0], x.shape[1]
    groups = k // GROUP
    if fmt in SUPER:
        return _kquant_reference(x, fmt, raw)
    b = torch.from_numpy(np.ascontiguousarray(raw)).reshape(n, groups, BLOCK_BYTES[fmt])
    dw = b[..., 0:2].contiguous().view(torch.float16)[..., 0].float()  # [N, G]
    if fmt == "q4_1":
        mw = b[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
        qs = b[..., 4:].to(torch.int64)
        u = torch.cat([qs & 15, qs >> 4], dim=-1)  # [N, G, 32]
    else:
        u = b[..., 2:].contiguous().view(torch.int8).to(torch.int64)
    q, d, ds, _ = quantize_rows(x)
    qg = q.reshape(x.shape[0], groups, GROUP).to(torch.int64)
    acc = torch.zeros(x.shape[0], n)
    for g in range(groups):
        isum = (qg[:, g, :] @ u[:, g, :].T).float()  # exact: |sum| < 2^24
        acc = _fma(isum, dw[None, :, g] * d[:, g, None], acc)
        if fmt == "q4_1":
            acc = _fma(mw[None, :, g].expand_as(acc), ds[:, g, None].expand_as(acc), acc)
    return acc


def _kquant_reference(x: torch.Tensor, fmt: str, raw: np.ndarray) -> torch.Tensor:
    """reference() for Q4_K (Q4_1's steps with its float32 scale and minimum) and Q6_K (a
    step per 16 k: its integer sum times scale * d)."""
    n, k = raw.shape[0], x.shape[1]
    groups = k // GROUP
    sc, mn, kq = (torch.from_numpy(np.ascontiguousarray(a)) if a is not None else None
                  for a in kquant_parts(fmt, raw, k))
    u = kq.to(torch.int64)  # [N, K]
    q, d, ds, _ = quantize_rows(x)
    q = q.to(torch.int64)
    acc = torch.zeros(x.shape[0], n)
    for g in range(groups):
        if mn is not None:
            isum = (q[:, g * GROUP:(g + 1) * GROUP] @ u[:, g * GROUP:(g + 1) * GROUP].T).float()
            acc = _fma(isum, sc[None, :, g] * d[:, g, None], acc)
            acc = _fma((-mn[None, :, g]).expand_as(acc), ds[:, g, None].expand_as(acc), acc)
            continue
        for h in (2 * g, 2 * g + 1):
            isum = (q[:, h * 16:(h + 1) * 16] @ u[:, h * 16:(h + 1) * 16].T).float()
            acc = _fma(isum, sc[None, :, h] * d[:, g, None], acc)
    return acc
