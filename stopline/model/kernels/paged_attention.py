"""Attention read in place from the paged K/V cache, through stopline's C kernel.

Each query row attends the first `nkeys` keys of its sequence through the sequence's block
table: a decode row its whole length, a prefill row up to its own position (causal). No
keys are gathered, padded or copied, and a row's result never depends on the other rows of
the call (see `csrc/paged_attention.c`), so prefill rows, decode rows and recomputed rows of
the same position agree on every bit.

It is the default on CPU where the C kernels build (`EngineConfig.attention_backend`); the
torch path (`attention.py`, with `kv/decode_rows.py`) is the fallback and has bits of its
own, so one engine uses one or the other for every step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stopline.config import AttentionBackend
from stopline.model.kernels.native import NativeUnavailable, kernels

log = logging.getLogger("stopline.attention")

HEAD_DIMS = (16, 32, 64, 128)  # the kernel's instantiations


@dataclass
class PagedRows:
    """Which keys each row of a step attends."""

    nkeys: torch.Tensor  # [N] int32: keys 0 .. nkeys-1 of the row's sequence
    table_at: torch.Tensor  # [N] int32: where the row's block table starts in `tables`
    tables: torch.Tensor  # int32: the step's block tables, one after another
    max_keys: int

    @classmethod
    def build(cls, nkeys: Sequence[int], table_at: Sequence[int], tables: Sequence[int]) -> PagedRows:
        if not nkeys or min(nkeys) < 1:
            raise ValueError("every row must attend at least one key")
        return cls(torch.tensor(nkeys, dtype=torch.int32), torch.tensor(table_at, dtype=torch.int32),
                   torch.tensor(tables, dtype=torch.int32), max(nkeys))


def supports(head_dim: int, device: str | torch.device) -> str | None:
    """None when the kernel can run this model here, else why not."""
    if torch.device(device).type != "cpu":
        return f"the kernel runs on CPU (the model is on {device})"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (the kernel takes {', '.join(map(str, HEAD_DIMS))})"
    try:
        kernels()
    except NativeUnavailable as e:
        return str(e)
    return None


def pick(backend: AttentionBackend | str, head_dim: int, device: str | torch.device) -> AttentionBackend:
    """NATIVE or TORCH for EngineConfig.attention_backend; NATIVE where it can't run is an
    error naming the reason."""
    why = None if backend == AttentionBackend.TORCH else supports(head_dim, device)
    if backend == AttentionBackend.NATIVE and why is not None:
        raise ValueError(f"attention_backend 'native' can't run here: {why}")
    if backend == AttentionBackend.TORCH or why is not None:
        if why is not None:
            log.info("attention runs in torch: %s", why)
        return AttentionBackend.TORCH
    return AttentionBackend.NATIVE


def paged_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, rows: PagedRows,
                    block_size: int, scale: float, window: int = 0,
                    ks: torch.Tensor | None = None, vs: torch.Tensor | None = None) -> torch.Tensor:
    """q: [N, num_heads, d] (rows may be strided, heads and d contiguous); kc, vc: one layer's
    cache [kv_heads, slots, d]; window: a sliding window's keys (each row reads its last
    `window`), 0 for all; ks, vs: an int8 cache's row scales [kv_heads, slots] (kc, vc then
    int8), None for a float32 cache. Returns [N, num_heads * d]."""
    n, heads, d = q.shape
    hk, slots, dk = kc.shape
    cache = (torch.int8, torch.float32) if ks is not None else (torch.float32, None)
    if (kc.dtype, None if ks is None else ks.dtype) != cache or vc.dtype != kc.dtype \
            or (ks is not None and (vs is None or vs.dtype != ks.dtype or ks.shape != (hk, slots)
                                    or vs.shape != ks.shape or not (ks.is_contiguous() and vs.is_contiguous()))):
        raise ValueError(f"paged attention takes a float32 cache, or an int8 one with contiguous float32 "
                         f"scales [Hk, slots]; got {kc.dtype}, {vc.dtype}, scales "
                         f"{None if ks is None else (ks.dtype, tuple(ks.shape))}")
    if q.dtype != torch.float32 or d != dk or vc.shape != kc.shape:
        raise ValueError(f"paged attention takes float32 q [N, H, d] and K/V [Hk, slots, d]; got "
                         f"{q.dtype} {tuple(q.shape)}, {kc.dtype} {tuple(kc.shape)}, {vc.dtype} {tuple(vc.shape)}")
    if d not in HEAD_DIMS or heads % hk or rows.nkeys.shape[0] != n:
        raise ValueError(f"paged attention: head_dim {d}, {heads} heads over {hk} KV heads, "
                         f"{rows.nkeys.shape[0]} row plans for {n} rows")
    if q.stride(2) != 1 or q.stride(1) != d or not (kc.is_contiguous() and vc.is_contiguous()):
        raise ValueError("paged attention needs each row's heads contiguous and a contiguous cache")
    out = torch.empty(n, heads * d)
    if ks is not None:
        rc = kernels().stopline_paged_attention_q8(
            q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(), ks.data_ptr(), vs.data_ptr(),
            out.data_ptr(), n, heads, hk, d, slots, block_size, rows.nkeys.data_ptr(),
            rows.table_at.data_ptr(), rows.tables.data_ptr(), rows.max_keys, scale, window)
        if rc != 0:
            raise MemoryError("paged attention could not allocate its scratch memory")
        return out
    rc = kernels().stopline_paged_attention_window(
        q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(), out.data_ptr(), n, heads, hk, d,
        slots, block_size, rows.nkeys.data_ptr(), rows.table_at.data_ptr(), rows.tables.data_ptr(),
        rows.max_keys, scale, window)
    if rc != 0:
        raise MemoryError("paged attention could not allocate its scratch memory")
    return out
