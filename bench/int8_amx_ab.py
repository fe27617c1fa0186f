"""Fast mode with the int8 kernel's many-row paths (Q4 nibbles split once a panel:
csrc/int8_rows.c; AMX-INT8 tiles: csrc/amx_i8_gemm.c) against the VNNI panels alone,
interleaved in one process (the switches change no bits): prefill of one 512-token prompt and
the 32-stream decode step, SmolLM2 (the default model).

    python bench/int8_amx_ab.py --rounds 5 [--threads 1]

Each round runs both arms in turn (the order alternating): prefill tok/s (best of --reps) and
the step's p50 over --steps steps (stopline.bench.floors' step_times: turns of 10 timed steps,
each opened by 2 untimed). Medians over rounds, with the min-max spread.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from stopline.bench.floors import prefill_rate, step_times
from stopline.config import EngineConfig
from stopline.engine.llm import LLM
from stopline.model.kernels.int8_linear import use_amx, use_split


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: the engine's default)")
    args = ap.parse_args()
    config = EngineConfig(numerics="fast", enable_prefix_caching=False, speculative="off")
    engine = LLM(None, config=config, progress=False).engine
    if args.threads:
        torch.set_num_threads(args.threads)
    arms = {"panels": (False, 0), "split": (True, 0)}
    if use_amx(None):
        arms["split+tiles"] = (True, 1)
    pre: dict[str, list[float]] = {a: [] for a in arms}
    step: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(args.rounds):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]  # a slow spell lands on all alike
        for a in order:
            use_split(arms[a][0])
            use_amx(arms[a][1])
            pre[a].append(prefill_rate(engine, args.tokens, args.reps))
            got = step_times({a: engine}, args.streams, warm=4, steps=args.steps)
            step[a].append(got[a]["p50_ms"])
        print(f"round {r}: " + ", ".join(f"{a} prefill {pre[a][-1]:.0f} tok/s, step {step[a][-1]:.2f} ms"
                                          for a in arms), flush=True)
    use_amx(None)
    use_split(True)

    def med(v: list[float], f: str) -> str:
        return f"{statistics.median(v):{f}} ({min(v):{f}}-{max(v):{f}})"
    for a in arms:
        print(f"{a}: prefill {args.tokens} tokens {med(pre[a], '.0f')} tok/s; "
              f"{args.streams}-stream step p50 {med(step[a], '.2f')} ms")


if __name__ == "__main__":
    main()
