"""Engine-wide stops of one core (docs/engine-stops.md): what it holds resident and which weights serve.

Sleep frees the KV pool and the prefix cache (level 2: the weights too) and wake-up restores
them; a weight update stages new weights (checked against the served architecture) and
commits them between steps; LoRA adapters load and unload (engine/adapters.py holds them);
`halted` is a pause with mode keep (the loop that steps the core sets it and runs no step
while it holds). All of it runs between steps, on the stepping thread (the core loop's
utility calls; a test may call it between its own steps). The core owns one `Residency` (`core.residency`); it is no
subclass of the core and keeps no per-request state.
"""

from __future__ import annotations

import ctypes
import gc
import time
from typing import TYPE_CHECKING

from stopline.config import PreemptionMode
from stopline.engine.output import RequestOutput
from stopline.model.loaders.loader import LoadedModel, load_model
from stopline.request import AbortSource
from stopline.worker.runner import ModelRunner

if TYPE_CHECKING:
    from stopline.engine.core import EngineCore, ModelSource

# What a weight update may not change (the KV layout, the network's shapes and its kind).
ARCHITECTURE = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                "num_heads", "num_kv_heads", "head_dim", "tie_word_embeddings", "attention_bias",
                "qk_norm", "rope_layers", "layer_windows")


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc keeps some below its mmap threshold)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Residency:
    def __init__(self, core: EngineCore, model: ModelSource) -> None:
        self.core = core
        # Where the weights come from (level-2 sleep reloads them from there); which weights
        # serve (every output carries it).
        self._weights_path: tuple[str | None] | None = None if isinstance(model, LoadedModel) else (model,)
        self.weight_version = 0
        self.asleep = 0  # the sleep level: 0 awake, 1 KV freed, 2 weights freed too
        self.halted = False  # paused with mode keep (set by the loop that steps it)
        self._staged: LoadedModel | None = None

    def halted_tick(self) -> list[RequestOutput]:
        """Halted or asleep, no step runs: apply the aborts that came in (the inbox's adds
        wait) and return their terminal outputs."""
        self.core._apply_aborts()
        return self.core.outputs.collect()

    def sleep(self, level: int) -> int:
        """Free the KV pool and the prefix cache (level 2: the weights too). Nothing may be
        live: the front end pauses with mode abort or wait first. Returns the bytes freed."""
        core = self.core
        if level not in (1, 2):
            raise ValueError(f"level: must be 1 or 2, got {level}")
        # Late aborts of requests already over, and adds whose abort overtook them (the front
        # end aborted every open request before this): they end here, nothing is kept for them.
        core._apply_inbox()
        if core.families or core.inbox.has_any():
            raise RuntimeError(f"sleep: {len(core.families)} requests are live; pause with mode "
                               "abort or wait first")
        if level == 2 and not isinstance(core.runner, ModelRunner):
            raise ValueError("level: 2 needs the model's own runner")
        if level == 2 and self._weights_path is None:
            raise ValueError("level: 2 frees the weights, but these were handed in, not loaded "
                             "from a path: they could not be reloaded")
        if self.asleep >= level:
            return 0
        freed = 0
        if not self.asleep:
            core.kv_manager.reset_prefix_cache()
            freed += core.kv.free_memory()
            if core.worker.rows is not None:
                core.worker.rows.reset()
        if level == 2:
            assert isinstance(core.runner, ModelRunner)
            freed += sum(t.numel() * t.element_size() for t in core.loaded.weights.values())
            core.runner.model = None  # type: ignore[assignment]
            core.model = None
            core.loaded.weights.clear()
            core.loaded.blocks.clear()
        self.asleep = level
        _trim_heap()
        return freed

    def wake_up(self) -> int:
        """Undo sleep: allocate the KV pool again (zeroed), reload the weights after level 2."""
        core = self.core
        if self.asleep == 2:
            assert self._weights_path is not None and isinstance(core.runner, ModelRunner)
            self._serve(load_model(self._weights_path[0], progress=False))
        core.kv.restore_memory()
        self.asleep = 0
        return core.kv.nbytes

    def stage_weights(self, path: str) -> dict:
        """Load new weights and check them against the served architecture; nothing changes
        yet. Raises ValueError naming what does not match."""
        if not isinstance(self.core.runner, ModelRunner):
            raise ValueError("path: this engine runs no model of its own (a test runner)")
        self._staged = None
        loaded = load_model(path, progress=False)
        old, new = self.core.model_config, loaded.config
        diff = [f"{k} {getattr(new, k)!r} (serving {getattr(old, k)!r})" for k in ARCHITECTURE
                if getattr(old, k) != getattr(new, k)]
        if diff:
            raise ValueError(f"path: {path} is not the served architecture: {'; '.join(diff)}")
        self._staged = loaded
        return {"path": path, "source": loaded.source}

    def commit_weights(self, recompute: bool = False) -> int:
        """Serve the staged weights from the next step on; returns the new weight version.
        Outputs already computed left before this (the loop flushes them); the prefix cache
        forgets every block, and the live requests' blocks never enter it again.

        recompute: every request with KV in the pool is preempted by recompute here (not
        counted against max_preemptions): it is admitted again and re-prefills its prompt and
        the tokens it has under the new weights (no block of old weights is served: the hashes
        are forgotten below), so its later tokens are what the new weights give from that point."""
        if self._staged is None:
            raise RuntimeError("no weights are staged")
        if self.asleep:
            raise RuntimeError("the engine is asleep: wake it up first")
        loaded, self._staged = self._staged, None
        assert isinstance(self.core.runner, ModelRunner)
        if recompute:
            self.recompute_live()
        self._serve(loaded)
        self._weights_path = (loaded.source,)
        self.core.kv_manager.new_weights()
        self.weight_version += 1
        _trim_heap()
        return self.weight_version

    def recompute_live(self) -> int:
        """Preempt by recompute every running request that holds KV (a family's samples
        waiting inside their leader go with it); returns how many."""
        core = self.core
        live = [r for r in core.queues.running if r.fork_leader is None]
        for r in live:
            core.lifecycle.preempt(r, PreemptionMode.RECOMPUTE)
        return len(live)

    def drop_staged(self) -> None:
        self._staged = None

    def load_lora(self, name: str, path: str, load_id: int | None = None) -> dict:
        """Load an adapter; {'status': 200 | 400, 'message': ...}. load_id: see Adapters.load."""
        return self.core.adapters.load(name, path, load_id)

    def unload_lora(self, name: str, policy: str = "wait") -> dict:
        """Unload an adapter with a policy (engine/adapters.py); requests aborted for it end
        at the next step boundary with source `unload`."""
        got, users = self.core.adapters.unload(name, policy)
        if users:
            self.core.abort(sorted({r.incarnation for r in users}), AbortSource.UNLOAD, time.monotonic())
        return got

    def _serve(self, loaded: LoadedModel) -> None:
        """Build the network of these weights and run the core's steps on it."""
        core = self.core
        assert isinstance(core.runner, ModelRunner)
        core.runner.model = core.model = ModelRunner.build_model(loaded, core.config)
        core.model.adapters = core.adapters.loaded  # loaded adapters outlive the network
        core.model.lora_slots = core.adapters.slots  # and so do the resident ones' slots
        core.loaded = loaded
