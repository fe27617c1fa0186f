"""Speculative decoding: speculation off / on / auto on the same workloads, in one run.

Five workloads, chat-templated prompts on one engine per mode (the model is loaded once and
shared):

  repetitive     one stream that quotes a given passage back, greedy (drafts from the prompt hit)
  free           one stream of free generation, greedy (drafts rarely hit)
  batch          N streams of free-generation questions at once, greedy
  sampled        the free stream sampled (temperature 0.8, seeded): speculation can't help
  sampled-batch  the batch sampled

Throughput is output tokens / wall time of the whole run, prefill included. Every mode must
produce the same tokens (seeded sampling too): the table says whether it did. Acceptance is
accepted / (accepted + rejected) drafts; discarded drafts were never verified
(docs/speculative.md). The modes alternate within each round, and a mode's figure against off
is the median over rounds of its ratio to off's run in the same round, with the lowest and
highest ratio beside it: the spread says how far the host's noise reaches.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stopline.args import add_engine_args, engine_config
from stopline.bench import machine
from stopline.bench.offline import QUESTIONS
from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.model.kernels.native import try_kernels
from stopline.model.loaders.loader import LoadedModel
from stopline.request import SamplingParams

MODES = ("off", "on", "auto")

PASSAGE = (
    "The engine keeps a block table for every request. When a request is cancelled, its blocks "
    "go back to the pool behind the fence, and no token computed after the cancel is ever "
    "delivered. When the pool is full, the scheduler picks a victim and preempts it: the victim "
    "is swapped out to host memory or recomputed later, and it resumes exactly where it was. "
    "Every way a request stops enters through one of four doors and leaves through one release, "
    "which walks the holders in a fixed order and frees the blocks last."
)
FREE = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SAMPLED = SamplingParams(temperature=0.8, seed=1234)


@dataclass
class Run:
    workload: str
    mode: str
    streams: int
    tokens: int
    seconds: float
    drafted: int
    accepted: int
    rejected: int
    discarded: int
    outputs: list[list[int]]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def acceptance(self) -> float | None:
        verified = self.accepted + self.rejected
        return self.accepted / verified if verified else None


def _chat(loaded: LoadedModel, text: str) -> list[int]:
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
                      add_special_tokens=False)


def workloads(loaded: LoadedModel, streams: int) -> dict[str, list[list[int]]]:
    quote = _chat(loaded, "Repeat the following passage word for word, without any comment:\n\n" + PASSAGE)
    batch = [_chat(loaded, QUESTIONS[i % len(QUESTIONS)] if i < len(QUESTIONS)
                   else f"({i}) {QUESTIONS[i % len(QUESTIONS)]}") for i in range(streams)]
    free = [_chat(loaded, FREE)]
    return {"repetitive": [quote], "free": free, "batch": batch, "sampled": free, "sampled-batch": batch}


def _run(core: EngineCore, name: str, mode: str, prompts: list[list[int]], max_tokens: int) -> Run:
    s = core.stats
    before = (s.spec_drafted, s.spec_accepted, s.spec_rejected, sum(s.spec_discarded.values()))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    if name.startswith("sampled"):
        params = dataclasses.replace(SAMPLED, max_tokens=max_tokens)
    t0 = time.perf_counter()
    incs = [core.add_request(f"{name}-{i}", p, params) for i, p in enumerate(prompts)]
    got: dict[str, list[int]] = {i: [] for i in incs}
    while core.has_unfinished():
        for out in core.step():
            got[out.incarnation] += out.new_token_ids
    seconds = time.perf_counter() - t0
    after = (s.spec_drafted, s.spec_accepted, s.spec_rejected, sum(s.spec_discarded.values()))
    d = [b - a for a, b in zip(before, after, strict=True)]
    outs = [got[i] for i in incs]
    return Run(name, mode, len(prompts), sum(map(len, outs)), seconds, *d, outs)


def run(loaded: LoadedModel, config: EngineConfig, streams: int, max_tokens: int, batch_tokens: int,
        rounds: int = 1, names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Each workload in each mode, modes interleaved per round (a busier minute of the machine
    moves all three) in an order that turns each round; a mode against off is the median of
    its per-round ratios, with their spread."""
    cores = {m: EngineCore(loaded, EngineConfig(**{**config.__dict__, "speculative": m}), progress=False)
             for m in MODES}
    loads = workloads(loaded, streams)
    if names is not None:
        unknown = set(names) - set(loads)
        if unknown:
            raise ValueError(f"unknown workload(s) {sorted(unknown)}; known: {', '.join(loads)}")
        loads = {n: p for n, p in loads.items() if n in names}
    for core in cores.values():  # warm-up: first-touch costs, and auto's first measurements
        _run(core, "warm", "-", workloads(loaded, 1)["free"], 16)
    runs: dict[tuple[str, str], list[Run]] = {}
    for i in range(rounds):
        # The order of the modes turns each round: no mode always runs after the same one.
        order = MODES[i % len(MODES):] + MODES[:i % len(MODES)]
        for name, prompts in loads.items():
            n = batch_tokens if name.endswith("batch") else max_tokens
            for mode in order:
                runs.setdefault((name, mode), []).append(_run(cores[mode], name, mode, prompts, n))
    rows = []
    for name in loads:
        offs = runs[(name, "off")]
        for mode in MODES:
            rs = runs[(name, mode)]
            ratios = sorted(r.tok_s / o.tok_s for r, o in zip(rs, offs, strict=True))
            r = sorted(rs, key=lambda r: r.tok_s)[len(rs) // 2]  # the median round's counters
            rows.append({"workload": name, "mode": mode, "streams": r.streams, "tokens": r.tokens,
                         "seconds": round(r.seconds, 3), "tok_s": round(statistics.median(x.tok_s for x in rs), 2),
                         "tok_s_min": round(min(x.tok_s for x in rs), 2), "tok_s_max": round(max(x.tok_s for x in rs), 2),
                         "vs_off": round(statistics.median(ratios), 3), "vs_off_min": round(ratios[0], 3),
                         "vs_off_max": round(ratios[-1], 3), "drafted": r.drafted,
                         "accepted": r.accepted, "rejected": r.rejected, "discarded": r.discarded,
                         "acceptance": None if r.acceptance is None else round(r.acceptance, 3),
                         "same_tokens_as_off": all(x.outputs == o.outputs for x, o in zip(rs, offs, strict=True))})
    return {"benchmark": "spec", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            **machine.stamp(), "c_kernels": try_kernels() is not None, "streams": streams, "max_tokens": max_tokens,
            "batch_tokens": batch_tokens, "rounds": rounds, "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = ["| workload | streams | mode | tok/s (median, min-max) | vs off (median, min-max) | drafted | "
             "accepted | rejected | acceptance | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        # results written before the spread was kept have one figure
        tok = f"{r['tok_s']:.1f}" + (f" ({r['tok_s_min']:.1f}-{r['tok_s_max']:.1f})" if "tok_s_min" in r else "")
        vs = f"{r['vs_off']:.2f}x" + (f" ({r['vs_off_min']:.2f}-{r['vs_off_max']:.2f})" if "vs_off_min" in r else "")
        lines.append(f"| {r['workload']} | {r['streams']} | {r['mode']} | {tok} | {vs} | {r['drafted']} | "
                     f"{r['accepted']} | {r['rejected']} | {acc} | {'yes' if r['same_tokens_as_off'] else 'NO'} |")
    return "\n".join(lines)


def summary(result: dict[str, Any], file: str) -> list[str]:
    """The report's paragraph and table (stopline/bench/report.py, docs/benchmarks.md)."""
    by = {(r["workload"], r["mode"]): r for r in result["rows"]}
    auto = [f"{w} {by[(w, 'auto')]['vs_off']:.2f}x" for w in ("repetitive", "free", "batch", "sampled", "sampled-batch")
            if (w, "auto") in by]
    kernels = "" if result.get("c_kernels", True) else ", C kernels off (torch attention and GEMMs)"
    return [f"**Speculative decoding** (`{result['command']}` on {result['machine']['summary']}{kernels}; `{file}`; "
            f"detail in [speculative.md](speculative.md)): auto against off: " + ", ".join(auto)
            + " (targets: ≥ 1.5x repetitive, ≥ 0.98x the others)."
            + (f" Note: {result['note']}." if result.get("note") else ""), "", table(result)]


def write(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(result, indent=2) + "\n")
    head = f"Host: {machine.summary(result['machine'])}, commit {result.get('git')}; `{result.get('command')}`"
    (out / "spec.md").write_text(head + "\n\n" + table(result) + "\n")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=32, help="concurrent streams of the batch workload")
    p.add_argument("--max-tokens", type=int, default=192, help="new tokens of a single stream")
    p.add_argument("--batch-tokens", type=int, default=64, help="new tokens per stream of the batch")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of every workload, the modes alternating (the median ratio counts)")
    p.add_argument("--workloads", default=None,
                   help="comma-separated subset of: repetitive, free, batch, sampled, sampled-batch")
    p.add_argument("--out", default="bench_results/spec")
    add_engine_args(p)


def main(args: argparse.Namespace) -> int:
    from stopline.model.loaders.loader import load_model

    names = tuple(w for w in args.workloads.split(",") if w) if args.workloads else None
    result = run(load_model(args.model), engine_config(args), args.streams, args.max_tokens,
                 args.batch_tokens, args.rounds, names)
    result["command"] = "stopline bench spec " + " ".join(sys.argv[3:])
    write(result, Path(args.out))
    print(table(result))
    return 0
