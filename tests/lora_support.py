"""Random LoRA adapters for the tiny test models, written by peft itself (the PEFT layout), and
the HF + peft oracle: the base model with the adapter merged into its weights."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(model_dir: Path, out: Path, *, seed: int, r: int = 4, alpha: float = 8.0,
                 targets: Sequence[str] = ALL_TARGETS, std: float = 0.15, rslora: bool = False) -> Path:
    """A PEFT LoRA directory for the HF model at model_dir, with random A and B (peft starts
    B at zero, which would change nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                     bias="none", use_rslora=rslora, task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return out


def merged(model_dir: Path, adapter_dir: Path):  # -> transformers.PreTrainedModel
    """The oracle: the base model with the adapter merged (W + scale * B A), in eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def peft_to_gguf(adapter_dir: Path, out: Path, *, q_heads: int, kv_heads: int, f16: bool = False) -> Path:
    """The PEFT adapter as llama.cpp's convert_lora_to_gguf.py writes it: blk.N.<tensor>.weight
    .lora_a / .lora_b, Llama's Q/K rows of B permuted like the base weights."""
    import json

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from tests.tiny_families import _permute

    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(cfg["lora_alpha"]))
    for key, t in sorted(load_file(str(adapter_dir / "adapter_model.safetensors")).items()):
        parts = key.split(".")
        li, module, half = int(parts[parts.index("layers") + 1]), parts[-3], parts[-2][-1].lower()
        arr = t.numpy().astype(np.float32)
        if half == "b" and module in ("q_proj", "k_proj"):
            arr = _permute(arr, q_heads if module == "q_proj" else kv_heads)
        w.add_tensor(f"blk.{li}.{names[module]}.weight.lora_{half}", arr.astype(np.float16) if f16 else arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
