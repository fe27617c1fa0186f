"""`stopline bench marathon`: the server under load while its engine processes are paused and
killed; canaries that must come back exact; a log that must stay clean.

It starts `stopline serve` itself (one engine core restarted when it dies, `--restart-core`,
with a standby core that takes over if `--standby-core`; or `--replicas N` on Ray; or
`--disagg`), with the ownership audit on sampled busy steps (`--audit-every`), and for
`--minutes` drives:

- load: `--concurrency` clients, each sending one request after another, plus a burst of
  `--burst-size` every `--burst-every` s; the mix is completions and chat, streamed and not,
  n = 2, JSON-schema grammars, repetitive prompts that the n-gram speculation drafts for, over
  a few shared prompt heads (prefix cache hits); a share `--cancel-rate` of them is cancelled
  by the client (a disconnect) at a random share of the time its kind takes;
- an injector: faults spread over the middle of the run, each on one engine process (the core;
  or one replica; or one role, in turn): a pause (SIGSTOP for `--pause-s`, then SIGCONT) or a
  kill (SIGKILL; the server starts it again);
- canaries: greedy completions of a few fixed prompts, recorded once at the start (their
  tokens and logprobs), sent every `--canary-every` s and compared;
- after each fault, the time until a canary comes back exact again (recovery);
- samples every 2 s of the KV pool's use and of each engine process's and the server's RSS;
- at the end, a scan of the server's log for lines that must never appear (HARD_ZERO).

The result (printed, and written as JSON with the machine and commit) is judged against
CRITERIA: every canary exact again within 30 s after the last fault, canary errors outside
the fault windows under 1%, recovery under 30 s after each fault, the pool's use once idle
again at most 10 points over its use before the load, and a clean log.

A canary refused (503) or ended with an error inside a fault window (from the fault until the
first exact canary after it) is what the fault is expected to do, and is counted apart; a
canary that comes back with different tokens counts as an error wherever it happens.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import os
import random
import re
import shlex
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stopline.bench import machine
from stopline.bench.prompts import make_prompt

# Lines that fail the run wherever they appear in the server's log.
HARD_ZERO = {
    "traceback": r"Traceback \(most recent call last\)",
    "audit failure": r"ownership audit failed|LedgerError",
    "leak": r"\bleak",
    "double release": r"double release|released twice|double free",
}
CRITERIA = {
    "canaries_exact_within_s": 30.0,  # after the last fault: every canary exact again
    "canary_error_pct_max": 1.0,  # outside fault windows (wrong tokens count everywhere)
    "recovery_s_max": 30.0,  # fault's end -> first exact canary
    "pool_growth_points_max": 10.0,  # idle pool use after the load minus before it
}
_CANARIES = 5
_CANARY_TOKENS = 12
_HEADS = 8
_SAMPLE_S = 2.0
_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                             "age": {"type": "integer"}},
           "required": ["name", "age"], "additionalProperties": False}
# Counted by the engine processes (a restart starts them again): summed over the run by the samples.
_ENGINE_COUNTERS = ("stopline_audits_total", "stopline_audit_failures_total",
                    "stopline_audit_seconds_total", "stopline_engine_steps_total",
                    "stopline_spec_draft_tokens_total", "stopline_spec_accepted_tokens_total",
                    "stopline_aborts_total")
KINDS = ("completion", "completion-stream", "chat", "chat-stream", "n2", "grammar", "repeat")


@dataclass
class Fault:
    kind: str  # pause or kill
    at_s: float  # planned, seconds since the load started
    target: str = ""  # core, replica0, prefill, ...
    pid: int | None = None
    start_s: float | None = None
    end_s: float | None = None  # SIGCONT (pause) or SIGKILL (kill)
    marked_stuck_s: float | None = None  # pause: /health said stuck this long after SIGSTOP
    healthy_s: float | None = None  # end -> /health 200 with the target serving
    recovery_s: float | None = None  # end -> first exact canary
    recovered_s: float | None = None  # when that was, since the load started
    by_standby: bool | None = None  # kill of the core: a standby core took over (--standby-core)
    error: str | None = None


def schedule(minutes: float, pauses: int, kills: int) -> list[Fault]:
    """Faults spread evenly over [15%, T - tail] of the run: the tail leaves the last one room
    to recover and the canaries their final window."""
    total = minutes * 60
    a, b = 0.15 * total, total - max(45.0, 0.25 * total)
    n = pauses + kills
    if n == 0:
        return []
    if b <= a:
        raise ValueError(f"--minutes {minutes} leaves no room for faults (need about 1.5 or more)")
    kill_at = {min(n - 1, int((j + 1) * n / kills) - 1) for j in range(kills)} if kills else set()
    kinds = ["kill" if i in kill_at else "pause" for i in range(n)]
    if kinds[-1] == "kill" and "pause" in kinds:
        # The last fault is a pause: the final canaries' window then measures the serving path
        # after a fault, not mostly a model load.
        j = len(kinds) - 1 - kinds[::-1].index("pause")
        kinds[j], kinds[-1] = kinds[-1], kinds[j]
    return [Fault(kind, round(a + (i + 0.5) * (b - a) / n, 1)) for i, kind in enumerate(kinds)]


def scan_log(text: str) -> dict[str, Any]:
    """Hard-zero lines of a server log: count per pattern, the first few, whole tracebacks."""
    counts = dict.fromkeys(HARD_ZERO, 0)
    first: list[str] = []
    tracebacks: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        for name, pat in HARD_ZERO.items():
            if re.search(pat, line, re.IGNORECASE):
                counts[name] += 1
                if len(first) < 10:
                    first.append(line[:300])
                if name == "traceback" and len(tracebacks) < 3:
                    tracebacks.append("\n".join(lines[max(0, i - 1):i + 25]))
    return {"counts": counts, "clean": not any(counts.values()), "first": first,
            "tracebacks": tracebacks}


def vm_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def parts_of(health: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """/health's engine processes by name: core / prefill / decode, or replica0, replica1..."""
    if "roles" in health:
        return {p["role"]: p for p in health["roles"]}
    return {f"replica{p['replica']}": p for p in health.get("replicas", [])}


class Marathon:
    def __init__(self, base_url: str, server_pid: int, args: argparse.Namespace) -> None:
        import httpx

        from stopline.bench.client import make_client

        self.base = base_url
        self.server_pid = server_pid
        self.args = args
        self.rng = random.Random(args.seed)
        self.client = make_client(base_url, timeout=120.0)
        self.http = httpx.AsyncClient(base_url=base_url, timeout=10.0)
        self.heads = [make_prompt(self.rng, 16) for _ in range(_HEADS)]
        crng = random.Random(args.seed + 1)
        self.canary_prompts = [make_prompt(crng, 8 + 3 * i) for i in range(_CANARIES)]
        self.recorded: list[dict[str, Any]] = []
        self.canaries: list[dict[str, Any]] = []
        self.outcomes: dict[str, dict[str, int]] = {}  # kind -> outcome -> count
        self.took: dict[str, collections.deque[float]] = {}  # kind -> its last served requests' seconds
        self.samples: list[dict[str, Any]] = []
        self.faults = schedule(args.minutes, args.pauses, args.kills)
        self.t0 = time.monotonic()
        self.stop = asyncio.Event()
        self.inflight: set[asyncio.Task] = set()
        self.paused_pids: set[int] = set()
        self.issued = 0
        self.final: dict[str, Any] = {}
        self.counters: dict[str, tuple[float, float]] = {}  # name -> (dead processes', current)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    # ---- what the server says ---------------------------------------------------------------
    async def health(self) -> tuple[int, dict[str, Any]]:
        try:
            r = await self.http.get("/health")
            return r.status_code, r.json()
        except Exception:  # noqa: BLE001 - a server busy past the timeout answers nothing
            return 0, {}

    async def metrics(self) -> dict[str, float]:
        from stopline.bench.probe import parse

        try:
            return parse((await self.http.get("/metrics")).text)
        except Exception:  # noqa: BLE001
            return {}

    async def metric_labels(self, name: str, label: str) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        try:
            text = (await self.http.get("/metrics")).text
        except Exception:  # noqa: BLE001 - a server that does not answer has no figures
            return out
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and s.value:
                    out[s.labels[label]] = out.get(s.labels[label], 0) + s.value
        return out

    # ---- canaries ---------------------------------------------------------------------------
    async def _canary_once(self, i: int, timeout: float = 30.0) -> tuple[list[str], list[float]]:
        resp = await asyncio.wait_for(self.client.completions.create(
            model=self.args.model_name, prompt=self.canary_prompts[i], max_tokens=_CANARY_TOKENS,
            temperature=0.0, logprobs=1, extra_body={"ignore_eos": True}), timeout)
        lp = resp.choices[0].logprobs
        return list(lp.tokens), [float(x) for x in lp.token_logprobs]

    async def record_canaries(self) -> None:
        for i in range(_CANARIES):
            tokens, logprobs = await self._canary_once(i, timeout=120.0)
            self.recorded.append({"prompt": self.canary_prompts[i], "tokens": tokens,
                                  "logprobs": logprobs})

    async def canary(self, i: int, why: str) -> dict[str, Any]:
        t = self.now()
        try:
            tokens, logprobs = await self._canary_once(i)
        except Exception as exc:  # noqa: BLE001 - a refusal or error is a result here
            status = getattr(exc, "status_code", None)
            res = f"error:{status}" if status else f"error:{type(exc).__name__}"
            rec = {"t": t, "i": i, "why": why, "result": res, "s": round(self.now() - t, 3),
                   "detail": str(exc)[:200]}
        else:
            want = self.recorded[i]
            exact = tokens == want["tokens"]
            drift = max((abs(a - b) for a, b in zip(logprobs, want["logprobs"], strict=False)),
                        default=0.0)
            rec = {"t": t, "i": i, "why": why, "result": "exact" if exact else "wrong",
                   "s": round(self.now() - t, 3), "logprob_drift": drift}
            if not exact:
                rec["tokens"] = tokens
        self.canaries.append(rec)
        return rec

    async def canary_loop(self) -> None:
        k = 0
        while not self.stop.is_set():
            await self.canary(k % _CANARIES, "periodic")
            k += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.args.canary_every)

    # ---- load -------------------------------------------------------------------------------
    def _prompt(self, rng: random.Random) -> str:
        head = rng.choice(self.heads)
        return head if rng.random() < 0.3 else head + " " + make_prompt(rng, rng.randint(3, 24))

    async def _send(self, kind: str, rng: random.Random) -> str:
        c, model = self.client, self.args.model_name
        mt = rng.randint(4, self.args.max_tokens)
        prompt = self._prompt(rng)
        msgs = [{"role": "user", "content": prompt}]
        if kind == "completion":
            r = await c.completions.create(model=model, prompt=prompt, max_tokens=mt, temperature=0.0)
            return r.choices[0].finish_reason
        if kind == "completion-stream":
            reason = None
            async for ch in await c.completions.create(model=model, prompt=prompt, max_tokens=mt,
                                                       temperature=0.0, stream=True):
                if ch.choices and ch.choices[0].finish_reason:
                    reason = ch.choices[0].finish_reason
            return reason or "none"
        if kind == "chat":
            r = await c.chat.completions.create(model=model, messages=msgs, max_tokens=mt,
                                                temperature=0.7, seed=rng.randrange(1 << 30))
            return r.choices[0].finish_reason
        if kind == "chat-stream":
            reason = None
            async for ch in await c.chat.completions.create(model=model, messages=msgs, max_tokens=mt,
                                                            temperature=0.0, stream=True):
                if ch.choices and ch.choices[0].finish_reason:
                    reason = ch.choices[0].finish_reason
            return reason or "none"
        if kind == "n2":
            r = await c.completions.create(model=model, prompt=prompt, max_tokens=mt, n=2,
                                           temperature=0.8, seed=rng.randrange(1 << 30))
            return ",".join(sorted(ch.finish_reason for ch in r.choices))
        if kind == "grammar":
            rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": _SCHEMA}}
            r = await c.chat.completions.create(model=model, messages=msgs, max_tokens=24,
                                                temperature=0.0, response_format=rf)
            return r.choices[0].finish_reason
        # repeat: a repetitive prompt, greedy: the n-gram drafter proposes, the verify accepts
        words = prompt.split()[:4] or ["a"]
        r = await c.completions.create(model=model, prompt=" ".join(words * 6), max_tokens=mt + 8,
                                       temperature=0.0, extra_body={"ignore_eos": True})
        return r.choices[0].finish_reason

    async def request(self, rng: random.Random) -> None:
        kind = rng.choice(KINDS)
        cancel = rng.random() < self.args.cancel_rate
        self.issued += 1
        task = asyncio.ensure_future(self._send(kind, rng))
        t0 = time.monotonic()
        try:
            if cancel:
                done, _ = await asyncio.wait({task}, timeout=self._cancel_after(kind, rng))
                if not done:
                    task.cancel()  # httpx closes the connection: a client disconnect
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                    self._count(kind, "cancelled by the client")
                    return
            reason = await task
            self.took.setdefault(kind, collections.deque(maxlen=32)).append(time.monotonic() - t0)
            self._count(kind, f"served: {reason}")
        except asyncio.CancelledError:
            task.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - every end is a result
            status = getattr(exc, "status_code", None)
            self._count(kind, f"refused {status}" if status else f"failed: {type(exc).__name__}")
            if status in (429, 503):
                # As a client should (the server sends Retry-After: 1): a refused client that
                # asked again at once would spin the front end while a core restarts.
                await asyncio.sleep(1.0)

    def _cancel_after(self, kind: str, rng: random.Random) -> float:
        """When the client leaves: a drawn share of the time this kind's requests take here, so
        that cancels land mid-request on a fast host as on a slow one (a fixed 0.05-2 s range
        cancelled none of the tiny model's requests on a fast CI host)."""
        took = self.took.get(kind, ())
        if len(took) < 3:
            return rng.uniform(0.05, 2.0)
        return rng.uniform(0.1, 0.9) * statistics.median(took)

    def _count(self, kind: str, outcome: str) -> None:
        per = self.outcomes.setdefault(kind, {})
        per[outcome] = per.get(outcome, 0) + 1

    async def client_loop(self, k: int) -> None:
        rng = random.Random(self.args.seed * 7919 + k)
        while not self.stop.is_set():
            await self.request(rng)

    async def burst_loop(self) -> None:
        rng = random.Random(self.args.seed * 104729)
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.args.burst_every)
            if self.stop.is_set():
                return
            for _ in range(self.args.burst_size):
                t = asyncio.ensure_future(self.request(random.Random(rng.random())))
                self.inflight.add(t)
                t.add_done_callback(self.inflight.discard)

    # ---- samples ------------------------------------------------------------------------------
    async def sample(self) -> dict[str, Any]:
        code, h = await self.health()
        m = await self.metrics()
        rss = {"server": vm_rss(self.server_pid)}
        states = {}
        for name, p in parts_of(h).items():
            states[name] = p.get("state")
            if p.get("pid"):
                rss[name] = vm_rss(p["pid"])
            standby = p.get("standby") or {}
            if standby.get("pid"):  # the spare core (--standby-core), loading or asleep
                rss[f"{name}-standby"] = vm_rss(standby["pid"])
        self._accumulate(m)
        s = {"t": self.now(), "health": code, "states": states,
             "kv_used": m.get("stopline_kv_blocks_used"), "kv_total": m.get("stopline_kv_blocks_total"),
             "open": m.get("stopline_requests_open"), "rss": rss}
        self.samples.append(s)
        return s

    def _accumulate(self, m: dict[str, float]) -> None:
        """The engine's counters over the whole run: a restarted process starts them from 0."""
        for name in _ENGINE_COUNTERS:
            if name not in m:
                continue
            base, last = self.counters.get(name, (0.0, 0.0))
            if m[name] < last:  # a fresh process: what the dead one counted stays counted
                base += last
            self.counters[name] = (base, m[name])

    def counter(self, name: str) -> float | None:
        return sum(self.counters[name]) if name in self.counters else None

    async def sample_loop(self) -> None:
        last = 0.0
        while not self.stop.is_set():
            s = await self.sample()
            if not self.args.no_progress and s["t"] - last >= 10:
                last = s["t"]
                served = sum(n for per in self.outcomes.values() for o, n in per.items()
                             if o.startswith("served"))
                exact = sum(c["result"] == "exact" for c in self.canaries)
                print(f"[{s['t']:6.0f} s] issued {self.issued}, served {served}, canaries "
                      f"{exact}/{len(self.canaries)} exact, pool {s['kv_used']}/{s['kv_total']}, "
                      f"states {s['states']}", flush=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), _SAMPLE_S)

    # ---- faults -------------------------------------------------------------------------------
    def targets(self) -> list[str]:
        if self.args.disagg:
            return ["prefill", "decode"]
        if self.args.replicas:
            return [f"replica{i}" for i in range(self.args.replicas)]
        return ["core"]

    async def injector(self) -> None:
        turn = {"pause": 0, "kill": 0}
        names = self.targets()
        for f in self.faults:
            wait = f.at_s - self.now()
            if wait > 0:
                await asyncio.sleep(wait)
            f.target = names[turn[f.kind] % len(names)]
            turn[f.kind] += 1
            try:
                await self.fault(f)
            except Exception as exc:  # noqa: BLE001 - a fault that could not run is recorded
                f.error = f"{type(exc).__name__}: {exc}"[:300]
            if not self.args.no_progress:
                print(f"fault: {json.dumps(asdict(f))}", flush=True)
        self.final = await self.final_canaries()  # at once, under load

    async def fault(self, f: Fault) -> None:
        _, h = await self.health()
        part = parts_of(h).get(f.target)
        if part is None or not part.get("pid"):
            raise RuntimeError(f"no process for {f.target} in /health: {h}")
        f.pid = pid = part["pid"]
        promoted = part.get("promoted")
        f.start_s = self.now()
        if f.kind == "pause":
            os.kill(pid, signal.SIGSTOP)
            self.paused_pids.add(pid)
            try:
                until = time.monotonic() + self.args.pause_s
                while time.monotonic() < until:
                    _, h = await self.health()
                    p = parts_of(h).get(f.target, {})
                    if f.marked_stuck_s is None and p.get("state") == "stuck":
                        f.marked_stuck_s = round(self.now() - f.start_s, 2)
                    await asyncio.sleep(0.2)
            finally:
                os.kill(pid, signal.SIGCONT)
                self.paused_pids.discard(pid)
        else:
            os.kill(pid, signal.SIGKILL)
        f.end_s = self.now()
        deadline = time.monotonic() + self.args.recovery_limit_s
        while time.monotonic() < deadline:
            code, h = await self.health()
            p = parts_of(h).get(f.target, {})
            if f.healthy_s is None and code == 200 and p.get("state") == "healthy" and (
                    f.kind == "pause" or p.get("pid") != pid):
                f.healthy_s = round(self.now() - f.end_s, 2)
                if f.kind == "kill" and promoted is not None:
                    f.by_standby = p.get("promoted", 0) > promoted
            if f.healthy_s is not None:
                rec = await self.canary(0, f"recovery after {f.kind} of {f.target}")
                if rec["result"] == "exact":
                    f.recovered_s = self.now()
                    f.recovery_s = round(f.recovered_s - f.end_s, 2)
                    return
            await asyncio.sleep(0.25)

    async def final_canaries(self) -> dict[str, Any]:
        """After the last fault: each canary until it comes back exact, within the window."""
        last = max((f.end_s for f in self.faults if f.end_s is not None), default=self.now())
        deadline = last + CRITERIA["canaries_exact_within_s"]
        exact_at: dict[int, float] = {}
        for i in range(_CANARIES):
            while self.now() < deadline:
                rec = await self.canary(i, "final")
                if rec["result"] == "exact":
                    exact_at[i] = rec["t"]
                    break
                await asyncio.sleep(0.25)
        return {"last_fault_end_s": last, "exact": len(exact_at), "of": _CANARIES,
                "last_exact_after_s": round(max(exact_at.values()) - last, 2) if exact_at else None}

    # ---- the run ------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        from stopline.bench.engines import STOPLINE_METRICS
        from stopline.bench.probe import Probe

        probe = Probe(self.base, STOPLINE_METRICS)
        await self.record_canaries()
        await probe.wait_idle(timeout=60.0)
        before = await self.sample()
        self.t0 = time.monotonic()
        loops = [asyncio.ensure_future(x) for x in (
            *(self.client_loop(k) for k in range(self.args.concurrency)), self.burst_loop(),
            self.canary_loop(), self.sample_loop())]
        injector = asyncio.ensure_future(self.injector())
        try:
            await asyncio.wait_for(self.stop.wait(), self.args.minutes * 60)
        except TimeoutError:
            pass
        try:
            try:
                await asyncio.wait_for(injector, self.args.recovery_limit_s + 60)
            except TimeoutError:  # faults left unrun (recoveries ran long): judged as failed
                print("marathon: the injector did not finish its faults in time", file=sys.stderr)
            final = self.final or {"last_fault_end_s": None, "exact": 0, "of": _CANARIES,
                                   "last_exact_after_s": None}
        finally:
            for pid in list(self.paused_pids):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGCONT)
            self.stop.set()
            injector.cancel()
            elapsed = self.now()
            # The load ends: clients finish what they sent (120 s timeout), bursts too.
            await asyncio.gather(*loops, *self.inflight, return_exceptions=True)
        idle_s = await probe.wait_idle(timeout=60.0)
        await asyncio.sleep(1.0)
        after = await self.sample()
        c = self.counter
        # finished: the front end's count over the run; aborts by source: the engine process
        # serving at the end (since its last restart); the rest summed over every process.
        server = {"finished": await self.metric_labels("stopline_request_finished_total", "reason"),
                  "aborts_by_source_last_process": await self.metric_labels("stopline_aborts_total",
                                                                            "source"),
                  "aborts": c("stopline_aborts_total"),
                  "audits": c("stopline_audits_total"),
                  "audit_failures": c("stopline_audit_failures_total"),
                  "audit_seconds": c("stopline_audit_seconds_total"),
                  "steps": c("stopline_engine_steps_total"),
                  "spec_draft_tokens": c("stopline_spec_draft_tokens_total"),
                  "spec_accepted_tokens": c("stopline_spec_accepted_tokens_total")}
        await probe.close()
        await self.http.aclose()
        await self.client.close()
        return {"elapsed_s": elapsed, "issued": self.issued, "outcomes": self.outcomes,
                "served_s_median": {k: round(statistics.median(v), 3) for k, v in self.took.items()},
                "server": server, "recorded_canaries": self.recorded, "canaries": self.canaries,
                "final_canaries": final, "faults": [asdict(f) for f in self.faults],
                "idle_before": before, "idle_after": after, "idle_after_s": idle_s,
                "samples": self.samples}


def judge(res: dict[str, Any]) -> dict[str, Any]:
    """Each criterion: the figure, the bound, pass."""
    windows = [(f["start_s"], f["recovered_s"] if f["recovered_s"] is not None else math.inf)
               for f in res["faults"] if f["start_s"] is not None]

    def in_window(c: dict[str, Any]) -> bool:  # sent before a window closed, answered after it opened
        return any(c["t"] <= b and c["t"] + c["s"] >= a for a, b in windows)

    cans = res["canaries"]
    wrong = [c for c in cans if c["result"] == "wrong"]
    outside = [c for c in cans if not in_window(c)]
    errors = [c for c in outside if c["result"] != "exact"]
    errors += [c for c in wrong if in_window(c)]
    err_pct = 100.0 * len(errors) / max(1, len(outside))
    recov = [f["recovery_s"] for f in res["faults"]]
    worst = max((r for r in recov if r is not None), default=None)

    def pool(s: dict[str, Any]) -> float | None:
        return 100.0 * s["kv_used"] / s["kv_total"] if s.get("kv_total") else None

    pb, pa = pool(res["idle_before"]), pool(res["idle_after"])
    growth = None if pa is None or pb is None else round(pa - pb, 2)
    final = res["final_canaries"]
    checks = {
        "canaries exact after the last fault": {
            "value": f"{final['exact']}/{final['of']} within {CRITERIA['canaries_exact_within_s']:g} s",
            "pass": final["exact"] == final["of"]},
        "canary errors outside fault windows": {
            "value": f"{len(errors)} of {len(outside)} ({err_pct:.2f}%); wrong tokens anywhere: {len(wrong)}",
            "bound": f"< {CRITERIA['canary_error_pct_max']:g}%",
            "pass": err_pct < CRITERIA["canary_error_pct_max"] and not wrong},
        "recovery after each fault": {
            "value": recov, "bound": f"< {CRITERIA['recovery_s_max']:g} s",
            "pass": bool(recov) and None not in recov and worst < CRITERIA["recovery_s_max"]
            and not any(f["error"] for f in res["faults"])},
        "pool use growth (idle after - idle before)": {
            "value": growth, "bound": f"< {CRITERIA['pool_growth_points_max']:g} points",
            "pass": growth is not None and growth < CRITERIA["pool_growth_points_max"]},
        "log scan": {"value": res["log_scan"]["counts"], "bound": "0 each",
                     "pass": res["log_scan"]["clean"]},
        "audit failures": {"value": res["server"]["audit_failures"], "bound": "0",
                           "pass": not res["server"]["audit_failures"]},
    }
    return checks


def rss_table(samples: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per process: first, last and peak RSS in MiB over the run."""
    out: dict[str, dict[str, float]] = {}
    for s in samples:
        for name, b in s["rss"].items():
            if b is None:
                continue
            d = out.setdefault(name, {"first_mib": b / 2**20, "peak_mib": 0.0})
            d["last_mib"] = b / 2**20
            d["peak_mib"] = max(d["peak_mib"], b / 2**20)
    return {k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in out.items()}


def summary(res: dict[str, Any]) -> str:
    lines = [f"marathon: {res['config']['mode']}, {res['elapsed_s']:.0f} s of load, "
             f"{res['issued']} requests issued"]
    for kind, per in sorted(res["outcomes"].items()):
        lines.append(f"  {kind:<18} " + ", ".join(f"{o} {n}" for o, n in sorted(per.items())))
    srv = res["server"]
    lines.append(f"server: finished {srv['finished']}; aborts {srv['aborts']} (by source, last "
                 f"process: {srv['aborts_by_source_last_process']}); "
                 f"audits {srv['audits']} ({srv['audit_failures']} failed, {srv['audit_seconds']} s); "
                 f"spec drafts {srv['spec_draft_tokens']}")
    for f in res["faults"]:
        lines.append(f"fault {f['kind']:<5} {f['target']:<9} at {f['start_s']} s: stuck after "
                     f"{f['marked_stuck_s']} s, healthy {f['healthy_s']} s and canary exact "
                     f"{f['recovery_s']} s after its end"
                     + ("; the standby took over" if f.get("by_standby") else "")
                     + (f"; ERROR {f['error']}" if f["error"] else ""))
    for name, r in res["rss"].items():
        lines.append(f"rss {name:<9} {r['first_mib']:.1f} -> {r['last_mib']:.1f} MiB (peak {r['peak_mib']:.1f})")
    for name, c in res["criteria"].items():
        lines.append(f"{'pass' if c['pass'] else 'FAIL'}  {name}: {c['value']}"
                     + (f" (bound {c['bound']})" if "bound" in c else ""))
    for line in res["log_scan"]["first"]:
        lines.append(f"  log: {line}")
    lines.append(f"marathon: {'PASS' if res['pass'] else 'FAIL'}")
    return "\n".join(lines)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=30.0, help="load time (faults in its middle)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--replicas", type=int, default=None, help="serve N Ray replicas")
    mode.add_argument("--disagg", action="store_true", help="serve the prefill/decode split")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2)")
    p.add_argument("--kv-cache-gb", type=float, default=0.25)
    p.add_argument("--concurrency", type=int, default=6, help="steady clients")
    p.add_argument("--burst-every", type=float, default=20.0, help="seconds between bursts")
    p.add_argument("--burst-size", type=int, default=8)
    p.add_argument("--cancel-rate", type=float, default=0.3, help="share of requests the client cancels")
    p.add_argument("--max-tokens", type=int, default=24, help="requests draw from [4, N]")
    p.add_argument("--canary-every", type=float, default=3.0)
    p.add_argument("--pauses", type=int, default=None, help="SIGSTOP faults (default: one a minute)")
    p.add_argument("--kills", type=int, default=None, help="SIGKILL faults (default: one per 5 minutes)")
    p.add_argument("--pause-s", type=float, default=6.0, help="how long each pause lasts")
    p.add_argument("--stuck-s", type=float, default=2.0, help="the server's --stuck-s")
    p.add_argument("--stuck-kill-s", type=float, default=60.0, help="the server's --stuck-kill-s")
    p.add_argument("--audit-every", type=int, default=16, help="the server's --audit-every")
    p.add_argument("--standby-core", action="store_true",
                   help="one engine core: serve with --standby-core (a spare core kept loaded "
                        "takes over a killed one)")
    p.add_argument("--recovery-limit-s", type=float, default=120.0,
                   help="give up waiting for a fault's recovery after this long")
    p.add_argument("--serve-args", default="", help="more `stopline serve` options, one string")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/marathon.json", help="result; the server log beside it")
    p.add_argument("--no-progress", action="store_true")


def serve_args(args: argparse.Namespace) -> list[str]:
    extra = ["--kv-cache-gb", str(args.kv_cache_gb), "--stuck-s", str(args.stuck_s),
             "--stuck-kill-s", str(args.stuck_kill_s), "--audit-every", str(args.audit_every)]
    if args.replicas:
        extra += ["--replicas", str(args.replicas)]
    elif args.disagg:
        extra += ["--disagg"]
    else:
        extra += ["--restart-core", str(args.kills + 5)]  # deaths in 300 s before it gives up
        if args.standby_core:
            extra += ["--standby-core"]
    return extra + shlex.split(args.serve_args)


def run(args: argparse.Namespace, log_path: Path, command: str = "") -> dict[str, Any]:
    from stopline.bench.engines import MODEL_NAME, RunningEngine, stopline_spec

    if args.standby_core and (args.replicas or args.disagg):
        raise SystemExit("--standby-core is for one engine core: replicas and the split's roles "
                         "restart their own")
    if args.pauses is None:
        args.pauses = max(1, round(args.minutes))
    if args.kills is None:
        args.kills = max(1, round(args.minutes / 5))
    args.model_name = MODEL_NAME
    extra = serve_args(args)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("")
    stamp = machine.stamp()  # the commit the server runs, before anything can change it
    eng = RunningEngine(stopline_spec(args.model, extra=extra), log_path)
    try:
        startup = eng.wait_ready()
        res = asyncio.run(Marathon(eng.base_url, eng.proc.pid, args).run())
        # Scanned before the stop: a shutdown's own lines are not the run's.
        res["log_scan"] = scan_log(log_path.read_text(errors="replace"))
    finally:
        eng.stop()
    mode = (f"{args.replicas} Ray replicas" if args.replicas else "prefill/decode split"
            if args.disagg else "one engine core and a standby core" if args.standby_core
            else "one engine core, restarted when it dies")
    res.update(**stamp, command=command,
               model=args.model or "SmolLM2-135M-Instruct (embedded GGUF)",
               startup_s=round(startup, 2), serve_args=extra, criteria_bounds=CRITERIA,
               config={k: v for k, v in vars(args).items() if k not in ("bench_func", "func")}
               | {"mode": mode})
    res["rss"] = rss_table(res["samples"])
    res["criteria"] = judge(res)
    res["pass"] = all(c["pass"] for c in res["criteria"].values())
    return res


def main(args: argparse.Namespace) -> int:
    # SIGTERM unwinds like Ctrl-C, so the server this run started is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = run(args, out.with_suffix(".log"), command=shlex.join(["stopline", *sys.argv[1:]]))
    out.write_text(json.dumps(res, indent=1, default=str))
    print(summary(res))
    print(f"results: {out}")
    return 0 if res["pass"] else 1


__all__ = ["CRITERIA", "HARD_ZERO", "Fault", "configure", "judge", "main", "scan_log", "schedule"]
