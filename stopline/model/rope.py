"""Rotary embedding tables: the inverse frequencies of each rope scheme the families use, and
the cos/sin tables the layers read by position.

The frequencies follow transformers' formulas op for op (`modeling_rope_utils`), so a table
gets the oracle's bits; a GGUF's Llama 3 scaling comes as llama.cpp's per-frequency divisors
(`rope_freqs.weight`) instead, which round a little differently in the medium band.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from stopline.model.config import ModelConfig


def inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None,
             factors: tuple[float, ...] = ()) -> torch.Tensor:
    """float32 [head_dim / 2] inverse frequencies. scaling: an HF rope dict (default, linear,
    llama3); factors: llama.cpp's rope_freqs, each frequency divided by its factor."""
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if factors:
        return freq / torch.tensor(factors, dtype=torch.float32)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return freq
    factor = scaling["factor"]
    if kind == "linear":
        return freq / factor
    if kind != "llama3":
        raise ValueError(f"rope type {kind!r} has no frequencies here")
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def tables(freq: torch.Tensor, max_position: int, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [max_position, head_dim] for `freq`. sin has its first half negated:
    rotate_half(x) * sin == roll(x, half) * sin with that sign flip, the same products (negation
    is exact) in 2 ops fewer."""
    half = freq.shape[0]
    pos = torch.arange(max_position, dtype=torch.float32)
    freqs = pos[:, None] * freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    sin = emb.sin()
    return emb.cos().to(device), torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(device)


def layer_freqs(config: ModelConfig) -> list[torch.Tensor | None]:
    """Each layer's inverse frequencies, None for a layer without rope. Layers with the same
    frequencies share one tensor (so one table)."""
    c = config
    full = inv_freq(c.head_dim, c.rope_theta, dict(c.rope_scaling), c.rope_freq_factors)
    local = inv_freq(c.head_dim, c.local_rope_theta) if c.local_rope_theta else full
    return [None if not c.uses_rope(i) else (local if c.window(i) else full) for i in range(c.num_layers)]
