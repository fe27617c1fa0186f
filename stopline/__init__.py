"""stopline: an LLM serving engine whose stop path is a designed, tested subsystem."""

from stopline.config import EngineConfig, PreemptionMode, VictimPolicy
from stopline.engine.llm import LLM, Completion, GenerationResult
from stopline.request import AbortSource, FinishReason, InvalidRequest, SamplingParams

__all__ = [
    "LLM", "AbortSource", "Completion", "EngineConfig", "FinishReason", "GenerationResult",
    "InvalidRequest", "PreemptionMode", "SamplingParams", "VictimPolicy",
]
__version__ = "0.1.0"
