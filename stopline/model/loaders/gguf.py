"""Read a llama.cpp GGUF file into HF-named float32 weights, a ModelConfig and a Tokenizer."""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from stopline.model.config import (
    GELU_TANH,
    SUPPORTED_GGUF_ARCHS,
    ModelConfig,
    UnsupportedModelError,
)
from stopline.model.kernels.quant_linear import (
    GGML_TYPES,
    GROUP,
    Q5_0,
    Q5_0_BYTES,
    Blocks,
    block_shape,
    q5_0_as_q8_0,
)
from stopline.model.loaders.weights_cache import as_float32
from stopline.tokenizer.tokenizer import Tokenizer

# GGUF tensor name -> HF name (Llama's, and Qwen's q/k norms); "{i}" is the layer index.
_LAYER_MAP = {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 names its four norms after llama.cpp's graph: ffn_norm is the MLP's input norm.
_GEMMA3_LAYER_MAP = {
    **_LAYER_MAP,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Llama 3 rope scaling, as convert_hf_to_gguf.py writes it: each frequency's divisor. Read into
# the config, not the weights.
ROPE_FREQS = "rope_freqs.weight"
# Qwen's q/k/v biases; a bias anywhere else has no place in the model.
_BIASES = frozenset({"attn_q", "attn_k", "attn_v"})


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """HF tensor name for a GGUF tensor name of `arch`; UnsupportedModelError if it has none."""
    if gguf_name in _GLOBAL_MAP:
        return _GLOBAL_MAP[gguf_name]
    layer_map = _GEMMA3_LAYER_MAP if arch == "gemma3" else _LAYER_MAP
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in layer_map and (m.group(3) == "weight" or m.group(2) in _BIASES):
        return f"model.layers.{m.group(1)}.{layer_map[m.group(2)]}.{m.group(3)}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no place in the model")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute()` of Q/K rows.

    The converter reorders each head's rows from HF's rotate_half layout (first half / second
    half of the head dim) to interleaved pairs for ggml's rope. For K, n_head is the number of
    KV heads.
    """
    rows = w.shape[0]
    if rows % (2 * n_head) != 0:
        raise ValueError(f"cannot unpermute a {w.shape} Q/K weight into {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute()` (HF layout -> GGUF layout); for tests/export."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF: name, ggml type, shape as numpy wants it ([out, in]) and raw bytes."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 view into the file mapping


@dataclass
class GGUFFile:
    """Parsed GGUF: metadata as Python values, tensor infos with zero-copy data views."""

    fields: dict[str, Any]
    tensors: list[GGUFTensorInfo]


# GGUF value types (gguf.GGUFValueType) -> numpy scalar types; 8 = string, 9 = array.
_SCALAR_TYPES: dict[int, np.dtype[Any]] = {
    0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"),
    4: np.dtype("<u4"), 5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("<u1"),
    10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8"),
}
_T_BOOL, _T_STRING, _T_ARRAY = 7, 8, 9


class _Cursor:
    """Little-endian reader over the mapped file, raising ValueError on truncation."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF (needs {n} bytes at offset {self.pos})")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self) -> str:
        return bytes(self.take(self.u64())).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _T_STRING:
            return self.string()
        if vtype == _T_ARRAY:
            etype, count = self.u32(), self.u64()
            if etype == _T_STRING:
                return [self.string() for _ in range(count)]
            if etype == _T_ARRAY:
                return [self.value(_T_ARRAY) for _ in range(count)]
            dt = self._dtype(etype)
            arr = np.frombuffer(self.take(dt.itemsize * count), dtype=dt)
            return arr.astype(bool).tolist() if etype == _T_BOOL else arr.tolist()
        dt = self._dtype(vtype)
        v = np.frombuffer(self.take(dt.itemsize), dtype=dt)[0].item()
        return bool(v) if vtype == _T_BOOL else v

    def _dtype(self, vtype: int) -> np.dtype[Any]:
        if vtype not in _SCALAR_TYPES:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at offset {self.pos}")
        return _SCALAR_TYPES[vtype]


def read_gguf(path: Path) -> GGUFFile:
    """Parse a GGUF (v2/v3, little-endian) header, metadata and tensor table.

    Our own parser rather than gguf.GGUFReader: the reader builds a numpy memmap view per vocab
    string (~100k of them), which takes several seconds; this takes well under one. Tensor data
    stays in the file mapping until dequantized.
    """
    import gguf

    with open(path, "rb") as f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # empty file
            raise ValueError(f"{path} is not a GGUF file (empty)") from e
    buf = memoryview(mm)
    cur = _Cursor(buf, path)
    if bytes(cur.take(4)) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (bad magic)")
    version = cur.u32()
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or 3, little-endian)")
    n_tensors, n_kv = cur.u64(), cur.u64()
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        fields[key] = cur.value(cur.u32())
    infos: list[tuple[str, int, tuple[int, ...], int]] = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.u32()
        dims = tuple(cur.u64() for _ in range(n_dims))
        ggml_type, offset = cur.u32(), cur.u64()
        infos.append((name, ggml_type, tuple(reversed(dims)), offset))
    align = int(fields.get("general.alignment", 32))
    data_start = (cur.pos + align - 1) // align * align
    whole = np.frombuffer(buf, dtype=np.uint8)
    tensors = []
    for name, ggml_type, shape, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(ggml_type)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError) as e:
            raise UnsupportedModelError(f"{path}: tensor {name} has unknown ggml type {ggml_type}") from e
        n_elems = math.prod(shape)
        n_bytes = n_elems // block * type_size
        start = data_start + offset
        if start + n_bytes > len(whole):
            raise ValueError(f"{path}: truncated GGUF (tensor {name} runs past the end of the file)")
        tensors.append(GGUFTensorInfo(name, ggml_type, shape, whole[start:start + n_bytes]))
    return GGUFFile(fields=fields, tensors=tensors)


def dequantize(t: GGUFTensorInfo) -> np.ndarray:
    """float32 array of shape `t.shape` for any type gguf.quants can dequantize."""
    import gguf

    qtype = gguf.GGMLQuantizationType(t.ggml_type)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                 gguf.GGMLQuantizationType.BF16):
        raw = t.data
    else:
        if t.shape[-1] % block != 0:
            raise ValueError(f"tensor {t.name}: row of {t.shape[-1]} is not a multiple of {qtype.name} blocks")
        raw = t.data.reshape(*t.shape[:-1], t.shape[-1] // block * type_size)
    try:
        arr = gguf.quants.dequantize(raw, qtype)
    except NotImplementedError as e:
        raise UnsupportedModelError(f"GGUF tensor {t.name}: {e}") from e
    return np.asarray(arr, dtype=np.float32).reshape(t.shape)


def _round_f32(x: float) -> float:
    """GGUF stores eps/theta as float32; take the shortest decimal that round-trips (1e-05, not
    9.999999747378752e-06) so exported configs read like the originals."""
    return float(str(np.float32(x)))


def _check_arch(fields: dict[str, Any]) -> str:
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise UnsupportedModelError(
            f"GGUF general.architecture={arch!r} is not supported; stopline runs these GGUF "
            f"architectures: {sorted(SUPPORTED_GGUF_ARCHS)}"
        )
    return str(arch)


def _config_from_fields(fields: dict[str, Any], tensor_names: set[str], tokenizer: Tokenizer,
                        rope_factors: tuple[float, ...] = ()) -> ModelConfig:
    arch = _check_arch(fields)

    def get(key: str, default: Any = None, *, required: bool = False) -> Any:
        v = fields.get(f"{arch}.{key}")
        if v is None:
            if required:
                raise ValueError(f"GGUF is missing required metadata {arch}.{key}")
            return default
        return v

    kind = get("rope.scaling.type")
    scaling: tuple[tuple[str, Any], ...] = ()
    if kind == "linear":
        scaling = (("factor", float(get("rope.scaling.factor", required=True))), ("rope_type", "linear"))
    elif kind not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported")
    if get("expert_count", 0):
        raise UnsupportedModelError("GGUF is a mixture-of-experts model; only dense models are supported")
    layers = int(get("block_count", required=True))
    windows: tuple[int, ...] = ()
    window = get("attention.sliding_window")
    if window and arch != "gemma3":
        raise UnsupportedModelError(f"GGUF sliding-window attention is not supported for {arch}")
    if arch == "gemma3":
        # llama.cpp: every 6th layer global unless the file says otherwise (a period or a flag a layer).
        pattern = get("attention.sliding_window_pattern", 6)
        local = ([bool(f) for f in pattern] if isinstance(pattern, list)
                 else [(i + 1) % int(pattern) != 0 for i in range(layers)])
        if len(local) != layers:
            raise ValueError(f"GGUF sliding_window_pattern names {len(local)} of {layers} layers")
        windows = tuple(int(window) if f else 0 for f in local)
    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    head_dim = int(get("attention.key_length", hidden // heads))
    rot = get("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise UnsupportedModelError(f"partial rotary (rope dims {rot} of head_dim {head_dim}) is not supported")
    vocab = get("vocab_size") or len(fields.get("tokenizer.ggml.tokens") or ())
    gemma = arch == "gemma3"
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", required=True)),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=_round_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_round_f32(get("rope.freq_base", 10000.0)),
        max_position=int(get("context_length", 2048)),
        # llama.cpp ties the output projection exactly when the file has no output.weight.
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        model_type="gemma3_text" if gemma else arch,
        rope_scaling=scaling,
        rope_freq_factors=rope_factors,
        # llama.cpp's sliding layers rope with base 10000 unless the file names one.
        local_rope_theta=_round_f32(get("rope.freq_base_swa", 10000.0)) if any(windows) else 0.0,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        layer_windows=windows if any(windows) else (),
        hidden_act=GELU_TANH if gemma else "silu",
        # llama.cpp's Gemma 3 scale: 1/sqrt(head_dim), but 1/sqrt(hidden/heads) for 27B (62 layers),
        # as query_pre_attn_scalar says in its HF config.
        attention_scale=(hidden / heads if layers == 62 else head_dim) ** -0.5 if gemma else 0.0,
    )


def raw_blocks(t: GGUFTensorInfo) -> tuple[str, np.ndarray] | None:
    """(format, [rows, bytes] copy of the GGML blocks) for a 2-D tensor in a format the
    quantized-weight kernels read (see quant_linear.py), else None. Q5_0 comes back as the
    Q8_0 blocks of the same weights."""
    if t.ggml_type == Q5_0 and len(t.shape) == 2 and t.shape[1] % GROUP == 0:
        return "q8_0", q5_0_as_q8_0(t.data.reshape(t.shape[0], t.shape[1] // GROUP * Q5_0_BYTES))
    fmt = GGML_TYPES.get(t.ggml_type)
    if fmt is None or len(t.shape) != 2:
        return None
    per, size = block_shape(fmt)
    if t.shape[1] % per:
        return None
    return fmt, np.array(t.data.reshape(t.shape[0], t.shape[1] // per * size))


def load_gguf(
    path: Path, *, progress: bool = True, desc: str | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, Blocks]:
    """Parse, dequantize and unpermute a GGUF. Returns (config, HF-named float32 weights,
    tokenizer, the GGML blocks of the weights the quantized kernel can read, rows in the
    same order as the float32 weights)."""
    gf = read_gguf(path)
    _check_arch(gf.fields)  # before the tokenizer, whose errors would hide the real problem
    tokenizer = Tokenizer.from_gguf_fields(gf.fields)
    factors = tuple(float(f) for t in gf.tensors if t.name == ROPE_FREQS for f in dequantize(t).reshape(-1))
    tensors = [t for t in gf.tensors if t.name != ROPE_FREQS]
    config = _config_from_fields(gf.fields, {t.name for t in tensors}, tokenizer, factors)
    names = [hf_name(t.name, str(gf.fields["general.architecture"])) for t in tensors]  # fail early
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ValueError(f"{path}: several GGUF tensors map to {sorted(dupes)}")

    def convert(item: tuple[str, GGUFTensorInfo]) -> tuple[str, torch.Tensor, tuple[str, np.ndarray] | None]:
        name, t = item
        arr, raw = dequantize(t), raw_blocks(t)
        # llama.cpp permutes Llama's Q/K rows for its normal rope; Qwen's (NEOX rope) keep HF's.
        heads = {"q_proj.weight": config.num_heads, "k_proj.weight": config.num_kv_heads}
        for suffix, n in heads.items() if config.model_type == "llama" else ():
            if name.endswith(suffix):
                arr = unpermute_qk(arr, n)
                if raw is not None:  # the permutation moves whole rows, blocks and all
                    raw = raw[0], unpermute_qk(raw[1], n)
        return name, as_float32(arr), raw

    weights: dict[str, torch.Tensor] = {}
    blocks: Blocks = {}
    bar = tqdm(total=len(names), desc=desc or f"dequantizing {path.name}", unit="tensor",
               file=sys.stderr, disable=not progress, leave=False)
    # numpy releases the GIL in the dequantization kernels, so threads help on multi-core hosts.
    workers = max(1, min(8, os.cpu_count() or 1))
    with bar, ThreadPoolExecutor(max_workers=workers) as pool:
        for name, tensor, raw in pool.map(convert, zip(names, tensors, strict=True)):
            weights[name] = tensor
            if raw is not None:
                blocks[name] = raw[0], torch.from_numpy(np.ascontiguousarray(raw[1]))
            bar.update(1)
    return config, weights, tokenizer, blocks
