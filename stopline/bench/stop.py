"""`stopline bench stop`: what stopping costs, measured in-process on the engine core.

Two workloads (issue 3):
  cancel storm      N requests, half aborted at random points (before the first token,
                    mid-prefill, mid-decode); then the same run with each aborted request
                    replaced by a twin whose max_tokens makes it stop by itself at the same
                    point. Ratio = survivors' completion time with twins / with aborts
                    (1.0: a cancel costs no more than a natural stop). Also tokens computed
                    after the abort and steps from abort to reclaim.
  preemption storm  the KV pool sized to a fraction of the demand; throughput against an
                    unconstrained pool for each victim policy and preemption mode, with
                    preemptions and recomputed tokens, then a light wave after the storm to
                    see that throughput recovers (no lingering admission throttle).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from stopline.args import add_engine_args, engine_config
from stopline.bench import machine
from stopline.config import EngineConfig, PreemptionMode, VictimPolicy
from stopline.engine.core import EngineCore
from stopline.model.loaders.loader import LoadedModel
from stopline.request import AbortSource, SamplingParams
from stopline.stats import SECONDS_BOUNDS, Histogram

TOPICS = ["the ocean", "a lighthouse keeper", "prime numbers", "a city at night", "bread baking",
          "the moon landing", "a lost cat", "volcanoes", "chess openings", "a rainy morning"]


@dataclass
class Job:
    rid: str
    prompt: list[int]
    max_tokens: int
    abort_kind: str | None = None  # "waiting", "prefill", "decode"
    abort_after: int = 0  # decode: tokens delivered before the abort


@dataclass
class RunResult:
    survivors_seconds: float
    total_seconds: float
    steps: int
    tokens_out: int
    aborted: int = 0
    tokens_after_abort: int = 0
    reclaim_steps_max: int = 0
    reclaim_seconds: Histogram = field(default_factory=lambda: Histogram(SECONDS_BOUNDS))
    delivered_at_abort: dict[str, int] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)
    recomputed_tokens: int = 0


def make_prompts(loaded: LoadedModel, n: int, seed: int, long_every: int = 4,
                 long_tokens: int = 600) -> list[list[int]]:
    rng = random.Random(seed)
    tok = loaded.tokenizer
    out = []
    for i in range(n):
        text = f"Write a short story about {rng.choice(TOPICS)} (story {i})."
        if long_every and i % long_every == 1:  # odd indices are the aborted half
            filler = " ".join(rng.choice(TOPICS) for _ in range(long_tokens // 3))
            text = f"Here are some notes: {filler}. Now summarize them."
        chat = tok.apply_chat_template([{"role": "user", "content": text}])
        out.append(tok.encode(chat, add_special_tokens=False))
    return out


def _fresh_engines(loaded: LoadedModel, cfgs: list[EngineConfig]) -> list[EngineCore]:
    # An engine (~1 GB here: float32 and packed weights, KV pool) is freed by the cycle
    # collector, which counts objects, not bytes: without a collection between runs a full
    # benchmark's dead engines filled 24 GB.
    gc.collect()
    return [EngineCore(loaded, c) for c in cfgs]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def run_jobs(loaded: LoadedModel, cfg: EngineConfig, jobs: list[Job], desc: str) -> RunResult:
    (eng,) = _fresh_engines(loaded, [cfg])
    t0 = time.perf_counter()
    inc = {j.rid: eng.add_request(j.rid, j.prompt, SamplingParams(
        temperature=0.0, max_tokens=j.max_tokens, ignore_eos=True)) for j in jobs}
    delivered = {j.rid: 0 for j in jobs}
    pending_abort = {j.rid: j for j in jobs if j.abort_kind}
    survivors = {j.rid for j in jobs if not j.abort_kind}
    survivors_done = None
    res = RunResult(0, 0, 0, 0)
    bar = tqdm(total=len(jobs), desc=desc, unit="req", leave=False)
    while eng.has_unfinished():
        for rid, j in list(pending_abort.items()):
            fam = eng.families.get(inc[rid])
            req = fam.members[0] if fam else None
            due = (j.abort_kind == "waiting"
                   or j.abort_kind == "prefill" and req is not None and 0 < eng.kv_manager.computed(req) < req.prompt_len
                   or j.abort_kind == "decode" and delivered[rid] >= j.abort_after)
            if due:
                res.delivered_at_abort[rid] = delivered[rid]
                eng.abort([inc[rid]], AbortSource.CANCEL, time.monotonic())
                del pending_abort[rid]
        for out in eng.step():
            delivered[out.request_id] += len(out.new_token_ids)
            res.tokens_out += len(out.new_token_ids)
            if out.finished:
                bar.update(1)
                survivors.discard(out.request_id)
                pending_abort.pop(out.request_id, None)
                if not survivors and survivors_done is None:
                    survivors_done = time.perf_counter() - t0
    bar.close()
    eng.audit()
    st = eng.lifecycle.stats
    res.total_seconds = time.perf_counter() - t0
    res.survivors_seconds = survivors_done if survivors_done is not None else res.total_seconds
    res.steps = eng.steps
    res.aborted = sum(st.aborts.values())
    res.tokens_after_abort = st.tokens_after_abort
    res.reclaim_steps_max = int(st.abort_to_reclaim_steps.max)
    res.reclaim_seconds = st.reclaim_seconds
    res.preemptions = dict(st.preemptions)
    res.recomputed_tokens = st.recomputed_tokens
    return res


def run_side_by_side(loaded: LoadedModel, cfgs: list[EngineConfig], jobs: list[Job], desc: str) -> list[RunResult]:
    """The same jobs on one engine per config, stepped in turn: the engine with the fewest
    tokens out so far steps next, so all of them run through the same stretch of wall time
    (this host's speed moves by 10-30% from one stretch of seconds to the next, which a storm
    run after its reference charges to one side). Each engine's total_seconds is the sum of
    its own steps."""
    engines = _fresh_engines(loaded, cfgs)
    results = [RunResult(0, 0, 0, 0) for _ in cfgs]
    for eng in engines:
        for j in jobs:
            eng.add_request(j.rid, j.prompt, SamplingParams(temperature=0.0, max_tokens=j.max_tokens,
                                                            ignore_eos=True))
    bar = tqdm(total=len(jobs) * len(cfgs), desc=desc, unit="req", leave=False)
    while True:
        live = [i for i, eng in enumerate(engines) if eng.has_unfinished()]
        if not live:
            break
        i = min(live, key=lambda i: results[i].tokens_out)
        t0 = time.perf_counter()
        outs = engines[i].step()
        results[i].total_seconds += time.perf_counter() - t0
        results[i].tokens_out += sum(len(o.new_token_ids) for o in outs)
        bar.update(sum(1 for o in outs if o.finished))
    bar.close()
    for eng, res in zip(engines, results, strict=True):
        eng.audit()
        res.survivors_seconds = res.total_seconds
        res.steps = eng.steps
        res.preemptions = dict(eng.lifecycle.stats.preemptions)
        res.recomputed_tokens = eng.lifecycle.stats.recomputed_tokens
    return results


def cancel_storm(loaded: LoadedModel, cfg: EngineConfig, n: int, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = make_prompts(loaded, n, seed)
    jobs = []
    for i, p in enumerate(prompts):
        j = Job(f"c{i}", p, max_tokens)
        if i % 2 == 1:
            kinds = ["waiting", "decode", "decode"] + (["prefill"] if len(p) > 2 * cfg.max_num_batched_tokens // 3 else [])
            j.abort_kind = rng.choice(kinds)
            j.abort_after = rng.randrange(1, max_tokens)
        jobs.append(j)
    # Aborts, twins, twins, aborts: each side is the mean of a run early and a run late in
    # the process, so warm-up (the first engine of the process pays its page faults) and
    # this host's drift fall on both alike.
    aborted = run_jobs(loaded, cfg, jobs, "cancel storm: aborts")
    twins = []
    for j in jobs:
        if j.abort_kind is None:
            twins.append(j)
        else:
            # The twin stops by itself where the abort hit (at least one token: a natural stop
            # cannot happen before the prompt is computed, so prefill twins cost more).
            twins.append(Job(j.rid, j.prompt, max(1, aborted.delivered_at_abort.get(j.rid, 1))))
    twin_s = [run_jobs(loaded, cfg, twins, "cancel storm: twins").survivors_seconds for _ in range(2)]
    again = run_jobs(loaded, cfg, jobs, "cancel storm: aborts again")
    abort_s = [aborted.survivors_seconds, again.survivors_seconds]
    both = (aborted, again)  # the stop-path counters hold in every run with aborts, not just one
    n_aborted = max(1, sum(r.aborted for r in both))
    reclaim = Histogram(SECONDS_BOUNDS)  # both runs' (fixed buckets: quantiles are bucket bounds)
    for r in both:
        reclaim.counts = [a + b for a, b in zip(reclaim.counts, r.reclaim_seconds.counts, strict=True)]
        reclaim.max = max(reclaim.max, r.reclaim_seconds.max)
    return {
        "requests": n, "aborted": aborted.aborted, "max_tokens": max_tokens,
        "abort_kinds": {k: sum(1 for j in jobs if j.abort_kind == k) for k in ("waiting", "prefill", "decode")},
        "survivors_s_with_aborts": sum(abort_s) / 2,
        "survivors_s_with_twins": sum(twin_s) / 2,
        "survivors_s_runs": {"aborts": abort_s, "twins": twin_s},
        "ratio_twins_over_aborts": sum(twin_s) / sum(abort_s),
        "tokens_after_abort_per_abort": sum(r.tokens_after_abort for r in both) / n_aborted,
        "abort_to_reclaim_steps_max": max(r.reclaim_steps_max for r in both),
        "reclaim_ms_p50": _ms(reclaim.quantile(0.5)), "reclaim_ms_p99": _ms(reclaim.quantile(0.99)),
        "preemptions": dict(Counter(aborted.preemptions) + Counter(again.preemptions)),
    }


def preemption_storm(loaded: LoadedModel, base: EngineConfig, n: int, max_tokens: int,
                     fraction: float, seed: int, combos: list[tuple[str, str]], rounds: int = 2) -> dict:
    prompts = make_prompts(loaded, n, seed, long_every=0)
    jobs = [Job(f"p{i}", p, max_tokens) for i, p in enumerate(prompts)]
    demand = sum(-(-(len(p) + max_tokens) // base.block_size) for p in prompts)
    # After the storm the demand drops to a wave that fits the tight pool with room to spare
    # (new prompts: the storm's would hit the prefix cache and flatter the engine); recovery
    # compares it with the same wave on a fresh engine of the same pool, twice, alternating.
    light = [Job(f"light{i}", p, max_tokens)
             for i, p in enumerate(make_prompts(loaded, max(1, int(n * fraction / 2)), seed + 7, long_every=0))]

    def cfg(num_blocks: int, mode: str = "recompute", policy: str = "cost") -> EngineConfig:
        return dataclasses.replace(base, num_blocks=num_blocks, preemption_mode=PreemptionMode(mode),
                                   victim_policy=VictimPolicy(policy))

    # Each storm runs side by side with an unconstrained run of the same jobs, stepped in
    # turn (run_side_by_side), and each combination once a round: one storm run after its
    # reference moved by up to 0.25 here between runs of the same engine.
    tight_blocks = max(int(demand * fraction), max(-(-(len(p) + max_tokens) // base.block_size) for p in prompts) + 1)
    free_tps: list[float] = []
    free_steps: list[float] = []
    runs: dict[tuple[str, str], list[dict]] = {combo: [] for combo in combos}
    first: dict[tuple[str, str], RunResult] = {}
    for k in range(rounds):
        for mode, policy in combos:
            # Which engine steps first (on ties) alternates by round: in a run of the
            # unconstrained engine beside itself, the first one read 2-10% slower.
            pair = [cfg(tight_blocks, mode, policy), cfg(demand + 16)]
            runs_ = run_side_by_side(loaded, pair if k % 2 == 0 else pair[::-1], jobs,
                                     f"storm {mode}/{policy} beside unconstrained")
            r, free = runs_ if k % 2 == 0 else runs_[::-1]
            first.setdefault((mode, policy), r)
            tps, around = r.tokens_out / r.total_seconds, free.tokens_out / free.total_seconds
            free_tps.append(around)
            free_steps.append(free.tokens_out / max(1, free.steps))
            runs[(mode, policy)].append({"tok_s": tps, "unconstrained_around_tok_s": around,
                                         "ratio": tps / around, "preemptions": sum(r.preemptions.values()),
                                         "recomputed_tokens": r.recomputed_tokens})
    # The method's own error: the unconstrained run beside itself (first engine / second).
    null = [run_side_by_side(loaded, [cfg(demand + 16), cfg(demand + 16)], jobs, "unconstrained beside itself")
            for _ in range(2)]
    null_ratios = [a.total_seconds / b.total_seconds for a, b in null]
    rows = []
    for (mode, policy), rs in runs.items():
        # Steps, preemptions, recomputed tokens: the first round's (the prefill cap follows
        # measured step times, so a later round's schedule can differ a little; see runs).
        r = first[(mode, policy)]
        rows.append({"mode": mode, "policy": policy, "tok_s": statistics.mean(x["tok_s"] for x in rs),
                     "unconstrained_around_tok_s": statistics.mean(x["unconstrained_around_tok_s"] for x in rs),
                     "ratio_vs_unconstrained": statistics.mean(x["ratio"] for x in rs),
                     "ratio_runs": [x["ratio"] for x in rs], "runs": rs,
                     "tokens_per_step": r.tokens_out / max(1, r.steps),
                     "preemptions": sum(r.preemptions.values()), "by_mode": r.preemptions,
                     "recomputed_tokens": r.recomputed_tokens})
    fresh_tps, after_tps = [], []
    for _ in range(2):
        fresh_tps.append(_storm_then_light(loaded, cfg(tight_blocks), [], light))
        after_tps.append(_storm_then_light(loaded, cfg(tight_blocks), jobs, light))
    return {"requests": n, "max_tokens": max_tokens, "demand_blocks": demand, "pool_blocks": tight_blocks,
            "rounds": rounds, "method": "side by side",
            "unconstrained_tok_s": statistics.mean(free_tps), "unconstrained_runs_tok_s": free_tps,
            "unconstrained_tokens_per_step": statistics.mean(free_steps),
            "null_ratios": null_ratios,
            "rows": rows, "light_wave_requests": len(light),
            "light_wave_tok_s_fresh": statistics.mean(fresh_tps),
            "light_wave_tok_s_after_storm": statistics.mean(after_tps),
            "light_wave_runs": {"fresh": fresh_tps, "after_storm": after_tps}}


def _storm_then_light(loaded: LoadedModel, cfg: EngineConfig, storm: list[Job], light: list[Job]) -> float:
    (eng,) = _fresh_engines(loaded, [cfg])
    for j in storm:
        eng.add_request(j.rid, j.prompt, SamplingParams(temperature=0.0, max_tokens=j.max_tokens, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    t0 = time.perf_counter()
    toks = 0
    for j in light:
        eng.add_request("after-" + j.rid, j.prompt, SamplingParams(temperature=0.0, max_tokens=j.max_tokens, ignore_eos=True))
    while eng.has_unfinished():
        toks += sum(len(o.new_token_ids) for o in eng.step())
    return toks / (time.perf_counter() - t0)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def run(loaded: LoadedModel, out: Path, n: int, max_tokens: int, storm_n: int, fraction: float,
        seed: int, combos: list[tuple[str, str]], base: EngineConfig, rounds: int = 2) -> dict:
    import torch

    result = {**machine.stamp(), "torch": torch.__version__, "command": None,
              "cancel_storm": cancel_storm(loaded, base, n, max_tokens, seed),
              "cancel_storm_under_pressure": cancel_storm(
                  loaded, dataclasses.replace(base, num_blocks=_pressure_blocks(loaded, base, n, max_tokens, seed)),
                  n, max_tokens, seed + 1),
              "preemption_storm": preemption_storm(loaded, base, storm_n, max_tokens, fraction, seed, combos,
                                                   rounds)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


def _pressure_blocks(loaded: LoadedModel, base: EngineConfig, n: int, max_tokens: int, seed: int) -> int:
    prompts = make_prompts(loaded, n, seed + 1)
    demand = sum(-(-(len(p) + max_tokens) // base.block_size) for p in prompts)
    biggest = max(-(-(len(p) + max_tokens) // base.block_size) for p in prompts)
    return max(biggest + 1, demand // 2)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=64, help="cancel storm size (half are aborted)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--storm-requests", type=int, default=32, help="preemption storm size")
    p.add_argument("--pool-fraction", type=float, default=0.25, help="KV pool / demand in the storm")
    p.add_argument("--combos", default="recompute:cost,recompute:newest,recompute:fewest-output,"
                   "recompute:longest-output,recompute:least-computed,swap:cost,auto:cost",
                   help="comma-separated mode:policy pairs for the preemption storm")
    p.add_argument("--storm-rounds", type=int, default=2,
                   help="runs of each preemption-storm pair (one per round; the ratio is their mean)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/stop.json")
    p.add_argument("--report", default="docs/stop-benchmark.md")
    add_engine_args(p)


def main(args: argparse.Namespace) -> int:
    from stopline.bench import stop_report
    from stopline.model.loaders.loader import load_model

    loaded = load_model(args.model)
    combos = [tuple(c.split(":", 1)) for c in args.combos.split(",") if c]
    if args.storm_rounds < 1:
        raise SystemExit(f"--storm-rounds must be >= 1, got {args.storm_rounds}")
    result = run(loaded, Path(args.out), args.requests, args.max_tokens, args.storm_requests,
                 args.pool_fraction, args.seed, combos, engine_config(args), args.storm_rounds)
    result["command"] = "stopline bench stop " + " ".join(sys.argv[3:])
    Path(args.out).write_text(json.dumps(result, indent=2))
    Path(args.report).write_text(stop_report.render(result))
    print(f"results: {args.out}; report: {args.report}")
    return 0
