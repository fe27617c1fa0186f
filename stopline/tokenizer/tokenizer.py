"""Tokenizer, built from GGUF metadata or an HF `tokenizer.json`.

The heavy lifting is done by the Rust `tokenizers` library; this module only assembles the
right pipeline and adds the serving-side pieces HF keeps in Python (BOS policy, stop-token
list). Chat templates are in chat_template.py, streaming detokenization in detokenizer.py.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from stopline.errors import UnsupportedModelError
from stopline.tokenizer.chat_template import (
    ChatTemplateError,
    hf_chat_template,
    jinja_env,
    read_json,
)
from stopline.tokenizer.detokenizer import CHAR_TO_BYTE

# GGUF token_type values (llama.cpp's llama_token_attr / gguf.TokenType).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Tokens llama.cpp treats as end-of-generation by their text even when the file names only one
# eos id; e.g. SmolLM2 says eos=<|im_end|> but a base-style continuation ends with <|endoftext|>.
_EOG_TEXTS = frozenset({
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
    "<|end_of_text|>", "<EOT>", "<｜end▁of▁sentence｜>",
})

# Pre-tokenizer regexes, by GGUF `tokenizer.ggml.pre`, mirroring llama.cpp's llama-vocab.cpp.
# The split decides which merges can ever apply, so a wrong one silently changes token ids.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 and Qwen3: Llama 3's split with every digit alone (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2).
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# StarCoder-lineage vocabularies (SmolLM among them) split every digit before the GPT-2 regex.
_PRE_DIGITS_THEN_GPT2 = frozenset({
    "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva",
})
_PRE_GPT2 = frozenset({"gpt2", "default", "mpt", "olmo", "jais", "trillion"})
_PRE_LLAMA3 = frozenset({
    "llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe",
})


def _gguf_pre_tokenizer(pre: str | None) -> tuple[Any, bool]:
    """(pre_tokenizer, ignore_merges) for a GGUF `tokenizer.ggml.pre` value."""
    if pre in _PRE_DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]), False
    if pre in _PRE_LLAMA3:
        # llama.cpp sets ignore_merges for the Llama 3 family: a word that is itself a vocab
        # entry is taken whole even if the merges would not build it.
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]), True
    if pre in ("qwen2", "stablelm2"):  # one case in llama.cpp; it keeps the merges for these
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]), False
    if pre is not None and pre not in _PRE_GPT2:
        warnings.warn(
            f"GGUF tokenizer.ggml.pre={pre!r} is not known to stopline; using the GPT-2 split. "
            "Token ids may differ from llama.cpp for some inputs.",
            stacklevel=3,
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True), False


def _bpe_backend(tokens: list[str], fields: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """A GGUF's byte-level BPE vocabulary (`tokenizer.ggml.model` gpt2) with its merges."""
    merges_raw = fields.get("tokenizer.ggml.merges")
    if not merges_raw:
        raise UnsupportedModelError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ValueError(f"malformed GGUF merge rule {m!r} (expected 'left right')")
        merges.append((left, right))
    pre_tok, ignore_merges = _gguf_pre_tokenizer(fields.get("tokenizer.ggml.pre"))
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges,
    ))
    backend.pre_tokenizer = pre_tok
    backend.decoder = decoders.ByteLevel()
    return backend


# Gemma GGUFs carry a SentencePiece vocabulary (`tokenizer.ggml.model` llama) without merges.
_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})


def _gemma_spelling(tokens: list[str]) -> list[str]:
    """Gemma files store a token of two or more spaces as real spaces; its tokenizer.json spells
    them with U+2581, as every other piece, so the merges built from them can match."""
    return ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]


def _gemma_backend(tokens: list[str], unk_id: int | None) -> tokenizers.Tokenizer:
    """Gemma's tokenizer (BPE with byte fallback over "\u2581"-spelled spaces, no prefix space)
    from a GGUF's pieces, as transformers rebuilds it from the same file: the file has no merges,
    so they are every split of a piece into two pieces, ranked by the merged piece's place in the
    file (Gemma's scores do not follow its merge order; the file order does)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[str, str, int]] = []
    for rank, piece in enumerate(tokens):
        local = [(piece[:k], piece[k:], -rank) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        ranked += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else "<unk>"
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=[(a, b) for a, b, _ in ranked], fuse_unk=True, unk_token=unk, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and stop tokens."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
        add_bos_token: bool = False,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("a tokenizer needs at least one eos token id")
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template: str | None = chat_template
        self.add_bos_token: bool = bool(add_bos_token)
        self.bos_token: str | None = bos_token if bos_token is not None else self.id_to_token(bos_token_id)
        self.eos_token: str | None = (
            eos_token if eos_token is not None else self.id_to_token(self.eos_token_ids[0])
        )
        self.pad_token: str | None = pad_token
        # A tokenizer.json post-processor (e.g. Llama's TemplateProcessing) may already add BOS;
        # adding it again by hand would double it.
        try:
            probe_plain = backend.encode("a", add_special_tokens=False).ids
            probe_special = backend.encode("a", add_special_tokens=True).ids
            self._post_processor_adds = probe_plain != probe_special
        except Exception:  # a vocabulary that cannot encode "a" at all: assume no post-processor
            self._post_processor_adds = False
        self._template: jinja2.Template | None = None
        self._bytes_cache: dict[int, bytes] = {}

    # ---- basic mapping -------------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (read-only use, please)."""
        return self._backend

    @property
    def eos_token_id(self) -> int:
        """The primary eos id (first of `eos_token_ids`)."""
        return self.eos_token_ids[0]

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of tokens marked special (skipped by `decode(skip_special_tokens=True)`)."""
        return frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    @cached_property
    def is_byte_level(self) -> bool:
        """True when decoding is plain byte-level BPE (GPT-2 alphabet), as for SmolLM/Llama 3."""
        return isinstance(self._backend.decoder, decoders.ByteLevel)

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes a byte-level token stands for (b'' for an unknown id), exactly as the
        ByteLevel decoder maps it: alphabet chars to bytes, any other token as its UTF-8."""
        b = self._bytes_cache.get(token_id)
        if b is None:
            tok = self._backend.id_to_token(token_id)
            if tok is None:
                b = b""
            else:
                try:
                    b = bytes(CHAR_TO_BYTE[c] for c in tok)
                except KeyError:
                    b = tok.encode("utf-8")
            self._bytes_cache[token_id] = b
        return b

    def id_to_token(self, token_id: int | None) -> str | None:
        """The vocab string of an id (byte-level spelling, e.g. 'Ġthe'), or None."""
        if token_id is None:
            return None
        return self._backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocab string, or None if it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. `<|im_start|>`) are
        matched as single ids; BOS is prepended only if the model asks for it (add_bos_token)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        # Like HF and llama.cpp, a text that already starts with the BOS string gets a second
        # BOS; chat prompts (which carry their own) should be encoded with add_special_tokens=False.
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None \
                and not self._post_processor_adds:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; an incomplete UTF-8 sequence at the end decodes to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat template -------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's chat template, the way HF transformers does
        (same jinja options and helpers); extra kwargs (tools=..., etc.) reach the template."""
        if self.chat_template is None:
            raise ChatTemplateError(
                "this model has no chat template (none in the GGUF metadata / tokenizer_config.json); "
                "send a plain completion prompt instead"
            )
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise ChatTemplateError("messages must be a list of dicts with 'role' and 'content'")
        if self._template is None:
            try:
                self._template = jinja_env().from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "unk_token": "",
            **kwargs,
        }
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    # ---- construction --------------------------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF `tokenizer.*` metadata (values already decoded to Python types).

        Supports byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`), which is what
        llama.cpp's converter writes for SmolLM, Llama 3, Qwen and most recent models, and Gemma's
        SentencePiece vocabulary (`llama` in a Gemma GGUF).
        """
        kind = fields.get("tokenizer.ggml.model")
        arch = fields.get("general.architecture")
        gemma_spm = kind == "llama" and arch in _GEMMA_ARCHS
        if kind != "gpt2" and not gemma_spm:
            raise UnsupportedModelError(
                f"GGUF tokenizer.ggml.model={kind!r} is not supported here; stopline builds byte-level "
                "BPE ('gpt2') tokenizers, and Gemma's SentencePiece ('llama'), from GGUF. Load the HF "
                "directory (with tokenizer.json) instead."
            )
        tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
        token_types: list[int] = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if len(token_types) != len(tokens):
            raise ValueError(
                f"GGUF tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
            )
        if gemma_spm:
            tokens = _gemma_spelling(tokens)
            backend = _gemma_backend(tokens, fields.get("tokenizer.ggml.unknown_token_id"))
        else:
            backend = _bpe_backend(tokens, fields)
        # Control tokens become special added tokens so "<|im_start|>" in text is one id, and
        # decode(skip_special_tokens=True) drops them; user-defined ones are matched whole but kept.
        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, token_types, strict=True) if ty == _TOKEN_TYPE_CONTROL]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, token_types, strict=True) if ty == _TOKEN_TYPE_USER_DEFINED]
        if special:
            backend.add_special_tokens(special)
        if user:
            backend.add_tokens(user)

        bos = fields.get("tokenizer.ggml.bos_token_id")
        eos = fields.get("tokenizer.ggml.eos_token_id")
        eos_ids: list[int] = [] if eos is None else [int(eos)]
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if fields.get(key) is not None:
                eos_ids.append(int(fields[key]))
        eos_ids += [i for i, (t, ty) in enumerate(zip(tokens, token_types, strict=True))
                    if ty == _TOKEN_TYPE_CONTROL and t in _EOG_TEXTS]
        if not eos_ids:
            raise ValueError("GGUF has no tokenizer.ggml.eos_token_id and no recognizable end-of-text token")
        add_bos = fields.get("tokenizer.ggml.add_bos_token")
        pad = fields.get("tokenizer.ggml.padding_token_id")
        return cls(
            backend,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            chat_template=fields.get("tokenizer.chat_template"),
            # llama.cpp's default without the key: BOS for SentencePiece vocabularies, none for BPE.
            add_bos_token=bool(add_bos) if add_bos is not None else gemma_spm,
            eos_token=tokens[int(eos)] if eos is not None else None,
            pad_token=tokens[int(pad)] if pad is not None and 0 <= int(pad) < len(tokens) else None,
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build from an HF model directory: tokenizer.json plus tokenizer_config.json,
        generation_config.json and config.json for BOS/EOS and the chat template."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            hint = " (only a SentencePiece tokenizer.model is present; save it once with " \
                "transformers' fast tokenizer to get tokenizer.json)" if (path / "tokenizer.model").exists() else ""
            raise FileNotFoundError(f"{tj} not found{hint}")
        backend = tokenizers.Tokenizer.from_file(str(tj))
        tcfg = read_json(path / "tokenizer_config.json")
        gen = read_json(path / "generation_config.json")
        mcfg = read_json(path / "config.json")

        def tok_str(v: Any) -> str | None:
            if isinstance(v, dict):  # older files store AddedToken dicts
                return v.get("content")
            return v

        bos_token = tok_str(tcfg.get("bos_token"))
        eos_token = tok_str(tcfg.get("eos_token"))
        pad_token = tok_str(tcfg.get("pad_token"))
        bos_id = gen.get("bos_token_id", mcfg.get("bos_token_id"))
        if bos_id is None and bos_token is not None:
            bos_id = backend.token_to_id(bos_token)
        eos_ids: list[int] = []
        for src in (gen.get("eos_token_id"), mcfg.get("eos_token_id")):
            if src is None:
                continue
            eos_ids += [int(x) for x in (src if isinstance(src, list) else [src])]
            break  # generation_config is authoritative when present
        if eos_token is not None and backend.token_to_id(eos_token) is not None:
            eos_ids.append(backend.token_to_id(eos_token))
        if not eos_ids:
            raise ValueError(f"{path}: no eos token in generation_config.json, config.json or tokenizer_config.json")
        if bos_token is None and bos_id is not None:
            bos_token = backend.id_to_token(int(bos_id))
        return cls(
            backend,
            bos_token_id=None if bos_id is None else int(bos_id),
            eos_token_ids=eos_ids,
            chat_template=hf_chat_template(path, tcfg),
            add_bos_token=bool(tcfg.get("add_bos_token", False)),
            bos_token=bos_token,
            eos_token=eos_token,
            pad_token=pad_token,
        )

    # ---- serialization (weights cache, export) ---------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """Everything needed to rebuild this tokenizer, as JSON-friendly data."""
        return {
            "tokenizer_json": self._backend.to_str(),
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "chat_template": self.chat_template,
            "add_bos_token": self.add_bos_token,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Tokenizer:
        """Inverse of `to_state`."""
        return cls(
            tokenizers.Tokenizer.from_str(state["tokenizer_json"]),
            bos_token_id=state["bos_token_id"],
            eos_token_ids=state["eos_token_ids"],
            chat_template=state["chat_template"],
            add_bos_token=state["add_bos_token"],
            bos_token=state["bos_token"],
            eos_token=state["eos_token"],
            pad_token=state.get("pad_token"),
        )

    def save_hf_files(self, out_dir: str | os.PathLike[str], *, model_max_length: int | None = None) -> None:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json so that
        transformers' AutoTokenizer (and vLLM) reproduce this tokenizer exactly."""
        out_dir = Path(out_dir)
        backend = tokenizers.Tokenizer.from_str(self._backend.to_str())
        if self.add_bos_token and self.bos_token_id is not None and not self._post_processor_adds:
            # Put the BOS policy into tokenizer.json itself: a generic fast tokenizer ignores
            # tokenizer_config's add_bos_token in some transformers versions.
            bos = self.bos_token or backend.id_to_token(self.bos_token_id)
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, self.bos_token_id)],
            )
        backend.save(str(out_dir / "tokenizer.json"))
        tcfg: dict[str, Any] = {
            # The generic class loads tokenizer.json as-is; a model-specific class (GPT2Tokenizer,
            # LlamaTokenizer) may rebuild its own pre-tokenizer and lose e.g. SmolLM's digit split.
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        if self.pad_token is not None:
            tcfg["pad_token"] = self.pad_token
        if self.chat_template is not None:
            tcfg["chat_template"] = self.chat_template
        if model_max_length is not None:
            tcfg["model_max_length"] = model_max_length
        (out_dir / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False))
        stm = {k: tcfg[k] for k in ("bos_token", "eos_token", "pad_token") if tcfg.get(k) is not None}
        (out_dir / "special_tokens_map.json").write_text(json.dumps(stm, indent=2, ensure_ascii=False))


__all__ = ["ChatTemplateError", "Tokenizer"]
