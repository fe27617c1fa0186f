"""1. Throughput / latency: closed loop at each concurrency, EOS ignored, greedy or sampled
(`temperature` above 0, every request seeded).

Output tok/s counts tokens the client received over the level's wall time; TTFT and ITL come
from chunk arrival times at the client, so every engine is timed by the same clock.
"""

from __future__ import annotations

import time
from typing import Any

from stopline.bench.prompts import make_prompts
from stopline.bench.stats import summary
from stopline.bench.workloads.context import Ctx, errors_of


def planned(cfg: Any) -> int:
    return sum(c * cfg.waves for c in cfg.concurrencies)


async def run(ctx: Ctx) -> dict[str, Any]:
    cfg = ctx.cfg
    levels = []
    for level, conc in enumerate(cfg.concurrencies):
        await ctx.settle()
        prompts = make_prompts(cfg.seed * 1000 + level, conc * cfg.waves, cfg.prompt_tokens)
        t0 = time.perf_counter()
        sampled = cfg.temperature > 0
        outs = await ctx.closed_loop(prompts, conc, cfg.output_tokens, temperature=cfg.temperature,
                                     seed_base=cfg.seed * 100003 if sampled else None)
        wall = time.perf_counter() - t0
        ok = [o for o in outs if o.error is None]
        tokens = sum(o.tokens for o in ok)
        itls = [x for o in ok for x in o.itls()]
        levels.append({
            "concurrency": conc, "temperature": cfg.temperature, "requests": len(outs), "ok": len(ok), "wall_s": wall,
            "output_tokens": tokens, "output_tok_s": tokens / wall if wall > 0 else None,
            "ttft": summary([o.ttft for o in ok if o.ttft is not None]),
            "itl": summary(itls),
            "prompt_tokens": ok[0].prompt_tokens if ok else None,
            # Sorted samples for the latency CDFs (seconds)
            "ttft_samples": sorted(round(o.ttft, 5) for o in ok if o.ttft is not None),
            "itl_samples": sorted(round(x, 5) for x in itls)[:: max(1, len(itls) // 500)],
            "errors": errors_of(outs),
        })
    return {"levels": levels}
