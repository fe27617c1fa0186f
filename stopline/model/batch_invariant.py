"""Kernels whose result for a row does not depend on the other rows of the batch.

CPU GEMM libraries pick a different kernel (and so a different summation order) depending
on how many rows a call has: measured here, torch's fp32 linear gives bitwise different
rows for M in 1..15 and 57..79 than for other M. So every linear runs on row tiles of a fixed
height: a row then always goes through the same kernel, whatever shares its step. Attention
reduces over each sequence's own keys in float64 and rounds once to float32, so that the
order of the reduction (which depends on padding and chunking) is lost in the rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def tiled_linear(x: torch.Tensor, w: torch.Tensor, tile: int) -> torch.Tensor:
    """x @ w.T computed on fixed-height row tiles (the last one zero-padded)."""
    n = x.shape[0]
    if n == tile:
        return F.linear(x, w)
    if n == 0:
        return x.new_empty(0, w.shape[0])
    full = n - n % tile
    if full == n:
        return torch.cat([F.linear(x[s:s + tile], w) for s in range(0, n, tile)])
    pad = x.new_zeros(tile, x.shape[1])
    pad[: n - full] = x[full:]
    parts = [F.linear(x[s:s + tile], w) for s in range(0, full, tile)]
    parts.append(F.linear(pad, w)[: n - full])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class RowSplit:
    """Rows of a step in two classes with their own tile heights: prompt rows and generated
    rows. A recomputed (preempted) request's generated tokens are generated rows again, so
    their K/V come out bitwise identical to the first time."""

    def __init__(self, is_generated: torch.Tensor, prompt_tile: int, decode_tile: int) -> None:
        self.prompt_tile = prompt_tile
        self.decode_tile = decode_tile
        n_gen = int(is_generated.sum())
        self.n = is_generated.numel()
        self.all_gen = n_gen == self.n
        self.all_prompt = n_gen == 0
        if not (self.all_gen or self.all_prompt):
            order = torch.argsort(is_generated.to(torch.int8), stable=True)
            self.order = order
            self.inverse = torch.empty_like(order)
            self.inverse[order] = torch.arange(self.n)
            self.n_prompt = self.n - n_gen

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.all_gen:
            return tiled_linear(x, w, self.decode_tile)
        if self.all_prompt:
            return tiled_linear(x, w, self.prompt_tile)
        xs = x.index_select(0, self.order)
        y = torch.cat([tiled_linear(xs[: self.n_prompt], w, self.prompt_tile),
                       tiled_linear(xs[self.n_prompt:], w, self.decode_tile)])
        return y.index_select(0, self.inverse)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # The mean of squares in float64: its reduction order is then irrelevant after rounding.
    var = x.double().pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(var + eps).to(x.dtype)) * w
