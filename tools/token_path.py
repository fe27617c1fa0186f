"""What a served token costs beyond the engine's step: one stream through `stopline serve`.

    python tools/token_path.py [--model M] [--tokens 256] [--rounds 3] [--serve-args "..."]

Starts `stopline serve` on a free loopback port and streams `--tokens` tokens (one request,
EOS ignored, sampled at temperature 0.8 with a seed so speculation can't help) `--rounds`
times. For each round it prints:

- the inter-token time at the client (median and mean of chunk gaps);
- the engine's step time over the same tokens (the core's busy-step seconds over its
  busy steps, from /metrics: the step's start to its outcome applied), and of it the worker's
  run (the forward and sampling);
- the CPU seconds per token of the front-end process (HTTP, the hop from the core,
  detokenization, SSE) and of the core process, from /proc/PID/stat.

On 2 cores the core's forward uses both, so the front end's CPU per token is time the step
does not get: that, and not only wall-clock overlap, is what a served token adds.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from stopline.bench.engines import RunningEngine, stopline_spec
from stopline.bench.soak import core_pid

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#") and line[len(name)] in " {")


def one_round(base: str, pids: dict[str, int], tokens: int, seed: int) -> dict[str, float]:
    m0 = httpx.get(base + "/metrics").text
    cpu0 = {k: cpu_s(p) for k, p in pids.items()}
    model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "stream": True,
            "temperature": 0.8, "seed": seed, "ignore_eos": True}
    arrivals: list[float] = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                arrivals.append(time.perf_counter())
    cpu1 = {k: cpu_s(p) for k, p in pids.items()}
    m1 = httpx.get(base + "/metrics").text
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    steps = metric(m1, "stopline_engine_busy_steps_total") - metric(m0, "stopline_engine_busy_steps_total")
    secs = (metric(m1, "stopline_engine_busy_step_seconds_total")
            - metric(m0, "stopline_engine_busy_step_seconds_total"))
    run = (metric(m1, "stopline_engine_execute_seconds_total")
           - metric(m0, "stopline_engine_execute_seconds_total"))
    n = len(arrivals)
    # A chunk may carry several tokens (accepted drafts, or a reader behind): the mean is per token.
    return {"chunks": n, "itl_p50_ms": statistics.median(gaps) * 1e3,
            "itl_mean_ms": (arrivals[-1] - arrivals[0]) / (tokens - 1) * 1e3,
            "step_ms": secs / steps * 1e3 if steps else float("nan"),
            "execute_ms": run / steps * 1e3 if steps else float("nan"),
            **{f"{k}_cpu_ms_per_token": (cpu1[k] - cpu0[k]) / tokens * 1e3 for k in pids}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--serve-args", default="", help="more `stopline serve` flags")
    args = p.parse_args()
    spec = stopline_spec(args.model, extra=shlex.split(args.serve_args))
    server = RunningEngine(spec, Path(tempfile.mkdtemp(prefix="token-path-")) / "server.log")
    try:
        server.wait_ready()
        pids = {"front_end": server.proc.pid, "core": core_pid(server.proc.pid)}
        one_round(server.base_url, pids, 16, 0)  # warm-up
        rows = [one_round(server.base_url, pids, args.tokens, 1 + i) for i in range(args.rounds)]
    finally:
        server.stop()
    print(f"{args.tokens} tokens a round, one stream; {os.uname().nodename}")
    print("round | ITL p50 ms | ITL mean ms | step ms | of which the worker's run ms | ITL mean / step | "
          "front-end CPU ms/token | core CPU ms/token")
    for i, r in enumerate(rows):
        print(f"{i} | {r['itl_p50_ms']:.2f} | {r['itl_mean_ms']:.2f} | {r['step_ms']:.2f} | {r['execute_ms']:.2f} | "
              f"{r['itl_mean_ms'] / r['step_ms']:.2f} | {r['front_end_cpu_ms_per_token']:.2f} | "
              f"{r['core_cpu_ms_per_token']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
