"""Linear weights as bf16 for the "fast" numerics mode (docs/numerics.md).

y = x @ w.T with x and w rounded to bf16 (round to nearest even) and every product summed in
fp32, on AMX-BF16 tiles where the CPU has them (csrc/amx_gemm.c: one accumulator lane per
output, one tdpbf16ps per 32-wide k tile in k order) or else by AVX512-BF16's vdpbf16ps, one
chain per output element in k order (csrc/bf16_gemm.c), so a row's result never depends on
the other rows, the chunking or the batch size. Which of the two a weight takes is fixed when
it is built (the CPU, STOPLINE_AMX, K a multiple of 32), never by the row count: the two sum
in different orders. The weight
is packed at start into panels of 32 output features, one 128-byte record per pair of inputs;
output features are zero padded to a multiple of 32 and inputs to an even count (a zero pair
adds an exact zero).
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from stopline.config import Numerics
from stopline.model.kernels.native import amx_ready, has_amx, has_bf16, kernels
from stopline.model.kernels.quant_linear import _f16_by_panel, can_pack

log = logging.getLogger("stopline.numerics")

PANEL = 32


def pack(w: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of w ([N, K], any float dtype) as bf16."""
    n, k = w.shape
    n_pad, k_pad = -(-n // PANEL) * PANEL, k + (k & 1)
    wb = torch.zeros(n_pad, k_pad, dtype=torch.bfloat16)
    wb[:n, :k] = w.detach().to("cpu", torch.bfloat16)
    # [P, 32, K/2, 2] -> [P, K/2, 32, 2]: per pair, each column's two weights side by side.
    return wb.reshape(n_pad // PANEL, PANEL, k_pad // 2, 2).transpose(1, 2).contiguous().reshape(-1)


def pack_q4_1(raw: np.ndarray, in_features: int) -> torch.Tensor:
    """The Q4_1 kernel's layout (csrc/bf16_gemm.c) of GGML Q4_1 blocks [out, groups * 20]."""
    n, k = raw.shape[0], in_features
    if not can_pack("q4_1", n, k) or raw.shape[1] != k // 32 * 20:
        raise ValueError(f"cannot pack a q4_1 weight of {tuple(raw.shape)} bytes for {n} x {k}")
    panels, groups = n // PANEL, k // 32
    b = raw.reshape(n, groups, 20)
    d, m = _f16_by_panel(b, 0, panels, groups), _f16_by_panel(b, 2, panels, groups)
    qs = b[..., 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [N, G, 32] in k order
    # [P, 4 vectors, 8 columns, G, 16 pairs, 2] -> [P, G, 16 pairs, 4 vectors, 16 lanes]
    lanes = q.reshape(panels, 4, 8, groups, 16, 2).transpose(0, 3, 4, 1, 2, 5).reshape(panels, groups, 16, 4, 16)
    nib = (lanes[:, :, :, 0::2] | (lanes[:, :, :, 1::2] << 4)).astype(np.uint8)  # (A|B<<4), (C|D<<4)
    rec = np.concatenate([d, m, nib.reshape(panels, groups, -1)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(rec).reshape(-1))


def pack_q8_0(raw: np.ndarray, in_features: int) -> torch.Tensor:
    """The AMX Q8_0 kernel's layout (csrc/amx_gemm.c q8_group) of GGML Q8_0 blocks [out, groups * 34]."""
    n, k = raw.shape[0], in_features
    if not can_pack("q8_0", n, k) or raw.shape[1] != k // 32 * 34:
        raise ValueError(f"cannot pack a q8_0 weight of {tuple(raw.shape)} bytes for {n} x {k}")
    panels, groups = n // PANEL, k // 32
    b = raw.reshape(n, groups, 34)
    d = _f16_by_panel(b, 0, panels, groups)
    q = b[..., 2:]  # [N, G, 32] int8 bytes in k order
    # [P, 4 vectors, 8 columns, G, 16 pairs, 2] -> [P, G, 16 pairs, 4 vectors, 8 columns, 2]
    lanes = q.reshape(panels, 4, 8, groups, 16, 2).transpose(0, 3, 4, 1, 2, 5).reshape(panels, groups, -1)
    rec = np.concatenate([d, lanes.astype(np.uint8)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(rec).reshape(-1))


# Row counts up to which a Q4_1 weight runs from its blocks rather than its bf16 copy: both give
# the same bits, so this is a speed choice only. Measured on SmolLM2's decode step, 2 cores
# (bench/bf16_time.py, interleaved): AVX512-BF16 blocks/bf16 time 0.86 at 1 and 2 streams,
# 0.89 at 4, 1.01 at 8, 1.06 at 12, 1.12 at 16 (AMD EPYC); AMX 0.90 at 1, 0.88 at 4, 0.91 at
# 8, 0.85 at 16 and 32 (Intel Xeon: the tiles make the dequantization the cheap part).
Q4_MAX_ROWS = 6
# The AMX kernel's Q4_1 path holds all rows in two tiles, and pays at every count it can take.
AMX_Q4_MAX = 32


@dataclass(frozen=True)
class BF16Weight:
    """A packed [out_features, in_features] bf16 weight and the kernel that multiplies by it;
    q4: the same weight's Q4_1 blocks in that kernel's layout, read by batches of up to
    q4_max_rows rows (fewer bytes, the same bits); q8: the same for Q8_0 blocks (AMX only);
    amx: every batch runs on AMX tiles."""

    out_features: int
    in_features: int
    packed: torch.Tensor  # bfloat16, flat
    q4: torch.Tensor | None = None
    q4_max_rows: int = Q4_MAX_ROWS  # from_float: AMX_Q4_MAX on AMX
    amx: bool = False
    q8: torch.Tensor | None = None

    @classmethod
    def from_float(cls, w: torch.Tensor, q4_raw: np.ndarray | torch.Tensor | None = None,
                   amx: bool | None = None, q8_raw: np.ndarray | torch.Tensor | None = None) -> BF16Weight:
        """w: the weight in float (a GGUF's dequantized exactly); q4_raw, q8_raw: its Q4_1 or
        Q8_0 blocks, if it has them. amx: None picks AMX where it runs (has_amx(), K a multiple
        of 32); True or False forces the choice (tests, benchmarks)."""
        def arr(raw: np.ndarray | torch.Tensor) -> np.ndarray:
            return raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)

        q4 = pack_q4_1(arr(q4_raw), w.shape[1]) if q4_raw is not None else None
        fits = w.shape[1] % 32 == 0
        if amx is None:
            amx = fits and has_amx()
        elif amx and not (fits and amx_ready()):
            raise ValueError("AMX cannot run this weight here (no AMX, or K not a multiple of 32)")
        # Q8_0 blocks only on AMX: the AVX512-BF16 kernel has no Q8_0 path (it reads the copy).
        q8 = pack_q8_0(arr(q8_raw), w.shape[1]) if q8_raw is not None and amx else None
        return cls(w.shape[0], w.shape[1], pack(w), q4, AMX_Q4_MAX if amx else Q4_MAX_ROWS, amx=amx, q8=q8)

    def _source(self, rows: int) -> str:
        """What a call of `rows` rows reads: the "q4" or "q8" blocks, or the bf16 "copy"."""
        if rows and self.q4 is not None and rows <= self.q4_max_rows and (rows <= AMX_Q4_MAX or not self.amx):
            return "q4"
        if rows and self.q8 is not None and rows <= min(self.q4_max_rows, AMX_Q4_MAX):
            return "q8"
        return "copy"

    def bytes_read(self, rows: int) -> int:
        """Weight bytes a call of `rows` rows reads."""
        source = self._source(rows)
        return self.packed.numel() * 2 if source == "copy" else getattr(self, source).numel()

    @property
    def _k(self) -> int:
        return self.in_features + (self.in_features & 1)

    @property
    def _n(self) -> int:
        return -(-self.out_features // PANEL) * PANEL

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T, x: [M, in] float32 or bfloat16 on the CPU; returns float32 [M, out]."""
        if x.device.type != "cpu" or x.dim() != 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"bf16 linear takes 2-d CPU rows of {self.in_features}, "
                             f"got {x.dtype} {tuple(x.shape)} on {x.device}")
        m = x.shape[0]
        if self._k != self.in_features:
            xb = torch.zeros(m, self._k, dtype=torch.bfloat16)
            xb[:, :self.in_features] = x
        else:
            xb = x.to(torch.bfloat16).contiguous()
        y = torch.empty(m, self._n)
        source = self._source(m)
        if source == "q4":
            self._q4_fn(xb.data_ptr(), self.q4.data_ptr(), y.data_ptr(), m, self._k, self._n)
        elif source == "q8":
            kernels().stopline_amx_q8_0_gemm(xb.data_ptr(), self.q8.data_ptr(), y.data_ptr(), m, self._k, self._n)
        elif m:
            self._fn(xb.data_ptr(), self.packed.data_ptr(), y.data_ptr(), m, self._k, self._n)
        return y if self._n == self.out_features else y[:, :self.out_features].contiguous()

    @functools.cached_property
    def _fn(self):  # looked up once: called ~120 times a step
        if not has_bf16():
            raise RuntimeError("this CPU lacks AVX512-BF16; the fast numerics kernel cannot run")
        return kernels().stopline_amx_bf16_gemm if self.amx else kernels().stopline_bf16_gemm

    @functools.cached_property
    def _q4_fn(self):
        self._fn  # noqa: B018  (the same check)
        return kernels().stopline_amx_q4_1_gemm if self.amx else kernels().stopline_q4_1_bf16_gemm


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in plain torch, for tests: bf16-rounded inputs, each output one
    fp32 chain over the k-pairs in order, each pair added as vdpbf16ps does (odd product first,
    then even, each add rounded to fp32; bf16 products are exact in fp32)."""
    xb = x.to(torch.bfloat16).float()
    wb = w.to(torch.bfloat16).float()
    k = x.shape[1]
    acc = torch.zeros(x.shape[0], w.shape[0])
    for p in range(0, k - 1, 2):
        acc = acc + xb[:, p + 1:p + 2] * wb[:, p + 1][None, :]
        acc = acc + xb[:, p:p + 1] * wb[:, p][None, :]
    if k & 1:
        acc = acc + xb[:, k - 1:k] * wb[:, k - 1][None, :]
    return acc


def resolve(numerics: Numerics | str, device: str) -> Numerics:
    """The numerics a model on `device` runs: FAST only where the bf16 kernel can run (a CPU
    with AVX512-BF16 and the C kernels built); otherwise EXACT, with a loud warning, so the
    results stay correct everywhere. On CUDA fast falls back to exact too: torch's bf16 matmul
    there would not be batch-invariant."""
    if Numerics(numerics) is not Numerics.FAST:
        return Numerics.EXACT
    why = None
    if torch.device(device).type != "cpu":
        why = f"the model is on {device} (the fast kernel is CPU-only)"
    elif not has_bf16():
        why = "this CPU lacks AVX512-BF16"
    else:
        from stopline.model.kernels.native import NativeUnavailable

        try:
            kernels()
        except NativeUnavailable as e:
            why = f"the C kernels are off ({e})"
    if why is None:
        return Numerics.FAST
    warnings.warn(f"numerics 'fast' is not available: {why}; running 'exact' (float32) instead",
                  RuntimeWarning, stacklevel=2)
    log.warning("numerics 'fast' unavailable (%s): running exact", why)
    return Numerics.EXACT
