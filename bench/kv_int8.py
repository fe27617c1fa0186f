"""Decode steps at a long context, fast numerics on a float32 KV cache against an int8 one.

    python bench/kv_int8.py --context 2048 --streams 1 32

Each stream's prompt is --context random plain tokens (no prefix shared, prefix caching off);
both engines prefill all their streams, then take turns of --turn timed decode steps (each
turn after --settle untimed ones, so a slow spell of the host lands on both alike). Printed:
the p50 and min step of each at each stream count, the KV bytes a step reads (streams x
context x bytes a token), a block's bytes (what swap moves per block), and the block counts
the same --kv-cache-gb buys.
"""

from __future__ import annotations

import argparse
import json
import random
import time

# stopline first: it sets the OpenMP spin policy before torch loads libgomp.
from stopline import LLM, SamplingParams
from stopline.bench import machine
from stopline.config import EngineConfig
from stopline.kv.kv_cache import KVCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct (Q4_1 GGUF)")
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens of each stream")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--warm", type=int, default=4, help="decode steps after the prefills, untimed")
    ap.add_argument("--steps", type=int, default=30, help="decode steps timed per engine")
    ap.add_argument("--turn", type=int, default=5)
    ap.add_argument("--settle", type=int, default=1)
    ap.add_argument("--kv-cache-gb", type=float, default=4.0)
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    kinds = {"fast": "auto", "fast-int8": "int8"}
    engines = {}
    for label, kv in kinds.items():
        cfg = EngineConfig(numerics="fast", kv_cache_dtype=kv, kv_cache_memory_gb=args.kv_cache_gb,
                           enable_prefix_caching=False, speculative="off", target_step_ms=None,
                           max_num_seqs=max(args.streams), max_num_batched_tokens=2048)
        engines[label] = LLM(args.model, config=cfg, progress=False).engine
    e0 = engines["fast"]
    c = e0.model_config
    bs = e0.kv.block_size
    result: dict = {**machine.stamp(), "context": args.context, "block_size": bs, "kv": {}, "steps": []}
    for label, e in engines.items():
        kv = e.kv
        per_block = KVCache.bytes_per_block(c.num_layers, bs, c.num_kv_heads, c.head_dim, kv.k[0].dtype)
        swapped = sum(t.numel() * t.element_size() for t in kv.read_blocks([0]))
        result["kv"][label] = {"bytes_per_block": per_block, "swap_bytes_per_block": swapped,
                               "blocks": kv.num_blocks, "cache_bytes": kv.nbytes}
    for n in args.streams:
        rng = random.Random(n)
        vocab = c.vocab_size
        prompts = [[rng.randrange(100, vocab) for _ in range(args.context)] for _ in range(n)]
        steps_needed = args.warm + -(-args.steps // args.turn) * (args.turn + args.settle) + 4
        params = SamplingParams(temperature=0.0, max_tokens=steps_needed + 8, ignore_eos=True)
        for label, e in engines.items():
            for i, p in enumerate(prompts):
                e.add_request(f"{label}-{n}-{i}", p, params)
            t0 = time.perf_counter()
            while len(e.queues.running) < n or any(not r.output_token_ids for r in e.queues.running):
                e.step()
            print(f"{label}: {n} prefills of {args.context} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
            for _ in range(args.warm):
                e.step()
        times: dict[str, list[float]] = {label: [] for label in engines}
        for t in range(-(-args.steps // args.turn)):
            for label, e in engines.items():
                for _ in range(args.settle):
                    e.step()
                for _ in range(min(args.turn, args.steps - t * args.turn)):
                    t0 = time.perf_counter()
                    e.step()
                    times[label].append(time.perf_counter() - t0)
        for label, e in engines.items():
            while e.has_unfinished():  # the few tokens left
                e.step()
            ts = sorted(times[label])
            per_token = KVCache.bytes_per_block(c.num_layers, 1, c.num_kv_heads, c.head_dim, e.kv.k[0].dtype)
            row = {"streams": n, "engine": label, "p50_ms": ts[len(ts) // 2] * 1e3, "min_ms": ts[0] * 1e3,
                   "kv_bytes_read": n * (args.context + args.warm) * per_token}
            result["steps"].append(row)
            print(f"{n:>3} streams {label:>9}: step p50 {row['p50_ms']:7.2f} ms, min {row['min_ms']:7.2f} ms, "
                  f"KV read {row['kv_bytes_read'] / 2**20:8.1f} MiB", flush=True)
    for label, k in result["kv"].items():
        print(f"{label:>9}: {k['bytes_per_block']} bytes a block of {bs} tokens (swap moves "
              f"{k['swap_bytes_per_block']}), {k['blocks']} blocks in {args.kv_cache_gb} GiB")
    for n in args.streams:
        t = {r["engine"]: r["p50_ms"] for r in result["steps"] if r["streams"] == n}
        print(f"{n} streams at {args.context}: fast-int8 / fast step time {t['fast-int8'] / t['fast']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
