"""4. Head-of-line: long prompts whose clients leave, then a short request.

10 clients send ~3,000-token prompts and disconnect `delay` seconds later; the short request
is sent right after the disconnects. Its TTFT / its TTFT alone says how much abandoned
prefill still stood in front of it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from stopline.bench.prompts import make_prompts
from stopline.bench.stats import percentile, ratio
from stopline.bench.workloads.context import Ctx, errors_of

ALONE_TRIES = 3


def planned(cfg: Any) -> int:
    return ALONE_TRIES + 1 + len(cfg.hol_delays) * (cfg.hol_clients + 1)


async def run(ctx: Ctx) -> dict[str, Any]:
    cfg = ctx.cfg
    shorts = make_prompts(cfg.seed * 1000 + 200, ALONE_TRIES + len(cfg.hol_delays),
                          cfg.hol_short_prompt_tokens)
    alone = []
    for p in shorts[:ALONE_TRIES]:
        await ctx.settle()
        alone.append(await ctx.send(p, cfg.hol_short_tokens))
    ttft_alone = percentile([o.ttft for o in alone if o.ttft is not None], 50)
    # The long clients leave before any usage arrives: count a long prompt's tokens once.
    sizing = await ctx.send(make_prompts(cfg.seed * 1000 + 299, 1, cfg.hol_prompt_tokens)[0], 1)
    runs = []
    for k, delay in enumerate(cfg.hol_delays):
        await ctx.settle()
        longs = make_prompts(cfg.seed * 1000 + 300 + k, cfg.hol_clients, cfg.hol_prompt_tokens)
        long_tasks = [asyncio.ensure_future(ctx.send(p, 16, close_after_s=delay)) for p in longs]
        long_outs = await asyncio.gather(*long_tasks)
        short = await ctx.send(shorts[ALONE_TRIES + k], cfg.hol_short_tokens)
        idle_after = await ctx.settle()
        runs.append({
            "delay_s": delay, "short_ttft_s": short.ttft,
            "ratio": ratio(short.ttft, ttft_alone),
            "long_prompt_tokens": sizing.prompt_tokens,
            "longs_answered_before_close": sum(o.first is not None for o in long_outs),
            "idle_after_short_s": idle_after,
            "errors": errors_of(list(long_outs) + [short]),
        })
    return {"ttft_alone_s": ttft_alone, "runs": runs, "errors": errors_of(alone)}
