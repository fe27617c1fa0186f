"""All decoder layers of a step in one C call (`csrc/decoder.c`), where every linear of every
layer runs on the quantized kernel (a GGUF model's decode and small mixed steps on CPU), or,
in the fast numerics mode, on the bf16 kernels (every step: they take any row count).

The Python loop (`LlamaModel._layers_native`) makes nine kernel calls a layer, each with
4-10 us of wrapper, ctypes and allocation: ~2 ms a step at 11 rows (cProfile). The C loop
calls the same kernels in the same order on the same buffers, so a row's bits are the same
either way (tests/test_decoder_native.py compares the two).

An abort that empties the step must still stop it at the next layer boundary: the C loop
cannot see a `threading.Event`, so the engine's event is a `StepInterrupt`, which mirrors
its state in an int32 the loop reads before each layer.
"""

from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING

import torch

from stopline.model.kernels.bf16_linear import BF16Weight
from stopline.model.kernels.int8_linear import Int8Weight
from stopline.model.kernels.native import kernels

if TYPE_CHECKING:
    from stopline.kv.kv_cache import KVCache
    from stopline.model.llama import LlamaModel, StepInputs

_P = ctypes.c_void_p
_LINEARS = ("qkv", "o", "gate_up", "down")
_FMT = {"q4_1": 0, "q8_0": 1}
_FAST = 2  # a BF16Weight
_INT8 = {"q4_1": 3, "q8_0": 4}  # an Int8Weight's blocks


class StepInterrupt(threading.Event):
    """A threading.Event whose state C code can read (`flag`, an int32 tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.flag = torch.zeros(1, dtype=torch.int32)

    def set(self) -> None:
        self.flag[0] = 1
        super().set()

    def clear(self) -> None:
        super().clear()
        self.flag[0] = 0


class Layer(ctypes.Structure):
    _fields_ = [("w", _P * 4), ("fmt", ctypes.c_int32 * 4), ("kc", ctypes.c_int32 * 4),
                ("ln1", _P), ("ln2", _P), ("k_cache", _P), ("v_cache", _P),
                ("bf", _P * 4), ("q4", _P * 4), ("q4_max", ctypes.c_int32 * 4), ("amx", ctypes.c_int32 * 4),
                # LoRA slots of each linear (model/lora.py LinearSlots); null: no resident
                # adapter touches it
                ("lora_at", _P * 4), ("lora_bt", _P * 4), ("lora_parts", _P * 4), ("lora_r", ctypes.c_int32 * 4),
                # an int8 KV cache's row scales (kv_cache.py); null: a float32 cache
                ("k_scale", _P), ("v_scale", _P)]


class Step(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in
                ("rows", "hidden", "heads", "kv_heads", "d", "inter", "bs", "max_keys")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("slots", ctypes.c_int64)] + \
               [(name, _P) for name in ("positions", "write_slots", "cos", "sin", "nkeys", "table_at",
                                        "tables", "h", "qkv", "q", "attn", "o", "gu", "act", "res",
                                        "interrupt", "xb", "linear_s", "q8x", "q8d", "q8ds", "q8s",
                                        "lora_slot", "lora_scale")]


class DecoderLoop:
    """One model's layer table for the C loop, built once per KV cache."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.fast = model.layers[0]["qkv"].fast is not None
        kinds = {type(layer[name].fast) for layer in model.layers for name in _LINEARS}
        self.bf16 = BF16Weight in kinds  # the kinds of buffer a step needs for its inputs
        self.int8 = Int8Weight in kinds
        # The bf16 kernels take any row count; the quantized one only up to quant_max_rows.
        self.max_rows = 1 << 30 if self.fast else min(model.layers[0][name].quant_max_rows for name in _LINEARS)
        self._tables: dict[tuple[int, int], ctypes.Array] = {}
        self._kv: KVCache | None = None  # the cache whose pointers the table holds, kept alive
        self._idle = StepInterrupt()  # for calls without an event: never set
        # float64 [1] the C loop adds its linears' seconds to, while a benchmark sets it.
        self.linear_s: torch.Tensor | None = None
        self._fn = kernels().stopline_decoder_layers
        self.lora_steps = 0  # steps with adapter rows that ran here (tests, benchmarks)

    @staticmethod
    def supports(model: LlamaModel) -> bool:
        """Whether every linear of every layer has a quantized weight whose kc matched, or every
        one a fast-mode bf16 weight with K even and N a multiple of 32 (no padding to cut)."""
        lins = [layer[name] for layer in model.layers for name in _LINEARS]
        if all(lin.fast is not None for lin in lins):
            return all(lin.in_features % 2 == 0 and lin.out_features % 32 == 0 for lin in lins) and all(
                lin.fast.fmt in _INT8 for lin in lins if isinstance(lin.fast, Int8Weight))
        return all(lin.quant is not None and lin.quant.fmt in _FMT and lin.kc() is not None for lin in lins)

    def _table(self, kv: KVCache) -> ctypes.Array:
        # Keyed by the tensors' allocation too: a cache that slept and woke up (engine-stops.md)
        # holds new tensors under the same object (some perhaps at their old addresses, others
        # not: keying on one address read freed scales of an int8 cache); and by the LoRA
        # slots' buffers, which grow.
        slots = self.model.lora_slots
        key = (id(kv), kv.generation, id(slots), slots.version if slots is not None else 0)
        table = self._tables.get(key)
        if table is None:
            table = (Layer * len(self.model.layers))()
            for li, layer in enumerate(self.model.layers):
                t = table[li]
                for j, name in enumerate(_LINEARS):
                    lin = layer[name]
                    if isinstance(lin.fast, Int8Weight):
                        t.fmt[j], t.w[j] = _INT8[lin.fast.fmt], lin.fast.packed.data_ptr()
                        continue
                    if lin.fast is not None:
                        f = lin.fast
                        t.fmt[j], t.bf[j], t.amx[j] = _FAST, f.packed.data_ptr(), int(f.amx)
                        t.q4[j], t.q4_max[j] = (f.q4.data_ptr(), f.q4_max_rows) if f.q4 is not None else (None, 0)
                        continue
                    t.w[j], t.fmt[j], t.kc[j] = lin.quant.packed.data_ptr(), _FMT[lin.quant.fmt], lin.kc()
                for j, name in enumerate(_LINEARS):
                    ls = slots.linears.get((li, name)) if slots is not None else None
                    if ls is not None:
                        t.lora_at[j], t.lora_bt[j] = ls.at.data_ptr(), ls.bt.data_ptr()
                        t.lora_parts[j], t.lora_r[j] = ls.parts.data_ptr(), ls.r
                t.ln1, t.ln2 = layer["ln1"].data_ptr(), layer["ln2"].data_ptr()
                t.k_cache, t.v_cache = kv.k[li].data_ptr(), kv.v[li].data_ptr()
                if kv.quantized:
                    t.k_scale, t.v_scale = kv.k_scale[li].data_ptr(), kv.v_scale[li].data_ptr()
            self._tables, self._kv = {key: table}, kv  # one cache at a time
        return table

    def can_run(self, rows: int, interrupt: threading.Event | None) -> bool:
        """Rows within every linear's kernel's range, and an interrupt the loop can read."""
        return rows <= self.max_rows and (interrupt is None or isinstance(interrupt, StepInterrupt))

    def run(self, x: torch.Tensor, inp: StepInputs, kv: KVCache,
            interrupt: threading.Event | None) -> tuple[torch.Tensor, int | None]:
        """Run every layer on x ([rows, hidden], contiguous, updated in place). Returns x
        and None, or x and the layer the interrupt stopped it before."""
        m, c = self.model, self.model.config
        flag = interrupt.flag if isinstance(interrupt, StepInterrupt) else self._idle.flag
        n, paged = x.shape[0], inp.paged
        qkv_width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        hd = c.num_heads * c.head_dim
        inter = c.intermediate_size
        bufs = {name: torch.empty(n, width) for name, width in
                (("h", c.hidden_size), ("qkv", qkv_width), ("q", hd), ("attn", hd), ("o", c.hidden_size),
                 ("gu", 2 * inter), ("act", inter), ("res", c.hidden_size))}
        # A fast linear's input as bf16, or as int8 with its groups' scales (unused in exact mode).
        widest = max(c.hidden_size, hd, inter)
        xb = torch.empty(n * widest if self.bf16 else 1, dtype=torch.bfloat16)
        q8x = torch.empty(n * widest if self.int8 else 1, dtype=torch.int8)
        q8d, q8ds = (torch.empty(n * widest // 32 if self.int8 else 1) for _ in range(2))
        q8s = torch.empty(n * widest // 32 if self.int8 else 1, dtype=torch.int32)
        positions, slots = inp.positions.contiguous(), inp.write_slots.contiguous()
        lora = inp.lora
        if lora is not None:
            if lora.slots is not m.lora_slots or lora.slot.dtype != torch.int32 or lora.slot.shape[0] != n:
                raise ValueError("the step's LoRA rows do not name the model's slots, one int32 per row")
            self.lora_steps += 1
        step = Step(rows=n, hidden=c.hidden_size, heads=c.num_heads, kv_heads=c.num_kv_heads,
                    d=c.head_dim, inter=inter, bs=kv.block_size, max_keys=paged.max_keys,
                    eps=c.rms_norm_eps, scale=m.scale, slots=kv.k[0].shape[1],
                    positions=positions.data_ptr(), write_slots=slots.data_ptr(),
                    cos=m.cos.data_ptr(), sin=m.sin.data_ptr(), nkeys=paged.nkeys.data_ptr(),
                    table_at=paged.table_at.data_ptr(), tables=paged.tables.data_ptr(),
                    interrupt=flag.data_ptr(), xb=xb.data_ptr(), q8x=q8x.data_ptr(), q8d=q8d.data_ptr(),
                    q8ds=q8ds.data_ptr(), q8s=q8s.data_ptr(),
                    linear_s=None if self.linear_s is None else self.linear_s.data_ptr(),
                    lora_slot=None if lora is None else lora.slot.data_ptr(),
                    lora_scale=None if lora is None else lora.slots.scale.data_ptr(),
                    **{k: v.data_ptr() for k, v in bufs.items()})
        ran = ctypes.c_int(0)
        rc = self._fn(ctypes.addressof(self._table(kv)), len(m.layers), ctypes.addressof(step),
                      x.data_ptr(), ctypes.addressof(ran))
        if rc == 2:
            raise MemoryError("paged attention could not allocate its scratch memory")
        return x, (ran.value if rc == 1 else None)
