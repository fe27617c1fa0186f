"""`stopline bench disagg`: the stop path across the prefill/decode split (stopline/disagg).

Measured through the AsyncEngine API of `serve --disagg` (no HTTP):
  head-of-line      a short request's completion time alone, and right after 10 long prompts
                    (~1,500 tokens) that were admitted and cancelled at once; the ratio.
  cancel-to-reclaim a long prompt cancelled mid-prefill, and a request cancelled mid-decode:
                    abort() -> both roles' pools back to baseline (polled snapshots).
  transfer          the KV of one long prompt, prefill side's pack -> decode side's blocks
                    written (waiting for the decode side's step boundary included): MB/s,
                    and its share of that request's time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from stopline.args import add_engine_args, engine_config
from stopline.bench import machine
from stopline.config import EngineConfig
from stopline.disagg.frontend import disagg_engine
from stopline.engine.async_engine import AsyncEngine
from stopline.request import AbortSource, SamplingParams


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    lo = min(1000, vocab // 4)  # past the special tokens (a tiny test model has 512 in all)
    return [rng.randrange(lo, vocab - 1) for _ in range(n)]


async def _complete(engine: AsyncEngine, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(time to first token, time to the terminal output), seconds."""
    t0 = time.monotonic()
    first = None
    s = await engine.add(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    async for out in s:
        if first is None and out.new_token_ids:
            first = time.monotonic() - t0
    return first or 0.0, time.monotonic() - t0


async def _pools_idle(engine: AsyncEngine, t0: float, timeout: float = 30.0) -> float:
    while True:
        snaps = await engine.utility("snapshot")
        if all(s.kv_blocks_used == 0 and s.running == 0 and s.waiting == 0 for s in snaps):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"pools not back to baseline in {timeout} s: {snaps}")
        await asyncio.sleep(0.002)


async def _run(model: str | None, config: EngineConfig, rounds: int, long_len: int, seed: int,
               reclaim_s: float) -> dict[str, Any]:
    engine = disagg_engine(model, config, reclaim_s=reclaim_s, progress=False)
    info = await engine.start()
    rng = random.Random(seed)
    vocab = info.vocab_size
    try:
        short = _tokens(rng, 16, vocab)
        await _complete(engine, "warm", _tokens(rng, long_len, vocab), 4)  # first-call costs
        alone, after = [], []
        for r in range(rounds):
            await engine.utility("reset_prefix_cache")
            alone.append((await _complete(engine, f"alone{r}", short, 16))[1])
            streams = [await engine.add(f"long{r}.{i}", _tokens(rng, long_len, vocab),
                                        SamplingParams(max_tokens=64, ignore_eos=True)) for i in range(10)]
            engine.abort([s.incarnation for s in streams], AbortSource.CANCEL, time.monotonic())
            after.append((await _complete(engine, f"after{r}", short, 16))[1])
            for s in streams:
                async for _ in s:
                    pass
            await _pools_idle(engine, time.monotonic())
        # Cancel-to-reclaim: mid-prefill (right after the add) and mid-decode (after 3 tokens).
        prefill_cut, decode_cut = [], []
        for r in range(rounds):
            s = await engine.add(f"cp{r}", _tokens(rng, long_len, vocab), SamplingParams(max_tokens=64))
            await asyncio.sleep(0.02)
            t0 = time.monotonic()
            engine.abort([s.incarnation], AbortSource.CANCEL, time.monotonic())
            async for _ in s:
                pass
            prefill_cut.append(await _pools_idle(engine, t0))
            s = await engine.add(f"cd{r}", _tokens(rng, long_len, vocab),
                                 SamplingParams(max_tokens=1000, ignore_eos=True))
            got = 0
            it = s.__aiter__()
            while got < 3:
                out = await it.__anext__()
                if out.finished:
                    raise RuntimeError(f"request ended before the cancel: {out.finish_reason} {out.stop_detail}")
                got += len(out.new_token_ids)
            t0 = time.monotonic()
            engine.abort([s.incarnation], AbortSource.CANCEL, time.monotonic())
            async for _ in it:
                pass
            decode_cut.append(await _pools_idle(engine, t0))
        # Transfer: one long prompt at a time, nothing else running.
        ttfts, shares, rates = [], [], []
        for r in range(rounds):
            await engine.utility("reset_prefix_cache")
            ttft, _ = await _complete(engine, f"tx{r}", _tokens(rng, long_len, vocab), 2)
            log = (await engine.utility("transfers"))[1]
            nbytes, secs = log[-1]
            ttfts.append(ttft)
            shares.append(secs / ttft)
            rates.append(nbytes / secs / 1e6)
        mb = nbytes / 1e6
    finally:
        await engine.close()
    med = statistics.median
    return {
        "rounds": rounds, "long_len": long_len, "reclaim_s": reclaim_s,
        "short_alone_s": med(alone), "short_after_cancelled_s": med(after),
        "head_of_line_ratio": med(after) / med(alone),
        "reclaim_mid_prefill_ms": 1000 * med(prefill_cut), "reclaim_mid_decode_ms": 1000 * med(decode_cut),
        "reclaim_max_ms": 1000 * max(prefill_cut + decode_cut),
        "transfer_mb": mb, "transfer_mb_s": med(rates), "ttft_s": med(ttfts),
        "transfer_share_of_ttft": med(shares),
        **machine.stamp(),
    }


def run(model: str | None, config: EngineConfig, rounds: int = 5, long_len: int = 1500, seed: int = 0,
        reclaim_s: float = 3.0) -> dict[str, Any]:
    return asyncio.run(_run(model, config, rounds, long_len, seed, reclaim_s))


def render(r: dict[str, Any], command: str, model: str) -> str:
    return "\n".join([
        f"Host: {machine.summary(r['machine'])}, commit {r['git']}.",
        f"`{command}` ({model}, {r['rounds']} rounds, long prompts of {r['long_len']} tokens, medians)",
        "",
        "| measure | value |",
        "|---|---|",
        f"| short request alone | {r['short_alone_s'] * 1000:.0f} ms |",
        f"| short request after 10 cancelled long prompts | {r['short_after_cancelled_s'] * 1000:.0f} ms |",
        f"| head-of-line ratio (target <= 2) | {r['head_of_line_ratio']:.2f} |",
        f"| cancel mid-prefill -> both pools at baseline | {r['reclaim_mid_prefill_ms']:.1f} ms |",
        f"| cancel mid-decode -> both pools at baseline | {r['reclaim_mid_decode_ms']:.1f} ms |",
        f"| slowest reclaim of all rounds | {r['reclaim_max_ms']:.1f} ms |",
        f"| KV of one long prompt | {r['transfer_mb']:.1f} MB |",
        f"| transfer, pack -> written on decode | {r['transfer_mb_s']:.0f} MB/s |",
        f"| time to first token of that prompt | {r['ttft_s'] * 1000:.0f} ms |",
        f"| transfer's share of it | {r['transfer_share_of_ttft'] * 100:.1f} % |",
    ])


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=5, help="rounds of each measure (medians reported)")
    p.add_argument("--long-len", type=int, default=1500, help="prompt tokens of the long prompts")
    p.add_argument("--reclaim-s", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/disagg.json")
    add_engine_args(p)


def main(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    result = run(args.model, engine_config(args), args.rounds, args.long_len, args.seed, args.reclaim_s)
    command = "stopline bench disagg " + " ".join(sys.argv[3:])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(render(result, command, args.model or "SmolLM2-135M-Instruct"))
    return 0
