"""Packed token masks (one bit a token, 32 to an int32 word, llguidance's layout) applied to
a row of logits. numpy's unpackbits turns SmolLM2's 1,536 words into 49,152 flags in ~11 us
(shifting each word by 0..31 in torch took ~250 us); the masked fill over the row then costs
what any op over 49k floats does (bench/grammar_mask.py prints both)."""

from __future__ import annotations

import sys

import numpy as np
import torch

if sys.byteorder != "little":  # a word's bits in memory order must be low byte first
    raise ImportError("stopline.grammar.bitmask assumes a little-endian machine")


def words(n_vocab: int) -> int:
    return (n_vocab + 31) // 32


def allocate(rows: int, n_vocab: int) -> torch.Tensor:
    """A [rows, words] int32 mask buffer, every token allowed."""
    return torch.full((rows, words(n_vocab)), -1, dtype=torch.int32)


def allowed(mask: torch.Tensor, n_vocab: int) -> torch.Tensor:
    """Bool flags [n_vocab] of one packed row (a CPU tensor)."""
    bits = np.unpackbits(mask.contiguous().numpy().view(np.uint8), bitorder="little")
    return torch.from_numpy(bits[:n_vocab].view(np.bool_))


def apply(row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """row (logits [V]) with every token the mask forbids set to -inf, in place. Tokens past
    the mask's width are forbidden too."""
    v = row.shape[-1]
    n = min(v, mask.shape[-1] * 32)
    keep = allowed(mask, n).to(row.device)
    if n < v:
        row[n:] = float("-inf")
    row[:n].masked_fill_(~keep, float("-inf"))
    return row


def allowed_rows(masks: torch.Tensor, n_vocab: int) -> torch.Tensor:
    """Bool flags [rows, n_vocab] of packed rows [rows, words] (a CPU tensor) in one unpack;
    tokens past the masks' width are forbidden."""
    bits = np.unpackbits(masks.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
    flags = torch.from_numpy(bits.view(np.bool_))
    n = flags.shape[1]
    if n >= n_vocab:
        return flags[:, :n_vocab]
    return torch.cat([flags, torch.zeros(flags.shape[0], n_vocab - n, dtype=torch.bool)], dim=1)


def apply_rows(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> torch.Tensor:
    """Copies of logits[rows] with each row's forbidden tokens set to -inf, in one fill over
    the block. Each row's result depends on its own logits and mask only."""
    block = logits[rows]  # advanced indexing: a copy
    keep = allowed_rows(masks, block.shape[-1]).to(block.device)
    return block.masked_fill_(~keep, float("-inf"))
