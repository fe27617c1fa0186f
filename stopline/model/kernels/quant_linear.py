"""Linear weights kept in their GGUF block format (Q4_1, Q8_0, Q4_K, Q6_K), for batches of few rows.

A decode step of few rows is bound by the bytes of weight it reads: SmolLM2's layers are
425 MB as float32 and 66 MB as Q4_1 (4 bits a weight plus a float16 scale and minimum per
32). The C kernel (`csrc/quant_gemm.c`) dequantizes in registers, exactly, and sums every
output in the order of the GEMM library the layer uses for larger batches, so both paths
give a row the same bits (`InvariantLinear` checks this before it lets the kernel run).

Blocks are kept as the GGUF stores them, one row of blocks per output feature ("raw"), and
repacked at start into the kernel's layout: panels of 32 output features, one record per 32
inputs (see the kernel's header comment).

The K-quants (super-blocks of 256 with 6- or 8-bit sub-block scales) are repacked with each
sub-block's float32 scale (and minimum) already multiplied out, exactly as gguf's numpy
dequantization multiplies them (`d * sc`, `dmin * m`), so the kernel forms each weight with
gguf's own float32 operations and the same bits: Q4_K `(d * sc) * q - dmin * m` (one fma:
`(d * sc) * q` is exact, 11 + 6 + 4 bits), Q6_K `(d * sc) * (q - 32)`. A GGUF's Q5_0 blocks
(`d * (q - 16)`, f16 d) are Q8_0 blocks with quants in [-16, 15] (`q5_0_as_q8_0`), so they
take every Q8_0 kernel, exact and fast.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from stopline.model.kernels.native import kernels

GROUP = 32  # weights per GGML block (Q4_1, Q8_0), and per record of every packed layout
PANEL = 32  # output features per kernel panel
# Bytes of one GGML block: Q4_1 = f16 d, f16 m, 16 bytes of nibbles; Q8_0 = f16 d, 32 int8.
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
# The K-quants' super-blocks: (weights, bytes). Q4_K = f16 d, f16 dmin, 12 bytes of 6-bit
# scales and minima, 128 of nibbles; Q6_K = 128 bytes of low nibbles, 64 of high 2-bit pairs,
# 16 int8 scales, f16 d.
SUPER = {"q4_k": (256, 144), "q6_k": (256, 210)}
# gguf.GGMLQuantizationType values; Q5_0 (6) is read as Q8_0 (q5_0_as_q8_0).
GGML_TYPES = {3: "q4_1", 8: "q8_0", 12: "q4_k", 14: "q6_k"}
Q5_0, Q5_0_BYTES = 6, 22  # f16 d, 4 bytes of high bits, 16 of low nibbles

Blocks = dict[str, tuple[str, torch.Tensor]]  # HF weight name -> (format, raw block rows)


def block_shape(fmt: str) -> tuple[int, int]:
    """(weights, bytes) of one GGML block of `fmt`."""
    return SUPER[fmt] if fmt in SUPER else (GROUP, BLOCK_BYTES[fmt])


def can_pack(fmt: str, out_features: int, in_features: int) -> bool:
    if fmt not in BLOCK_BYTES and fmt not in SUPER:
        return False
    return out_features % PANEL == 0 and in_features % block_shape(fmt)[0] == 0 and in_features > 0


def q5_0_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q5_0 blocks [rows, groups * 22] as the Q8_0 blocks [rows, groups * 34] of the same
    weights: the same f16 d and the quants q - 16 as int8 (gguf: `d * (q - 16)`)."""
    b = raw.reshape(raw.shape[0], -1, Q5_0_BYTES)
    qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # [N, G, 1]: bit j = weight j's fifth bit
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, G, 32]
    low = np.concatenate([b[..., 6:] & 15, b[..., 6:] >> 4], axis=-1)  # weights 0-15, 16-31
    q = ((low | (high << 4)).astype(np.int16) - 16).astype(np.int8)
    return np.concatenate([b[..., :2], q.view(np.uint8)], axis=-1).reshape(raw.shape[0], -1)


def kquant_parts(fmt: str, raw: np.ndarray, in_features: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Q4_K or Q6_K blocks [N, bytes] as (scales, minima, quants) in k order, with gguf's own
    float32 arithmetic: Q4_K scales d * sc and minima dmin * m [N, K / 32], quants 0..15
    [N, K]; Q6_K scales d * sc [N, K / 16], no minima, quants q - 32 (int8) [N, K]."""
    n = raw.shape[0]
    b = raw.reshape(n, in_features // 256, SUPER[fmt][1])
    if fmt == "q4_k":
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16).astype(np.float32)  # [N, S, 1]
        dmin = np.ascontiguousarray(b[..., 2:4]).view(np.float16).astype(np.float32)
        sc6 = b[..., 4:16].reshape(n, -1, 3, 4)
        lo, hi, both = sc6[..., 0, :], sc6[..., 1, :], sc6[..., 2, :]
        sc = np.concatenate([lo & 0x3F, (both & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)  # [N, S, 8]
        mn = np.concatenate([hi & 0x3F, (both >> 4) | ((hi >> 2) & 0x30)], axis=-1)
        qs = b[..., 16:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & 15).reshape(n, in_features)  # sub-block j: chunk j // 2, low nibbles if j even
        return ((d * sc.astype(np.float32)).reshape(n, -1), (dmin * mn.astype(np.float32)).reshape(n, -1), q)
    ql, qh = b[..., :128], b[..., 128:192]
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)  # [N, S, 16]
    d = np.ascontiguousarray(b[..., 208:210]).view(np.float16).astype(np.float32)
    low = (ql.reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 15
    high = (qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    q = (low.reshape(n, -1, 2, 128) | (high.reshape(n, -1, 2, 128) << 4)).astype(np.int8) - np.int8(32)
    return (d * sc).reshape(n, -1), None, q.reshape(n, in_features)


def kquant_dequantize(fmt: str, raw: np.ndarray, in_features: int) -> np.ndarray:
    """float32 [N, K] from (kquant_parts), in gguf's order of operations: the reference the
    kernel's exact dequantization is tested against, besides gguf itself."""
    s, m, q = kquant_parts(fmt, raw, in_features)
    sub = 32 if fmt == "q4_k" else 16
    w = np.repeat(s, sub, axis=1) * q.astype(np.float32)
    return w - np.repeat(m, sub, axis=1) if m is not None else w


def _f32_by_panel(v: np.ndarray, panels: int, groups: int) -> np.ndarray:
    """float32 [N, G] as [panel, group, 32 features] bytes."""
    v = np.ascontiguousarray(v, dtype=np.float32)
    return np.ascontiguousarray(v.reshape(panels, PANEL, groups).transpose(0, 2, 1)).view(np.uint8)


def _pack_kquant(fmt: str, raw: np.ndarray, k: int) -> list[np.ndarray]:
    n = raw.shape[0]
    panels, groups = n // PANEL, k // GROUP
    s, m, q = kquant_parts(fmt, raw, k)
    if fmt == "q4_k":  # scale, -minimum, then Q4_1's nibble pairs
        q = q.reshape(panels, PANEL, groups, GROUP // 2, 2).transpose(0, 2, 3, 1, 4)
        pairs = (q[..., 0] | (q[..., 1] << 4)).astype(np.uint8)
        assert m is not None
        return [_f32_by_panel(s, panels, groups), _f32_by_panel(-m, panels, groups),
                pairs.reshape(panels, groups, -1)]
    halves = s.reshape(n, groups, 2)  # each 32 k: the scale of k 0-15, of k 16-31
    q = q.view(np.uint8).reshape(panels, PANEL, groups, GROUP).transpose(0, 2, 3, 1)
    return [_f32_by_panel(halves[..., 0], panels, groups), _f32_by_panel(halves[..., 1], panels, groups),
            q.reshape(panels, groups, -1)]


def _f16_by_panel(b: np.ndarray, lo: int, panels: int, groups: int) -> np.ndarray:
    """The float16 at byte `lo` of every block, as [panel, group, 32 features] bytes."""
    v = np.ascontiguousarray(b[..., lo:lo + 2]).view(np.float16)[..., 0]  # [N, G]
    return np.ascontiguousarray(v.reshape(panels, PANEL, groups).transpose(0, 2, 1)).view(np.uint8)


def pack(fmt: str, raw: np.ndarray, in_features: int) -> torch.Tensor:
    """The kernel's layout of `raw` ([out_features, blocks * bytes] GGML blocks)."""
    n, k = raw.shape[0], in_features
    if not can_pack(fmt, n, k) or raw.shape[1] != k // block_shape(fmt)[0] * block_shape(fmt)[1]:
        raise ValueError(f"cannot pack a {fmt} weight of {tuple(raw.shape)} bytes for {n} x {k}")
    panels, groups = n // PANEL, k // GROUP
    if fmt in SUPER:
        parts = _pack_kquant(fmt, raw, k)
        return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=-1)).reshape(-1))
    b = raw.reshape(n, groups, BLOCK_BYTES[fmt])
    d = _f16_by_panel(b, 0, panels, groups)
    if fmt == "q4_1":
        m = _f16_by_panel(b, 2, panels, groups)
        qs = b[..., 4:]  # byte j: weight j in the low nibble, weight j + 16 in the high one
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [N, G, 32] in k order
        q = q.reshape(panels, PANEL, groups, GROUP // 2, 2).transpose(0, 2, 3, 1, 4)
        pairs = (q[..., 0] | (q[..., 1] << 4)).astype(np.uint8)  # [P, G, 16, 32]
        parts = [d, m, pairs.reshape(panels, groups, -1)]
    else:
        q = b[..., 2:].reshape(panels, PANEL, groups, GROUP).transpose(0, 2, 3, 1)  # [P, G, k, 32]
        parts = [d, q.reshape(panels, groups, -1)]
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=-1)).reshape(-1))


@dataclass(frozen=True)
class QuantWeight:
    """A packed [out_features, in_features] weight and the kernel that multiplies by it."""

    fmt: str
    out_features: int
    in_features: int
    packed: torch.Tensor  # uint8

    @classmethod
    def from_raw(cls, fmt: str, raw: torch.Tensor | np.ndarray, in_features: int) -> QuantWeight:
        arr = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
        return cls(fmt, arr.shape[0], in_features, pack(fmt, arr, in_features))

    def __call__(self, x: torch.Tensor, kc: int) -> torch.Tensor:
        """x @ w.T, summed in blocks of kc inputs (see the kernel). x: [M, in] float32."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != self.in_features:
            raise ValueError(f"quantized linear takes float32 CPU rows of {self.in_features}, "
                             f"got {x.dtype} {tuple(x.shape)} on {x.device}")
        if kc % GROUP or kc < GROUP:
            raise ValueError(f"kc must be a positive multiple of {GROUP}, got {kc}")
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features)
        self._fn(x.data_ptr(), self.packed.data_ptr(), y.data_ptr(), x.shape[0], self.in_features,
                 self.out_features, kc)
        return y

    @functools.cached_property
    def _fn(self):  # the C entry point, looked up once: this is called ~120 times a step
        return getattr(kernels(), f"stopline_{self.fmt}_gemm")


def from_raw_rows(fmt: str, parts: list[torch.Tensor], in_features: int) -> QuantWeight | None:
    """One QuantWeight for weights concatenated along their rows (q|k|v, gate|up), or None
    when the shape does not fit the kernel."""
    rows = sum(p.shape[0] for p in parts)
    if not can_pack(fmt, rows, in_features):
        return None
    return QuantWeight.from_raw(fmt, torch.cat(parts) if len(parts) > 1 else parts[0], in_features)
