"""`stopline bench-serve`: the serving benchmark, every engine through its OpenAI HTTP API.

Engines run one at a time (each alone on the machine while measured), each started on a free
loopback port, warmed up, run through the selected workloads, stopped. Results go to
bench-results/<run>/results.json after every workload, so an interrupted run keeps what it
measured; engine logs beside it. `stopline bench-report` turns results into docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from stopline.bench import machine
from stopline.bench.client import make_client
from stopline.bench.engines import (
    MODEL_NAME,
    EngineSpec,
    EngineStartError,
    RunningEngine,
    spec_for,
    stop_all,
)
from stopline.bench.probe import Probe
from stopline.bench.prompts import make_prompts
from stopline.bench.workloads import (
    cancel_storm,
    head_of_line,
    invariance,
    nonstream_disconnect,
    preemption,
    throughput,
)
from stopline.bench.workloads.config import BenchConfig
from stopline.bench.workloads.context import Ctx

MODULES = {"throughput": throughput, "invariance": invariance, "cancel_storm": cancel_storm,
           "head_of_line": head_of_line, "nonstream_disconnect": nonstream_disconnect,
           "preemption": preemption}
WARMUP_REQUESTS = 2


def new_run_dir(root: Path) -> Path:
    d = root / time.strftime("%Y%m%d-%H%M%S")
    d.mkdir(parents=True, exist_ok=True)
    return d


def run_bench(engines: list[str], cfg: BenchConfig, out_dir: Path, *, model: str | None = None,
              command: str | None = None, progress: bool = True,
              specs: dict[str, EngineSpec] | None = None) -> Path:
    """Benchmark `engines` in order; returns the results file."""
    results: dict[str, Any] = {
        "meta": {"command": command or shlex.join(["stopline", *sys.argv[1:]]),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), **machine.stamp(),
                 "model": model or "SmolLM2-135M-Instruct (embedded GGUF)"},
        "config": cfg.to_json(), "engines": {}}
    path = out_dir / "results.json"

    def save() -> None:
        path.write_text(json.dumps(results, indent=1, default=str))

    try:
        for name in engines:
            _one(name, specs, model, cfg, out_dir, results, save, progress)
    finally:
        stop_all()  # also on Ctrl-C / SIGTERM: no engine outlives the bench
    return path


def _one(name: str, specs: dict[str, EngineSpec] | None, model: str | None, cfg: BenchConfig,
         out_dir: Path, results: dict[str, Any], save: Callable[[], None], progress: bool) -> None:
    spec = (specs or {}).get(name) or spec_for(name, model)
    results["engines"][name] = entry = {"status": "running", "workloads": {}}
    save()
    try:
        asyncio.run(_bench_engine(spec, cfg, out_dir, entry, save, progress))
    except EngineStartError as exc:
        entry.update(status="setup_failed", error=str(exc))
    except Exception as exc:  # record and go on to the next engine
        entry.update(status="failed", error=f"{exc}\n{traceback.format_exc()[-2000:]}")
    else:
        entry["status"] = "ok"
    save()


async def _bench_engine(spec: EngineSpec, cfg: BenchConfig, out_dir: Path, entry: dict[str, Any],
                        save: Callable[[], None], progress: bool) -> None:
    logs = out_dir / "logs"
    current: list[RunningEngine] = []

    async def launch(kv_tokens: int | None, variant: dict[str, str]):
        while current:
            await asyncio.to_thread(current.pop().stop)
        tag = "-".join([spec.name, *(v for v in variant.values())] + ([f"kv{kv_tokens}"] if kv_tokens else []))
        eng = RunningEngine(spec, logs / f"{tag}.log", kv_tokens, variant)
        current.append(eng)
        startup = await asyncio.to_thread(eng.wait_ready)
        entry.setdefault("launches", []).append({"command": eng.command, "startup_s": round(startup, 2)})
        client = make_client(eng.base_url, cfg.request_timeout)
        probe = Probe(eng.base_url, spec.metrics)
        for p in make_prompts(cfg.seed + 999, WARMUP_REQUESTS, 16):  # first-request costs out
            await client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=4, temperature=0)
        return client, probe

    try:
        client, probe = await launch(None, {})
        total = sum(MODULES[w].planned(cfg) for w in cfg.workloads)
        with tqdm(total=total, desc=spec.name, unit="req", disable=not progress,
                  dynamic_ncols=True) as bar:
            ctx = Ctx(spec=spec, client=client, probe=probe, cfg=cfg, bar=bar, relaunch=launch)
            for w in cfg.workloads:
                bar.set_postfix_str(w)
                t0 = time.perf_counter()
                try:
                    res = await MODULES[w].run(ctx)
                except Exception as exc:
                    res = {"error": f"{type(exc).__name__}: {exc}",
                           "traceback": traceback.format_exc()[-2000:]}
                res["elapsed_s"] = round(time.perf_counter() - t0, 2)
                entry["workloads"][w] = res
                gone = current[-1].death() if current else None
                if gone:  # e.g. a native build that dies at its first prompt: say so, stop here
                    entry["died"] = res["engine_died"] = f"{spec.name} {gone}"
                    save()
                    break
                save()
            await ctx.probe.close()
    finally:
        while current:
            await asyncio.to_thread(current.pop().stop)
