"""stopline: an LLM serving engine whose stop path is a designed, tested subsystem."""

import os

# How long OpenMP threads spin between parallel regions. libgomp's default spin (300k) made
# a contended 2-core machine 10x slower (0.5 vs 3.8 tok/s, one stream, two busy processes
# beside it), while not spinning at all (OMP_WAIT_POLICY=PASSIVE) halves a quiet machine's
# speed, since every GEMM then wakes its threads from sleep (6.6-10 vs 14-16 tok/s). A short
# spin covers the gaps between a step's GEMMs and gives the core back soon after: 3.3 tok/s
# contended, 14-16 quiet. It must be set before torch loads its OpenMP runtime; explicit
# settings win.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "20000"

from stopline.config import EngineConfig, PreemptionMode, VictimPolicy
from stopline.engine.llm import LLM, Completion, GenerationResult
from stopline.request import AbortSource, FinishReason, InvalidRequest, SamplingParams

__all__ = [
    "LLM", "AbortSource", "Completion", "EngineConfig", "FinishReason", "GenerationResult",
    "InvalidRequest", "PreemptionMode", "SamplingParams", "VictimPolicy",
]
__version__ = "0.1.0"
