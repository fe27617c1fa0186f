"""6. Non-stream disconnect: a non-streaming client drops after 1 s; what runs on after it?

A server that does not watch a non-streaming request's connection generates to max_tokens
for nobody. Measured three ways, each where the engine allows it: the engine's own count of
tokens computed after the abort (stopline), its per-step generation counter read at the
drop and at idle (vLLM), and for every engine the seconds it stayed busy after the drop.
"""

from __future__ import annotations

from typing import Any

from stopline.bench.prompts import make_prompts
from stopline.bench.workloads.context import Ctx, delta


def planned(cfg: Any) -> int:
    return 1


async def run(ctx: Ctx) -> dict[str, Any]:
    cfg = ctx.cfg
    prompt = make_prompts(cfg.seed * 1000 + 400, 1, 32)[0]
    await ctx.settle()
    before = await ctx.probe.read()
    out = await ctx.send(prompt, cfg.nonstream_max_tokens, stream=False,
                         close_after_s=cfg.nonstream_drop_s)
    at_drop = await ctx.probe.read()
    busy_after = await ctx.probe.wait_idle(timeout=cfg.idle_timeout, poll=0.01)
    after = await ctx.probe.read()
    per_step = ctx.probe.names.gen_tokens_per_step
    return {
        "dropped": out.closed, "finished_before_drop": not out.closed and out.error is None,
        "max_tokens": cfg.nonstream_max_tokens,
        "tokens_after_abort_engine": delta(after, before, "tokens_after_abort"),
        "gen_counter_after_drop": delta(after, at_drop, "gen_tokens") if per_step else None,
        "gen_counter_total": delta(after, before, "gen_tokens"),
        "busy_after_drop_s": busy_after,
        "error": out.error if not out.closed else None,
    }
