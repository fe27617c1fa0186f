"""Time the ownership audit (EngineCore.audit: the ledger, every holder) on a busy engine,
next to the decode step it is sampled on (`--audit-every N`, docs/soak.md).

    python bench/audit_time.py                 # SmolLM2, 0.25 GiB pool, 32 decoding requests
    python bench/audit_time.py --requests 64 --kv-cache-gb 1

The audit's cost per step at `--audit-every N` is its time / N.
"""

from __future__ import annotations

import argparse
import statistics
import time

from stopline import LLM
from stopline.request import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--kv-cache-gb", type=float, default=0.25)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--steps", type=int, default=30, help="decode steps timed (after 10)")
    p.add_argument("--audits", type=int, default=200)
    args = p.parse_args()
    e = LLM(args.model, kv_cache_memory_gb=args.kv_cache_gb, progress=False).engine
    for i in range(args.requests):
        prompt = [1 + (i * 7 + k) % 400 for k in range(40 + i)]
        e.add_request(f"r{i}", prompt, SamplingParams(max_tokens=10_000, ignore_eos=True))
    steps = []
    for _ in range(10 + args.steps):
        t = time.perf_counter()
        e.step()
        steps.append(time.perf_counter() - t)
    audits = []
    for _ in range(args.audits):
        t = time.perf_counter()
        e.audit()
        audits.append(time.perf_counter() - t)
    step, audit = statistics.median(steps[10:]), statistics.median(audits)
    print(f"pool {e.pool.num_blocks} blocks ({e.pool.num_used} used), {len(e.live_requests())} live "
          f"requests: step median {step * 1e3:.1f} ms; audit median {audit * 1e3:.3f} ms "
          f"(p90 {sorted(audits)[int(0.9 * len(audits))] * 1e3:.3f} ms) = {100 * audit / step:.3f}% of "
          f"a step; at --audit-every 16: {100 * audit / 16 / step:.4f}%")


if __name__ == "__main__":
    main()
