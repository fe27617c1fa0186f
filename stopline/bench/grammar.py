"""Structured output's cost when served: N streams of json_schema answers vs N unstructured
streams, the same prompts, in one run of one `stopline serve` (the default model, SmolLM2).

The phases alternate, unstructured first, for `rounds` rounds; the fastest of each kind
counts. Throughput is completion tokens / wall time of a phase (all N streams at once,
greedy). Every stream of both kinds runs to max_tokens: the unstructured ones with
`ignore_eos`, the structured ones on a schema whose answer string is longer than max_tokens
can write. Otherwise a phase whose answers end early finishes with a batch that thins out,
and its tokens per second fall for that reason alone. Mask time is read from the server's
`stopline_grammar_mask_seconds` histogram over the structured phases (bucket upper bounds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from stopline.bench import machine
from stopline.bench.offline import QUESTIONS

SCHEMA = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 40}, "answer": {"type": "string", "minLength": 4000},
    "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["topic", "answer", "confidence"], "additionalProperties": False}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(serve_args: list[str], models: int = 1) -> Iterator[str]:
    """`stopline serve *serve_args` on a free loopback port, ready once /health is 200 and
    /v1/models lists `models` models; yields its base URL and stops it."""
    import httpx

    port = _port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "stopline.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--no-access-log", "--log-level", "warning", *serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start ({cmd})")
            try:
                if (httpx.get(base + "/health", timeout=2).status_code == 200
                        and len(httpx.get(base + "/v1/models", timeout=5).json()["data"]) >= models):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


def _metrics(base: str) -> dict[str, float]:
    import httpx  # the bench extra: imported where used, so the parser builds on the base install

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name.startswith("stopline_grammar_mask_seconds"):
                out[s.name + (s.labels.get("le", "") and f"{{{s.labels['le']}}}")] = s.value
    return out


def _quantile(before: dict[str, float], after: dict[str, float], q: float) -> float | None:
    les = sorted((float(k.split("{")[1][:-1]), k) for k in after if "_bucket{" in k)
    n = after.get("stopline_grammar_mask_seconds_count", 0) - before.get("stopline_grammar_mask_seconds_count", 0)
    if n <= 0:
        return None
    for le, k in les:
        if after[k] - before.get(k, 0) >= q * n:
            return le
    return None


async def _phase(base: str, model: str, prompts: list[str], max_tokens: int,
                 structured: bool) -> tuple[int, float, list[str]]:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}

    async def one(p: str) -> tuple[int, str]:
        kw: dict[str, Any] = {"response_format": rf} if structured else {"extra_body": {"ignore_eos": True}}
        r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                                 max_tokens=max_tokens, temperature=0, **kw)
        return r.usage.completion_tokens, r.choices[0].finish_reason

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(p) for p in prompts))
    await client.close()
    return sum(n for n, _ in got), time.perf_counter() - t0, [f for _, f in got]


def run(streams: int, max_tokens: int, serve_args: list[str], rounds: int = 2) -> dict[str, Any]:
    import httpx

    with served(serve_args) as base:
        model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        prompts = [f"({i}) {QUESTIONS[i % len(QUESTIONS)]} Answer as JSON." for i in range(streams)]
        asyncio.run(_phase(base, model, prompts[:2], 8, True))  # warm: compile cached, kernels hot
        plains, structs = [], []
        before = _metrics(base)
        for _ in range(rounds):
            plains.append(asyncio.run(_phase(base, model, prompts, max_tokens, False)))
            structs.append(asyncio.run(_phase(base, model, prompts, max_tokens, True)))
        after = _metrics(base)
    # The fastest phase of each kind counts: a warm-up or a neighbour's load only slows one.
    plain = max(plains, key=lambda p: p[0] / p[1])
    structured = max(structs, key=lambda p: p[0] / p[1])
    tps = {"plain": plain[0] / plain[1], "structured": structured[0] / structured[1]}
    return {**machine.stamp(), "streams": streams, "max_tokens": max_tokens,
            "plain": {"tokens": plain[0], "seconds": plain[1], "tok_s": tps["plain"]},
            "structured": {"tokens": structured[0], "seconds": structured[1], "tok_s": tps["structured"],
                           "finish": {f: structured[2].count(f) for f in set(structured[2])}},
            "ratio": tps["structured"] / tps["plain"],
            "mask_p50_s": _quantile(before, after, 0.5), "mask_p99_s": _quantile(before, after, 0.99),
            "masks": after.get("stopline_grammar_mask_seconds_count", 0)
            - before.get("stopline_grammar_mask_seconds_count", 0)}


def table(r: dict[str, Any]) -> str:
    def us(s: float | None) -> str:
        return "n/a" if s is None else f"<= {s * 1e6:.0f} us"
    return "\n".join([
        f"| {r['streams']} streams, max_tokens {r['max_tokens']} | tokens | seconds | tok/s |",
        "|---|---|---|---|",
        f"| unstructured | {r['plain']['tokens']} | {r['plain']['seconds']:.1f} | {r['plain']['tok_s']:.1f} |",
        f"| json_schema | {r['structured']['tokens']} | {r['structured']['seconds']:.1f} | "
        f"{r['structured']['tok_s']:.1f} |",
        "",
        f"ratio structured/unstructured: {r['ratio']:.2f}x; mask fill per token p50 {us(r['mask_p50_s'])}, "
        f"p99 {us(r['mask_p99_s'])} over {r['masks']:.0f} masks; structured finishes {r['structured']['finish']}",
    ])


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of both phases (fastest counts)")
    p.add_argument("--serve-arg", action="append", default=[], help="passed to `stopline serve` (repeat)")


def main(args: argparse.Namespace) -> int:
    result = run(args.streams, args.max_tokens, args.serve_arg, args.rounds)
    # No results file: the host and commit are printed above the table that goes into the docs.
    print(f"Host: {machine.summary(result['machine'])}, commit {result['git']}.")
    print("stopline bench grammar " + " ".join(sys.argv[3:]))
    print(table(result))
    return 0
