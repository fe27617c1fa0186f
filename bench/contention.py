"""How much a decode step slows when another process takes a slice of the CPUs.

    python bench/contention.py 32                 # 32 requests; background 2 ms busy of every 7
    python bench/contention.py 32 --busy-ms 1 --idle-ms 9

Served, the engine core shares these 2 cores with the API server and the benchmark's client.
This times decode steps of one engine alternately with and without a background process that
spins for --busy-ms then sleeps for --idle-ms, so the two readings share the host's drift.
Every step runs ~270 OpenMP regions (9 kernels x 30 layers), and each waits at its end for
whichever compute thread the OS has paused, so the step slows by more than the CPU taken.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

# stopline first: it sets the OpenMP spin policy before torch loads libgomp.
from stopline import LLM, SamplingParams
from stopline.bench.offline import chat_prompts
from stopline.config import EngineConfig

_SPIN = """
import sys, time
busy, idle = float(sys.argv[1]) / 1000, float(sys.argv[2]) / 1000
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(idle)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("requests", type=int)
    ap.add_argument("--busy-ms", type=float, default=2.0)
    ap.add_argument("--idle-ms", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=8, help="alternations of --steps steps each way")
    ap.add_argument("--steps", type=int, default=5, help="steps timed in each phase")
    ap.add_argument("--settle", type=int, default=0,
                    help="untimed steps that open each phase (the engine's thread choice reads the "
                         "last 0.5 s of CPU use: a persistent neighbour, not one that comes and goes)")
    ap.add_argument("--no-adapt-threads", action="store_true", help="keep every thread whatever the neighbours")
    args = ap.parse_args()
    # Speculation off: every timed step is one decode token per stream.
    eng = LLM(config=EngineConfig(kv_cache_memory_gb=2.0, speculative="off",
                                  adapt_threads=not args.no_adapt_threads),
              progress=False).engine
    params = SamplingParams(temperature=0.0, max_tokens=40 + 2 * args.rounds * (args.steps + args.settle) + 8, ignore_eos=True)
    for i, ids in enumerate(chat_prompts(eng.loaded, args.requests)):
        eng.add_request(f"c{i}", ids, params)
    for _ in range(30):
        eng.step()
    times: dict[str, list[float]] = {"quiet": [], "background": []}
    for _ in range(args.rounds):
        for label in times:
            spin = (subprocess.Popen([sys.executable, "-c", _SPIN, str(args.busy_ms), str(args.idle_ms)])
                    if label == "background" else None)
            try:
                time.sleep(0.05)
                for _ in range(args.settle):
                    eng.step()
                for _ in range(args.steps):
                    t = time.perf_counter()
                    eng.step()
                    times[label].append(time.perf_counter() - t)
            finally:
                if spin is not None:
                    spin.kill()
                    spin.wait()
    share = args.busy_ms / (args.busy_ms + args.idle_ms)
    for label, ts in times.items():
        print(f"{args.requests} requests, {label}: step p50 {statistics.median(ts) * 1e3:.1f} ms, "
              f"mean {statistics.mean(ts) * 1e3:.1f} ms")
    print(f"steps on fewer threads: {eng.runner.threads.dropped_steps}")
    print(f"background: {share:.0%} of one CPU; step p50 ratio "
          f"{statistics.median(times['background']) / statistics.median(times['quiet']):.2f}")


if __name__ == "__main__":
    main()
