"""Tiny random-weight Llama models for tests, built locally (no hub access).

`make_tiny_llama_dir` writes an HF directory (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json with a ChatML template) that both
stopline and transformers load. `make_tiny_gguf` turns such a directory into a llama.cpp-style
GGUF (Q/K rows permuted like convert_hf_to_gguf.py), optionally quantized.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

# ChatML, as SmolLM2-Instruct uses it (default system prompt when the first message isn't one).
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A template that thinks, as Qwen3's and DeepSeek-R1's do: the generation prompt opens the
# thinking (unless enable_thinking is false), and past assistant turns drop theirs.
THINK_TEMPLATE = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is not defined or enable_thinking %}{{ '<think>\n' }}{% endif %}{% endif %}"
)
THINK_TOKENS = ["<think>", "</think>"]  # ids 3 and 4 in a thinking model (added, not special)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 1, 2  # <|im_start|>, <|im_end|>: the SmolLM2 convention

# Training text for the tiny BPE: English, code, digits and some non-ASCII so that merges exist
# for all the kinds of input tests throw at it.
_CORPUS = """
The quick brown fox jumps over the lazy dog. The capital of France is Paris, and the capital
of Germany is Berlin. A language model predicts the next token given the previous tokens.
When a request is cancelled, the engine must release its blocks and never deliver another token.
Scheduling, preemption and recomputation are the hard parts of serving large language models.
Hello world! How are you today? I'm fine, thank you. They'll arrive at 10:30 on 2024-05-17.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
for i in range(10):
    print(i, i * i, {"key": [1, 2, 3]})
SELECT name, count(*) FROM users WHERE age >= 21 GROUP BY name ORDER BY 2 DESC;
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1000 65536 3.14159 2.71828 -17 +5 1e-5
café naïve résumé Zürich São Paulo Ελληνικά русский язык 日本語 中文 한국어 emoji 🎉 🚀 👍
The user asked a question and the assistant gave a helpful answer about the weather, the news,
music, science, history, mathematics, programming, cooking, travel, sports and many other topics.
Once upon a time there was a little robot who wanted to learn how to write poems and stories.
""" * 3


def _train_tokenizer(vocab_size: int, thinking: bool = False):  # -> tokenizers.Tokenizer
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} for a byte-level BPE")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
        + [AddedToken(t, special=False, normalized=False) for t in (THINK_TOKENS if thinking else ())],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    short = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if short > 0:
        # The corpus ran out of merges: pad so tokenizer and embedding sizes agree, which keeps
        # every id a random model can sample decodable.
        tok.add_tokens([AddedToken(f"<|reserved_{i}|>", normalized=False) for i in range(short)])
    return tok


def make_tiny_llama_dir(
    path: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_position: int = 1024,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
    init_std: float = 0.02,
    add_bos_token: bool = False,
    chat_template: str | None = CHATML_TEMPLATE,
    thinking: bool = False,
) -> Path:
    """Write a random-weight LlamaForCausalLM HF directory at `path` and return it.

    Deterministic for a given set of arguments. Token ids: 0 <|endoftext|>, 1 <|im_start|> (bos),
    2 <|im_end|> (eos), then the byte alphabet and learned merges. thinking: 3 <think> and
    4 </think> come before the alphabet, and the chat template thinks (THINK_TEMPLATE).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        max_position_embeddings=max_position,
        rope_theta=rope_theta,
        rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        # HF initializes norms to exactly 1; perturb them so a norm weight wired to the wrong
        # place shows up as a numerical mismatch.
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    model.eval()
    model.save_pretrained(path, safe_serialization=True)

    tok = _train_tokenizer(vocab_size, thinking)
    if thinking:
        chat_template = THINK_TEMPLATE
    tok.save(str(path / "tokenizer.json"))
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[EOS_ID],
        "add_bos_token": add_bos_token,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position,
    }
    if chat_template is not None:
        tcfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    return path


def permute_qk_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute` (HF rotate_half rows -> ggml interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    parts = hf_name.split(".")  # model.layers.{i}.<module...>.weight
    return f"blk.{parts[2]}.{_GGUF_LAYER_NAMES['.'.join(parts[3:-1])]}.weight"


def make_tiny_gguf(hf_dir: str | Path, out_path: str | Path, *, qtype: str = "F32",
                   pre: str = "gpt2", tokenizer_model: str = "gpt2") -> Path:
    """Convert a tiny HF Llama dir to GGUF the way llama.cpp's convert_hf_to_gguf.py does.

    qtype: "F32", "F16" or a gguf.quants type name such as "Q8_0" for the 2-D matrices (norms stay
    F32, like llama.cpp).
    """
    import gguf
    from safetensors.numpy import load_file

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    tcfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))

    w = gguf.GGUFWriter(str(out_path), "llama")
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    add_shape(w, cfg, "tiny-llama", head_dim)
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))

    # Tokenizer, as llama.cpp writes a byte-level BPE vocabulary.
    vocab: dict[str, int] = dict(tj["model"]["vocab"])
    added = {t["id"]: t for t in tj.get("added_tokens", [])}
    for i, t in added.items():
        vocab[t["content"]] = i
    n = cfg["vocab_size"]
    by_id = {i: s for s, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n)]
    types = []
    for i in range(n):
        if i in added:
            types.append(gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED)
        elif i in by_id:
            types.append(gguf.TokenType.NORMAL)
        else:
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(bool(tcfg.get("add_bos_token", False)))
    if tcfg.get("chat_template"):
        w.add_chat_template(tcfg["chat_template"])

    quant = gguf.GGMLQuantizationType[qtype]
    for name, arr in weights.items():
        arr = arr.astype(np.float32)
        if name.endswith("q_proj.weight"):
            arr = permute_qk_like_llama_cpp(arr, heads)
        elif name.endswith("k_proj.weight"):
            arr = permute_qk_like_llama_cpp(arr, kv)
        gname = gguf_tensor_name(name)
        if arr.ndim == 1 or quant == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, arr)
        elif quant == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, quant), raw_dtype=quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def add_shape(w: Any, cfg: dict, name: str, head_dim: int) -> None:
    """A GGUF's name and shape keys from an HF config.json, as llama.cpp's converter writes
    them (every family's writer in the tests shares them)."""
    w.add_name(name)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_rope_dimension_count(head_dim)
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])


def kquant_blocks(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K or Q6_K blocks [n, k / 256 * bytes] with finite f16 scales (gguf cannot
    quantize to the K-quants): every bit pattern of their quants and 6/8-bit scales is valid."""
    from stopline.model.kernels.quant_linear import SUPER

    rng = np.random.default_rng(seed)
    per, size = SUPER[fmt]
    raw = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    scales = (rng.standard_normal((n, k // per, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if fmt == "q4_k":  # d and dmin lead the block
        raw[..., 0:4] = scales.reshape(n, k // per, 4)
    else:  # d ends it
        raw[..., size - 2:] = scales[..., :2]
    return raw.reshape(n, -1)
