"""Model hyperparameters in one loader-independent shape.

Both loaders (GGUF and HF safetensors) reduce their metadata to a `ModelConfig`; the engine and
the model code only ever see this dataclass, never a GGUF key or a transformers config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from stopline.errors import UnsupportedModelError

# Architectures whose math is exactly the Llama block (RMSNorm, rotary with rotate_half, SwiGLU,
# no biases). Anything else would load but compute the wrong thing, so it is refused up front.
SUPPORTED_HF_MODEL_TYPES = frozenset({"llama", "mistral"})
SUPPORTED_GGUF_ARCHS = frozenset({"llama"})


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads "
                f"({self.num_kv_heads}); grouped-query attention needs whole groups"
            )
        if self.head_dim % 2 != 0:
            raise UnsupportedModelError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.eos_token_ids:
            raise ValueError("ModelConfig.eos_token_ids must name at least one token")

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (used by the weights cache)."""
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict`."""
        d = dict(d)
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        return cls(**d)

    @classmethod
    def from_hf_config(
        cls,
        cfg: dict[str, Any],
        *,
        generation_config: dict[str, Any] | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
    ) -> ModelConfig:
        """Build from a transformers `config.json` dict (v4 or v5 layout).

        `generation_config.json` wins for eos because that is where HF puts the full stop list
        (it may be a list, e.g. Llama 3 Instruct stops on both <|end_of_text|> and <|eot_id|>).
        """
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_HF_MODEL_TYPES:
            archs = cfg.get("architectures")
            raise UnsupportedModelError(
                f"model_type {model_type!r} (architectures={archs}) is not supported; stopline "
                f"runs Llama-family models: {sorted(SUPPORTED_HF_MODEL_TYPES)}"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise UnsupportedModelError(f"{flag}=True is not supported (the Llama block has no biases)")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; only silu (SwiGLU)")
        rope_theta = _hf_rope_theta(cfg)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        window = cfg.get("sliding_window")
        if window is not None and int(window) < max_pos:
            raise UnsupportedModelError(
                f"sliding_window={window} < max_position_embeddings={max_pos}: sliding-window "
                "attention is not supported"
            )
        gen = generation_config or {}
        eos = _as_id_tuple(gen.get("eos_token_id"))
        if not eos:
            eos = _as_id_tuple(cfg.get("eos_token_id"))
        eos = _dedupe(eos + tuple(extra_eos_token_ids))
        bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A transformers `config.json` for LlamaForCausalLM.

        Both the v4 (`rope_theta`, `rope_scaling`) and v5 (`rope_parameters`) spellings are
        written, so older readers (vLLM pins transformers 4.x) and newer ones agree.
        """
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0],
            "torch_dtype": "float32",
            "use_cache": True,
        }


def _hf_rope_theta(cfg: dict[str, Any]) -> float:
    """rope theta from either layout, refusing scaled rope (the model code has no scaling)."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    for p in (params, scaling):
        if isinstance(p, dict):
            kind = p.get("rope_type", p.get("type", "default"))
            if kind not in (None, "default"):
                raise UnsupportedModelError(
                    f"rope scaling {kind!r} is not supported; only plain rotary embeddings"
                )
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(cfg.get("rope_theta", 10000.0))


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _dedupe(ids: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF Llama tensor names and [out, in] shapes a checkpoint for `config` must have."""
    h, hd = config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (config.num_heads * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (config.num_kv_heads * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (config.num_kv_heads * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, config.num_heads * hd)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, Any], source: str) -> None:
    """Raise ValueError naming every missing, unexpected or misshapen tensor."""
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    wrong = [f"{n}: {tuple(weights[n].shape)} != {expected[n]}"
             for n in sorted(set(expected) & set(weights)) if tuple(weights[n].shape) != expected[n]]
    problems = []
    if missing:
        problems.append(f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if extra:
        problems.append(f"unexpected {extra[:8]}{' ...' if len(extra) > 8 else ''}")
    if wrong:
        problems.append(f"wrong shape {wrong[:8]}")
    if problems:
        raise ValueError(f"{source}: weights do not match the config: " + "; ".join(problems))
