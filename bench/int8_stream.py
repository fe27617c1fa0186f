"""How fast one and two threads read the fast mode's weights through the int8 kernel at one
row, from memory and from cache.

    python bench/int8_stream.py
    python bench/int8_stream.py --threads 1 2 1 2 --rounds 30

"memory": SmolLM2's 30 layers once (66 MB against a 32 MB L3), as a decode step reads them;
"cache": the first two layers over and over (4.4 MB). If one thread reads from cache far
faster than from memory, a one-row step on one core is bound by that core's memory reads, not
its arithmetic; the gap between one and two threads from memory is then what a step that
gives a core to a neighbour must pay (docs/benchmarks.md, "Numerics modes and floors").
"""

from __future__ import annotations

import argparse
import time

import torch

from stopline.config import EngineConfig
from stopline.engine.llm import LLM
from stopline.model.kernels.int8_linear import Int8Weight


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 1, 2])
    ap.add_argument("--rounds", type=int, default=20, help="timed passes (best shown)")
    args = ap.parse_args()
    config = EngineConfig(numerics="fast", enable_prefix_caching=False, speculative="off")
    model = LLM(None, config=config, progress=False).engine.runner.model
    weights = [layer[n].fast for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]
    if not all(isinstance(w, Int8Weight) for w in weights):
        raise SystemExit("the int8 kernel is not in use here (no AVX512-VNNI, or STOPLINE_INT8=0)")
    x = torch.zeros(max(w.in_features for w in weights), dtype=torch.int8)  # one quantized row
    scale, zero = torch.ones(64), torch.zeros(64, dtype=torch.int32)
    y = torch.empty(max(w.out_features for w in weights))
    ptrs = (x.data_ptr(), scale.data_ptr(), scale.data_ptr(), zero.data_ptr())
    calls = [(w._fn, w.packed.data_ptr(), w.in_features, w.out_features, w.packed.numel()) for w in weights]
    sets = {"memory": calls, "cache": calls[:8] * 15}
    for threads in args.threads:
        torch.set_num_threads(threads)
        out = []
        for name, todo in sets.items():
            best = float("inf")
            for _ in range(args.rounds):
                start = time.perf_counter()
                for fn, w, k, n, _ in todo:
                    fn(*ptrs, w, y.data_ptr(), 1, k, n)
                best = min(best, time.perf_counter() - start)
            gbs = sum(c[4] for c in todo) / best / 1e9
            out.append(f"{name} {gbs:.1f} GB/s ({best * 1e3:.2f} ms)")
        print(f"{threads} thread{'s' if threads > 1 else ''}: " + ", ".join(out), flush=True)


if __name__ == "__main__":
    main()
