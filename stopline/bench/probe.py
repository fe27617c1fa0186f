"""Reading an engine's Prometheus `/metrics`: the same few quantities under each engine's names.

Each quantity lists candidate metric names, first present wins, summed over label sets
(e.g. stopline's preemptions by mode). A quantity an engine doesn't expose reads as None and
the report says so, rather than guessing.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class MetricNames:
    """Sample names (with `_total` where the exposition adds it) for each quantity."""

    kv_used: tuple[str, ...] = ()  # fraction 0..1, or blocks when kv_total is set
    kv_total: tuple[str, ...] = ()
    busy: tuple[str, ...] = ()  # requests running + waiting (+ preempted); summed across names
    gen_tokens: tuple[str, ...] = ()  # tokens generated, counted per step
    gen_tokens_per_step: bool = True  # False: the counter moves only when a request ends
    tokens_after_abort: tuple[str, ...] = ()  # the engine's own count of wasted tokens
    preemptions: tuple[str, ...] = ()
    recomputed: tuple[str, ...] = ()


@dataclass
class Reading:
    t: float  # time.perf_counter()
    kv_used: float | None = None  # fraction of the pool
    busy: float | None = None
    gen_tokens: float | None = None
    tokens_after_abort: float | None = None
    preemptions: float | None = None
    recomputed: float | None = None


def parse(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def _first(values: dict[str, float], names: tuple[str, ...]) -> float | None:
    for n in names:
        if n in values:
            return values[n]
    return None


def reading(values: dict[str, float], names: MetricNames, t: float) -> Reading:
    kv = _first(values, names.kv_used)
    if kv is not None and names.kv_total:
        total = _first(values, names.kv_total)
        kv = kv / total if total else None
    busy_parts = [values[n] for n in names.busy if n in values]
    return Reading(
        t=t, kv_used=kv, busy=sum(busy_parts) if busy_parts else None,
        gen_tokens=_first(values, names.gen_tokens),
        tokens_after_abort=_first(values, names.tokens_after_abort),
        preemptions=_first(values, names.preemptions), recomputed=_first(values, names.recomputed))


@dataclass
class Probe:
    """Scrapes one engine's /metrics: on demand, or every `interval` s into `timeline`."""

    base_url: str
    names: MetricNames
    interval: float = 0.1
    timeline: list[Reading] = field(default_factory=list)
    _http: httpx.AsyncClient | None = None
    _task: asyncio.Task | None = None

    async def read(self) -> Reading:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=10.0)
        t = time.perf_counter()
        try:
            r = await self._http.get(self.base_url.rstrip("/") + "/metrics")
            r.raise_for_status()
            return reading(parse(r.text), self.names, t)
        except (httpx.HTTPError, ValueError):
            return Reading(t=t)

    def start(self) -> None:
        """Record a timeline until stop() (for the KV-over-time plots)."""
        self.timeline = []
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> list[Reading]:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        return self.timeline

    async def _loop(self) -> None:
        while True:
            self.timeline.append(await self.read())
            await asyncio.sleep(self.interval)

    async def wait_idle(self, kv_baseline: float | None = None, timeout: float = 120.0,
                        poll: float = 0.02) -> float | None:
        """Seconds until no request is busy and KV use is at or under `kv_baseline`;
        None if that didn't happen within `timeout` (or the engine exposes neither)."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            r = await self.read()
            if r.busy is None and r.kv_used is None:
                return None
            busy_ok = r.busy is None or r.busy <= 0
            kv_ok = kv_baseline is None or r.kv_used is None or r.kv_used <= kv_baseline + 1e-9
            if busy_ok and kv_ok:
                return time.perf_counter() - t0
            await asyncio.sleep(poll)
        return None

    async def close(self) -> None:
        await self.stop()
        if self._http is not None:
            await self._http.aclose()
            self._http = None
