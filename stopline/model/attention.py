"""Attention in torch ops whose result for a query row never depends on the rest of the batch.

This is the fallback where stopline's C kernel can't run (`paged_attention.py`, the default
on CPU); an engine uses one of the two for every step, since they give different bits.

The same position must come out with the same bits whether it is a decode row among 32, a
decode row alone, or a row of a prefill chunk of any size (a preempted request is recomputed
as a prefill and must write the K/V it wrote the first time). So no reduction here may
change order with the batch, the padding or the chunking:

- scores: `q @ k` reduces over head_dim only; the batched GEMM gives the same bits for
  every row count from some small count on (measured: 2 on the earlier hosts, 4 on a Zen 5
  host, where MKL takes 2 and 3 rows through another kernel), so a query block with fewer
  rows gets zero rows beside it, up to a count probed at first use (`min_rows`);
- softmax: rows are padded with -inf to whole tiles of KEY_TILE (64) keys, so torch's fused
  softmax takes every element through its vector loop, and the padding only adds exact
  zeros to its per-lane sums; a probe at start checks that a row's bits do not move with
  its padding or its neighbours (measured: they do not, and it is 25-35% faster than the
  float64 form), else exp runs in float64, rounded once, with the sum per tile;
- P @ V: per tile of 64 keys (a fixed shape, whatever the KV block size), then summed over
  tiles in order by `cumsum`, which accumulates sequentially in float64 on CPU; tiles past
  a row's last key add exact zeros.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# 64 rather than 16: the per-tile partial sums are 4x fewer; measured, prefill attention
# 2.3-3.5x faster (128 rows x 128 keys: 3.1 -> 0.9 ms; 512 x 512: 67 -> 30 ms), decodes no slower.
KEY_TILE = 64


def attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
           masked: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [..., m, d] query rows; keys: [..., d, ctx]; vals: [..., ctx, d] with zeros wherever
    a key is masked for every row; masked: bool, broadcastable to the scores [..., m, ctx].
    Returns [..., m, d]."""
    pad = -keys.shape[-1] % KEY_TILE
    if pad:
        keys = F.pad(keys, (0, pad))
        vals = F.pad(vals, (0, 0, 0, pad))
        masked = F.pad(masked, (0, pad), value=True)
    m = q.shape[-2]
    p = _weights(q, keys, masked, scale)
    nt = vals.shape[-2] // KEY_TILE
    vals = vals.unflatten(-2, (nt, KEY_TILE))  # [..., nt, tile, d]
    pb = _pad_rows(p.unflatten(-1, (nt, KEY_TILE)).transpose(-3, -2))  # [..., nt, m', tile]
    acc = torch.matmul(pb, vals)  # [..., nt, m', d], per tile
    return acc.cumsum(dim=-3)[..., -1, :m, :]


def attend_rows(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                masked: torch.Tensor, scale: float) -> torch.Tensor:
    """`attend` for keys and values that are views into wider buffers (the first `ctx` of a
    longer capacity, as DecodeRows hands them out; ctx a whole number of tiles): the same
    arithmetic and bits, with P @ V taken one key tile at a time, since batching the tiles
    together needs them evenly spaced, which here would mean copying the values.
    q: [..., m, d]; keys: [..., d, ctx]; vals: [..., ctx, d]; masked as for `attend`."""
    ctx = vals.shape[-2]
    if ctx % KEY_TILE:
        raise ValueError(f"attend_rows needs whole tiles of {KEY_TILE} keys, got {ctx}")
    m = q.shape[-2]
    p = _pad_rows(_weights(q, keys, masked, scale))
    acc = torch.stack([torch.matmul(p[..., t:t + KEY_TILE], vals[..., t:t + KEY_TILE, :])
                       for t in range(0, ctx, KEY_TILE)], dim=-3)  # [..., nt, m', d]
    return acc.cumsum(dim=-3)[..., -1, :m, :]


def _weights(q: torch.Tensor, keys: torch.Tensor, masked: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax weights [..., m, ctx] of the query rows over the keys."""
    m = q.shape[-2]
    scores = torch.matmul(_pad_rows(q), keys)[..., :m, :].mul_(scale)
    scores.masked_fill_(masked, float("-inf"))
    return _softmax(scores)


def _pad_rows(a: torch.Tensor) -> torch.Tensor:
    """a [..., m, k] with zero rows after its own up to `min_rows`: a GEMM library takes a
    few rows through another kernel than many."""
    want = min_rows(a.device.type, torch.get_num_threads())
    m = a.shape[-2]
    if m >= want:
        return a
    return torch.cat([a, a.new_zeros(*a.shape[:-2], want - m, a.shape[-1])], dim=-2)


@functools.lru_cache(maxsize=8)
def min_rows(device: str, threads: int) -> int:
    """The fewest rows the attention's batched GEMMs take: the smallest of 2, 4, 8, 16 from
    which every row count gives a row the bits it gets among 64, for the shapes attention
    uses (scores over a few key counts, P @ V over a tile). Probed, like the linears."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(d, n) for d in (16, 32, 64, 128) for n in (64, 640)] + [(KEY_TILE, d) for d in (16, 32, 64, 128)]
    cases = []
    for k, n in shapes:
        a = torch.randn(3, 64, k, generator=gen).to(device)
        b = torch.randn(3, k, n, generator=gen).to(device)
        cases.append((a, b, torch.matmul(a, b)))
    for want in (2, 4, 8, 16):
        if all(torch.equal(torch.matmul(a[:, :h], b), ref[:, :h])
               for a, b, ref in cases for h in range(want, 65)):
            return want
    return 64  # none held: pad every block to the tallest count probed


def probe(device: str) -> bool:
    """Run (once) the probe that picks the softmax path; True for the fused one."""
    return _fused_softmax_ok(device, torch.get_num_threads())


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    if _fused_softmax_ok(scores.device.type, torch.get_num_threads()):
        return torch.softmax(scores, dim=-1)
    # exp in float64, rounded once; the sum per tile, tiles summed in order.
    p = scores.sub_(scores.amax(dim=-1, keepdim=True)).double().exp_().float()
    nt = p.shape[-1] // KEY_TILE
    sums = p.unflatten(-1, (nt, KEY_TILE)).sum(dim=-1).cumsum(dim=-1)[..., -1:]
    return p.div_(sums)


@functools.lru_cache(maxsize=8)
def _fused_softmax_ok(device: str, threads: int) -> bool:
    """Whether torch's softmax gives a row the same bits whatever its padding (whole tiles of
    -inf) and whatever rows share the call. Probed, like the linears, rather than trusted."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = torch.randn(10, 3000, generator=gen).to(device) * 4
    lens = [1, 5, 63, 64, 65, 200, 333, 640, 1000, 3000]
    ref = []
    for r, n in zip(rows, lens, strict=True):
        one = torch.full((1, -(-n // KEY_TILE) * KEY_TILE), float("-inf"), device=device)
        one[0, :n] = r[:n]
        ref.append(torch.softmax(one, dim=-1)[0, :n])
    for width in (3008, 4096, 8192):  # up to a long context's padding
        batch = torch.full((len(lens) + 3, width), float("-inf"), device=device)
        batch[len(lens):] = torch.randn(3, width, generator=gen).to(device)
        for i, (r, n) in enumerate(zip(rows, lens, strict=True)):
            batch[i, :n] = r[:n]
        out = torch.softmax(batch, dim=-1)
        if not all(torch.equal(out[i, :n], ref[i]) for i, n in enumerate(lens)):
            return False
    return True
