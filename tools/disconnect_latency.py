"""Measure disconnect -> abort latency of a running `stopline serve`, from its own histograms.

Starts a server (given model, or SmolLM2) on a free loopback port, starts 8 background streams
(1000 tokens each), then drops requests (streaming and not) 40-170 ms after sending them, one
at a time, and prints p50/p90/p99 of
stopline_abort_accept_latency_seconds, stopline_abort_latency_seconds and
stopline_reclaim_latency_seconds (interpolated within histogram buckets).

    python tools/disconnect_latency.py [MODEL_DIR_OR_GGUF] [TRIALS] [-- extra serve options]
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.server_harness import ServerProcess, raw_request  # noqa: E402


def quantiles(m: dict[str, float], name: str, source: str) -> tuple[float, dict[float, float]]:
    buckets = sorted((float(k.split('le="')[1].split('"')[0]), v) for k, v in m.items()
                     if k.startswith(name + "_bucket") and f'source="{source}"' in k)
    n = buckets[-1][1] if buckets else 0.0
    out = {}
    for q in (0.5, 0.9, 0.99):
        target, prev_le, prev_c = q * n, 0.0, 0.0
        for le, c in buckets:
            if c >= target:
                frac = (target - prev_c) / max(c - prev_c, 1e-9)
                out[q] = prev_le + frac * (le - prev_le) if le != float("inf") else prev_le
                break
            prev_le, prev_c = le, c
    return n, out


def main() -> None:
    args = sys.argv[1:]
    extra = args[args.index("--") + 1:] if "--" in args else []
    args = args[:args.index("--")] if "--" in args else args
    model = args[0] if args and args[0] else None
    trials = int(args[1]) if len(args) > 1 else 100
    srv = ServerProcess(*(["--model", model] if model else []), "--num-blocks", "512",
                        "--max-num-seqs", "16", *extra)
    srv.wait_ready()
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 1000,
                "ignore_eos": True, "stream": True}
        background = [raw_request(srv.port, "/v1/completions", json.dumps(body).encode())
                      for _ in range(8)]
        srv.wait_for(lambda m: m["stopline_requests_running"] >= 8, timeout=120)
        for i in range(trials):
            s = raw_request(srv.port, "/v1/completions", json.dumps(
                {"prompt": f"Trial {i}", "max_tokens": 300, "ignore_eos": True,
                 "stream": i % 2 == 0}).encode())
            time.sleep(random.uniform(0.02, 0.15))
            s.close()
            time.sleep(0.02)
        time.sleep(1.0)
        m = srv.metrics()
        for name in ("stopline_abort_accept_latency_seconds", "stopline_abort_latency_seconds",
                     "stopline_reclaim_latency_seconds"):
            n, q = quantiles(m, name, "disconnect")
            print(f"{name}: n={n:.0f} " + " ".join(f"p{int(k * 100)}={v * 1000:.2f} ms" for k, v in q.items()))
        for s in background:
            s.close()
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
