"""Time pure decode steps of the engine at a given number of running requests.

    python bench/step_time.py 11 31        # p50 / min step time at 11, then 31 requests
    python bench/step_time.py 64 --warm 150 --compare-decode-rows   # with and without DecodeRows

Each request is a chat-templated question (the offline benchmark's prompts) generating with
EOS ignored; steps are timed after `--warm` steps, so every request is decoding.
"""

from __future__ import annotations

import argparse
import time

# stopline first: it sets the OpenMP spin policy before torch loads libgomp.
from stopline import LLM, SamplingParams
from stopline.bench.offline import chat_prompts
from stopline.config import EngineConfig


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("requests", type=int, nargs="+")
    ap.add_argument("--warm", type=int, default=40, help="steps before timing")
    ap.add_argument("--steps", type=int, default=40, help="steps timed")
    ap.add_argument("--compare-decode-rows", action="store_true",
                    help="time each count with DecodeRows on, then off (the gathering path)")
    args = ap.parse_args()
    cfg = EngineConfig(kv_cache_memory_gb=2.0)
    llm = LLM(config=cfg, progress=False)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.warm + args.steps + 8, ignore_eos=True)
    rows = eng.runner.rows
    runs = [(n, on) for n in args.requests for on in ((True, False) if args.compare_decode_rows else (True,))]
    for n, on in runs:
        eng.runner.rows = rows if on else None
        for i, ids in enumerate(chat_prompts(eng.loaded, n)):
            eng.add_request(f"{n}-{i}", ids, params)
        for _ in range(args.warm):
            eng.step()
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        while eng.has_unfinished():
            eng.step()
        times.sort()
        label = "" if not args.compare_decode_rows else (" decode rows" if on else " gathering")
        print(f"{n} requests{label}: step p50 {times[len(times) // 2] * 1e3:.1f} ms, min {times[0] * 1e3:.1f} ms "
              f"({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
