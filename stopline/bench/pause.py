"""`stopline bench pause`: what an engine-wide pause costs (docs/engine-stops.md).

With N streams decoding (the engine core in its own process, through the AsyncEngine API),
per pause mode:
  pause s         pause() called -> it returned: abort, every stream ended; keep, the core
                  halted (no step runs); wait, every stream finished.
  resume s        resume() called -> it returned (the core steps again).
  first token s   resume() called -> the next token of a kept stream (keep only).
  discarded       tokens the streams had been sent and that ended in an error (abort: the
                  client's work is lost); keep and wait discard none.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import sys
import time
from pathlib import Path
from typing import Any

from stopline.args import add_engine_args, engine_config
from stopline.bench import machine
from stopline.config import EngineConfig
from stopline.engine.async_engine import AsyncEngine
from stopline.engine.streams import EngineStopped
from stopline.request import SamplingParams

MODES = ("abort", "keep", "wait")


async def _round(engine: AsyncEngine, mode: str, streams: int, max_tokens: int) -> dict[str, Any]:
    prompt = engine.tokenizer.encode("Write a long story about a lighthouse keeper.")
    counts = [0] * streams
    last = [0.0] * streams
    stopped = [False] * streams

    async def read(i: int) -> None:
        s = await engine.add(f"{mode}{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                  temperature=0))
        try:
            async for out in s:
                counts[i] += len(out.new_token_ids)
                last[i] = time.monotonic()
        except EngineStopped:
            stopped[i] = True

    tasks = [asyncio.ensure_future(read(i)) for i in range(streams)]
    while min(counts) < 4:  # every stream decoding
        await asyncio.sleep(0.01)
    t0 = time.monotonic()
    answer = await engine.pause(mode)
    pause_s = time.monotonic() - t0
    held = list(counts)
    await asyncio.sleep(0.2)
    moved = sum(counts) - sum(held)  # keep: tokens sent while paused (0)
    t1 = time.monotonic()
    await engine.resume()
    resume_s = time.monotonic() - t1
    first = None
    if mode == "keep":
        while sum(counts) == sum(held):
            await asyncio.sleep(0.001)
        first = max(0.0, min(t for t, c, h in zip(last, counts, held, strict=True) if c > h) - t1)
        await engine.abort_and_wait(None)
    await asyncio.gather(*tasks)
    return {"mode": mode, "streams": streams, "pause_s": round(pause_s, 4), "resume_s": round(resume_s, 4),
            "first_token_s": None if first is None else round(first, 4),
            "discarded_tokens": sum(c for c, s in zip(counts, stopped, strict=True) if s),
            "ended_by_pause": answer["aborted"], "tokens_while_paused": moved}


def run(model: str | None, config: EngineConfig, streams: int, max_tokens: int, wait_tokens: int) -> dict:
    async def main() -> list[dict[str, Any]]:
        engine = AsyncEngine.in_subprocess(model, config, progress=False, max_buffered=10_000)
        await engine.start()
        try:
            return [await _round(engine, m, streams, wait_tokens if m == "wait" else max_tokens)
                    for m in MODES]
        finally:
            await engine.close()

    rows = asyncio.run(main())
    return {"benchmark": "pause", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            **machine.stamp(), "streams": streams, "max_tokens": max_tokens, "wait_tokens": wait_tokens,
            "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = ["| mode | streams | pause s | resume s | first token after resume s | tokens discarded |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        first = "-" if r["first_token_s"] is None else f"{r['first_token_s']:.3f}"
        lines.append(f"| {r['mode']} | {r['streams']} | {r['pause_s']:.3f} | {r['resume_s']:.3f} | "
                     f"{first} | {r['discarded_tokens']} |")
    return "\n".join(lines)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=32, help="streams in flight when the pause comes")
    p.add_argument("--max-tokens", type=int, default=2000, help="new tokens a stream asks for (abort, keep)")
    p.add_argument("--wait-tokens", type=int, default=48, help="new tokens a stream asks for (mode wait)")
    p.add_argument("--out", default="bench_results/pause")
    add_engine_args(p)


def main(args: argparse.Namespace) -> int:
    result = run(args.model, engine_config(args), args.streams, args.max_tokens, args.wait_tokens)
    result["command"] = "stopline bench pause " + " ".join(sys.argv[3:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pause.json").write_text(json.dumps(result, indent=2) + "\n")
    head = f"Host: {machine.summary(result['machine'])}, commit {result.get('git')}; `{result['command']}`"
    (out / "pause.md").write_text(head + "\n\n" + table(result) + "\n")
    print(head + "\n\n" + table(result))
    return 0
