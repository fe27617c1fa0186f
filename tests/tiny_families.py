"""Tiny random-weight models of the families beside Llama (Llama 3 rope, Qwen2, Qwen3, SmolLM3,
Mistral with a sliding window, Gemma 3), built with transformers' own classes, and GGUFs of
them written the way llama.cpp's convert_hf_to_gguf.py does.

Every weight HF initializes to a constant (norms, biases) is perturbed, so a norm or bias wired
to the wrong place shows up as a numerical mismatch against the oracle.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from tests.tiny_model import (
    BOS_ID,
    CHATML_TEMPLATE,
    EOS_ID,
    SPECIAL_TOKENS,
    _train_tokenizer,
    add_shape,
)

VOCAB = 512

# The families under test: HF model_type and the config beyond the shared tiny shape. Windows
# of 16 keys and prompts of up to 130 tokens: most rows see only part of their prefix.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("llama", {"rope_parameters": {
        # original 64 positions: of head_dim 16's 8 frequencies, 1 keeps its value, 2 are
        # smoothed and 5 divided by the factor.
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "smollm3": ("smollm3", {"no_rope_layers": [1, 0, 1]}),
    "mistral_window": ("mistral", {"sliding_window": 16}),
    "qwen2_window": ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
    "gemma3": ("gemma3_text", {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 16, "query_pre_attn_scalar": 24,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}}}),
    # llama.cpp's Gemma 3 layout: five sliding layers, then a global one.
    "gemma3_gguf": ("gemma3_text", {
        "num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "sliding_window": 16, "query_pre_attn_scalar": 16,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}}}),
}


def make_family_dir(path: str | Path, family: str, *, seed: int = 0, init_std: float = 0.2,
                    layers: int = 3, max_position: int = 1024) -> Path:
    """Write a random-weight HF directory of `family` (a key of FAMILIES) and return it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = FAMILIES[family]
    extra = dict(extra)
    layers = extra.pop("num_hidden_layers", layers)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_position,
        rms_norm_eps=1e-6, initializer_range=init_std, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        # Gemma ties its head in the wild, but a tiny tied Gemma (embeddings scaled by 8) only
        # repeats its input token; SmolLM3 covers the tied head.
        pad_token_id=EOS_ID, tie_word_embeddings=model_type == "smollm3", **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # Gemma's norms multiply by (1 + w) and start at 0; the others start at 1.
                base = 0.0 if model_type == "gemma3_text" else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(init_std * torch.randn(p.shape, generator=gen))
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, max_position)
    return path


def write_tokenizer(path: Path, max_position: int) -> None:
    """tokenizer.json and tokenizer_config.json as tests/tiny_model.py writes them."""
    _train_tokenizer(VOCAB).save(str(path / "tokenizer.json"))
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[EOS_ID],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position,
        "chat_template": CHATML_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GEMMA3_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(hf: str, arch: str) -> str:
    if hf in _GGUF_NAMES:
        return _GGUF_NAMES[hf]
    names = _GEMMA3_NAMES if arch == "gemma3" else _GGUF_LAYER_NAMES
    parts = hf.split(".")  # model.layers.{i}.<module...>.weight|bias
    return f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (Q/K rows to ggml's interleaved rope)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(head_dim: int, rope: dict[str, Any]) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: the rope_freqs tensor."""
    base, factor = rope.get("rope_theta", 10000.0), rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def sentencepiece_pieces(size: int) -> list[str]:
    """A Gemma-style vocabulary of `size` pieces: <pad> <eos> <bos> <unk>, the 256 byte tokens,
    runs of spaces as llama.cpp writes Gemma's (real spaces), then BPE pieces over
    U+2581-spelled text, in merge order (the order a Gemma GGUF lists them in)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    from tests.tiny_model import _CORPUS

    head = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256)), "  ", "   "]
    trainer = Tokenizer(models.BPE())
    trainer.normalizer = normalizers.Replace(" ", "\u2581")
    trainer.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    trainer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainers.BpeTrainer(
        vocab_size=4 * size, show_progress=False))
    learned = sorted(trainer.get_vocab().items(), key=lambda kv: kv[1])
    pieces = [p for p, _ in learned if p not in head]
    return (head + pieces)[:size]


def make_family_gguf(hf_dir: str | Path, out_path: str | Path, *, qtype: str = "F32",
                     sentencepiece: bool = False) -> Path:
    """Convert a tiny llama / qwen2 / qwen3 / gemma3_text HF dir to GGUF as convert_hf_to_gguf.py
    does: Llama's Q/K rows permuted (ggml's normal rope), the others' left alone (NEOX rope);
    Llama 3 rope as a rope_freqs tensor; Gemma's norms shifted by 1."""
    import gguf
    from safetensors.numpy import load_file

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    arch = {"gemma3_text": "gemma3"}.get(cfg["model_type"], cfg["model_type"])
    w = gguf.GGUFWriter(str(out_path), arch)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma3":  # Gemma3Model.set_gguf_parameters: the global layers' rope, the window
        rope = rope["full_attention"]
        w.add_sliding_window(cfg["sliding_window"])
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    add_shape(w, cfg, f"tiny-{arch}", head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))

    vocab: dict[str, int] = dict(tj["model"]["vocab"])
    added = {t["id"]: t for t in tj.get("added_tokens", [])}
    for i, t in added.items():
        vocab[t["content"]] = i
    n = cfg["vocab_size"]
    by_id = {i: s for s, i in vocab.items()}
    if sentencepiece:  # Gemma's published GGUFs: tokenizer.ggml.model "llama", no merges
        pieces = sentencepiece_pieces(n)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(pieces)
        w.add_token_scores([-float(i) for i in range(n)])
        w.add_token_types([gguf.TokenType.CONTROL if i < 4 else gguf.TokenType.BYTE if i < 260
                           else gguf.TokenType.NORMAL for i in range(n)])
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)
    else:
        _bpe_vocabulary(w, by_id, added, tj, n, arch, cfg)

    w.add_chat_template(CHATML_TEMPLATE)

    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, rope))
    quant = gguf.GGMLQuantizationType[qtype]
    for name, arr in weights.items():
        arr = arr.astype(np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):
            arr = arr + np.float32(1.0)  # Gemma3Model.norm_shift
        if arch == "llama" and name.endswith("q_proj.weight"):
            arr = _permute(arr, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            arr = _permute(arr, kv)
        if arr.ndim == 1 or quant == gguf.GGMLQuantizationType.F32:
            w.add_tensor(_gguf_name(name, arch), arr)
        else:
            w.add_tensor(_gguf_name(name, arch), gguf.quants.quantize(arr, quant), raw_dtype=quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def _bpe_vocabulary(w: Any, by_id: dict[int, str], added: dict[int, Any], tj: dict[str, Any], n: int,
                    arch: str, cfg: dict[str, Any]) -> None:
    """The tiny byte-level BPE, as llama.cpp writes one (Qwen's with its own split label)."""
    import gguf

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch in ("qwen2", "qwen3") else "gpt2")
    w.add_token_list([by_id.get(i, f"[PAD{i}]") for i in range(n)])
    w.add_token_types([(gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED)
                       if i in added else gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED
                       for i in range(n)])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
