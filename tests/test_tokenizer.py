"""Tokenizer: encode/decode against two independent oracles (transformers, and a from-scratch
llama.cpp-style BPE), chat templates against transformers, and streaming detokenization."""

from __future__ import annotations

import json
import random
import shutil
from functools import lru_cache
from pathlib import Path

import pytest

from stopline.model.loaders.loader import export_hf_dir, load_model
from stopline.tokenizer.detokenizer import IncrementalDetokenizer
from stopline.tokenizer.tokenizer import ChatTemplateError, Tokenizer
from tests.tiny_model import make_tiny_llama_dir

STRINGS = [
    "Hello world",
    "The capital of France is",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "I'm sure they'll say it's 'quoted' and you've seen WE'RE shouting",
    "Numbers 0 7 42 1234567890 3.14159 -17 1e-5 2024-05-17 10:30",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }  // C code",
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
    "café naïve résumé Zürich São Paulo",
    "Ελληνικά, русский язык, עברית, العربية",
    "日本語のテキストと中文的文本和한국어",
    "emoji 🎉🚀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "math ∑∫√∞ ≠ ≤ ≥ and symbols ©®™ §¶",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|im_end|><|im_start|>",
    "text<|im_end|>glued<|im_start|>together",
    "   ",
    "",
    "a" * 300 + " " + "ab" * 50,
    "\u200bzero width\u00a0nbsp and combining e\u0301",
]


# ---- an independent reference: llama.cpp's BPE for pre="smollm", written from scratch ----------

@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


class ReferenceBPE:
    """Special tokens first, then \\p{N} isolated, then the GPT-2 regex, then rank-ordered merges."""

    def __init__(self, tokens: list[str], merges: list[str], specials: list[str]) -> None:
        import regex

        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        self.specials = set(specials)
        self.special_re = regex.compile("(" + "|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")")
        self.digits_re = regex.compile(r"\p{N}|[^\p{N}]+")
        self.gpt2_re = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")

    def _bpe(self, word: str) -> list[str]:
        syms = [_bytes_to_unicode()[b] for b in word.encode("utf-8")]
        while len(syms) > 1:
            pairs = [(self.ranks.get((a, b), float("inf")), i) for i, (a, b) in enumerate(zip(syms, syms[1:], strict=False))]
            best = min(pairs)[0]
            if best == float("inf"):
                break
            pair = next((syms[i], syms[i + 1]) for r, i in pairs if r == best)
            out, i = [], 0
            while i < len(syms):
                if i + 1 < len(syms) and (syms[i], syms[i + 1]) == pair:
                    out.append(syms[i] + syms[i + 1])
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            syms = out
        return syms

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self.special_re.split(text):
            if part in self.specials:
                ids.append(self.vocab[part])
                continue
            for chunk in self.digits_re.findall(part):
                for word in self.gpt2_re.findall(chunk):
                    ids += [self.vocab[s] for s in self._bpe(word)]
        return ids


@pytest.fixture(scope="module")
def reference_bpe(smollm2_gguf: Path) -> ReferenceBPE:
    from stopline.model.loaders.gguf import read_gguf

    f = read_gguf(smollm2_gguf).fields
    assert f["tokenizer.ggml.pre"] == "smollm"
    tokens = f["tokenizer.ggml.tokens"]
    specials = [t for t, ty in zip(tokens, f["tokenizer.ggml.token_type"], strict=True) if ty == 3]
    return ReferenceBPE(tokens, f["tokenizer.ggml.merges"], specials)


@pytest.fixture(scope="module")
def hf_tok(smollm2_hf_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_hf_dir)


# ---- SmolLM2 encode / decode ----------------------------------------------------------------------

def test_smollm2_basics(smollm2) -> None:
    tok = smollm2.tokenizer
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == (1, 2, False)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.encode("Hello", add_special_tokens=True) == tok.encode("Hello", add_special_tokens=False)
    assert tok.token_to_id("<|im_end|>") == 2 and tok.id_to_token(2) == "<|im_end|>"
    assert tok.id_to_token(tok.encode(" the")[0]) == "Ġthe"
    assert {0, 1, 2} <= tok.special_token_ids
    # Digits are split one by one (SmolLM's pre-tokenizer), unlike plain GPT-2.
    assert len(tok.encode("1234567890")) == 10


@pytest.mark.parametrize("text", STRINGS)
def test_smollm2_encode_matches_llama_cpp_reference(smollm2, reference_bpe: ReferenceBPE, text: str) -> None:
    assert smollm2.tokenizer.encode(text) == reference_bpe.encode(text)


def test_smollm2_matches_transformers(smollm2, hf_tok) -> None:
    tok = smollm2.tokenizer
    for text in STRINGS:
        ids = tok.encode(text)
        assert ids == hf_tok(text).input_ids, text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_smollm2_chat_template_matches_transformers(smollm2, hf_tok) -> None:
    tok = smollm2.tokenizer
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "日本語で?"}],
    ]
    for msgs in conversations:
        for gen in (True, False):
            ours = tok.apply_chat_template(msgs, add_generation_prompt=gen)
            assert ours == hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert tok.encode(ours) == hf_tok(ours).input_ids
    text = tok.apply_chat_template(conversations[0])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")


# ---- HF dir specifics ---------------------------------------------------------------------------

def test_hf_dir_bos_policy_and_eos_list(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    plain = Tokenizer.from_hf_dir(tiny_model_dir)
    assert plain.encode("hi") == plain.encode("hi", add_special_tokens=False)

    d = make_tiny_llama_dir(tmp_path / "bos", add_bos_token=True)
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 0]
    (d / "generation_config.json").write_text(json.dumps(gen))
    m = load_model(d, progress=False)
    tok = m.tokenizer
    assert tok.encode("hi")[0] == 1 and tok.encode("hi")[1:] == tok.encode("hi", add_special_tokens=False)
    assert tok.encode("<|im_start|>hi")[:2] == [1, 1]  # doubled, as HF and llama.cpp do
    assert tok.eos_token_ids == m.config.eos_token_ids == (2, 0)

    # The export carries the BOS policy to transformers.
    out = export_hf_dir(m, tmp_path / "exported")
    hf = AutoTokenizer.from_pretrained(out)
    for text in ("hi there", "Numbers 12345", "café 🎉", "<|im_start|>hi"):
        assert hf(text).input_ids == tok.encode(text)
        assert hf(text, add_special_tokens=False).input_ids == tok.encode(text, add_special_tokens=False)
    assert Tokenizer.from_hf_dir(out).encode("hi") == tok.encode("hi")


def test_chat_template_file_and_named_templates(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert Tokenizer.from_hf_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "[user]x"
    (d / "chat_template.jinja").unlink()
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    tcfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg))
    assert Tokenizer.from_hf_dir(d).chat_template == "D"


def test_missing_tokenizer_json_is_explained(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.model").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="tokenizer.json.*SentencePiece"):
        Tokenizer.from_hf_dir(d)


def test_state_round_trip(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_hf_dir(tiny_model_dir)
    back = Tokenizer.from_state(json.loads(json.dumps(tok.to_state())))
    for text in STRINGS:
        assert back.encode(text) == tok.encode(text)
    assert (back.bos_token_id, back.eos_token_ids, back.chat_template) == (
        tok.bos_token_id, tok.eos_token_ids, tok.chat_template)


# ---- chat template rendering ------------------------------------------------------------------

FANCY_TEMPLATE = """
{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
  {%- if m.role not in ['system', 'user', 'assistant'] -%}
    {{- raise_exception('Unknown role: ' + m.role) -}}
  {%- endif -%}
  {%- if m.role == 'system' %}{% continue %}{% endif -%}
  {%- set ns.n = ns.n + 1 -%}
  {{ bos_token }}{{ m.role }}#{{ ns.n }}: {% generation %}{{ m.content | trim }}{% endgeneration %}{{ eos_token }}
{% endfor -%}
{%- if tools %}TOOLS {{ tools | tojson }}{% endif -%}
{%- if add_generation_prompt %}{{ bos_token }}assistant#{{ ns.n + 1 }}: {% endif -%}
"""


def test_chat_template_features_match_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = Tokenizer.from_hf_dir(tiny_model_dir)
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = FANCY_TEMPLATE
    tok._template = None  # the template is compiled lazily and cached
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "  <b>hi</b> & \"q\"  "},
            {"role": "assistant", "content": "ok"}]
    tools = [{"name": "f", "description": "<x> & 'y' ü"}]
    for gen in (True, False):
        ours = tok.apply_chat_template(msgs, add_generation_prompt=gen, tools=tools)
        theirs = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, tools=tools,
                                        chat_template=FANCY_TEMPLATE)
        assert ours == theirs
    assert '"<x> & \'y\' ü"' in ours  # tojson: no HTML escaping, no ASCII escaping
    with pytest.raises(ChatTemplateError, match="Unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_chat_template_errors(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_hf_dir(tiny_model_dir)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok.chat_template = "{% for m in messages %}{{ m.content }"
    tok._template = None
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok.chat_template = "{{ ''.__class__.__mro__ }}"
    tok._template = None
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute escapes
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="list of dicts"):
        tok.apply_chat_template("hello")  # type: ignore[arg-type]


# ---- streaming detokenization -----------------------------------------------------------------

def stream(tok: Tokenizer, ids: list[int], **kw) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, **kw)
    deltas = [d.push(i) for i in ids]
    deltas.append(d.flush())
    return deltas, d


def test_detokenizer_handles_split_multibyte_chars(smollm2) -> None:
    tok = smollm2.tokenizer
    text = "Voilà 🎉🚀 日本語のテキスト 👨‍👩‍👧 ok, 中文 and more ✨\n<|im_end|>done"
    ids = tok.encode(text)
    # The test is only meaningful if some token carries an incomplete UTF-8 sequence.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    for skip in (True, False):
        deltas, d = stream(tok, ids, skip_special_tokens=skip)
        assert "".join(deltas) == d.text == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in x for x in deltas)
        assert sum(1 for x in deltas if x == "") > 0  # something was held back
    assert "<|im_end|>" in stream(tok, ids, skip_special_tokens=False)[1].text
    assert "<|im_end|>" not in stream(tok, ids, skip_special_tokens=True)[1].text


def test_detokenizer_random_streams(smollm2, tiny_model_dir: Path) -> None:
    rng = random.Random(0)
    for tok in (smollm2.tokenizer, Tokenizer.from_hf_dir(tiny_model_dir)):
        assert tok.is_byte_level
        for _ in range(20):
            text = "".join(rng.choice(STRINGS) for _ in range(3))
            ids = tok.encode(text)
            deltas, d = stream(tok, ids, prompt_token_ids=tok.encode(rng.choice(STRINGS)))
            assert "".join(deltas) == tok.decode(ids), text
            assert d.num_tokens == len(ids)


def test_detokenizer_random_ids_match_full_decode(smollm2, tiny_model_dir: Path) -> None:
    """What a random-weight model emits: arbitrary ids, lone UTF-8 continuation bytes, special
    tokens, ids past the vocab. Invalid bytes must become U+FFFD exactly as a full decode does."""
    rng = random.Random(1)
    for tok in (smollm2.tokenizer, Tokenizer.from_hf_dir(tiny_model_dir)):
        for _ in range(30):
            ids = [rng.randrange(tok.vocab_size + 5) for _ in range(rng.randrange(1, 40))]
            for skip in (True, False):
                deltas, d = stream(tok, ids, skip_special_tokens=skip)
                assert "".join(deltas) == d.text == tok.decode(ids, skip_special_tokens=skip)


def test_detokenizer_flush_emits_an_unfinished_char(smollm2) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode("ok 🎉")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    d = IncrementalDetokenizer(tok)
    assert "".join(d.push(i) for i in ids[:cut]) == "ok "
    assert d.flush() == tok.decode(ids[:cut])[len("ok "):]
    assert d.flush() == ""


# A Llama-2-style tokenizer (SentencePiece conventions: "▁" for spaces, <0xNN> byte fallback,
# leading space stripped on decode) exercises the windowed path.
def _sentencepiece_like() -> Tokenizer:
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    corpus = [line for line in STRINGS if line.isascii()] * 5
    trainer_tok = tokenizers.Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer_tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    spec = json.loads(trainer_tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["model"]["merges"]]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], add_bos_token=True)


def test_detokenizer_sentencepiece_style() -> None:
    tok = _sentencepiece_like()
    assert not tok.is_byte_level
    assert tok.encode("hi")[0] == 1
    rng = random.Random(2)
    texts = STRINGS + ["The quick brown fox jumps over the lazy dog. 日本語 🎉 " * 40]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        deltas, _ = stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids), text
        assert not any("\ufffd" in x for x in deltas)
        # With prompt context the first token keeps its leading space, as a continuation should.
        prompt = tok.encode(rng.choice(STRINGS) or "x", add_special_tokens=False)
        deltas, _ = stream(tok, ids, prompt_token_ids=prompt)
        assert "".join(deltas) == tok.decode(prompt + ids)[len(tok.decode(prompt)):], text


def test_detokenizer_window_stays_small() -> None:
    tok = _sentencepiece_like()
    ids = tok.encode("The quick brown fox jumps over the lazy dog. 日本語 🎉 " * 100)
    d = IncrementalDetokenizer(tok)
    out = []
    for i in ids:
        out.append(d.push(i))
        assert len(d._ids) <= 80  # bounded window, not the whole history
    assert "".join(out) + d.flush() == tok.decode(ids)
