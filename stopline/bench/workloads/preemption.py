"""5. Preemption storm: the KV pool sized to a fraction (25%) of what the streams need.

Measured per engine that has a pool to shrink: storm throughput / the same storm
unconstrained, preemptions and recomputed tokens (engine counters), and the throughput of a
light load in the seconds right after the storm against the same load before it (a collapse
after pressure shows up as a ratio well under 1). stopline runs once per victim policy and
preemption mode.

Each variant is bracketed by unconstrained runs (the engine relaunched with its own pool):
its ratios are taken against the mean of the reference just before and just after it. With
one reference at the start, a host that slowed down over the ~5 minutes of variants read as
the later variants being slower: in one run the light load alone, which no pool size
touches, read 155-182 tok/s after the last three variants against 205 at the start.
`preempt_bracket=False` keeps the single reference (fewer relaunches, e.g. for a slow peer).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from stopline.bench.prompts import make_prompts
from stopline.bench.stats import ratio
from stopline.bench.workloads.context import Ctx, delta, errors_of, timeline_json

AFTER_TOKENS = 32


def planned(cfg: Any) -> int:
    per_variant = 2 if cfg.preempt_bracket else 1
    return 1 + cfg.preempt_streams * (1 + per_variant * len(cfg.preempt_variants))


def _variants(ctx: Ctx) -> list[tuple[str, str]]:
    return list(ctx.cfg.preempt_variants) if ctx.spec.name == "stopline" else [("default", "default")]


async def run(ctx: Ctx) -> dict[str, Any]:
    cfg = ctx.cfg
    if not ctx.spec.can_size_kv:
        return {"skipped": ctx.spec.no_kv_why}
    prompts = make_prompts(cfg.seed * 1000 + 500, cfg.preempt_streams, cfg.preempt_prompt_tokens)
    await ctx.settle()
    probe_out = await ctx.send(prompts[0], 1)
    prompt_tokens = probe_out.prompt_tokens or cfg.preempt_prompt_tokens
    demand = cfg.preempt_streams * (prompt_tokens + cfg.preempt_output_tokens)
    kv_tokens = int(demand * cfg.preempt_kv_fraction)

    refs = [await _reference(ctx, prompts, 0)]
    results: dict[str, Any] = {"demand_tokens": demand, "kv_tokens": kv_tokens,
                               "unconstrained": refs[0], "variants": []}
    variants = _variants(ctx)
    for i, (policy, mode) in enumerate(variants):
        settings = {} if policy == "default" else {"victim-policy": policy, "preemption-mode": mode}
        try:
            ctx.client, ctx.probe = await ctx.relaunch(kv_tokens, settings)
        except Exception as exc:  # a setting that can't start is a result too
            results["variants"].append({"policy": policy, "mode": mode, "error": str(exc)[-800:]})
            continue
        storm = await _storm(ctx, prompts)
        after = await _after_load(ctx, "after")
        bracket = refs[-1:]
        if cfg.preempt_bracket:
            ctx.client, ctx.probe = await ctx.relaunch(None, {})
            refs.append(await _reference(ctx, prompts, i + 1))
            bracket = refs[-2:]
        free_tok_s = _mean([r["output_tok_s"] for r in bracket])
        free_after = _mean([r["light_load_tok_s"] for r in bracket])
        storm |= {
            "policy": policy, "mode": mode,
            "unconstrained_tok_s": free_tok_s, "unconstrained_light_load_tok_s": free_after,
            "throughput_ratio": ratio(storm["output_tok_s"], free_tok_s),
            "light_load_after_tok_s": after,
            "after_ratio": ratio(after, free_after),
        }
        results["variants"].append(storm)
    if len(refs) > 1:
        results["references"] = [{k: r[k] for k in ("output_tok_s", "light_load_tok_s")} for r in refs]
    return results


async def _reference(ctx: Ctx, prompts: list[str], n: int) -> dict[str, Any]:
    """The storm and the light load on the engine with its own (unconstrained) pool."""
    free = await _storm(ctx, prompts)
    return free | {"light_load_tok_s": await _after_load(ctx, f"before:{n}" if n else "before")}


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


async def _storm(ctx: Ctx, prompts: list[str]) -> dict[str, Any]:
    cfg = ctx.cfg
    await ctx.settle()
    before = await ctx.probe.read()
    ctx.probe.start()
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(ctx.send(p, cfg.preempt_output_tokens) for p in prompts))
    wall = time.perf_counter() - t0
    await ctx.settle()
    timeline = await ctx.probe.stop()
    after = await ctx.probe.read()
    ok = [o for o in outs if o.error is None]
    tokens = sum(o.tokens for o in ok)
    return {
        "ok": len(ok), "requests": len(outs), "wall_s": wall, "output_tokens": tokens,
        "output_tok_s": tokens / wall if wall > 0 else None,
        "preemptions": delta(after, before, "preemptions"),
        "recomputed_tokens": delta(after, before, "recomputed"),
        "finish_reasons": sorted({str(o.finish_reason) for o in outs}),
        "timeline": timeline_json(timeline, t0),
        "errors": errors_of(outs),
    }


async def _after_load(ctx: Ctx, salt: str) -> float | None:
    """Tokens/s of a closed loop of short requests over `preempt_after_s` seconds, counting
    only tokens that arrived inside the window."""
    cfg = ctx.cfg
    rng = ctx.rng(f"after:{salt}")
    deadline = time.perf_counter() + cfg.preempt_after_s
    t_start = time.perf_counter()
    counted = 0

    async def worker() -> None:
        nonlocal counted
        while time.perf_counter() < deadline:
            prompt = make_prompts(rng.randrange(10**9), 1, cfg.preempt_prompt_tokens)[0]
            ctx.bar.total += 1  # requests the plan couldn't count: keep the bar honest
            out = await ctx.send(prompt, AFTER_TOKENS, close_after_s=deadline - time.perf_counter() + 0.01)
            counted += sum(1 for t in out.chunk_times if t <= deadline)

    await asyncio.gather(*(worker() for _ in range(cfg.preempt_after_concurrency)))
    await ctx.settle()
    return counted / max(1e-9, deadline - t_start)
