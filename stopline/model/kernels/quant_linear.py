"""Linear weights kept in their GGUF block format (Q4_1, Q8_0), for batches of few rows.

A decode step of few rows is bound by the bytes of weight it reads: SmolLM2's layers are
425 MB as float32 and 66 MB as Q4_1 (4 bits a weight plus a float16 scale and minimum per
32). The C kernel (`csrc/quant_gemm.c`) dequantizes in registers, exactly, and sums every
output in the order of the GEMM library the layer uses for larger batches, so both paths
give a row the same bits (`InvariantLinear` checks this before it lets the kernel run).

Blocks are kept as the GGUF stores them, one row of blocks per output feature ("raw"), and
repacked at start into the kernel's layout: panels of 32 output features, one record per 32
inputs (see the kernel's header comment).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from stopline.model.kernels.native import kernels

GROUP = 32  # weights per GGML block (both formats)
PANEL = 32  # output features per kernel panel
# Bytes of one GGML block: Q4_1 = f16 d, f16 m, 16 bytes of nibbles; Q8_0 = f16 d, 32 int8.
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
GGML_TYPES = {3: "q4_1", 8: "q8_0"}  # gguf.GGMLQuantizationType values

Blocks = dict[str, tuple[str, torch.Tensor]]  # HF weight name -> (format, raw block rows)


def can_pack(fmt: str, out_features: int, in_features: int) -> bool:
    return fmt in BLOCK_BYTES and out_features % PANEL == 0 and in_features % GROUP == 0 and in_features > 0


def _f16_by_panel(b: np.ndarray, lo: int, panels: int, groups: int) -> np.ndarray:
    """The float16 at byte `lo` of every block, as [panel, group, 32 features] bytes."""
    v = np.ascontiguousarray(b[..., lo:lo + 2]).view(np.float16)[..., 0]  # [N, G]
    return np.ascontiguousarray(v.reshape(panels, PANEL, groups).transpose(0, 2, 1)).view(np.uint8)


def pack(fmt: str, raw: np.ndarray, in_features: int) -> torch.Tensor:
    """The kernel's layout of `raw` ([out_features, blocks * bytes] GGML blocks)."""
    n, k = raw.shape[0], in_features
    if not can_pack(fmt, n, k) or raw.shape[1] != k // GROUP * BLOCK_BYTES[fmt]:
        raise ValueError(f"cannot pack a {fmt} weight of {tuple(raw.shape)} bytes for {n} x {k}")
    panels, groups = n // PANEL, k // GROUP
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
        lib = kernels()
        return lib.stopline_q4_1_gemm if self.fmt == "q4_1" else lib.stopline_q8_0_gemm


def from_raw_rows(fmt: str, parts: list[torch.Tensor], in_features: int) -> QuantWeight | None:
    """One QuantWeight for weights concatenated along their rows (q|k|v, gate|up), or None
    when the shape does not fit the kernel."""
    rows = sum(p.shape[0] for p in parts)
    if not can_pack(fmt, rows, in_features):
        return None
    return QuantWeight.from_raw(fmt, torch.cat(parts) if len(parts) > 1 else parts[0], in_features)
