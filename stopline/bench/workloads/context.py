"""What a workload gets: a client and a probe for one running engine, plus shared helpers."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from stopline.bench.client import BenchClient, Outcome, complete
from stopline.bench.engines import MODEL_NAME, EngineSpec
from stopline.bench.probe import Probe, Reading
from stopline.bench.workloads.config import BenchConfig

# Relaunch the engine under test with a KV pool of this many tokens (None: default) and
# engine-specific settings; returns the new client and probe.
Relaunch = Callable[[int | None, dict[str, str]], Awaitable[tuple[BenchClient, Probe]]]


@dataclass
class Ctx:
    spec: EngineSpec
    client: BenchClient
    probe: Probe
    cfg: BenchConfig
    bar: tqdm
    relaunch: Relaunch
    model: str = MODEL_NAME
    notes: list[str] = field(default_factory=list)

    def rng(self, salt: str) -> random.Random:
        """A generator per workload, so one workload's draws don't shift another's."""
        return random.Random(f"{self.cfg.seed}:{salt}")

    async def send(self, prompt: str, max_tokens: int, **kw: Any) -> Outcome:
        out = await complete(self.client, self.model, prompt, max_tokens, **kw)
        self.bar.update(1)
        return out

    async def closed_loop(self, prompts: list[str], concurrency: int, max_tokens: int,
                          seed_base: int | None = None, **kw: Any) -> list[Outcome]:
        """Keep `concurrency` requests in flight until every prompt has been sent; with a
        seed_base, prompt i is sent with the seed seed_base + i."""
        outs: list[Outcome | None] = [None] * len(prompts)
        queue = list(enumerate(prompts))[::-1]

        async def worker() -> None:
            while queue:
                i, p = queue.pop()
                seed = {} if seed_base is None else {"seed": seed_base + i}
                outs[i] = await self.send(p, max_tokens, **seed, **kw)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
        return [o for o in outs if o is not None]

    async def settle(self) -> float | None:
        """Wait for the engine to go idle between measurements."""
        return await self.probe.wait_idle(timeout=self.cfg.idle_timeout)

    async def kv_baseline(self) -> float | None:
        await self.settle()
        return (await self.probe.read()).kv_used


def delta(after: Reading, before: Reading, name: str) -> float | None:
    a, b = getattr(after, name), getattr(before, name)
    return None if a is None or b is None else a - b


def timeline_json(readings: list[Reading], t0: float) -> list[list[float | None]]:
    """[t, kv_used, busy] rows for the KV-over-time plots."""
    return [[round(r.t - t0, 4), r.kv_used, r.busy] for r in readings]


def errors_of(outs: list[Outcome]) -> list[str]:
    return sorted({o.error for o in outs if o.error and not o.closed})[:5]
