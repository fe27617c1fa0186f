"""`stopline bench serve`'s flags and run, apart from stopline/bench/serve.py so that its parser
builds without the bench extra (the client's httpx and openai are imported when it runs)."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from dataclasses import replace
from pathlib import Path

ENGINES = ("stopline", "stopline-fast", "stopline-fast-int8", "vllm", "llamacpp", "ikllamacpp", "hf")


def configure(p: argparse.ArgumentParser) -> None:
    from stopline.bench.workloads.config import PROFILES, WORKLOADS

    p.add_argument("--peers", default="",
                   help=f"comma-separated peers to run after stopline ({', '.join(ENGINES[1:])}); "
                        "each is started by bench/peers/start_*.sh (set up with setup_*.sh)")
    p.add_argument("--engines", default=None,
                   help="comma-separated engines, overriding stopline + --peers (e.g. 'vllm' alone)")
    p.add_argument("--profile", default="full", choices=sorted(PROFILES),
                   help="workload sizes: full (the issue's), quick (minutes per engine on 2 cores), "
                        "tiny (seconds, the test model)")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated subset of: {', '.join(WORKLOADS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrencies", default=None,
                   help="throughput's stream counts, comma-separated (default: the profile's, e.g. 1,8,32,64)")
    p.add_argument("--output-tokens", type=int, default=None,
                   help="throughput's tokens per request (default: the profile's)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="throughput's sampling temperature (0: greedy; above 0 every request is "
                        "seeded, so a rerun draws the same text)")
    p.add_argument("--model", default=None,
                   help="model every engine serves: a GGUF file or an installed package that carries "
                        "one (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--results-dir", default="bench-results", help="a run's folder is made under this")
    p.add_argument("--report", default="docs/benchmarks.md",
                   help="report to write after the run ('' to skip); plots go to its img/ folder")
    p.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    from stopline.bench.report import write_report
    from stopline.bench.serve import new_run_dir, run_bench
    from stopline.bench.workloads.config import PROFILES, WORKLOADS

    if args.engines:
        engines = [e for e in args.engines.split(",") if e]
    else:
        engines = ["stopline", *(e for e in args.peers.split(",") if e)]
    unknown = [e for e in engines if e not in ENGINES]
    wanted = tuple(w for w in args.workloads.split(",") if w)
    bad = [w for w in wanted if w not in WORKLOADS]
    if unknown or bad:
        print(f"error: unknown engine(s) {unknown} / workload(s) {bad}", file=sys.stderr)
        return 2
    cfg = replace(PROFILES[args.profile](), seed=args.seed, workloads=wanted)
    if args.concurrencies:
        cfg = replace(cfg, concurrencies=tuple(int(c) for c in args.concurrencies.split(",") if c))
    if args.output_tokens:
        cfg = replace(cfg, output_tokens=args.output_tokens)
    if args.temperature < 0:
        print("error: --temperature must be 0 or more", file=sys.stderr)
        return 2
    cfg = replace(cfg, temperature=args.temperature)
    # SIGTERM unwinds like Ctrl-C, so the engines this run started are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out_dir = new_run_dir(Path(args.results_dir))
    path = run_bench(engines, cfg, out_dir, model=args.model, progress=not args.no_progress,
                     command=shlex.join(["stopline", *sys.argv[1:]]))
    print(f"results: {path}")
    if args.report:
        md = write_report([path], Path(args.report))
        print(f"report: {md}")
    return 0
