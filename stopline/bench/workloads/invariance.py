"""3. Batch invariance: each greedy request alone, then all of them at once; count differences.

A request whose text differs when it shares steps with others depends on its neighbours; the
stop-path chaos tests compare outputs under storms with undisturbed runs, which only means
something when this count is 0.
"""

from __future__ import annotations

import asyncio
from typing import Any

from stopline.bench.prompts import make_prompts
from stopline.bench.workloads.context import Ctx, errors_of


def planned(cfg: Any) -> int:
    return 2 * cfg.invariance_requests


def _first_diff(a: str, b: str) -> int | None:
    if a == b:
        return None
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


async def run(ctx: Ctx) -> dict[str, Any]:
    cfg = ctx.cfg
    prompts = make_prompts(cfg.seed * 1000 + 7, cfg.invariance_requests, cfg.invariance_prompt_tokens)
    await ctx.settle()
    alone = []
    for p in prompts:
        alone.append(await ctx.send(p, cfg.invariance_tokens))
    await ctx.settle()
    together = await asyncio.gather(*(ctx.send(p, cfg.invariance_tokens) for p in prompts))
    pairs = [(a, b) for a, b in zip(alone, together, strict=True) if a.error is None and b.error is None]
    diffs = [_first_diff(a.text, b.text) for a, b in pairs]
    return {
        "requests": len(prompts), "compared": len(pairs),
        "differ": sum(d is not None for d in diffs),
        "first_diff_chars": [d for d in diffs if d is not None],
        "errors": errors_of(alone + list(together)),
    }
