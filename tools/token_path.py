"""What a served token costs beyond the engine's step: streams through `stopline serve`.

    python tools/token_path.py [--model M] [--tokens 256] [--rounds 3] [--streams 1]
                               [--serve-args "..."]

Starts `stopline serve` on a free loopback port and streams `--tokens` tokens (`--streams`
requests at once, EOS ignored, sampled at temperature 0.8, each with its own seed so
speculation can't help) `--rounds` times. For each round it prints:

- the inter-token time at the client (median and mean of chunk gaps, over every stream);
- the engine's step time over the same tokens (the core's busy-step seconds over its
  busy steps, from /metrics: the step's start to its outcome applied), and of it the worker's
  run (the forward and sampling);
- the CPU seconds per step of the front-end process (HTTP, the hop from the core,
  detokenization, SSE), of the core process (from /proc/PID/stat) and of this client.

On 2 cores the core's forward uses both, so the front end's CPU per token is time the step
does not get: that, and not only wall-clock overlap, is what a served token adds.
"""

from __future__ import annotations

import argparse
import asyncio
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


async def stream(client: httpx.AsyncClient, base: str, body: dict) -> list[float]:
    arrivals: list[float] = []
    async with client.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                arrivals.append(time.perf_counter())
    return arrivals


def one_round(base: str, pids: dict[str, int], tokens: int, streams: int, seed: int) -> dict[str, float]:
    m0 = httpx.get(base + "/metrics").text
    cpu0 = {k: cpu_s(p) for k, p in pids.items()}
    me0 = time.process_time()
    model = httpx.get(base + "/v1/models").json()["data"][0]["id"]

    async def all_streams() -> list[list[float]]:
        limits = httpx.Limits(max_connections=streams + 4)
        async with httpx.AsyncClient(limits=limits) as client:
            return await asyncio.gather(*(stream(client, base, {
                "model": model, "prompt": "Once upon a time", "max_tokens": tokens, "stream": True,
                "temperature": 0.8, "seed": seed * 1000 + i, "ignore_eos": True}) for i in range(streams)))

    t0 = time.perf_counter()
    runs = asyncio.run(all_streams())
    wall = time.perf_counter() - t0
    me = time.process_time() - me0
    cpu1 = {k: cpu_s(p) for k, p in pids.items()}
    m1 = httpx.get(base + "/metrics").text
    gaps = [b - a for arrivals in runs for a, b in zip(arrivals, arrivals[1:], strict=False)]
    steps = metric(m1, "stopline_engine_busy_steps_total") - metric(m0, "stopline_engine_busy_steps_total")
    secs = (metric(m1, "stopline_engine_busy_step_seconds_total")
            - metric(m0, "stopline_engine_busy_step_seconds_total"))
    run = (metric(m1, "stopline_engine_execute_seconds_total")
           - metric(m0, "stopline_engine_execute_seconds_total"))
    # A chunk may carry several tokens (accepted drafts, or a reader behind): the mean is per token.
    itl_mean = statistics.mean((a[-1] - a[0]) / (tokens - 1) for a in runs)
    return {"chunks": sum(map(len, runs)), "itl_p50_ms": statistics.median(gaps) * 1e3,
            "itl_mean_ms": itl_mean * 1e3, "tok_s": streams * tokens / wall,
            "step_ms": secs / steps * 1e3 if steps else float("nan"),
            "execute_ms": run / steps * 1e3 if steps else float("nan"),
            **{f"{k}_cpu_ms_per_step": (cpu1[k] - cpu0[k]) / tokens * 1e3 for k in pids},
            "client_cpu_ms_per_step": me / tokens * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=1, help="requests streamed at once")
    p.add_argument("--serve-args", default="", help="more `stopline serve` flags")
    args = p.parse_args()
    spec = stopline_spec(args.model, extra=shlex.split(args.serve_args))
    server = RunningEngine(spec, Path(tempfile.mkdtemp(prefix="token-path-")) / "server.log")
    try:
        server.wait_ready()
        pids = {"front_end": server.proc.pid, "core": core_pid(server.proc.pid)}
        one_round(server.base_url, pids, 16, args.streams, 0)  # warm-up
        rows = [one_round(server.base_url, pids, args.tokens, args.streams, 1 + i)
                for i in range(args.rounds)]
    finally:
        server.stop()
    print(f"{args.tokens} tokens a stream, {args.streams} streams; {os.uname().nodename}")
    print("round | tok/s | ITL p50 ms | ITL mean ms | step ms | of which the worker's run ms | "
          "ITL mean / step | CPU ms a step: front end | core | client")
    for i, r in enumerate(rows):
        print(f"{i} | {r['tok_s']:.1f} | {r['itl_p50_ms']:.2f} | {r['itl_mean_ms']:.2f} | {r['step_ms']:.2f} | "
              f"{r['execute_ms']:.2f} | {r['itl_mean_ms'] / r['step_ms']:.2f} | "
              f"{r['front_end_cpu_ms_per_step']:.2f} | {r['core_cpu_ms_per_step']:.2f} | "
              f"{r['client_cpu_ms_per_step']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
