"""Kernels whose result for a row does not depend on the other rows of the batch.

A GEMM library picks its kernel (and so its summation order) by the shape of the call, so a
row can come out with different bits depending on how many rows share its step. Measured on
this machine's MKL: `F.linear(x, w)` gives different rows for M = 1, M in 2..15 and M >= 16;
`x @ w_t` with the weight stored transposed (K x N, contiguous) gives the same rows for
every M >= 2 with one thread, while with two threads the K = 1536 projection splits again
at M = 17..129. Rather than trust either, each weight calibrates itself: it multiplies
random rows at a ladder of row counts (shifted, so a row also changes its place in the
tile) and keeps the row counts whose every row matches the others bit for bit. A batch then
runs as tiles of kept heights only (padded with zero rows), which is one GEMM whenever the
library allows it. (Attention's own fixed reduction order is in `attention.py`.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

# A tile costs its rows plus this many rows' worth of fixed overhead (call, weight reads).
_TILE_OVERHEAD_ROWS = 8


def probe_heights(max_rows: int) -> list[int]:
    """Row counts to calibrate: every count up to 16, then steps of about 1/8."""
    out = list(range(1, min(16, max_rows) + 1))
    h = 16
    while h < max_rows:
        h += max(4, 1 << max(0, h.bit_length() - 4))
        out.append(min(h, max_rows))
    return out


MatMul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def calibrate(w_t: torch.Tensor, max_rows: int, seed: int = 0,
              matmul: MatMul = torch.matmul) -> tuple[int, ...]:
    """The row counts at which `x @ w_t` gives every row the same bits as at every other
    kept count. Seeded from 2 rows (a lone decode pads to 2; one row goes down another path
    in every library tried); if that class stops short of 16 rows, the class of 16 is tried
    too and the cheaper one for a spread of batch sizes wins."""
    probes = [h for h in probe_heights(max_rows) if h >= 2] or [2]
    small = _chain(w_t, probes, 2, seed, matmul)
    if small and small[-1] >= 16:
        return small
    large = _chain(w_t, probes, 16, seed, matmul)
    if not large:
        return small
    sizes = sorted({1, 4, 16, 64, max_rows})
    cost = {c: sum(_plan_cost(n, c) for n in sizes) for c in (small, large) if c}
    return min(cost, key=cost.__getitem__)


def _chain(w_t: torch.Tensor, probes: list[int], first: int, seed: int,
           matmul: MatMul) -> tuple[int, ...]:
    k = w_t.shape[0]
    shift_span = 8
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(max(probes) + shift_span, k, generator=gen).to(w_t.device, w_t.dtype)
    ref = torch.zeros(x.shape[0], w_t.shape[1], device=w_t.device, dtype=w_t.dtype)
    known = torch.zeros(x.shape[0], dtype=torch.bool, device=w_t.device)
    if first not in probes:
        return ()
    kept = []
    for h in [first] + [h for h in probes if h != first]:
        s = (h * 5) % shift_span  # the rows sit at a different place in each tile
        y = matmul(x[s:s + h], w_t)
        seen = known[s:s + h]
        if not kept or torch.equal(y[seen], ref[s:s + h][seen]):
            ref[s:s + h] = y
            known[s:s + h] = True
            kept.append(h)
    return tuple(sorted(kept))


def tile_plan(n: int, heights: tuple[int, ...]) -> Sequence[tuple[int, int]]:
    """Cover n rows with tiles of allowed heights: [(rows used, tile height), ...], chosen
    by cost (padded rows plus a fixed overhead per tile)."""
    plans = _plans(heights)
    return plans[n] if n < len(plans) else _plan_long(n, heights)


@functools.lru_cache(maxsize=64)
def _plans(heights: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
    top = heights[-1]
    cost = [0.0] * (top + 1)
    plans: list[tuple[tuple[int, int], ...]] = [()] * (top + 1)
    for n in range(1, top + 1):
        best_cost, best_plan = float("inf"), ()
        for h in heights:
            if h >= n:
                c = h + _TILE_OVERHEAD_ROWS
                if c < best_cost:
                    best_cost, best_plan = c, ((n, h),)
                break  # larger heights only pad more
            c = h + _TILE_OVERHEAD_ROWS + cost[n - h]
            if c < best_cost:
                best_cost, best_plan = c, ((h, h),) + plans[n - h]
        cost[n], plans[n] = best_cost, best_plan
    return plans


def _plan_cost(n: int, heights: tuple[int, ...]) -> int:
    return sum(h + _TILE_OVERHEAD_ROWS for _, h in tile_plan(n, heights))


def _plan_long(n: int, heights: tuple[int, ...]) -> Sequence[tuple[int, int]]:
    top = heights[-1]
    full, rest = divmod(n, top)
    return ((top, top),) * full + (_plans(heights)[rest] if rest else ())


class InvariantLinear:
    """y = x @ w.T whose rows never depend on the other rows of x."""

    def __init__(self, w: torch.Tensor, max_rows: int) -> None:
        self.w_t = w.t().contiguous()
        self.max_rows = max(2, max_rows)
        self._heights: dict[int, tuple[int, ...]] = {}

    def heights(self) -> tuple[int, ...]:
        # The library's choice of kernel depends on the thread count too.
        threads = torch.get_num_threads()
        found = self._heights.get(threads)
        if found is None:
            found = _calibrated(self.w_t, self.max_rows, threads)
            self._heights[threads] = found
        return found

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n == 0:
            return x.new_empty(0, self.w_t.shape[1])
        plan = tile_plan(n, self.heights())
        if len(plan) == 1 and plan[0][1] == n:
            return x @ self.w_t
        parts = []
        start = 0
        for used, h in plan:
            tile = x[start:start + used]
            if used < h:  # zero rows pad the tile up to a kept height
                tile = F.pad(tile, (0, 0, 0, h - used))
            parts.append((tile @ self.w_t)[:used])
            start += used
        return torch.cat(parts) if len(parts) > 1 else parts[0]


_CALIBRATED: dict[tuple, tuple[int, ...]] = {}


def _calibrated(w_t: torch.Tensor, max_rows: int, threads: int) -> tuple[int, ...]:
    """Calibration depends on the shape, not the values: one per shape and thread count."""
    key = (tuple(w_t.shape), w_t.dtype, str(w_t.device), max_rows, threads)
    if key not in _CALIBRATED:
        _CALIBRATED[key] = calibrate(w_t, max_rows)
    return _CALIBRATED[key]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm whose result for a row does not depend on the other rows. torch's fused
    kernel is used when a probe finds it row-invariant (measured here: it is, and 2-3x
    faster than the float64 form); otherwise the mean of squares is taken in float64, whose
    reduction order is irrelevant after rounding."""
    if _fused_norm_ok(x.device.type, torch.get_num_threads(), x.shape[-1]):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return _rms_norm_f64(x, w, eps)


def _rms_norm_f64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    var = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float64).square_()
    return x * var.div_(x.shape[-1]).add_(eps).rsqrt_().to(x.dtype) * w


@functools.lru_cache(maxsize=16)
def _fused_norm_ok(device: str, threads: int, width: int) -> bool:
    """Whether torch's fused RMS norm gives a row of this width the same bits in any batch
    (the vector loop's tail depends on the width, so each width is probed)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(160, width, generator=gen).to(device)
    w = torch.randn(width, generator=gen).to(device)
    ref = F.rms_norm(x, (width,), w, 1e-5)
    return all(torch.equal(F.rms_norm(x[s:s + n].clone(), (width,), w, 1e-5), ref[s:s + n])
               for n in (1, 2, 3, 7, 16, 17, 33, 64, 127) for s in (0, 5, 30))
