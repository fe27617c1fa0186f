"""Process entry of each role: the engine-core process (engine/proc/core_proc.py) builds
its core with `RoleFactory` instead of a plain EngineCore. Picklable, so the spawned
process can take it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stopline.disagg.messages import RoleSpec

if TYPE_CHECKING:  # the engine is imported in the spawned process, when the core is built
    from stopline.config import EngineConfig
    from stopline.engine.core import EngineCore, ModelSource


class RoleFactory:
    def __init__(self, spec: RoleSpec) -> None:
        if spec.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {spec.role!r}")
        self.spec = spec

    def __call__(self, model: ModelSource, config: EngineConfig | None, *,
                 progress: bool = True) -> EngineCore:
        if self.spec.role == "prefill":
            from stopline.disagg.prefill_core import PrefillCore

            return PrefillCore(model, config, spec=self.spec, progress=progress)
        from stopline.disagg.decode_core import DecodeCore

        return DecodeCore(model, config, spec=self.spec, progress=progress)
