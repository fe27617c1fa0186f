"""`stopline bench soak`: does a long-running server's memory stay flat?

A real `stopline serve` (engine core in its own process) on a free loopback port gets N short
streaming requests through the official async `openai` client, `concurrency` at a time; half
of them are closed by the client after the first chunk or two (a disconnect, as a user's
would look), the others run to their end. The resident memory (VmRSS) of the server and of
its core process is read every `sample_every` requests while the run goes on. The figure is
the least-squares slope of RSS against requests done over the second half of the run, in
bytes per request: the first half is where caches bounded by count (the frontend's recently
finished ids, the allocator's arenas, the prefix cache filling the pool) fill up, so growth
that is still there in the second half is growth without a bound. Issue 19 asks for at most
1 KiB per request for both processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from stopline.bench import machine
from stopline.bench.prompts import make_prompt
from stopline.server import memtrace

LIMIT_B_PER_REQUEST = 1024  # the default bound; a 50,000-request soak is held to 102 (0.1 KiB)
_HEADS = 32  # shared prompt heads: the prefix cache's hits
_WARMUP = 8  # requests before the first sample: first-request costs out


_STALL_S = 30.0  # no request ended for this long while some are open: a stall, recorded


@dataclass
class Sample:
    done: int  # requests finished when read
    t: float  # seconds since the soak started
    server: int  # VmRSS, bytes
    core: int
    # RssAnon: VmRSS less file-backed pages, which the kernel may drop under memory pressure
    # from other processes (a fall in VmRSS that says nothing about this one); a leak is here.
    server_anon: int
    core_anon: int

    def row(self) -> list[float]:
        return [self.done, self.t, self.server, self.core, self.server_anon, self.core_anon]


def rss(pid: int, field: str = "VmRSS") -> int:
    """A memory figure of /proc/PID/status in bytes (VmRSS; RssAnon; VmHWM is the peak)."""
    return status(pid, field)[field]


def status(pid: int, *fields: str) -> dict[str, int]:
    want = set(fields)
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in want:
            out[name] = int(value.split()[0]) * 1024
    if len(out) != len(want):
        raise ValueError(f"no {', '.join(sorted(want - set(out)))} for process {pid}")
    return out


def children(pid: int) -> list[int]:
    """Direct children of `pid` (scans /proc: /proc/PID/task/*/children needs a kernel option)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            # comm may hold spaces and parentheses: the fields after the last ')' are fixed.
            stat = (d / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return sorted(out)


def core_pid(server: int, timeout: float = 10.0) -> int:
    """The server's engine-core child: multiprocessing's spawn child, not its resource tracker."""
    deadline = time.monotonic() + timeout
    while True:
        for pid in children(server):
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"spawn_main" in cmd:
                    return pid
        if time.monotonic() > deadline:
            raise RuntimeError(f"no engine-core child of server process {server}")
        time.sleep(0.2)


def serving_core_pid(base_url: str) -> int | None:
    """The core process /health names (with --standby-core the server has two core children,
    and only this one serves); None if it names none."""
    import httpx

    try:
        roles = httpx.get(base_url + "/health", timeout=10).json().get("roles") or []
    except (httpx.HTTPError, ValueError):
        return None
    return next((r["pid"] for r in roles if r.get("role") == "core" and r.get("pid")), None)


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys on xs; None with fewer than two distinct xs."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


class Plan:
    """Request i's prompt, max_tokens and close point, drawn from one seed.

    A third of the prompts are a shared head alone, a third a shared head and a fresh tail,
    a third fresh: the prefix cache sees full hits, partial hits and misses (and, once the
    pool is full, evicts)."""

    def __init__(self, seed: int, max_tokens: int) -> None:
        self.seed = seed
        self.max_tokens = max_tokens
        rng = random.Random(seed)
        self.heads = [make_prompt(rng, 24) for _ in range(_HEADS)]

    def request(self, i: int) -> tuple[str, int, int | None]:
        rng = random.Random(self.seed * 1_000_003 + i)
        kind = rng.randrange(3)
        if kind == 0:
            prompt = rng.choice(self.heads)
        elif kind == 1:
            prompt = rng.choice(self.heads) + " " + make_prompt(rng, rng.randint(4, 16))
        else:
            prompt = make_prompt(rng, rng.randint(8, 32))
        max_tokens = rng.randint(max(1, self.max_tokens // 2), self.max_tokens)
        close = rng.choice((1, 2)) if rng.random() < 0.5 else None
        return prompt, max_tokens, close


def finished_by_reason(text: str) -> dict[str, int]:
    """stopline_request_finished_total by reason, from a /metrics page."""
    out: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "stopline_request_finished_total" and s.value:
                out[s.labels["reason"]] = int(s.value)
    return out


def run(*, model: str | None, requests: int, concurrency: int, max_tokens: int,
        port: int | None, sample_every: int | None, kv_cache_gb: float, seed: int,
        log_path: Path, serve_args: list[str] | None = None, max_rss_gb: float = 8.0,
        tracemalloc: int = 0, progress: bool = True, command: str = "",
        limit_b: float = LIMIT_B_PER_REQUEST) -> dict[str, Any]:
    """Start the server, soak it, stop it; returns the result (see `summary`)."""
    from stopline.bench.engines import RunningEngine, stopline_spec  # the bench extra's httpx

    every = sample_every or max(1, requests // 100)
    spec = stopline_spec(model, extra=["--kv-cache-gb", str(kv_cache_gb), *(serve_args or [])])
    if tracemalloc:
        spec.env[memtrace.ENV] = str(tracemalloc)
    stamp = machine.stamp()  # the commit the server runs, before anything can change it
    eng = RunningEngine(spec, log_path, port=port)
    try:
        startup = eng.wait_ready()
        pids = {"server": eng.proc.pid,
                "core": serving_core_pid(eng.base_url) or core_pid(eng.proc.pid)}
        res = asyncio.run(_soak(eng.base_url, pids, Plan(seed, max_tokens), requests,
                                concurrency, every, int(max_rss_gb * 2**30), bool(tracemalloc),
                                progress))
        res["peak_rss"] = {k: rss(p, "VmHWM") for k, p in pids.items()}
    finally:
        eng.stop()
    res.update(
        **stamp, command=command,
        model=model or "SmolLM2-135M-Instruct (embedded GGUF)", startup_s=round(startup, 2),
        config={"requests": requests, "concurrency": concurrency, "max_tokens": max_tokens,
                "sample_every": every, "kv_cache_gb": kv_cache_gb, "seed": seed,
                "port": eng.port, "serve_args": serve_args or [], "max_rss_gb": max_rss_gb,
                "tracemalloc": tracemalloc},
        pids=pids, limit_b_per_request=limit_b)
    _judge(res)
    return res


async def _soak(base_url: str, pids: dict[str, int], plan: Plan, n: int, concurrency: int,
                every: int, max_rss: int, trace: bool, progress: bool) -> dict[str, Any]:
    import httpx

    from stopline.bench.client import complete, make_client
    from stopline.bench.engines import MODEL_NAME, STOPLINE_METRICS
    from stopline.bench.probe import Probe
    from stopline.bench.probe import parse as probe_parse

    client = make_client(base_url, timeout=300.0)
    probe = Probe(base_url, STOPLINE_METRICS)
    for i in range(_WARMUP):
        prompt, mt, _ = plan.request(-1 - i)
        await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=mt,
                                        temperature=0.0)
    await probe.wait_idle(timeout=30.0)
    t0 = time.perf_counter()

    def sample(done: int) -> Sample:
        srv = status(pids["server"], "VmRSS", "RssAnon")
        core = status(pids["core"], "VmRSS", "RssAnon")
        return Sample(done, round(time.perf_counter() - t0, 3), srv["VmRSS"], core["VmRSS"],
                      srv["RssAnon"], core["RssAnon"])

    samples = [sample(0)]
    outcomes: dict[str, int] = {}
    errors: list[str] = []
    planned_closes = 0
    issued = done = 0
    stopped: str | None = None  # why the run ended before n requests
    http = httpx.AsyncClient(base_url=base_url, timeout=120.0)
    traced: dict[str, Any] | None = None
    started: dict[int, float] = {}  # request -> when sent, while in flight
    stalls: list[dict[str, Any]] = []

    async def watch() -> None:
        """Record each stretch of STALL_S or more in which no request ended, with the server's
        gauges at its start: a soak is also a liveness check."""
        last_done, since = done, time.perf_counter()
        stall: dict[str, Any] | None = None
        while True:
            await asyncio.sleep(1.0)
            now = time.perf_counter()
            if done != last_done:
                if stall is not None:
                    stall["seconds"] = round(now - since, 1)
                    stall = None
                last_done, since = done, now
            elif stall is None and started and now - since >= _STALL_S and len(stalls) < 20:
                gauges = {k: v for k, v in
                          probe_parse((await http.get("/metrics")).text).items()
                          if k.startswith(("stopline_requests_", "stopline_kv_blocks_"))}
                stall = {"after_request": done, "t": round(since - t0, 1), "seconds": None,
                         "in_flight": len(started),
                         "oldest_s": round(now - min(started.values()), 1), "gauges": gauges}
                stalls.append(stall)

    async def growth() -> dict[str, Any]:
        """Each process's growth since the last call (the core answers for itself)."""
        out = {}
        for proc in memtrace.PROCESSES:
            r = await http.get("/debug/tracemalloc", params={"top": 20, "process": proc})
            out[proc] = r.json() if r.status_code == 200 else {"error": f"{r.status_code}: {r.text[:300]}"}
        return out

    bar = tqdm(total=n, desc="soak", unit="req", disable=not progress, dynamic_ncols=True)

    async def worker() -> None:
        nonlocal issued, done, planned_closes, stopped
        while issued < n and stopped is None:
            i = issued
            issued += 1
            prompt, mt, close = plan.request(i)
            planned_closes += close is not None
            started[i] = time.perf_counter()
            out = await complete(client, MODEL_NAME, prompt, mt, ignore_eos=False,
                                 close_after_tokens=close)
            del started[i]
            # A planned close can lose the race to the request's own end: it counts as that end.
            key = ("error" if out.error else "closed" if out.closed
                   else out.finish_reason or "none")
            outcomes[key] = outcomes.get(key, 0) + 1
            if out.error and len(errors) < 5:
                errors.append(out.error)
            done += 1
            bar.update()
            if trace and done == n // 2:
                await growth()  # the baseline: the second half's growth is what counts
            if done % every == 0 and done < n:
                last = sample(done)
                samples.append(last)
                bar.set_postfix_str(f"server {last.server / 2**20:.0f} MiB, "
                                    f"core {last.core / 2**20:.0f} MiB")
                if max(last.server, last.core) > max_rss and stopped is None:
                    # A leak must not take the (shared) machine down with it: stop here, the
                    # slope so far says enough.
                    stopped = (f"stopped after {done} requests: RSS over {max_rss / 2**30:.1f} GiB "
                               f"(server {last.server / 2**30:.2f}, core {last.core / 2**30:.2f})")

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
        if samples[-1].done != done:
            samples.append(sample(done))
        # The end figure is read once the server is idle (every abort applied, streams gone).
        await probe.wait_idle(timeout=30.0)
        end = sample(done)
        server_finished = finished_by_reason((await http.get("/metrics")).text)
        if trace:
            traced = await growth()
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        bar.close()
        await http.aclose()
        await probe.close()
        await client.close()
    return {"requests_done": done, "stopped": stopped, "elapsed_s": round(elapsed, 2),
            "requests_per_s": round(done / elapsed, 2),
            "outcomes": dict(sorted(outcomes.items())), "planned_closes": planned_closes,
            "errors": errors, "server_finished": server_finished, "warmup_requests": _WARMUP,
            "stalls": stalls,
            "samples_columns": ["done", "t_s", "server_rss", "core_rss", "server_anon",
                                "core_anon"],
            "samples": [s.row() for s in samples], "end_idle": end.row(),
            "tracemalloc": traced}


def _judge(res: dict[str, Any]) -> None:
    samples = res["samples"]
    half = [s for s in samples if s[0] >= res["requests_done"] / 2]
    procs = {}
    for col, name in ((2, "server"), (3, "core")):
        xs = [s[0] for s in half]
        b, anon = slope(xs, [s[col] for s in half]), slope(xs, [s[col + 2] for s in half])
        procs[name] = {
            "pid": res["pids"][name], "start_rss": samples[0][col], "end_rss": res["end_idle"][col],
            "peak_rss": res["peak_rss"][name],
            "slope_b_per_request": None if b is None else round(b, 2),
            "anon_slope_b_per_request": None if anon is None else round(anon, 2),
            "pass": b is not None and anon is not None
            and max(b, anon) <= res.get("limit_b_per_request", LIMIT_B_PER_REQUEST)}
    res["second_half"] = {"from_request": half[0][0] if half else None, "samples": len(half)}
    res["processes"] = procs
    res["pass"] = all(p["pass"] for p in procs.values()) and not res["stopped"]


def summary(res: dict[str, Any]) -> str:
    mib = 2**20

    def fmt(b: float | None) -> str:
        return "n/a" if b is None else f"{b:.1f}"

    lines = [f"{'process':<8} {'pid':>7} {'start MiB':>10} {'end MiB':>9} {'peak MiB':>9} "
             f"{'B/request VmRSS':>16} {'RssAnon':>10}  pass   (slopes over the 2nd half)"]
    for name, p in res["processes"].items():
        lines.append(f"{name:<8} {p['pid']:>7} {p['start_rss'] / mib:>10.1f} "
                     f"{p['end_rss'] / mib:>9.1f} {p['peak_rss'] / mib:>9.1f} "
                     f"{fmt(p['slope_b_per_request']):>16} {fmt(p['anon_slope_b_per_request']):>10}"
                     f"  {'yes' if p['pass'] else 'NO'}")
    cfg = res["config"]
    if res["stopped"]:
        lines.append(res["stopped"])
    lines.append(f"{res['requests_done']} requests at concurrency {cfg['concurrency']} in "
                 f"{res['elapsed_s']:.0f} s ({res['requests_per_s']:.1f} req/s); outcomes "
                 + ", ".join(f"{k} {v}" for k, v in res["outcomes"].items())
                 + f"; limit {res.get('limit_b_per_request', LIMIT_B_PER_REQUEST):g} B/request: {'pass' if res['pass'] else 'FAIL'}")
    for st in res["stalls"]:
        lines.append(f"stall: no request ended for {st['seconds'] or '>' + str(_STALL_S)} s after "
                     f"request {st['after_request']} ({st['in_flight']} in flight)")
    for name, traced in (res.get("tracemalloc") or {}).items():
        if "error" in traced:
            lines.append(f"{name} allocations: not traced ({traced['error']})")
            continue
        lines.append(f"{name} allocations grown over the second half (tracemalloc, process "
                     f"{traced['pid']}, {traced['traced_bytes'] / 2**20:.1f} MiB traced):")
        lines += [f"  {t['size_diff']:>+10} B {t['count_diff']:>+7} blocks  {t['traceback'][-1]}"
                  for t in traced["top"][:8]]
    return "\n".join(lines)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=20_000, help="half are closed after a chunk or two")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8, help="each request draws from [N/2, N]")
    p.add_argument("--model", default=None,
                   help="GGUF file or HF directory (default: the embedded SmolLM2)")
    p.add_argument("--kv-cache-gb", type=float, default=0.25, help="the server's KV pool")
    p.add_argument("--port", type=int, default=None, help="server port (default: a free one)")
    p.add_argument("--sample-every", type=int, default=None,
                   help="requests between RSS reads (default: 1%% of the run)")
    p.add_argument("--serve-args", default="",
                   help="more `stopline serve` options, one string (e.g. '--async-scheduling')")
    p.add_argument("--max-rss-gb", type=float, default=8.0,
                   help="stop early when the server or core process grows past this")
    p.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                   help="trace the Python allocations of the server and of its engine core "
                        "(STOPLINE_TRACEMALLOC) and record, per process, the sites that grew over "
                        "the second half; the RSS figures are then not the processes' own")
    p.add_argument("--limit-b", type=float, default=LIMIT_B_PER_REQUEST,
                   help="bound on each process's RSS growth per request over the second half "
                        "(issue 47 holds a 50,000-request soak to 102, 0.1 KiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/soak.json", help="result; the server log beside it")
    p.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    # SIGTERM unwinds like Ctrl-C, so the server this run started is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = run(model=args.model, requests=args.requests, concurrency=args.concurrency,
              max_tokens=args.max_tokens, port=args.port, sample_every=args.sample_every,
              kv_cache_gb=args.kv_cache_gb, seed=args.seed, log_path=out.with_suffix(".log"),
              serve_args=shlex.split(args.serve_args), max_rss_gb=args.max_rss_gb,
              tracemalloc=args.tracemalloc, progress=not args.no_progress, limit_b=args.limit_b,
              command=shlex.join(["stopline", *sys.argv[1:]]))
    out.write_text(json.dumps(res, indent=1))
    print(summary(res))
    print(f"results: {out}")
    return 0 if res["pass"] else 1
