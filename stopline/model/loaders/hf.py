"""Read an HF transformers model directory (config.json + *.safetensors + tokenizer.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from stopline.model.config import ModelConfig
from stopline.tokenizer.tokenizer import Tokenizer


def _read_json(p: Path) -> dict[str, Any]:
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{p} must hold a JSON object")
    return data


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a model dir: those named by a sharded index if there is one,
    else every *.safetensors file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards named in {index} are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {bins}: re-save with safe_serialization=True)" if bins else ""
        raise FileNotFoundError(f"no *.safetensors weights in {path}{hint}")
    return files


def load_hf_dir(path: Path, *, progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Load config, float32 weights (HF names) and tokenizer from an HF model directory."""
    cfg = _read_json(path / "config.json")
    gen_path = path / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    tokenizer = Tokenizer.from_hf_dir(path)
    config = ModelConfig.from_hf_config(cfg, generation_config=gen, extra_eos_token_ids=tokenizer.eos_token_ids)
    # One stop list for both: the engine checks config.eos_token_ids, detokenization the tokenizer's.
    tokenizer.eos_token_ids = config.eos_token_ids
    if tokenizer.bos_token_id is None:
        tokenizer.bos_token_id = config.bos_token_id

    files = safetensors_files(path)
    weights: dict[str, torch.Tensor] = {}
    with tqdm(total=len(files), desc=f"loading {path.name}", unit="file", file=sys.stderr,
              disable=not progress, leave=False) as bar:
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if name.endswith("rotary_emb.inv_freq"):
                        continue  # old checkpoints saved this buffer; it is recomputed from theta
                    if name in weights:
                        raise ValueError(f"tensor {name} appears in more than one shard ({f.name})")
                    weights[name] = st.get_tensor(name).to(torch.float32).contiguous()
            bar.update(1)
    if config.gemma:
        # Gemma's norms scale by (1 + w); hand the model the multiplier, as a GGUF holds it
        # (convert_hf_to_gguf.py adds the 1). float32 1 + w is what transformers computes.
        for name in weights:
            if name.endswith("norm.weight"):
                weights[name] = weights[name] + 1.0
    if config.tie_word_embeddings:
        # Some tied checkpoints still store lm_head (a copy of the embedding); the model ties it.
        weights.pop("lm_head.weight", None)
    return config, weights, tokenizer
