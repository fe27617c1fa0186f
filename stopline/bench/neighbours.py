"""`stopline bench neighbours`: how much a decode step slows while another process takes a
slice of our CPUs.

One engine decodes N streams (speculation off: one token per stream a step). Phases of
--steps timed steps alternate, quiet and beside a neighbour process that spins for
--busy-ms then sleeps for --idle-ms, so both readings share the host's drift. Each phase
opens with untimed steps, at least --settle of them and for at least --settle-s seconds: the
engine's thread choice (worker/cpu_share.py) reads the last 0.5 s of CPU use, so a phase is
timed once that window holds only the phase (a persistent neighbour's steady state).
`--no-adapt-threads` keeps every thread whatever the neighbours, for the A/B.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from stopline.bench import machine
from stopline.request import AbortSource

NEIGHBOUR = """
import sys, time
busy, idle = float(sys.argv[1]) / 1000, float(sys.argv[2]) / 1000
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(idle)
"""


def configure(p: argparse.ArgumentParser) -> None:
    from stopline.args import add_engine_args

    p.add_argument("--streams", type=int, default=1, help="requests decoding together")
    p.add_argument("--busy-ms", type=float, default=1.0, help="the neighbour spins this long ...")
    p.add_argument("--idle-ms", type=float, default=1.0, help="... then sleeps this long (1 / 1: half a core)")
    p.add_argument("--rounds", type=int, default=4, help="alternations of a quiet and a neighbour phase")
    p.add_argument("--steps", type=int, default=10, help="steps timed in each phase")
    p.add_argument("--settle", type=int, default=60, help="untimed steps that open each phase ...")
    p.add_argument("--settle-s", type=float, default=None,
                   help="... for at least this many seconds (default: the thread choice's window and "
                        "period, so its reading holds only the phase)")
    p.add_argument("--warm", type=int, default=30, help="steps before the first phase")
    add_engine_args(p)
    p.add_argument("--out", default="bench-results/neighbours.json")


def run(args: argparse.Namespace) -> dict:
    from stopline.args import engine_config
    from stopline.bench.offline import chat_prompts
    from stopline.engine.llm import LLM
    from stopline.request import SamplingParams

    if min(args.rounds, args.steps, args.streams) < 1 or min(args.settle, args.warm) < 0:
        raise SystemExit("--streams, --rounds and --steps must be >= 1, --settle and --warm >= 0")
    if args.settle_s is not None and args.settle_s < 0:
        raise SystemExit(f"--settle-s must be >= 0, got {args.settle_s}")
    if args.busy_ms <= 0 or args.idle_ms < 0:
        raise SystemExit(f"--busy-ms must be > 0 and --idle-ms >= 0, got {args.busy_ms}, {args.idle_ms}")
    config = replace(engine_config(args), speculative="off")
    eng = LLM(args.model, config=config, progress=False).engine
    prompts = chat_prompts(eng.loaded, args.streams)
    # The settle is timed, so its steps are not known ahead: streams may run to the context.
    params = SamplingParams(temperature=0.0, max_tokens=eng.max_model_len - max(map(len, prompts)) - 1,
                            ignore_eos=True)
    incs = [eng.add_request(f"n{i}", ids, params) for i, ids in enumerate(prompts)]
    for _ in range(args.warm):
        eng.step()
    times: dict[str, list[float]] = {"quiet": [], "neighbour": []}
    moved = {"quiet": 0, "neighbour": 0}
    settles: list[dict] = []  # each phase's untimed opening
    policy = eng.runner.threads  # ThreadPolicy: its count of steps moved to fewer threads
    settle_s = policy.reading_s if args.settle_s is None else args.settle_s
    for _ in range(args.rounds):
        for label in times:
            spin = (subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(args.busy_ms), str(args.idle_ms)])
                    if label == "neighbour" else None)
            try:
                start = time.perf_counter()
                settled = 0
                while settled < args.settle or time.perf_counter() - start < settle_s:
                    eng.step()
                    settled += 1
                settles.append({"steps": settled, "s": time.perf_counter() - start})
                before = policy.dropped_steps
                for _ in range(args.steps):
                    t = time.perf_counter()
                    eng.step()
                    times[label].append(time.perf_counter() - t)
                moved[label] += policy.dropped_steps - before
                if len(eng.live_requests()) < args.streams:
                    raise SystemExit(f"the streams reached the context's end ({eng.max_model_len}) "
                                     "before the phases ended: fewer --rounds or a shorter --settle-s")
            finally:
                if spin is not None:
                    spin.kill()
                    spin.wait()
    eng.abort(incs, AbortSource.CANCEL, time.monotonic())
    while eng.has_unfinished():
        eng.step()
    quiet, busy = statistics.median(times["quiet"]), statistics.median(times["neighbour"])
    return {**machine.stamp(), "streams": args.streams, "neighbour_cores": args.busy_ms / (args.busy_ms + args.idle_ms),
            "adapt_threads": config.adapt_threads, "threads": policy.threads,
            "quiet_p50_ms": quiet * 1e3, "neighbour_p50_ms": busy * 1e3, "slowdown": busy / quiet,
            "steps_each": len(times["quiet"]), "moved_steps": moved, "settle_s": settle_s,
            "settles": settles}


def summary(r: dict) -> str:
    return (f"{r['streams']} streams, a neighbour taking {r['neighbour_cores']:.0%} of a core "
            f"({r['threads']} threads, adapting {'on' if r['adapt_threads'] else 'off'}): step p50 {r['quiet_p50_ms']:.2f} ms quiet, "
            f"{r['neighbour_p50_ms']:.2f} ms beside it, slowdown {r['slowdown']:.2f}x; steps on fewer "
            f"threads: {r['moved_steps']['neighbour']} of {r['steps_each']} beside it, "
            f"{r['moved_steps']['quiet']} quiet")


def main(args: argparse.Namespace) -> int:
    result = run(args)
    result["command"] = "stopline bench neighbours " + " ".join(sys.argv[3:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))
    print(f"results: {out}")
    return 0
