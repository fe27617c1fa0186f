"""The families beside plain Llama, each a tiny random-weight model made by transformers, held to
HF transformers' greedy output token for token (exact numerics) and to batch invariance.

Per family: each prompt alone, then all of them in one batch with a prefill budget of 7 tokens
a step and a pool small enough to preempt, on both attention backends (the C one where its
kernels build); and 24 requests at once, each with the tokens it gets alone. An ablation (the HF model without the family's feature) must change the
reference, so a model that ignored the feature would fail.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from stopline import LLM, FinishReason
from stopline.errors import UnsupportedModelError
from stopline.model.config import ModelConfig
from stopline.model.kernels.paged_attention import supports as native_attention
from stopline.model.loaders.loader import export_hf_dir, load_model
from stopline.model.rope import inv_freq
from tests.engine_support import (
    MIN_MARGIN_TINY,
    assert_idle,
    greedy,
    hf_greedy,
    load_hf,
    random_prompts,
)
from tests.tiny_families import FAMILIES, make_family_dir, make_family_gguf

MAX_NEW = 24
LENGTHS = [1, 5, 17, 33, 64, 100, 130, 9, 40]
GGUF_FAMILIES = ["llama3", "qwen2", "qwen3", "gemma3_gguf"]

# What each family's test takes away from the HF model (config.json changes) to show the feature
# matters. As Llama, a Qwen checkpoint's biases or q/k norms are left unread.
AS_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
ABLATIONS: dict[str, dict] = {
    "llama3": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "qwen2": AS_LLAMA,
    "qwen3": AS_LLAMA,
    "smollm3": {"no_rope_layers": [1, 1, 1]},
    "mistral_window": {"sliding_window": None},
    "qwen2_window": {"layer_types": ["full_attention"] * 3},
    "gemma3": {"layer_types": ["full_attention"] * 3},
    "gemma3_gguf": {"layer_types": ["full_attention"] * 6},
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(len(LENGTHS), LENGTHS, seed=3)


_dirs: dict[str, Path] = {}
_refs: dict[str, list[list[int]]] = {}


def family_dir(factory: pytest.TempPathFactory, family: str) -> Path:
    if family not in _dirs:
        _dirs[family] = make_family_dir(factory.mktemp(family), family)
    return _dirs[family]


def reference(factory: pytest.TempPathFactory, family: str, prompts: list[list[int]]) -> list[list[int]]:
    if family not in _refs:
        ref = hf_greedy(load_hf(family_dir(factory, family)), prompts, MAX_NEW)
        ref.check_meaningful(MIN_MARGIN_TINY)
        # A model that repeats one token would match almost any buggy engine.
        assert all(len(set(t)) >= MAX_NEW // 3 for t in ref.tokens), ref.tokens
        _refs[family] = ref.tokens
    return _refs[family]


def _engine(model, **kw) -> LLM:
    kw.setdefault("num_blocks", 1024)
    kw.setdefault("block_size", 4)
    return LLM(model=model, progress=False, debug=True, target_step_ms=None, **kw)


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for res in llm.generate(prompts, greedy(MAX_NEW)):
        c = res.outputs[0]
        assert c.finish_reason is FinishReason.LENGTH, (c.finish_reason, c.stop_detail)
        out.append(c.token_ids)
    return out


def _windowed(family: str) -> bool:
    return family in ("mistral_window", "qwen2_window", "gemma3", "gemma3_gguf")


def _backends() -> list[str]:
    return ["torch"] if native_attention(16, "cpu") is not None else ["native", "torch"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_dir_matches_oracle_alone_and_batched(family: str, tmp_path_factory, prompts) -> None:
    d = family_dir(tmp_path_factory, family)
    ref = reference(tmp_path_factory, family, prompts)
    for backend in _backends():
        alone = _engine(str(d), attention_backend=backend, enable_prefix_caching=False)
        assert alone.engine.model.attention == backend
        # Only plain Llama (llama3 here) may take the fused C decoder or the C glue.
        assert (alone.engine.model.config.plain_llama) == (family == "llama3")
        got = [_run(alone, [p])[0] for p in prompts]
        assert got == ref, f"{family} ({backend}): alone differs from HF"
        assert_idle(alone.engine)
        # All together, chunked at 7 tokens a step, in a pool that forces preemption. Where
        # every layer's window gives blocks back as it slides (docs/sliding-window.md), the
        # pool is just the longest prompt's, admitting into any free room.
        tight = dict(num_blocks=34, admission_lookahead=0) if family == "mistral_window" else dict(num_blocks=40)
        batched = _engine(str(d), attention_backend=backend, max_num_batched_tokens=7, max_preemptions=1000,
                          **tight)
        assert _run(batched, prompts) == got, f"{family} ({backend}): batched differs from alone"
        assert sum(batched.engine.lifecycle.stats.preemptions.values()) > 0
        assert_idle(batched.engine)
    if _windowed(family):
        # Torch attention with decodes gathering their blocks rather than reading DecodeRows:
        # the window's third mask.
        gathered = _engine(str(d), attention_backend="torch", decode_rows=False, max_num_batched_tokens=7)
        assert _run(gathered, prompts) == ref
        assert_idle(gathered.engine)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_alone_equals_24_concurrent(family: str, tmp_path_factory, prompts) -> None:
    """24 requests at once (the prompts over and over, each new copy a request of its own),
    every one admitted in the first step: each gets the tokens HF gives it alone, which the
    engine gives it alone too (test above)."""
    d = family_dir(tmp_path_factory, family)
    ref = reference(tmp_path_factory, family, prompts)
    many = [prompts[i % len(prompts)] for i in range(24)]
    llm = _engine(str(d), max_num_seqs=24, max_num_batched_tokens=4096, enable_prefix_caching=False)
    assert _run(llm, many) == [ref[i % len(prompts)] for i in range(24)], family
    assert_idle(llm.engine)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_feature_changes_the_reference(family: str, tmp_path_factory, prompts) -> None:
    """Without the family's feature the HF model answers otherwise: the oracle test sees it."""
    src = family_dir(tmp_path_factory, family)
    d = tmp_path_factory.mktemp(f"{family}_ablated")
    shutil.copytree(src, d, dirs_exist_ok=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(ABLATIONS[family])
    (d / "config.json").write_text(json.dumps(cfg))
    ablated = hf_greedy(load_hf(d), prompts, MAX_NEW).tokens
    assert ablated != reference(tmp_path_factory, family, prompts)


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_gguf_matches_oracle(family: str, tmp_path_factory, prompts, stopline_cache_dir: Path) -> None:
    d = family_dir(tmp_path_factory, family)
    path = make_family_gguf(d, tmp_path_factory.mktemp(f"{family}_gguf") / f"{family}.gguf")
    loaded = load_model(path, progress=False, cache_dir=stopline_cache_dir)
    # The GGUF's metadata says what the HF config says (Llama 3's rope comes as factors instead).
    hf = load_model(d, progress=False).config
    same = ("model_type", "num_layers", "head_dim", "rope_theta", "local_rope_theta", "attention_bias",
            "qk_norm", "rope_layers", "layer_windows", "hidden_act", "attention_scale", "tie_word_embeddings")
    assert {k: getattr(loaded.config, k) for k in same} == {k: getattr(hf, k) for k in same}
    assert loaded.config.rope_scaling == (() if family == "llama3" else hf.rope_scaling)
    if family == "llama3":
        assert len(loaded.config.rope_freq_factors) == 8
    ref = reference(tmp_path_factory, family, prompts)
    llm = _engine(loaded, num_blocks=40, max_num_batched_tokens=7, max_preemptions=1000)
    assert _run(llm, prompts) == ref
    assert_idle(llm.engine)
    # The weights cache gives the same config back.
    again = load_model(path, progress=False, cache_dir=stopline_cache_dir)
    assert again.from_cache and again.config == loaded.config
    # Exported as an HF directory (for peers that need one), transformers answers the same; a
    # config HF can't spell (rope_freqs factors, Gemma) is refused by name.
    out = tmp_path_factory.mktemp(f"{family}_export")
    if family in ("qwen2", "qwen3"):
        export_hf_dir(loaded, out)
        assert hf_greedy(load_hf(out), prompts, MAX_NEW).tokens == ref
    else:
        with pytest.raises(UnsupportedModelError, match="can't be written as an HF config"):
            export_hf_dir(loaded, out)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "linear", "factor": 4.0},
])
def test_rope_frequencies_are_transformers_bits(scaling: dict) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = LlamaConfig(hidden_size=1024, num_attention_heads=8, head_dim=128,
                         rope_parameters={**scaling, "rope_theta": 500000.0})
    want, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu")
    assert factor == 1.0
    assert torch.equal(inv_freq(128, 500000.0, scaling), want)


def _cfg(**kw) -> dict:
    base = {"model_type": "llama", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "eos_token_id": 2}
    return {**base, **kw}


@pytest.mark.parametrize("cfg, match", [
    (_cfg(model_type="phi3", architectures=["Phi3ForCausalLM"]),
     r"'phi3'.*\['gemma3_text', 'llama', 'mistral', 'qwen2', 'qwen3', 'smollm3'\]"),
    (_cfg(model_type="gemma2"), "'gemma2' .*not supported"),
    (_cfg(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "'yarn'"),
    (_cfg(model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=30.0),
     "final_logit_softcapping"),
    (_cfg(model_type="qwen3", hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_unsupported_configs_are_refused_by_name(cfg: dict, match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf_config(cfg)


def test_layouts_of_windows_and_rope() -> None:
    """transformers' assignment of windows and rope per layer, from v4 and v5 configs."""
    qwen = ModelConfig.from_hf_config(_cfg(model_type="qwen2", num_hidden_layers=4, use_sliding_window=True,
                                           sliding_window=64, max_window_layers=2))
    assert qwen.layer_windows == (0, 0, 64, 64)
    off = ModelConfig.from_hf_config(_cfg(model_type="qwen2", sliding_window=64, use_sliding_window=False))
    assert off.layer_windows == () and off.plain_llama is False  # q/k/v biases
    mistral = ModelConfig.from_hf_config(_cfg(model_type="mistral", sliding_window=64))
    assert mistral.layer_windows == (64, 64)
    gemma_v4 = ModelConfig.from_hf_config(_cfg(
        model_type="gemma3_text", num_hidden_layers=6, hidden_activation="gelu_pytorch_tanh",
        sliding_window=512, sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=256))
    assert gemma_v4.layer_windows == (512, 512, 0, 512, 512, 0)
    assert (gemma_v4.rope_theta, gemma_v4.local_rope_theta) == (1e6, 1e4)
    assert dict(gemma_v4.rope_scaling) == {"rope_type": "linear", "factor": 8.0}
    assert gemma_v4.attention_scale == 256 ** -0.5 and gemma_v4.tie_word_embeddings
    # Llama 3.2's config.json (v4 layout: the theta beside rope_scaling).
    llama32 = ModelConfig.from_hf_config(_cfg(rope_theta=500000.0, rope_scaling={
        "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"}))
    assert llama32.rope_theta == 500000.0 and dict(llama32.rope_scaling)["factor"] == 32.0
    assert llama32.plain_llama
    smol = ModelConfig.from_hf_config(_cfg(model_type="smollm3", num_hidden_layers=8))
    assert smol.rope_layers == (True, True, True, False) * 2
    assert ModelConfig.from_dict(smol.to_dict()) == smol
    assert ModelConfig.from_dict(gemma_v4.to_dict()) == gemma_v4


@pytest.mark.skipif(native_attention(16, "cpu") is not None, reason="the C kernels don't run here")
@pytest.mark.parametrize("d", [16, 64, 128])
def test_c_attention_window_reads_only_the_last_keys(d: int) -> None:
    """The C kernel under a window: each row equals float64 attention over its last `window`
    keys, and gets the same bits alone as among rows of other lengths."""
    from stopline.model.kernels.paged_attention import PagedRows, paged_attention

    gen = torch.Generator().manual_seed(d)
    heads, hk, bs, window = 4, 2, 4, 7
    kc, vc = torch.randn(hk, 64 * bs, d, generator=gen), torch.randn(hk, 64 * bs, d, generator=gen)
    table = torch.randperm(64, generator=gen).tolist()
    lens = [1, 5, 7, 8, 9, 30, 61]
    q = torch.randn(len(lens), heads, d, generator=gen)
    rows = PagedRows.build(lens, [0] * len(lens), table)
    out = paged_attention(q, kc, vc, rows, bs, 0.25, window)
    slots = torch.tensor([table[k // bs] * bs + k % bs for k in range(64)])
    for i, n in enumerate(lens):
        keys = slots[max(0, n - window):n]
        k, v = kc[:, keys].double(), vc[:, keys].double()  # [hk, m, d]
        qi = q[i].double().view(hk, heads // hk, d)
        p = torch.softmax(qi @ k.transpose(1, 2) * 0.25, dim=-1)
        want = (p @ v).reshape(-1)
        assert torch.allclose(out[i].double(), want, atol=1e-5), (d, n)
        alone = paged_attention(q[i:i + 1], kc, vc, PagedRows.build([n], [0], table), bs, 0.25, window)
        assert torch.equal(alone[0], out[i])
    # A window longer than every row is the full prefix, bit for bit.
    assert torch.equal(paged_attention(q, kc, vc, rows, bs, 0.25, 64), paged_attention(q, kc, vc, rows, bs, 0.25))



def _q8_engine(tmp_path_factory, family: str, stopline_cache_dir: Path, **kw):
    from stopline.config import EngineConfig
    from stopline.engine.core import EngineCore

    d = family_dir(tmp_path_factory, family)
    path = make_family_gguf(d, tmp_path_factory.mktemp(f"{family}_q8") / f"{family}.q8_0.gguf", qtype="Q8_0")
    loaded = load_model(path, progress=False, cache_dir=stopline_cache_dir)
    cfg = dict(num_blocks=128, block_size=4, max_num_batched_tokens=64, quant_max_rows=16, debug=True,
               target_step_ms=None)
    return EngineCore(loaded, EngineConfig(**{**cfg, **kw}))


@pytest.mark.skipif(native_attention(16, "cpu") is not None, reason="the C kernels don't run here")
def test_llama3_rope_runs_in_the_fused_c_decoder(tmp_path_factory, prompts, stopline_cache_dir) -> None:
    """Llama 3 rope is only a table: a Q8_0 Llama 3 GGUF keeps the fused C decoder, with the
    layer loop's bits."""
    from tests.engine_support import greedy_logprobs

    fused = _q8_engine(tmp_path_factory, "llama3", stopline_cache_dir)
    assert fused.model.decoder is not None
    loop = _q8_engine(tmp_path_factory, "llama3", stopline_cache_dir)
    loop.model.c_layers = False
    assert greedy_logprobs(fused, prompts[:6]) == greedy_logprobs(loop, prompts[:6])


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_other_gguf_families_leave_the_fused_decoder(family: str, tmp_path_factory, prompts,
                                                     stopline_cache_dir) -> None:
    """Biases and q/k norms are not in the C glue: a quantized Qwen runs the torch glue (with
    the quantized linears and the C attention), alone and batched alike."""
    from tests.engine_support import greedy_logprobs

    batched = _q8_engine(tmp_path_factory, family, stopline_cache_dir)
    assert batched.model.decoder is None and not batched.model.config.plain_llama
    together = greedy_logprobs(batched, prompts)
    alone = {}
    for i, p in enumerate(prompts):
        got = greedy_logprobs(_q8_engine(tmp_path_factory, family, stopline_cache_dir), [p])
        alone[f"r{i}"] = got["r0"]
    assert together == alone


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_fast_numerics_stay_batch_invariant(family: str, tmp_path_factory, prompts) -> None:
    """Fast mode's bf16 linears under the torch glue: a request alone gets the tokens it gets
    among the others, chunked and preempted."""
    d = str(family_dir(tmp_path_factory, family))
    alone = _engine(d, numerics="fast", enable_prefix_caching=False)
    got = [_run(alone, [p])[0] for p in prompts]
    batched = _engine(d, numerics="fast", num_blocks=40, max_num_batched_tokens=7, max_preemptions=1000)
    assert _run(batched, prompts) == got
    assert_idle(batched.engine)


def test_qwen_gguf_tokenizer_splits_like_qwen(tmp_path_factory) -> None:
    """tokenizer.ggml.pre = "qwen2" (Qwen2 and Qwen3 GGUFs): Qwen's tokenizer.json split (Llama 3's
    with each digit alone), not GPT-2's; checked against `tokenizers` with that split."""
    from tokenizers import Regex, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from stopline.model.loaders.gguf import read_gguf
    from stopline.tokenizer.tokenizer import Tokenizer

    d = family_dir(tmp_path_factory, "qwen2")
    path = make_family_gguf(d, tmp_path_factory.mktemp("qwen_tok") / "q.gguf")
    ours = Tokenizer.from_gguf_fields(read_gguf(path).fields)
    ref = HFTokenizer.from_file(str(d / "tokenizer.json"))
    ref.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    for text in ["The year 2024 had 65536 days", "They'LL arrive at 10:30\n\n  ok", "café 日本語 🎉 x=3.14159"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
    assert len(ours.encode("65536")) == 5  # a token per digit


def test_gemma_gguf_sentencepiece_tokenizer_matches_transformers(tmp_path_factory) -> None:
    """A Gemma GGUF's SentencePiece vocabulary (no merges; runs of spaces stored as spaces) gives
    the ids transformers' tokenizer for the same file gives, and decodes back."""
    from transformers import AutoTokenizer

    from stopline.model.loaders.gguf import read_gguf
    from stopline.tokenizer.tokenizer import Tokenizer

    d = family_dir(tmp_path_factory, "gemma3_gguf")
    out = tmp_path_factory.mktemp("gemma_spm")
    make_family_gguf(d, out / "g.gguf", sentencepiece=True)
    ours = Tokenizer.from_gguf_fields(read_gguf(out / "g.gguf").fields)
    ref = AutoTokenizer.from_pretrained(out, gguf_file="g.gguf")
    assert ours.add_bos_token and ours.bos_token_id == 2 and not ours.is_byte_level
    texts = ["The quick brown fox", "  two  spaces   and\ttabs\n\nnewlines", "café 日本語 🎉 <eos> x",
             "def fibonacci(n):\n    return n", " leading", "trailing ", "", "Numbers: 65536 3.14159"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
