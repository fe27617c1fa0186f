"""The KV tensors behind the block pool, and the host swap space for swap preemption."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from stopline.config import EngineConfig, KVCacheDtype, PreemptionMode
from stopline.kv.block_pool import BlockPool


class KVCache:
    """Per layer, K and V as [num_kv_heads, (num_blocks + 1) * block_size, head_dim]: heads
    first, so that gathering a batch's blocks gives each head's keys contiguous and attention
    multiplies them in place (a slot-first layout cost a transposing copy of every gathered
    key and value, half the attention time at 32 streams).

    Attention multiplies the V of masked positions by exactly 0, so those must never hold
    NaN or inf: the extra block at the end (`null_block`) is never handed out and stays zero
    (padded reads point there), and a block is zeroed when it is handed out, so the unwritten
    tail of a sequence's last block is zero rather than stale or poisoned (debug NaN) data.

    dtype int8 (`--kv-cache-dtype int8`, fast numerics only; docs/numerics.md): k and v hold
    int8 quants and `k_scale`, `v_scale` ([num_kv_heads, slots] float32) a scale per (kv head,
    slot), each row quantized on its own when written (`quantize_rows`) and never rescaled,
    so a request's earlier keys do not change with what is written after them. A row reads
    back as `q * scale` (`dequantize`). Every copy (read_blocks, write_blocks, copy_block)
    moves quants and scales together: K, V, then K scales, V scales.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 layer_group: Sequence[int] | None = None, group_blocks: Sequence[int] = ()) -> None:
        """layer_group: each layer's group (`layer_groups`); None: one group. Every group
        numbers its blocks 0 .. its pool's size - 1 in its own pool, in its own layers'
        tensors. group_blocks: each group's pool size (num_blocks, group 0's, for every
        group if empty); its layers' tensors hold one more block, its zero block (`nulls`)."""
        self.num_blocks = num_blocks
        self.layer_group = list(layer_group) if layer_group else [0] * num_layers
        self.groups = [[li for li, g in enumerate(self.layer_group) if g == gi]
                       for gi in range(max(self.layer_group, default=0) + 1)]
        self.group_blocks = list(group_blocks) or [num_blocks] * len(self.groups)
        if len(self.group_blocks) != len(self.groups) or self.group_blocks[0] != num_blocks:
            raise ValueError(f"group_blocks {self.group_blocks}: one per layer group, group 0's num_blocks")
        self.block_size = block_size
        self.null_block = num_blocks
        if dtype not in (torch.float32, torch.int8):
            raise ValueError(f"a KV cache holds float32 or int8, not {dtype}")
        self.quantized = dtype == torch.int8
        self.nulls = list(self.group_blocks)  # each group's zero block, past its pool's blocks
        shapes = [(num_kv_heads, (self.group_blocks[g] + 1) * block_size, head_dim) for g in self.layer_group]
        self._layout = (shapes, dtype, device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.k_scale: list[torch.Tensor] = []  # int8 only: [num_kv_heads, slots] a layer
        self.v_scale: list[torch.Tensor] = []
        # Counts the allocations of the tensors: whatever holds their addresses (the fused
        # decoder's layer table) checks it, since new tensors may reuse some old addresses.
        self.generation = 0
        self.restore_memory()

    @property
    def kinds(self) -> int:
        """Tensors a layer has: K and V, and their scales in an int8 cache."""
        return 4 if self.quantized else 2

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v + self.k_scale + self.v_scale)

    def free_memory(self) -> int:
        """Drop the tensors (the engine sleeps: no block is owned or cached). Returns the
        bytes dropped; `restore_memory` allocates them again, zeroed."""
        freed = self.nbytes
        self.k, self.v, self.k_scale, self.v_scale = [], [], [], []
        return freed

    def restore_memory(self) -> None:
        if self.k:
            return
        shapes, dtype, device = self._layout
        self.generation += 1
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        if self.quantized:
            self.k_scale = [torch.zeros(shape[:2], device=device) for shape in shapes]
            self.v_scale = [torch.zeros(shape[:2], device=device) for shape in shapes]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype = torch.float32) -> int:
        """int8: head_dim quants and a float32 scale a row (68 bytes at head_dim 64, against
        256 as float32)."""
        row = head_dim + 4 if dtype == torch.int8 else head_dim * dtype.itemsize
        return 2 * num_layers * block_size * num_kv_heads * row

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """An int8 cache's K and V row scales of one layer; (None, None) for float32."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.quantized else (None, None)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one layer's k, v ([num_kv_heads, n, head_dim] float32) at `slots`; int8:
        quantized, a scale per (kv head, row). (The C glue writes through rope_store.)"""
        if not self.quantized:
            self.k[layer].index_copy_(1, slots, k)
            self.v[layer].index_copy_(1, slots, v)
            return
        for t, sc, x in ((self.k[layer], self.k_scale[layer], k), (self.v[layer], self.v_scale[layer], v)):
            q, d = quantize_rows(x)
            t.index_copy_(1, slots, q)
            sc.index_copy_(1, slots, d)

    def _slots(self, blocks: Sequence[int]) -> torch.Tensor:
        b = torch.as_tensor(list(blocks), dtype=torch.long, device=self.k[0].device)
        return (b[:, None] * self.block_size + torch.arange(self.block_size, device=b.device)).reshape(-1)

    def block(self, t: torch.Tensor, b: int) -> torch.Tensor:
        """Block b of one layer's K or V tensor: [num_kv_heads, block_size, head_dim]."""
        return t[:, b * self.block_size:(b + 1) * self.block_size]

    def _tensors(self, group: int | None) -> list[torch.Tensor]:
        """K then V of every layer, or of one group's layers (block ids are per group); an
        int8 cache's K then V scales after them."""
        if group is None or len(self.groups) == 1:
            return self.k + self.v + self.k_scale + self.v_scale
        layers = self.groups[group]
        return [t[li] for t in (self.k, self.v, self.k_scale, self.v_scale) if t for li in layers]

    def dtypes(self, group: int | None = None) -> list[torch.dtype]:
        """The dtype of each tensor read_blocks gives for the group, in its order."""
        return [t.dtype for t in self._tensors(group)]

    def zero(self, blocks: Sequence[int], group: int | None = None) -> None:
        self._fill(blocks, 0.0, group)

    def poison(self, blocks: Sequence[int], group: int | None = None) -> None:
        """Debug mode: fill freed blocks with NaN so that any read of them shows in outputs."""
        self._fill(blocks, float("nan"), group)

    def _fill(self, blocks: Sequence[int], value: float, group: int | None) -> None:
        slots = self._slots(blocks)
        for t in self._tensors(group):
            # int8 quants take 0; their scales the value (NaN scales read back as NaN).
            t.index_fill_(1, slots, value if t.is_floating_point() else 0)

    def copy_block(self, src: int, dst: int, group: int | None = None) -> None:
        for t in self._tensors(group):
            self.block(t, dst).copy_(self.block(t, src))

    def read_blocks(self, blocks: Sequence[int], group: int | None = None) -> list[torch.Tensor]:
        """Copies of the blocks' K and V, one tensor per layer (of the group) and kind (never
        views); int8: the K and V quants, then the K and V scales."""
        slots = self._slots(blocks)
        return [t.index_select(1, slots) for t in self._tensors(group)]

    def write_blocks(self, blocks: Sequence[int], data: Sequence[torch.Tensor],
                     group: int | None = None) -> None:
        slots = self._slots(blocks)
        for t, d in zip(self._tensors(group), data, strict=True):
            if d.dtype != t.dtype:
                raise ValueError(f"KV blocks of {d.dtype} for a cache of {t.dtype}")
            t.index_copy_(1, slots, d.to(t.device))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] float32 -> (int8 quants [..., d], float32 scales [...]), a scale per row:
    scale = max|x| / 127, q = round(clamp(x * (1 / scale), -127, 127)), nearest even. A row of
    zeros gets scale 0; a row with a NaN or an infinity scale NaN (and quants 0), so it reads
    back as NaN. The arithmetic of the C writer (layer_ops.c `quant_row`), bit for bit."""
    scale = x.abs().amax(dim=-1) / 127 + (x - x).sum(dim=-1)  # (x - x): 0, or NaN for NaN/inf
    ok = scale > 0
    inv = torch.where(ok, scale.reciprocal(), 0.0)
    q = (x * inv.unsqueeze(-1)).clamp_(-127, 127).round_()
    return torch.where(ok.unsqueeze(-1), q, 0.0).to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The values an int8 cache's rows read back as: q [..., d] times its row's scale [...],
    one rounding each (the C attention's load)."""
    return q.float() * scale.unsqueeze(-1)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """cache [hk, num_blocks, bs, d] -> [hk, len(blocks), bs, d]. index_select along dim 1
    is slow for many blocks (measured: 0.9 ms for 512 blocks against 0.36 ms one head at a
    time along dim 0), while one call is cheaper for a few. scale: an int8 cache's row scales
    [hk, num_blocks, bs]; the blocks then come back dequantized, float32."""
    if scale is not None:
        return dequantize(gather_blocks(cache, blocks), gather_blocks(scale, blocks))
    if blocks.numel() <= 64:
        return cache.index_select(1, blocks)
    out = cache.new_empty(cache.shape[0], blocks.numel(), *cache.shape[2:])
    for h in range(cache.shape[0]):
        torch.index_select(cache[h], 0, blocks, out=out[h])
    return out


class SwapSpace:
    """Host memory for swapped-out blocks, with its own block accounting. The KV manager
    holds each request's slots and gives them back when it ends."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_slots: list[int] = list(range(num_blocks - 1, -1, -1))
        self.data: dict[int, list[torch.Tensor]] = {}  # first slot of a request -> tensors

    def can_hold(self, n: int) -> bool:
        return n <= len(self.free_slots)

    def store(self, tensors: list[torch.Tensor], n: int) -> list[int]:
        """Keep `tensors` (fresh copies, as read_blocks gives them) in host memory: on the CPU
        as they are, from a GPU copied to the host."""
        slots = [self.free_slots.pop() for _ in range(n)]
        self.data[slots[0]] = [t.to("cpu") for t in tensors]
        return slots

    def load(self, slots: Sequence[int]) -> list[torch.Tensor]:
        return self.data[slots[0]]

    def free(self, slots: Sequence[int]) -> None:
        if not slots:
            return
        self.data.pop(slots[0], None)
        self.free_slots.extend(slots)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_slots)


def layer_groups(layer_windows: Sequence[int]) -> tuple[list[int], list[int]]:
    """The KV groups of a model's layers: (each layer's group, each group's window). Layers
    that attend to every position form group 0 and, if any layer has a window, each distinct
    window a group after it (Gemma 3: global layers, then local ones). A model whose layers
    share one window, or none, is one group ([]: every layer in group 0)."""
    windows = sorted(set(layer_windows)) or [0]
    if len(windows) == 1:
        return [], windows  # () windows: every layer attends to all
    at = {w: i for i, w in enumerate(windows)}
    return [at[w] for w in layer_windows], windows


def window_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The blocks a group of sliding window `window` needs for max_num_seqs requests at once
    (docs/sliding-window.md, the budget): each holds the blocks its window reads for its next
    query and for one in flight (async scheduling: w + 1 positions, at most
    (w + bs - 1) // bs + 1 blocks) and one more for a chunk's boundary; and the chunks of the
    step being planned and of the one in flight add at most max_num_batched_tokens positions
    each."""
    per_seq = (window + block_size - 1) // block_size + 2
    return max_num_seqs * per_seq + 2 * -(-max_num_batched_tokens // block_size)


def pool_sizes(cfg: EngineConfig, layers: Sequence[int], windows: Sequence[int], per_layer: int) -> list[int]:
    """Each layer group's pool size. layers: each group's layer count; windows: its window;
    per_layer: bytes of one block of one layer. A windowed group gets what its window needs
    (`window_blocks`, or cfg.window_pool_blocks), at most the global group's count; the
    groups without a window (the first) get the rest of the budget: cfg.num_blocks blocks
    (the global group's), or what is left of kv_cache_memory_gb. A model without a global
    group, or of one group, has num_blocks in every group (the budget split by layer
    counts), as has every group when the windows' share would exceed that."""
    budget = int(cfg.kv_cache_memory_gb * 2**30)
    if len(layers) == 1 or all(windows):
        return [cfg.num_blocks or max(1, budget // (per_layer * sum(layers)))] * len(layers)
    want = [(cfg.window_pool_blocks or window_blocks(w, cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens))
            if w else 0 for w in windows]
    if cfg.num_blocks:
        n = cfg.num_blocks
    else:
        global_layers = sum(n for n, w in zip(layers, windows, strict=True) if not w)
        rest = budget - sum(f * n * per_layer for f, n in zip(want, layers, strict=True))
        n = rest // (per_layer * global_layers)
        if n < max(want):  # too little for the windows' share: equal counts, as one group
            n = max(1, budget // (per_layer * sum(layers)))
    return [min(f, n) if w else n for f, w in zip(want, windows, strict=True)]


def make_cache(cfg: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int,
               layer_group: Sequence[int] | None = None, windows: Sequence[int] = ()
               ) -> tuple[list[BlockPool], KVCache, SwapSpace | None]:
    """A block pool per layer group (`layer_groups`, windows: each group's), the K/V tensors
    and host swap space (none when preemption only recomputes), sized by cfg and
    `pool_sizes`: a windowed group's pool by its window, the global group's by num_blocks
    or by what kv_cache_memory_gb holds besides. int8 (cfg.kv_cache_dtype): a block's bytes
    as int8 quants and scales."""
    dtype = torch.int8 if cfg.kv_cache_dtype == KVCacheDtype.INT8 else torch.float32
    per_layer = KVCache.bytes_per_block(1, cfg.block_size, num_kv_heads, head_dim, dtype)
    groups = max(layer_group, default=0) + 1 if layer_group else 1
    layers = [sum(1 for g in layer_group if g == gi) for gi in range(groups)] if layer_group else [num_layers]
    sizes = pool_sizes(cfg, layers, list(windows) or [0] * groups, per_layer)
    kv = KVCache(num_layers, sizes[0], cfg.block_size, num_kv_heads, head_dim, dtype, device=cfg.device,
                 layer_group=layer_group, group_blocks=sizes)
    pools = []
    for g, n in enumerate(sizes):
        pool = BlockPool(n, cfg.block_size)
        if cfg.debug:  # a freed block reads as NaN: a stale read fails loudly
            pool.on_garbage = kv.poison if len(kv.groups) == 1 else functools.partial(kv.poison, group=g)
        pools.append(pool)
    swap = None
    if cfg.preemption_mode is not PreemptionMode.RECOMPUTE:
        # A swapped request stores the live blocks of every group.
        swap = SwapSpace(cfg.swap_space_blocks or sum(sizes))
    return pools, kv, swap
