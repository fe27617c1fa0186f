"""An engine that is dropped is freed: nothing keeps its frames, its KV cache or its logits.

On a host where stopline's C kernels can't build, `kernels()` re-raised one kept exception
on every op, and each raise chained the caller's frames onto its traceback: every step's
frames (with the engine, its logits and its KV) stayed alive for the life of the process.
"""

from __future__ import annotations

import gc
import traceback
import weakref

from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.model.kernels import native
from stopline.model.loaders.loader import load_model
from stopline.request import SamplingParams


def _depth(exc: BaseException) -> int:
    return len(traceback.extract_tb(exc.__traceback__))


def test_an_unavailable_kernel_raises_fresh_each_time(monkeypatch):
    monkeypatch.setattr(native, "_outcome", native.NativeUnavailable("no compiler here"))
    depths = []
    for _ in range(3):
        try:
            native.kernels()
        except native.NativeUnavailable as e:
            depths.append(_depth(e))
    assert depths[0] == depths[1] == depths[2], depths  # nothing chained onto the kept one
    assert native._outcome.__traceback__ is None


def test_a_dropped_engine_is_freed(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), progress=False)
    for async_scheduling in (False, True):
        eng = EngineCore(loaded, EngineConfig(num_blocks=32, block_size=4, debug=True,
                                              async_scheduling=async_scheduling))
        eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))
        while eng.has_unfinished():
            eng.step()
        gone = weakref.ref(eng)
        if eng._worker is not None:
            eng._worker.shutdown()
        del eng
        gc.collect()
        assert gone() is None, "something still holds the engine"
