"""LoRA adapters: loading (PEFT directories, llama.cpp GGUF LoRA files), checking them against
the base model, the resident adapters' stacked weights (`Slots`), and adding their low-rank
delta to a step's rows.

An adapter's delta for a row x of a target module is `scale * B (A x)`, added to the base
linear's output of that row only, after the base linear ran over the whole step. At most
`--max-loras` adapters are resident: each in a slot of `Slots`, which stacks per fused linear
the slots' A (transposed, [slots, in, ranks]) and B^T ([slots, ranks, out]), zero-padded to the
widest resident rank, plus a scale per slot. A step names each row's slot (-1: the base model)
in `LoraRows`, and one C kernel (`csrc/lora.c`) adds every row's delta:

- `u[j] = x[0] * A[j, 0] + x[1] * A[j, 1] + ...` in that order, for each rank j;
- `y[n] = y[n] + scale * (u[j0] * B[n, j0] + u[j0 + 1] * B[n, j0 + 1] + ...)` over the ranks
  of the part (q, k, v; gate, up) whose outputs hold n, in rank order.

So a row's bits depend on its own input and slot only (batch invariance with adapters), never
on its neighbours or their adapters; the fused C decoder and the Python layer loops call the
same kernel, so both give the same bits. Where the C kernels are off, torch runs the same sums
per slot (`_apply_torch`), in torch's own fixed order.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stopline.model.config import ModelConfig

# HF module name -> (stopline's fused linear, which part of it, in order)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
# llama.cpp's tensor names for the same modules
_GGUF_TARGETS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                 "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}


class LoraError(ValueError):
    """An adapter that cannot be served with this base model; the message names the problem."""


MAX_PARTS = 3  # a fused linear's target modules: q, k, v of qkv


@dataclass
class Part:
    """One target module of one layer: rows [off, off + B.shape[0]) of its fused linear."""

    off: int
    a: torch.Tensor  # [r, in]
    bt: torch.Tensor  # [r, out]: B transposed, so each rank's column is one contiguous row


@dataclass
class Target:
    """An adapter's parts of one fused linear, their A stacked: the parts read the same input,
    so one product and one reduction give every part's u (each output its own reduction)."""

    a: torch.Tensor  # [sum of ranks, in]
    parts: list[Part]
    spans: list[tuple[int, int]]  # each part's rows of `a`


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    scale: float
    # (layer, fused linear name) -> its parts, in target order
    parts: dict[tuple[int, str], Target] = field(default_factory=dict)
    modules: tuple[str, ...] = ()


class LinearSlots:
    """One fused linear's slots: A transposed [slots, in, R], B^T [slots, R, out], zero-padded to
    R (the widest resident rank sum), and per slot its parts (MAX_PARTS x (rank end, first
    output, end output); all zero: the slot's adapter leaves this linear alone)."""

    def __init__(self, k: int, n: int, capacity: int, r: int) -> None:
        self.at = torch.zeros(capacity, k, r)
        self.bt = torch.zeros(capacity, r, n)
        self.parts = torch.zeros(capacity, MAX_PARTS, 3, dtype=torch.int32)

    @property
    def r(self) -> int:
        return self.at.shape[2]


class Slots:
    """The resident adapters' weights, stacked per fused linear of each layer. The engine
    (engine/adapters.py) decides which adapter sits in which slot; a linear no resident adapter
    targets has no entry. Buffers grow (slots, ranks) when an adapter needs more: `version`
    counts that, so the C decoder refreshes the pointers it keeps."""

    def __init__(self, config: ModelConfig, capacity: int) -> None:
        self.capacity = capacity
        self.names: list[str | None] = [None] * capacity
        self.scale = torch.zeros(capacity)
        self.linears: dict[tuple[int, str], LinearSlots] = {}
        self.version = 0
        sh = _shapes(config)
        self.dims = {"qkv": (sh["q_proj"][1], sh["q_proj"][0] + 2 * sh["k_proj"][0]),
                     "o": sh["o_proj"][::-1], "gate_up": (sh["gate_proj"][1], 2 * sh["gate_proj"][0]),
                     "down": sh["down_proj"][::-1]}  # (in, out) of each fused linear

    def index(self, name: str) -> int:
        """The slot of a resident adapter, or -1."""
        try:
            return self.names.index(name)
        except ValueError:
            return -1

    def _room(self, key: tuple[int, str], r: int) -> LinearSlots:
        cur = self.linears.get(key)
        if cur is not None and cur.r >= r:
            return cur
        k, n = self.dims[key[1]]
        # Every slot, whichever placed it: a row of any slot reads its parts here.
        new = LinearSlots(k, n, self.capacity, max(r, cur.r if cur else 0))
        if cur is not None:
            new.at[:, :, :cur.r] = cur.at
            new.bt[:, :cur.r] = cur.bt
            new.parts[:] = cur.parts
        self.linears[key] = new
        self.version += 1
        return new

    def place(self, slot: int, adapter: Adapter) -> None:
        """Copy an adapter's weights into a slot (between steps)."""
        self.clear(slot)
        for key, target in adapter.parts.items():
            r = target.a.shape[0]
            ls = self._room(key, r)
            ls.at[slot, :, :r] = target.a.t()
            row = 0
            for q, (p, (lo, hi)) in enumerate(zip(target.parts, target.spans, strict=True)):
                w = p.bt.shape[1]
                ls.bt[slot, lo:hi, p.off:p.off + w] = p.bt
                ls.parts[slot, q] = torch.tensor([hi, p.off, p.off + w], dtype=torch.int32)
                row = hi
            ls.parts[slot, len(target.parts):, 0] = row
        self.scale[slot] = adapter.scale
        self.names[slot] = adapter.name

    def clear(self, slot: int) -> None:
        """The slot holds no adapter: every linear skips its rows, its weights are zeroed."""
        for ls in self.linears.values():
            ls.at[slot].zero_()
            ls.bt[slot].zero_()
            ls.parts[slot].zero_()
        self.scale[slot] = 0.0
        self.names[slot] = None


@dataclass
class LoraRows:
    """A step's rows' adapter slots (int32 [rows], -1: the base model) and the slots."""

    slot: torch.Tensor
    slots: Slots


def _lib():  # -> the C kernels, or None where they are off
    from stopline.model.kernels.native import NativeUnavailable, kernels

    try:
        return kernels()
    except NativeUnavailable:
        return None


def apply(y: torch.Tensor, x: torch.Tensor, li: int, linear: str, lora: LoraRows | None) -> torch.Tensor:
    """The linear's output y ([rows, out]) for the step's inputs x ([rows, in]) with each
    adapter row's delta added (in place where y is contiguous); y itself when no resident
    adapter touches this linear."""
    ls = None if lora is None else lora.slots.linears.get((li, linear))
    if ls is None:
        return y
    lib = _lib()
    if lib is None:
        return _apply_torch(y, x, ls, lora)
    x, y = x.contiguous(), y.contiguous()
    slot = lora.slot
    if slot.dtype != torch.int32 or slot.shape[0] != x.shape[0] or y.shape[0] != x.shape[0]:
        raise ValueError(f"lora: {x.shape[0]} rows of x, {y.shape[0]} of y, slots {tuple(slot.shape)} {slot.dtype}")
    lib.stopline_lora_rows(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[0], slot.data_ptr(),
                           ls.at.data_ptr(), ls.bt.data_ptr(), ls.parts.data_ptr(), lora.slots.scale.data_ptr(),
                           ls.r, x.shape[1], y.shape[1])
    return y


def _apply_torch(y: torch.Tensor, x: torch.Tensor, ls: LinearSlots, lora: LoraRows) -> torch.Tensor:
    """apply() in torch ops, one slot's rows at a time: each reduction runs over a non-innermost
    axis, which torch vectorizes across outputs, never across the reduced axis."""
    slot = lora.slot.long()
    for s in sorted(set(slot.tolist()) - {-1}):
        parts = ls.parts[s].tolist()
        rank = parts[-1][0]
        if rank == 0:
            continue
        rows = (slot == s).nonzero()[:, 0]
        u = (x.index_select(0, rows)[:, :, None] * ls.at[s, :, :rank][None]).sum(1)  # [n, rank]
        ys = y.index_select(0, rows)
        j0 = 0
        for j1, lo, hi in parts:
            if j1 > j0:
                d = (u[:, j0:j1, None] * ls.bt[s, j0:j1, lo:hi][None]).sum(1)
                ys[:, lo:hi] = ys[:, lo:hi] + lora.slots.scale[s] * d
            j0 = j1
        y = y.index_copy(0, rows, ys)
    return y


def _shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each target module."""
    h, q, kv, i = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def _offsets(c: ModelConfig) -> dict[str, int]:
    s = _shapes(c)
    return {"q_proj": 0, "k_proj": s["q_proj"][0], "v_proj": s["q_proj"][0] + s["k_proj"][0], "o_proj": 0,
            "gate_proj": 0, "up_proj": s["gate_proj"][0], "down_proj": 0}


def build(name: str, path: str, config: ModelConfig, max_rank: int, scale: float,
          pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> Adapter:
    """An adapter from its (layer, HF module) -> (A [r, in], B [out, r]) pairs, checked
    against the base model's shapes and the rank limit."""
    if not pairs:
        raise LoraError(f"adapter {name!r}: no LoRA weights found in {path}")
    shapes, offsets = _shapes(config), _offsets(config)
    ranks = set()
    parts: dict[tuple[int, str], list[tuple[int, Part]]] = {}
    for (li, module), (a, b) in sorted(pairs.items()):
        if module not in TARGETS:
            raise LoraError(f"adapter {name!r}: target module {module!r} is not supported "
                            f"(supported: {', '.join(TARGETS)})")
        if not 0 <= li < config.num_layers:
            raise LoraError(f"adapter {name!r}: layer {li} of {module}; the base model has "
                            f"{config.num_layers} layers")
        out, inp = shapes[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != inp or b.shape[0] != out or b.shape[1] != r:
            raise LoraError(f"adapter {name!r}: layer {li} {module}: A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)} do not fit the base model's {module} of {inp} -> {out} "
                            f"(expected A [r, {inp}], B [{out}, r]): wrong base model?")
        if r > max_rank:
            raise LoraError(f"adapter {name!r}: rank {r} is over the limit of {max_rank} (--max-lora-rank)")
        ranks.add(r)
        linear, order = TARGETS[module]
        part = Part(offsets[module], a.float().contiguous(), b.float().t().contiguous())
        parts.setdefault((li, linear), []).append((order, part))
    modules = tuple(sorted({m for _, m in pairs}))
    targets = {}
    for k, v in parts.items():
        ordered = [p for _, p in sorted(v, key=lambda t: t[0])]
        ends = list(itertools.accumulate(p.a.shape[0] for p in ordered))
        targets[k] = Target(torch.cat([p.a for p in ordered]).contiguous(), ordered,
                            list(zip([0, *ends[:-1]], ends, strict=True)))
    return Adapter(name, path, max(ranks), scale, targets, modules)


_PEFT_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


def load_peft(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> Adapter:
    """A PEFT LoRA directory: adapter_config.json and adapter_model.safetensors."""
    d = Path(path)
    cfg_path, weights_path = d / "adapter_config.json", d / "adapter_model.safetensors"
    if not cfg_path.is_file():
        raise LoraError(f"adapter {name!r}: {cfg_path} not found (a PEFT adapter directory has "
                        "adapter_config.json and adapter_model.safetensors)")
    if not weights_path.is_file():
        raise LoraError(f"adapter {name!r}: {weights_path} not found")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"adapter {name!r}: adapter_config.json is not readable JSON: {exc}") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError(f"adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"),
                     ("rank_pattern", "per-module ranks (rank_pattern)"),
                     ("alpha_pattern", "per-module alphas (alpha_pattern)")):
        if cfg.get(key):
            raise LoraError(f"adapter {name!r}: {why} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"adapter {name!r}: bias {cfg.get('bias')!r} is not supported (only 'none')")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in TARGETS]
    if unknown:
        raise LoraError(f"adapter {name!r}: target modules {unknown} are not supported "
                        f"(supported: {', '.join(TARGETS)})")
    r, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", cfg.get("r", 8)))
    if r < 1:
        raise LoraError(f"adapter {name!r}: rank r={r} must be >= 1")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:
        raise LoraError(f"adapter {name!r}: adapter_model.safetensors is not readable: {exc}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _PEFT_KEY.match(key)
        if m is None:
            raise LoraError(f"adapter {name!r}: tensor {key!r} is not a LoRA weight of a supported "
                            f"target module (supported: {', '.join(TARGETS)})")
        halves.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    return build(name, str(d), config, max_rank, scale, _pairs(name, halves))


def _pairs(name: str, halves: dict[tuple[int, str], dict[str, torch.Tensor]]
           ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    pairs = {}
    for (li, module), ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: layer {li} {module} has lora_{''.join(ab)} without its pair")
        pairs[(li, module)] = (ab["A"], ab["B"])
    return pairs


def load_gguf(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> Adapter:
    """A llama.cpp LoRA GGUF (convert_lora_to_gguf.py): `blk.N.<tensor>.weight.lora_a` [r, in]
    and `.lora_b` [out, r], float32 or float16, scaled by `adapter.lora.alpha` / r. Q and K rows
    are stored permuted the way llama.cpp stores the base weights; they are permuted back."""
    import numpy as np
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:
        raise LoraError(f"adapter {name!r}: {path} is not a readable GGUF file: {exc}") from None

    def field_value(key: str) -> object:
        f = reader.fields.get(key)
        if f is None:
            return None
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types and f.types[0].name == "STRING" else v.tolist()[0]

    if field_value("general.type") != "adapter" or field_value("adapter.type") not in (None, "lora"):
        raise LoraError(f"adapter {name!r}: {path} is not a LoRA adapter GGUF")
    alpha = field_value("adapter.lora.alpha")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        m = re.match(r"blk\.(\d+)\.([a-z_]+)\.weight\.lora_([ab])$", t.name)
        if m is None or m.group(2) not in _GGUF_TARGETS:
            raise LoraError(f"adapter {name!r}: tensor {t.name!r} is not a LoRA weight of a supported "
                            f"target module (supported: {', '.join(_GGUF_TARGETS)})")
        if t.tensor_type.name not in ("F32", "F16"):
            raise LoraError(f"adapter {name!r}: tensor {t.name!r} is {t.tensor_type.name}; only F32/F16 load")
        shape = [int(s) for s in reversed(t.shape.tolist())]  # ggml lists dims innermost first
        arr = torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(shape))
        halves.setdefault((int(m.group(1)), _GGUF_TARGETS[m.group(2)]), {})[m.group(3).upper()] = arr
    pairs = _pairs(name, halves)
    for (li, module), (a, b) in list(pairs.items()):
        if module in ("q_proj", "k_proj"):  # llama.cpp permutes Q/K rows: B's rows are outputs
            heads = config.num_heads if module == "q_proj" else config.num_kv_heads
            if config.model_type == "llama":  # as the GGUF loader: Qwen's rows keep HF's order
                pairs[(li, module)] = (a, _unpermute(b, heads))
    ranks = {a.shape[0] for a, _ in pairs.values()}
    r = max(ranks) if ranks else 1
    scale = float(alpha) / r if alpha else 1.0
    return build(name, str(path), config, max_rank, scale, pairs)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's Q/K row permutation (per head: interleaved halves)."""
    out = w.shape[0]
    return w.reshape(heads, out // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> Adapter:
    """A PEFT directory or a GGUF LoRA file, by what `path` is."""
    p = Path(path)
    if p.is_dir():
        return load_peft(name, p, config, max_rank)
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf(name, p, config, max_rank)
    raise LoraError(f"adapter {name!r}: {path} is neither a PEFT adapter directory nor a .gguf file")
