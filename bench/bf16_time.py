"""Fast numerics: decode step time with Q4_1 blocks read up to ROWS rows against bf16 weights
only (the same bits either way; two engines stepped alternately, SmolLM2's GGUF).

    python bench/bf16_time.py 1 2 4 8 12 16 --q4-rows 16
"""

from __future__ import annotations

import argparse
import dataclasses

from stopline import LLM
from stopline.bench.floors import step_times
from stopline.config import EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("streams", type=int, nargs="+")
    ap.add_argument("--q4-rows", type=int, default=16)
    ap.add_argument("--warm", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    cfg = EngineConfig(numerics="fast", enable_prefix_caching=False)
    engines = {"q4 blocks": LLM(config=cfg, progress=False).engine, "bf16 only": LLM(config=cfg, progress=False).engine}
    for label, eng in engines.items():
        m = eng.runner.model
        for lin in [m.lm_head, *(v for layer in m.layers for v in layer.values() if hasattr(v, "fast"))]:
            lin.fast = dataclasses.replace(lin.fast, q4_max_rows=args.q4_rows) if label == "q4 blocks" else \
                dataclasses.replace(lin.fast, q4=None)
    for n in args.streams:
        t = step_times(engines, n, args.warm, args.steps)
        a, b = t["q4 blocks"]["p50_ms"], t["bf16 only"]["p50_ms"]
        print(f"{n} streams: q4 blocks p50 {a:.2f} ms, bf16 only {b:.2f} ms, ratio {a / b:.2f}")


if __name__ == "__main__":
    main()
