"""The Llama-family transformer over a flat batch of rows, reading and writing paged K/V.

One class runs every family (config.py names them): plain Llama through the C glue and the
fused C decoder where they run; the others (q/k/v biases, q/k norms, layers without rope,
sliding windows, Gemma 3's block) through the torch glue, which the C glue does not implement,
with either attention (each takes a layer's sliding window).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from stopline.config import AttentionBackend, Numerics
from stopline.kv.decode_rows import DecodeRows, RowPlan
from stopline.kv.kv_cache import KVCache, dequantize, gather_blocks, quantize_rows
from stopline.model.attention import attend, attend_rows
from stopline.model.attention import probe as attention_probe
from stopline.model.batch_invariant import InvariantLinear, rms_norm
from stopline.model.config import GELU_TANH, ModelConfig
from stopline.model.decoder_native import DecoderLoop
from stopline.model.kernels.bf16_linear import BF16Weight
from stopline.model.kernels.bf16_linear import resolve as fast_numerics
from stopline.model.kernels.int8_linear import Int8Weight, int8_ready
from stopline.model.kernels.layer_ops import add_rms_norm, rope_store, silu_mul
from stopline.model.kernels.paged_attention import PagedRows, paged_attention
from stopline.model.kernels.paged_attention import pick as pick_attention
from stopline.model.kernels.quant_linear import Blocks, QuantWeight, can_pack, from_raw_rows
from stopline.model.lora import Adapter, LoraRows, Slots
from stopline.model.lora import apply as lora_apply
from stopline.model.rope import layer_freqs, tables


class StepInterrupted(Exception):
    """Every request of the step was aborted; the forward stopped at a layer boundary."""


@dataclass
class PrefillSeq:
    row_start: int
    row_end: int
    blocks: torch.Tensor  # [nb] KV blocks of positions 0 .. the chunk's last row
    masked: torch.Tensor  # [rows, nb * block_size] bool: keys after the row (causal) or unwritten


@dataclass
class DecodeBatch:
    rows: torch.Tensor  # [B] row index of each decode
    all_rows: bool  # the step is decodes only, in row order
    # Either the decodes sit in DecodeRows (staged), or they gather their blocks (the rest).
    blocks: torch.Tensor | None = None  # [B, nb_max] KV blocks, padded with the zero block
    masked: torch.Tensor | None = None  # [B, 1, 1, nb_max * block_size] bool: keys past the end
    staged: RowPlan | None = None


@dataclass
class StepInputs:
    token_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    write_slots: torch.Tensor  # [N] where each row's K/V goes
    prefills: list[PrefillSeq]
    decode: DecodeBatch | None
    logit_rows: torch.Tensor  # rows whose next-token logits are needed
    # With the native attention: the keys of every row (prefills and decode are then unused).
    paged: PagedRows | None = None
    # LoRA: each row's adapter slot (model/lora.py); None: every row runs the base model.
    lora: LoraRows | None = None
    # Several KV layer groups (kv_cache.layer_groups): each group's inputs (write slots and
    # tables in its blocks; the first is this one); layer li reads groups[kv.layer_group[li]].
    groups: list[StepInputs] | None = None


def fast_weight(full: torch.Tensor, raw: dict[str, torch.Tensor]) -> BF16Weight | Int8Weight:
    """A fast-mode linear: block weights (raw: Q4_1, Q8_0, Q4_K or Q6_K blocks of `full`) on the
    int8 kernel where it runs, everything else on bf16 (which reads Q4_1/Q8_0 blocks for few rows,
    with the same bits as its bf16 copy). Fixed per weight at load, never by the row count."""
    if raw and int8_ready():
        fmt, blocks = next(iter(raw.items()))
        return Int8Weight.from_raw(fmt, blocks, full.shape[1])
    return BF16Weight.from_float(full, raw.get("q4_1"), q8_raw=raw.get("q8_0"))


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], *, max_rows: int,
                 max_logit_rows: int, device: str = "cpu", linear_backend: str = "auto",
                 blocks: Blocks | None = None, quant_max_rows: int = 0,
                 attention: AttentionBackend = AttentionBackend.TORCH,
                 numerics: Numerics = Numerics.EXACT) -> None:
        """max_rows: most rows a step carries; max_logit_rows: most rows that need logits;
        linear_backend: see `batch_invariant.pick_backend`; attention: see
        `paged_attention.pick` (the chosen one is `self.attention`); blocks: the GGML blocks of
        quantized weights, which batches of up to quant_max_rows rows read instead of the
        float32 weights (see quant_linear.py)."""
        self.config = config
        c = config
        self.group = c.num_heads // c.num_kv_heads
        self.scale = c.attention_scale or 1.0 / math.sqrt(c.head_dim)
        self.attention = pick_attention(attention, c.head_dim, device)

        def w(name: str) -> torch.Tensor:
            # A private copy: matmuls on tensors still backed by the safetensors mmap ran
            # about 4x slower here.
            return weights[name].to(device=device, dtype=torch.float32).clone()

        blocks = blocks if device == "cpu" and quant_max_rows > 0 else {}
        self.numerics = fast_numerics(numerics, device)

        def quant(names: tuple[str, ...]) -> QuantWeight | None:
            found = [blocks.get(n) for n in names]
            fmts = {f[0] for f in found if f is not None}
            if None in found or len(fmts) != 1:
                return None
            return from_raw_rows(fmts.pop(), [f[1] for f in found if f is not None],
                                 weights[names[0]].shape[1])

        def linear(*names: str, rows: int = max_rows) -> InvariantLinear:
            full = torch.cat([w(n) for n in names])
            if self.numerics is Numerics.FAST:
                found = [blocks.get(n) for n in names]
                raw = {}
                for fmt in ("q4_1", "q8_0", "q4_k", "q6_k"):
                    if all(f is not None and f[0] == fmt for f in found) and can_pack(fmt, *full.shape):
                        raw[fmt] = torch.cat([f[1] for f in found if f is not None])
                return InvariantLinear(full, rows, fast=fast_weight(full, raw))
            return InvariantLinear(full, rows, linear_backend,
                                   quant=quant(names), quant_max_rows=quant_max_rows)

        # LoRA adapters by name (model/lora.py): the engine loads and unloads them between
        # steps, and places the resident ones in lora_slots (its own, so that they outlive a
        # rebuilt network); a step's rows name their slots in StepInputs.lora.
        self.adapters: dict[str, Adapter] = {}
        self.lora_slots: Slots | None = None
        self.embed = w("model.embed_tokens.weight")
        # Gemma scales the embeddings by sqrt(hidden), rounded to float32 as its buffer is.
        self.embed_scale = torch.tensor(c.hidden_size ** 0.5) if c.gemma else None
        head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
        self.lm_head = linear(head, rows=max_logit_rows)

        # Gemma's norms multiply by (1 + w): the loaders hand over the multiplier (the HF loader
        # adds the 1, a GGUF has it added), so every norm weight here is what x is scaled by.
        self.final_norm = w("model.norm.weight")
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            layer: dict[str, InvariantLinear | torch.Tensor] = {
                "ln1": w(p + "input_layernorm.weight"),
                # Gemma: post_attention_layernorm normalizes the attention's output, and
                # pre_feedforward_layernorm is the MLP's input norm (Llama's ln2).
                "ln2": w(p + ("pre_feedforward_layernorm.weight" if c.gemma else "post_attention_layernorm.weight")),
                "qkv": linear(attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                "o": linear(attn + "o_proj.weight"),
                "gate_up": linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                "down": linear(p + "mlp.down_proj.weight"),
            }
            if c.attention_bias:
                layer["qkv_bias"] = torch.cat([w(attn + f"{x}_proj.bias") for x in "qkv"])
            if c.qk_norm:
                layer["q_norm"], layer["k_norm"] = w(attn + "q_norm.weight"), w(attn + "k_norm.weight")
            if c.gemma:
                layer["attn_out_norm"] = w(p + "post_attention_layernorm.weight")
                layer["mlp_out_norm"] = w(p + "post_feedforward_layernorm.weight")
            self.layers.append(layer)
        # One (cos, sin) table per distinct frequency set; None for a layer without rope.
        made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        freqs = layer_freqs(c)
        self.rope = [None if f is None else made.setdefault(id(f), tables(f, c.max_position, device))
                     for f in freqs]
        # The C glue and decoder read one table, which every layer of a plain Llama shares.
        self.cos, self.sin = next((t for t in self.rope if t is not None), (None, None))

    # With the C attention, run the layer glue in C too (layer_ops.py). Off only to measure
    # what it saves (bench/step_time.py --compare-glue).
    c_glue = True

    # All layers in one C call where every linear is quantized, or fast (decoder_native.py). Off only
    # to measure what it saves (bench/step_time.py --compare-layers).
    c_layers = True
    decoder: DecoderLoop | None = None  # set by calibrate() where it can run

    # Whether one row may run as itself: true when the quantized kernel serves every linear
    # (see calibrate); the GEMM libraries give one row other bits than two.
    one_row_ok = False

    def calibrate(self) -> None:
        """Probe every kernel's row invariance now (about 1.5 s for SmolLM2 on 2 cores) rather
        than inside the first request's time to first token."""
        linears = [v for v in (self.lm_head, *(v for layer in self.layers for v in layer.values()))
                   if isinstance(v, InvariantLinear)]
        for lin in linears:
            if lin.fast is None:
                lin.heights()
                lin.kc()  # each weight checks its own packing against the library once
        self.one_row_ok = all(lin.kc() is not None or lin.fast is not None for lin in linears)
        if self.attention is AttentionBackend.NATIVE and self.config.plain_llama and DecoderLoop.supports(self):
            self.decoder = DecoderLoop(self)
        rms_norm(self.embed[:2], self.final_norm, self.config.rms_norm_eps)
        if self.attention is AttentionBackend.TORCH:
            attention_probe(self.embed.device.type)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return (x * cos).add_(torch.roll(x, x.shape[-1] // 2, dims=-1).mul_(sin))

    def own_kernels(self, rows: int, logit_rows: int) -> bool:
        """Whether a step of `rows` rows (`logit_rows` of them through the LM head) runs all
        its linears on stopline's kernels: the fused decoder and the head's own kernel."""
        return (self.c_glue and self.c_layers and self.decoder is not None
                and self.decoder.can_run(rows, None) and self.lm_head.own_kernel(logit_rows))

    def forward(self, inp: StepInputs, kv: KVCache, interrupt: threading.Event | None = None,
                decode_rows: DecodeRows | None = None) -> torch.Tensor:
        """Run one step; returns float32 logits for inp.logit_rows. decode_rows: the buffers
        inp.decode.staged refers to, if any."""
        c = self.config
        x = self.embed.index_select(0, inp.token_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if inp.paged is not None and self.c_glue and c.plain_llama and inp.groups is None:
            # Rows with adapters too: both loops add the deltas with the same kernel.
            if (self.c_layers and self.decoder is not None
                    and self.decoder.can_run(x.shape[0], interrupt)):
                x, stopped = self.decoder.run(x, inp, kv, interrupt)
                if stopped is not None:
                    raise StepInterrupted(f"interrupted before layer {stopped}")
            else:
                x = self._layers_native(x, inp, inp.paged, kv, interrupt)
        else:
            x = self._layers_torch(x, inp, kv, interrupt, decode_rows)
        last = rms_norm(x.index_select(0, inp.logit_rows), self.final_norm, c.rms_norm_eps)
        return self.lm_head(last)

    @staticmethod
    def _linear(layer: dict, li: int, lora: LoraRows | None):  # -> (name, x) -> y
        """Layer li's linears, each with the adapters' deltas added to their rows."""
        if lora is None:
            return lambda name, x: layer[name](x)
        return lambda name, x: lora_apply(layer[name](x), x, li, name, lora)

    @staticmethod
    def _check(interrupt: threading.Event | None, li: int) -> None:
        if interrupt is not None and interrupt.is_set():
            raise StepInterrupted(f"interrupted before layer {li}")

    def _layers_native(self, x: torch.Tensor, inp: StepInputs, paged: PagedRows, kv: KVCache,
                       interrupt: threading.Event | None) -> torch.Tensor:
        """The layers with the C attention and glue (layer_ops.py): K/V go straight into the
        cache, and each residual add is fused with the norm after it."""
        c = self.config
        eps, res = c.rms_norm_eps, None
        for li, layer in enumerate(self.layers):
            self._check(interrupt, li)
            h = rms_norm(x, layer["ln1"], eps) if res is None else add_rms_norm(x, res, layer["ln1"], eps)
            lin = self._linear(layer, li, inp.lora)
            ks, vs = kv.scales(li)
            q = rope_store(lin("qkv", h), inp.positions, self.cos, self.sin, inp.write_slots,
                           kv.k[li], kv.v[li], c.num_heads, ks, vs)
            o = paged_attention(q, kv.k[li], kv.v[li], paged, kv.block_size, self.scale, 0, ks, vs)
            h = add_rms_norm(x, lin("o", o), layer["ln2"], eps)
            res = lin("down", silu_mul(lin("gate_up", h)))
        return x if res is None else x.add_(res)

    def _layers_torch(self, x: torch.Tensor, inp: StepInputs, kv: KVCache,
                      interrupt: threading.Event | None, decode_rows: DecodeRows | None) -> torch.Tensor:
        c = self.config
        n = inp.token_ids.shape[0]
        hq, hk, d = c.num_heads, c.num_kv_heads, c.head_dim
        rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by table, for this step's positions
        for t in self.rope:
            if t is not None and id(t) not in rope:
                rope[id(t)] = tuple(a.index_select(0, inp.positions)[:, None, :] for a in t)
        # For torch attention, the step's inputs with each window's keys masked too (the C
        # attention takes the window itself).
        groups = inp.groups or [inp]
        lg = kv.layer_group if inp.groups else [0] * len(self.layers)
        windowed: dict[tuple[int, int], StepInputs] = {}
        for li, wd in enumerate(c.layer_windows):
            if wd and inp.paged is None and (lg[li], wd) not in windowed:
                windowed[lg[li], wd] = self._windowed(groups[lg[li]], wd)
        act = (lambda g: F.gelu(g, approximate="tanh")) if c.hidden_act == GELU_TANH else F.silu
        for li, layer in enumerate(self.layers):
            self._check(interrupt, li)
            lin = self._linear(layer, li, inp.lora)
            h = rms_norm(x, layer["ln1"], c.rms_norm_eps)
            qkv = lin("qkv", h)
            if "qkv_bias" in layer:
                qkv = qkv + layer["qkv_bias"]
            qk = qkv[:, :(hq + hk) * d].reshape(n, hq + hk, d)
            if "q_norm" in layer:  # per head, before rope
                qk = torch.cat([rms_norm(qk[:, :hq], layer["q_norm"], c.rms_norm_eps),
                                rms_norm(qk[:, hq:], layer["k_norm"], c.rms_norm_eps)], dim=1)
            if self.rope[li] is not None:
                qk = self._rope(qk, *rope[id(self.rope[li])])
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hk) * d:].reshape(n, hk, d)
            gi = groups[lg[li]]  # this layer's group's slots and tables
            kv.store(li, gi.write_slots, k.transpose(0, 1), v.transpose(0, 1))
            o = lin("o", self._attention(li, q, k, v, windowed.get((lg[li], c.window(li)), gi), kv, decode_rows))
            if "attn_out_norm" in layer:
                o = rms_norm(o, layer["attn_out_norm"], c.rms_norm_eps)
            x = x + o
            h = rms_norm(x, layer["ln2"], c.rms_norm_eps)
            gu = lin("gate_up", h)
            inter = gu.shape[1] // 2
            m = lin("down", act(gu[:, :inter]) * gu[:, inter:])
            if "mlp_out_norm" in layer:
                m = rms_norm(m, layer["mlp_out_norm"], c.rms_norm_eps)
            x = x + m
        return x

    @staticmethod
    def _windowed(inp: StepInputs, window: int) -> StepInputs:
        """inp with the keys more than `window` positions behind each row masked too (HF's
        sliding window: a query at p sees the keys at p - window + 1 .. p). A key's index in
        the gathered blocks and in DecodeRows is its position."""
        if inp.paged is not None:
            raise RuntimeError("a sliding-window layer was given the C attention's inputs")

        def behind(masked: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            keys = torch.arange(masked.shape[-1], device=masked.device)
            return masked | (keys[None, :] <= pos[:, None] - window).view(pos.shape[0], *[1] * (masked.dim() - 2), -1)

        prefills = [replace(p, masked=behind(p.masked, inp.positions[p.row_start:p.row_end]))
                    for p in inp.prefills]
        dec = inp.decode
        if dec is not None and dec.staged is not None:
            st = dec.staged
            pos = torch.zeros(st.masked.shape[0], dtype=st.positions.dtype, device=st.positions.device)
            pos.index_copy_(0, st.rows, st.positions)  # an unused row keeps its one key
            dec = replace(dec, staged=replace(st, masked=behind(st.masked, pos)))
        elif dec is not None and dec.masked is not None:
            dec = replace(dec, masked=behind(dec.masked, inp.positions.index_select(0, dec.rows)))
        return replace(inp, prefills=prefills, decode=dec)

    def _attention(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   inp: StepInputs, kv: KVCache, decode_rows: DecodeRows | None) -> torch.Tensor:
        """Layer li's attention output [N, heads * d] for q [N, heads, d]; the step's k, v
        [N, kv_heads, d] are already in the cache."""
        if inp.paged is not None:  # the C attention under the torch glue (c_glue off, or not Llama)
            return paged_attention(q, kv.k[li], kv.v[li], inp.paged, kv.block_size, self.scale,
                                   self.config.window(li), *kv.scales(li))
        dec = inp.decode
        rows_kv = None
        ks, vs = kv.scales(li)
        if dec is not None and dec.staged is not None and decode_rows is not None:
            kd, vd = (k, v) if dec.all_rows else (k.index_select(0, dec.rows), v.index_select(0, dec.rows))
            if kv.quantized:  # the rows hold what the cache reads back
                kd, vd = dequantize(*quantize_rows(kd)), dequantize(*quantize_rows(vd))
            rows_kv = decode_rows.update(li, kv.k[li], kv.v[li], kd, vd, dec.staged, ks, vs)
        return self._torch_attention(q, inp, kv.k[li], kv.v[li], kv.block_size, rows_kv, ks, vs)

    def _torch_attention(self, q: torch.Tensor, inp: StepInputs, kc: torch.Tensor, vc: torch.Tensor,
                         bs: int, rows_kv: tuple[torch.Tensor, torch.Tensor] | None,
                         ks: torch.Tensor | None = None, vs: torch.Tensor | None = None) -> torch.Tensor:
        """kc, vc: one layer's cache, [hk, slots, d]; rows_kv: the decodes' K/V rows
        [used rows, hk, width, d] (views into wider buffers) when DecodeRows holds them. Gathered blocks keep heads first, so the
        keys enter the score GEMM as a transposed view, without a copy. ks, vs: an int8
        cache's row scales [hk, slots]: the gathered blocks come back dequantized."""
        n = q.shape[0]
        hk, g, d = self.config.num_kv_heads, self.group, self.config.head_dim
        kb = kc.view(hk, -1, bs, d)
        vb = vc.view(hk, -1, bs, d)
        kbs = None if ks is None else ks.view(hk, -1, bs)
        vbs = None if vs is None else vs.view(hk, -1, bs)
        out = q.new_empty(n, hk * g * d)
        for p in inp.prefills:
            rows, nb = p.row_end - p.row_start, p.blocks.shape[0]
            qs = q[p.row_start:p.row_end].view(rows, hk, g, d).permute(1, 0, 2, 3).reshape(hk, rows * g, d)
            keys = gather_blocks(kb, p.blocks, kbs).view(hk, nb * bs, d)
            vals = gather_blocks(vb, p.blocks, vbs).view(hk, nb * bs, d)
            masked = p.masked[:, None, :].expand(rows, g, nb * bs).reshape(rows * g, nb * bs)
            o = attend(qs, keys.transpose(1, 2), vals, masked, self.scale)  # [hk, rows * g, d]
            out[p.row_start:p.row_end] = o.view(hk, rows, g, d).permute(1, 0, 2, 3).reshape(rows, -1)
        dec = inp.decode
        if dec is not None:
            b = dec.rows.shape[0]
            qs = (q if dec.all_rows else q.index_select(0, dec.rows)).view(b, hk, g, d).transpose(0, 1)
            if dec.staged is not None:
                if rows_kv is None:
                    raise RuntimeError("the decodes were planned into DecodeRows, but the forward "
                                       "was not given them")
                keys, vals = rows_kv
                # Each decode's query goes to its row; the other rows' outputs are dropped.
                qr = qs.new_zeros(keys.shape[0], hk, g, d).index_copy_(0, dec.staged.rows, qs.transpose(0, 1))
                o = attend_rows(qr, keys.transpose(2, 3), vals, dec.staged.masked, self.scale)
                o = o.index_select(0, dec.staged.rows).transpose(0, 1)  # [hk, b, g, d]
            elif dec.blocks is not None and dec.masked is not None:
                nb = dec.blocks.shape[1]
                flat = dec.blocks.reshape(-1)
                keys = gather_blocks(kb, flat, kbs).view(hk, b, nb * bs, d)
                vals = gather_blocks(vb, flat, vbs).view(hk, b, nb * bs, d)
                masked = dec.masked.transpose(0, 1)  # [1, b, 1, ctx]
                o = attend(qs, keys.transpose(2, 3), vals, masked, self.scale)  # [hk, b, g, d]
            else:
                raise RuntimeError("a decode batch carries neither DecodeRows nor block tables")
            o = o.transpose(0, 1).reshape(b, -1)
            if dec.all_rows:
                return o
            out.index_copy_(0, dec.rows, o)
        return out

