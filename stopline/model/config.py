"""Model hyperparameters in one loader-independent shape.

Both loaders (GGUF and HF safetensors) reduce their metadata to a `ModelConfig`; the engine and
the model code only ever see this dataclass, never a GGUF key or a transformers config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from stopline.errors import UnsupportedModelError

# Architectures whose math the model code implements (the Llama block and the variations named by
# the fields below: q/k/v biases, q/k norms, layers without rope, sliding windows, Gemma 3's
# sandwich norms). Anything else would load but compute the wrong thing, so it is refused up front.
SUPPORTED_HF_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma3_text"})
SUPPORTED_GGUF_ARCHS = frozenset({"llama", "qwen2", "qwen3", "gemma3"})
# Rope frequency schemes the model computes (HF `rope_type`); scaling that also changes the
# attention (yarn, longrope) or the positions (dynamic) is refused.
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3"})
GELU_TANH = "gelu_pytorch_tanh"


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Llama-family decoder.

    The fields after eos_token_ids describe the families' departures from Llama; their defaults
    are plain Llama, so a config written before they existed (the weights cache) reads as one.
    """

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
    model_type: str = "llama"
    # HF rope_scaling of the global layers as sorted items, e.g. (("factor", 8.0), ("rope_type",
    # "llama3"), ...); () for plain rope.
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    # llama.cpp's rope_freqs tensor (a GGUF's Llama 3 scaling): each frequency is divided by its factor.
    rope_freq_factors: tuple[float, ...] = ()
    local_rope_theta: float = 0.0  # rope base of the sliding-window layers (Gemma 3); 0: rope_theta
    attention_bias: bool = False  # biases on q, k and v (Qwen2)
    qk_norm: bool = False  # per-head RMS norm of q and k before rope (Qwen3, Gemma 3)
    rope_layers: tuple[bool, ...] = ()  # per layer, whether it applies rope (SmolLM3); (): all
    layer_windows: tuple[int, ...] = ()  # per layer, its sliding window (0: full attention); (): all full
    hidden_act: str = "silu"  # the MLP gate's activation: silu, or gelu_pytorch_tanh (Gemma 3)
    attention_scale: float = 0.0  # scale of q.k; 0: 1/sqrt(head_dim)

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
        for name in ("rope_layers", "layer_windows"):
            if len(getattr(self, name)) not in (0, self.num_layers):
                raise ValueError(f"ModelConfig.{name} must name every layer or none")
        if self.rope_freq_factors and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"{len(self.rope_freq_factors)} rope frequency factors for head_dim {self.head_dim}")

    @property
    def gemma(self) -> bool:
        """Gemma 3's block: scaled embeddings, (1 + w) norms, norms after attention and MLP."""
        return self.model_type == "gemma3_text"

    @property
    def plain_llama(self) -> bool:
        """Exactly the Llama block, which the C glue and the fused C decoder implement."""
        return not (self.attention_bias or self.qk_norm or self.gemma or self.hidden_act != "silu"
                    or not all(self.rope_layers) or any(self.layer_windows) or self.attention_scale)

    def window(self, layer: int) -> int:
        """Layer's sliding window (a query sees the keys of its last `window` positions), 0 for full."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def uses_rope(self, layer: int) -> bool:
        return self.rope_layers[layer] if self.rope_layers else True

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (used by the weights cache)."""
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["rope_scaling"] = dict(self.rope_scaling)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict`."""
        d = dict(d)
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        d["rope_scaling"] = tuple(sorted(dict(d.get("rope_scaling") or {}).items()))
        for name in ("rope_freq_factors", "rope_layers", "layer_windows"):
            d[name] = tuple(d.get(name) or ())
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
                f"runs these HF model types: {sorted(SUPPORTED_HF_MODEL_TYPES)}"
            )
        # Qwen2's q/k/v biases are built in; a Llama or Mistral with attention_bias also has one
        # on o_proj, which the model code lacks.
        if model_type != "qwen2" and cfg.get("attention_bias"):
            raise UnsupportedModelError(f"attention_bias=True is not supported for {model_type}")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=True is not supported")
        gemma = model_type == "gemma3_text"
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        act = "silu" if act == "swish" else act
        if act != (GELU_TANH if gemma else "silu"):
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported for {model_type}")
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(cap) is not None:
                raise UnsupportedModelError(f"{cap}={cfg[cap]} is not supported")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError("use_bidirectional_attention is not supported")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        windows = _hf_windows(cfg, model_type, layers, max_pos)
        rope_theta, scaling, local_theta = _hf_rope(cfg, windows)
        rope_layers: tuple[bool, ...] = ()
        if model_type == "smollm3":
            flags = cfg.get("no_rope_layers")  # despite the name: 1 where the layer uses rope
            if flags is None:
                every = int(cfg.get("no_rope_layer_interval", 4))
                flags = [int((i + 1) % every != 0) for i in range(layers)]
            if len(flags) != layers:
                raise UnsupportedModelError(f"no_rope_layers names {len(flags)} of {layers} layers")
            rope_layers = tuple(bool(f) for f in flags) if not all(flags) else ()
        gen = generation_config or {}
        eos = _as_id_tuple(gen.get("eos_token_id"))
        if not eos:
            eos = _as_id_tuple(cfg.get("eos_token_id"))
        eos = _dedupe(eos + tuple(extra_eos_token_ids))
        bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
        # Gemma's checkpoints leave tie_word_embeddings to the class default (tied).
        tie = cfg.get("tie_word_embeddings", gemma or model_type == "smollm3")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position=max_pos,
            tie_word_embeddings=bool(tie),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos,
            model_type=str(model_type),
            rope_scaling=scaling,
            local_rope_theta=local_theta,
            attention_bias=model_type == "qwen2",
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            rope_layers=rope_layers,
            layer_windows=windows,
            hidden_act=act,
            attention_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else 0.0,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A transformers `config.json` for LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM
        (what a GGUF loads as).

        Both the v4 (`rope_theta`, `rope_scaling`) and v5 (`rope_parameters`) spellings are
        written, so older readers (vLLM pins transformers 4.x) and newer ones agree.
        """
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        if self.model_type not in arch or self.rope_freq_factors:
            why = "rope_freqs factors" if self.rope_freq_factors else f"model_type {self.model_type!r}"
            raise UnsupportedModelError(f"{why} can't be written as an HF config here")
        scaling = dict(self.rope_scaling) or None
        return {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
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
            "rope_scaling": scaling,
            "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0],
            "torch_dtype": "float32",
            "use_cache": True,
        }


def _hf_windows(cfg: dict[str, Any], model_type: str, layers: int, max_pos: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full), as transformers assigns them; () when none bites."""
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "smollm3") and not cfg.get("use_sliding_window", False):
        window = None  # their configs carry a window that only use_sliding_window turns on
    if window is None or (int(window) >= max_pos and model_type != "gemma3_text"):
        return ()  # a window no sequence can outgrow is full attention (Gemma's also picks the rope)
    window = int(window)
    types = cfg.get("layer_types")
    if types is None and model_type == "gemma3_text":
        every = int(cfg.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    elif types is None and model_type in ("qwen2", "qwen3", "smollm3"):
        first = int(cfg.get("max_window_layers", layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    elif types is None:
        types = ["sliding_attention"] * layers  # Mistral: every layer
    if len(types) != layers:
        raise UnsupportedModelError(f"layer_types names {len(types)} of {layers} layers")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported")
    out = tuple(window if t == "sliding_attention" else 0 for t in types)
    return out if any(out) else ()


def _rope_spec(p: dict[str, Any] | None, default_theta: float) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """(theta, scaling items) of one HF rope dict, refusing the schemes the model lacks."""
    p = dict(p or {})
    kind = p.get("rope_type", p.get("type")) or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling {kind!r} is not supported; stopline computes {sorted(SUPPORTED_ROPE_TYPES)}")
    theta = float(p.get("rope_theta") or default_theta)
    if kind == "default":
        return theta, ()
    keys = {"linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}[kind]
    missing = [k for k in keys if p.get(k) is None]
    if missing:
        raise UnsupportedModelError(f"rope scaling {kind!r} lacks {missing}")
    return theta, tuple(sorted([("rope_type", kind), *((k, float(p[k])) for k in keys)]))


def _hf_rope(cfg: dict[str, Any], windows: tuple[int, ...]) -> tuple[float, tuple[tuple[str, Any], ...], float]:
    """(rope theta, scaling of the global layers, rope theta of the sliding layers or 0) from the
    v5 layout (`rope_parameters`, per layer type for Gemma 3) or the v4 one (`rope_theta`,
    `rope_scaling`, `rope_local_base_freq`)."""
    base = float(cfg.get("rope_theta") or 10000.0)
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per layer type
        theta, scaling = _rope_spec(params["full_attention"], base)
        local = params.get("sliding_attention")
        if local is None:
            return theta, scaling, 0.0
        local_theta, local_scaling = _rope_spec(local, base)
        if local_scaling:
            raise UnsupportedModelError("rope scaling on sliding-window layers is not supported")
        return theta, scaling, local_theta if any(windows) else 0.0
    if not isinstance(params, dict):
        params = cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else None
    theta, scaling = _rope_spec(params, base)
    local = float(cfg.get("rope_local_base_freq") or 0.0) if any(windows) else 0.0
    return theta, scaling, local


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _dedupe(ids: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and [out, in] shapes a checkpoint for `config` must have."""
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
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (config.num_heads * hd,)
            shapes[p + "self_attn.k_proj.bias"] = (config.num_kv_heads * hd,)
            shapes[p + "self_attn.v_proj.bias"] = (config.num_kv_heads * hd,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        if config.gemma:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
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
