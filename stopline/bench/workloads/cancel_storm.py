"""2. Cancel storm: half the streams are closed by the client; then the same run with each
closed stream replaced by a twin that stops on its own at the same point (max_tokens).

ratio = survivors' mean completion time with twins / with closes. 1.0: a cancel costs the
survivors no more than a natural stop at the same point; below 1: cancelled work kept
running (or its resources were held) at the survivors' expense. The runs go closes, twins,
twins, closes (fresh prompts each), and each side is the mean of its two; tokens after the
abort, KV back to baseline and the KV timeline are the first close run's.

Close points: `queued` (within 50 ms of sending), `prefill` (a time inside the window it
takes the engine to prefill the whole storm, calibrated from one request alone) and `decode`
(after k tokens). Which phase a timed close really hit is the engine's business; the result
counts closes that came before the first token.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from stopline.bench.client import Outcome
from stopline.bench.prompts import make_prompts
from stopline.bench.stats import mean, ratio
from stopline.bench.workloads.context import Ctx, delta, errors_of, timeline_json

MIXED = ("queued", "prefill", "decode")


def planned(cfg: Any) -> int:
    return 1 + 4 * (cfg.storm_streams + cfg.storm_decode_streams)


async def run(ctx: Ctx) -> dict[str, Any]:
    cfg = ctx.cfg
    await ctx.settle()
    calib = await ctx.send(make_prompts(cfg.seed * 1000 + 90, 1, cfg.storm_prompt_tokens)[0], 1)
    ttft_alone = calib.ttft or 0.05
    variants = {"mixed": await _storm(ctx, cfg.storm_streams, MIXED, "mixed", ttft_alone)}
    if cfg.storm_decode_streams:
        variants["decode"] = await _storm(ctx, cfg.storm_decode_streams, ("decode",), "decode",
                                          ttft_alone)
    return {"ttft_alone_s": ttft_alone, "variants": variants}


async def _storm(ctx: Ctx, n: int, kinds: tuple[str, ...], label: str,
                 ttft_alone: float) -> dict[str, Any]:
    cfg = ctx.cfg
    rng = ctx.rng(f"storm:{label}")
    prompts = make_prompts(cfg.seed * 1000 + 100 + len(label), n, cfg.storm_prompt_tokens)
    closers = rng.sample(range(n), n // 2)
    prefill_window = max(0.1, ttft_alone * n / 2)
    plan: dict[int, tuple[str, dict[str, Any]]] = {}
    for j, i in enumerate(closers):
        kind = kinds[j % len(kinds)]
        if kind == "queued":
            plan[i] = (kind, {"close_after_s": rng.uniform(0.0, 0.05)})
        elif kind == "prefill":
            plan[i] = (kind, {"close_after_s": rng.uniform(0.05, prefill_window)})
        else:
            plan[i] = (kind, {"close_after_tokens": rng.randint(1, max(1, cfg.storm_output_tokens - 1))})

    base_kv = await ctx.kv_baseline()
    before = await ctx.probe.read()
    ctx.probe.start()
    t0 = time.perf_counter()
    closed_run = await asyncio.gather(*(
        ctx.send(p, cfg.storm_output_tokens, **(plan[i][1] if i in plan else {}))
        for i, p in enumerate(prompts)))
    kv_back = await ctx.probe.wait_idle(kv_baseline=base_kv, timeout=cfg.idle_timeout, poll=0.01)
    await asyncio.sleep(0.2)  # a little idle tail on the plot
    timeline = await ctx.probe.stop()
    after = await ctx.probe.read()

    # Twins stop on their own where the close happened; a close before the first token is
    # matched by the nearest natural stop, one token. Every run gets fresh prompts of the same
    # length: an earlier run's prompts would be prefix-cache hits and make a later run cheap.
    # The runs go closes, twins, twins, closes and each side is the mean of its two: the
    # first run of a level ran 5-10% slower here whatever it was (decode closes 0.88-0.91
    # with one run a side, closes first).
    twin_tokens = {i: max(1, closed_run[i].chunks) for i in plan}

    async def again(salt: int, closes: bool) -> tuple[list[Outcome], float]:
        fresh = make_prompts(cfg.seed * 1000 + salt + len(label), n, cfg.storm_prompt_tokens)
        await ctx.settle()
        # The metrics scrape runs during every run: on 2 cores its load alone slowed the close
        # run's survivors by 13-17% when only that run was scraped (ratio 0.83-0.87, against
        # 0.97 from a client that scraped neither).
        ctx.probe.start()
        t = time.perf_counter()
        outs = await asyncio.gather(*(
            ctx.send(p, cfg.storm_output_tokens, **(plan[i][1] if i in plan else {})) if closes
            else ctx.send(p, twin_tokens.get(i, cfg.storm_output_tokens)) for i, p in enumerate(fresh)))
        await ctx.probe.stop()
        return list(outs), t

    twin_runs = [await again(150, False), await again(170, False)]
    closed_again = await again(190, True)
    survivors = [i for i in range(n) if i not in plan]

    def surv_times(outs: list[Outcome], start: float) -> tuple[float | None, float | None]:
        ok = [outs[i] for i in survivors if outs[i].error is None]
        return mean([o.latency for o in ok]), max((o.end - start for o in ok), default=None)

    closes = [surv_times(closed_run, t0), surv_times(*closed_again)]
    twins = [surv_times(*run) for run in twin_runs]

    def side(runs: list[tuple[float | None, float | None]], k: int) -> float | None:
        vals = [r[k] for r in runs]
        return None if None in vals else mean([v for v in vals if v is not None])

    closes_mean, closes_makespan = side(closes, 0), side(closes, 1)
    twins_mean, twins_makespan = side(twins, 0), side(twins, 1)
    received = sum(o.chunks if o.closed else o.tokens for o in closed_run if o.error is None or o.closed)
    gen = delta(after, before, "gen_tokens")
    by_kind: dict[str, dict[str, int]] = {}
    for i, (kind, _) in plan.items():
        k = by_kind.setdefault(kind, {"closed": 0, "before_first_token": 0})
        k["closed"] += 1
        k["before_first_token"] += closed_run[i].first is None
    return {
        "streams": n, "closed": len(plan), "by_kind": by_kind,
        "survivor_mean_s": {"closes": closes_mean, "twins": twins_mean},
        "survivor_mean_s_runs": {"closes": [c[0] for c in closes], "twins": [t[0] for t in twins]},
        "survivor_makespan_s": {"closes": closes_makespan, "twins": twins_makespan},
        "ratio": ratio(twins_mean, closes_mean),
        "ratio_makespan": ratio(twins_makespan, closes_makespan),
        "tokens_after_abort_engine": delta(after, before, "tokens_after_abort"),
        "generated_minus_received": (gen - received) if gen is not None else None,
        "gen_counter_per_step": ctx.probe.names.gen_tokens_per_step,
        "kv_baseline": base_kv,
        "kv_back_to_baseline_s": kv_back,
        "timeline": timeline_json(timeline, t0),
        "close_times": sorted(round(o.closed_at - t0, 4) for o in closed_run if o.closed_at),
        "errors": errors_of(closed_run + closed_again[0] + twin_runs[0][0] + twin_runs[1][0]),
    }
