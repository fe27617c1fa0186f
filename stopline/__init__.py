"""stopline: an LLM serving engine whose stop path is a designed, tested subsystem."""

import os

# How long OpenMP threads spin between parallel regions. libgomp's default spin (300k) made
# a contended 2-core machine 10x slower (0.5 vs 3.8 tok/s, one stream, two busy processes
# beside it), while not spinning at all (OMP_WAIT_POLICY=PASSIVE) halved a quiet machine's
# speed when every GEMM woke its threads from sleep. Since the layers run in one C call the
# gaps between regions are short, and a spin of 1,000 covers them: with a process taking 29%
# of one CPU beside a 32-request decode (`stopline bench neighbours --streams 32 --busy-ms 2
# --idle-ms 5 --settle 0 --steps 5 --rounds 8`), the step slowed 1.46-1.50x against
# 1.78-1.86x with 20,000, and a quiet step took the same time with either
# (1 and 32 requests, quantized and float32 paths: `python bench/step_time.py 1 32
# --compare-quant 64`). Served, the API server and the client are that process. It must be
# set before torch loads its OpenMP runtime; explicit settings win (and the serving
# benchmark starts peer engines without it: SPIN_SET_HERE).
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "1000"
    SPIN_SET_HERE = True
else:
    SPIN_SET_HERE = False

from stopline.config import EngineConfig, PreemptionMode, VictimPolicy
from stopline.engine.llm import LLM, Completion, GenerationResult
from stopline.request import AbortSource, FinishReason, InvalidRequest, SamplingParams

__all__ = [
    "LLM", "AbortSource", "Completion", "EngineConfig", "FinishReason", "GenerationResult",
    "InvalidRequest", "PreemptionMode", "SamplingParams", "VictimPolicy",
]
__version__ = "0.1.0"
