"""Time pure decode steps of the engine at a given number of running requests.

    python bench/step_time.py 11 31        # p50 / min step time at 11, then 31 requests

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
    args = ap.parse_args()
    llm = LLM(config=EngineConfig(), progress=False)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.warm + args.steps + 8, ignore_eos=True)
    for n in args.requests:
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
        print(f"{n} requests: step p50 {times[len(times) // 2] * 1e3:.1f} ms, min {times[0] * 1e3:.1f} ms "
              f"({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
