"""One wave of N prompts through an engine's offline API, no server: tokens per second.

    python bench/peers/offline_wave.py --engine stopline 64 32
    $STOPLINE_PEERS_DIR/vllm-venv/bin/python bench/peers/offline_wave.py --engine vllm 64 32

The prompts are the serving benchmark's (seeded random words, ~118 tokens), 256 tokens each
with EOS ignored, greedy. Comparing this with `stopline bench serve` tells the engine's share
of a gap from the serving path's. vLLM needs the HF directory setup_vllm.sh exports.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # stopline's prompts, from any venv

from stopline.bench.prompts import make_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("streams", type=int, nargs="+")
    ap.add_argument("--engine", choices=["stopline", "vllm"], required=True)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    if args.engine == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        from vllm import LLM, SamplingParams

        peers = os.environ.get("STOPLINE_PEERS_DIR", "/work/peers")
        llm = LLM(model=f"{peers}/hf-smollm2", dtype="float32", max_num_seqs=64, max_model_len=4096,
                  gpu_memory_utilization=0.4)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    else:
        from stopline import LLM, SamplingParams
        from stopline.config import EngineConfig

        llm = LLM(config=EngineConfig(kv_cache_memory_gb=2.0), progress=False)  # vLLM's 2 GiB
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for n in args.streams:
        prompts = make_prompts(n, n, 128)
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"{args.engine} offline, {n} streams: {toks} tokens in {dt:.1f} s = {toks / dt:.1f} tok/s",
              flush=True)


if __name__ == "__main__":  # vLLM's engine process is spawned: the guard is required
    main()
