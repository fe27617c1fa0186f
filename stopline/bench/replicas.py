"""`stopline bench replicas`: what the Ray replicas (stopline/cluster) cost on the stop path.

Measured through the AsyncEngine API (no HTTP), so the figures are the router's and Ray's:
  abort latency     abort() -> the stream's terminal output at the front end, one request
                    decoding at a time; two replicas vs one engine core in its own process.
  add round trip    engine.add() -> admitted, both ways; and the router's choice alone.
  prefix hit rate   groups of requests sharing a long prefix, sent interleaved: prompt tokens
                    served from a replica's prefix cache, affinity vs round robin.
  head-of-line      a short request's completion time alone, and right after 10 long prompts
                    that were admitted and cancelled at once (ratio, through the router).
  replica kill      SIGKILL one replica while 8 streams run: slowest error at the front end,
                    then the time until Ray restarted it and it rejoined.
  idle CPU          CPU seconds of the front end and each replica over 5 idle seconds.
Run it in a network namespace (docs/replicas.md): Ray listens on every interface.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from stopline.args import add_engine_args, engine_config
from stopline.bench import machine
from stopline.cluster.cores import ReplicaState
from stopline.cluster.frontend import quiet_ray_env, ray_engine
from stopline.cluster.router import Policy, Router
from stopline.config import EngineConfig
from stopline.engine.async_engine import AsyncEngine
from stopline.engine.streams import EngineDead
from stopline.request import AbortSource, SamplingParams


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


_VOCAB = [20000]  # set from the engine's model in run()


def _tokens(rng: random.Random, n: int) -> list[int]:
    hi = _VOCAB[0] - 1
    return [rng.randrange(min(1000, hi // 4), hi) for _ in range(n)]


async def _abort_latency(engine: AsyncEngine, rng: random.Random, rounds: int) -> dict[str, Any]:
    lat, adds = [], []
    for i in range(rounds):
        t = time.monotonic()
        s = await engine.add(f"abort{i}", _tokens(rng, 32), SamplingParams(max_tokens=1000, ignore_eos=True))
        adds.append(time.monotonic() - t)
        it = s.__aiter__()
        got = 0
        while got < 3:
            got += len((await it.__anext__()).new_token_ids)
        t0 = time.monotonic()
        engine.abort([s.incarnation], AbortSource.CANCEL, t0)
        async for _ in it:
            pass
        lat.append(time.monotonic() - t0)
    return {"abort_p50_ms": 1e3 * _pct(lat, 0.5), "abort_p99_ms": 1e3 * _pct(lat, 0.99),
            "add_p50_ms": 1e3 * _pct(adds, 0.5)}


async def _complete(engine: AsyncEngine, rid: str, prompt: list[int], max_tokens: int) -> float:
    t = time.monotonic()
    s = await engine.add(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    async for _ in s:
        pass
    return time.monotonic() - t


async def _head_of_line(engine: AsyncEngine, rng: random.Random, long_len: int) -> dict[str, float]:
    short = _tokens(rng, 16)
    alone = statistics.median([await _complete(engine, f"alone{i}", short, 16) for i in range(5)])
    after = []
    for r in range(3):
        longs = [await engine.add(f"long{r}.{i}", _tokens(rng, long_len),
                                  SamplingParams(max_tokens=64, ignore_eos=True)) for i in range(10)]
        engine.abort([s.incarnation for s in longs], AbortSource.CANCEL, time.monotonic())
        after.append(await _complete(engine, f"after{r}", short, 16))
        for s in longs:
            async for _ in s:
                pass
    return {"short_alone_ms": 1e3 * alone, "short_after_cancels_ms": 1e3 * statistics.median(after),
            "ratio": statistics.median(after) / alone}


async def _hit_rate(engine: AsyncEngine, rng: random.Random, policy: Policy) -> float:
    backend = engine.backend
    backend.router = Router(policy, block_size=backend.router.block_size)
    await engine.utility("reset_prefix_cache")
    # 7 groups: an odd count, so round robin does not send a group to one replica by chance
    groups = [_tokens(rng, 128) for _ in range(7)]
    cached = prompt = 0
    for wave in range(4):
        streams = [await engine.add(f"g{policy}{wave}.{g}", p + _tokens(rng, 16),
                                    SamplingParams(max_tokens=1)) for g, p in enumerate(groups)]
        for s in streams:
            async for out in s:
                if out.finished and wave > 0 and out.usage is not None:
                    cached += out.usage.cached_tokens
                    prompt += out.usage.prompt_tokens
    return cached / prompt


async def _kill(engine: AsyncEngine, rng: random.Random) -> dict[str, float]:
    backend = engine.backend
    errors: list[float] = []
    killed_at = [0.0]

    async def one(i: int) -> None:
        s = await engine.add(f"kill{i}", _tokens(rng, 8), SamplingParams(max_tokens=2000, ignore_eos=True))
        try:
            async for _ in s:
                pass
        except EngineDead:
            errors.append(time.monotonic() - killed_at[0])

    tasks = [asyncio.ensure_future(one(i)) for i in range(8)]
    await asyncio.sleep(1.0)
    victim = backend.slots[0]
    killed_at[0] = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    while victim.state is not ReplicaState.DEAD:
        await asyncio.sleep(0.001)
    # The survivor's streams are not what is measured: cancel them.
    engine.abort(engine.open_ids(), AbortSource.CANCEL, time.monotonic())
    await asyncio.gather(*tasks)
    while victim.state is not ReplicaState.HEALTHY:
        await asyncio.sleep(0.05)
    return {"killed_streams": len(errors), "error_max_ms": 1e3 * max(errors),
            "rejoin_s": time.monotonic() - killed_at[0]}


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(model: str | None, config: EngineConfig, rounds: int = 40, long_len: int = 512,
        seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)

    async def single() -> dict[str, Any]:
        engine = AsyncEngine.in_subprocess(model, config, progress=False, core_threads=1)
        _VOCAB[0] = (await engine.start()).vocab_size
        try:
            return await _abort_latency(engine, rng, rounds)
        finally:
            await engine.close()

    async def cluster() -> dict[str, Any]:
        engine = ray_engine(model, config, replicas=2, threads=1)
        _VOCAB[0] = (await engine.start()).vocab_size
        try:
            out: dict[str, Any] = {"router": await _abort_latency(engine, rng, rounds)}
            router = Router(Policy.AFFINITY, block_size=engine.backend.router.block_size)
            prompts = [_tokens(rng, 256) for _ in range(200)]
            t = time.perf_counter()
            for p in prompts * 5:
                router.choose(p, [0, 1], lambda r: 0)
            out["choose_us"] = 1e6 * (time.perf_counter() - t) / (len(prompts) * 5)
            out["hit_rate"] = {p.value: await _hit_rate(engine, rng, p)
                               for p in (Policy.AFFINITY, Policy.ROUND_ROBIN)}
            engine.backend.router = Router(Policy.AFFINITY, block_size=router.block_size)
            out["head_of_line"] = await _head_of_line(engine, rng, long_len)
            out["kill"] = await _kill(engine, rng)
            await asyncio.sleep(1.0)
            pids = [s.pid for s in engine.backend.slots]
            t_cpu, r_cpu = time.process_time(), [_cpu(p) for p in pids]
            await asyncio.sleep(5.0)
            out["idle_cpu_s"] = {"frontend": time.process_time() - t_cpu,
                                 "replicas": [_cpu(p) - c for p, c in zip(pids, r_cpu, strict=True)]}
            return out
        finally:
            await engine.close()

    result = {"single": asyncio.run(single())}
    result |= asyncio.run(cluster())
    result |= machine.stamp()
    return result


def render(r: dict[str, Any], command: str, model: str) -> str:
    s, c = r["single"], r["router"]
    hol, k, idle = r["head_of_line"], r["kill"], r["idle_cpu_s"]
    rows = [
        ("abort latency p50 / p99, one engine core (own process)",
         f"{s['abort_p50_ms']:.1f} / {s['abort_p99_ms']:.1f} ms"),
        ("abort latency p50 / p99, through the router (2 replicas)",
         f"{c['abort_p50_ms']:.1f} / {c['abort_p99_ms']:.1f} ms"),
        ("p99 difference (target ≤ 10 ms)", f"{c['abort_p99_ms'] - s['abort_p99_ms']:+.1f} ms"),
        ("add round trip p50, one core / router", f"{s['add_p50_ms']:.2f} / {c['add_p50_ms']:.2f} ms"),
        ("router choice alone (256-token prompt)", f"{r['choose_us']:.1f} µs"),
        ("prefix hit rate, affinity / round robin",
         f"{r['hit_rate']['affinity']:.0%} / {r['hit_rate']['round-robin']:.0%}"),
        ("short request alone / after 10 cancelled long prompts",
         f"{hol['short_alone_ms']:.0f} / {hol['short_after_cancels_ms']:.0f} ms "
         f"(×{hol['ratio']:.2f}, target ≤ 2)"),
        (f"replica SIGKILL: slowest of its {k['killed_streams']} streams to error",
         f"{k['error_max_ms']:.0f} ms (target ≤ 1 s)"),
        ("killed replica restarted and rejoined after", f"{k['rejoin_s']:.1f} s"),
        ("idle CPU over 5 s: front end / replicas",
         f"{idle['frontend']:.2f} / {', '.join(f'{x:.2f}' for x in idle['replicas'])} s"),
    ]
    lines = [f"Host: {machine.summary(r['machine'])}, commit {r['git']}. Model: {model}. Command: `{command}`",
             "", "| measure | value |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines) + "\n"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=40, help="aborts timed per engine")
    p.add_argument("--long-len", type=int, default=512, help="prompt tokens of the cancelled long prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/replicas.json")
    add_engine_args(p)


def main(args: argparse.Namespace) -> int:
    quiet_ray_env()
    result = run(args.model, engine_config(args), args.rounds, args.long_len, args.seed)
    command = "stopline bench replicas " + " ".join(sys.argv[3:])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(render(result, command, args.model or "SmolLM2-135M-Instruct"))
    return 0
