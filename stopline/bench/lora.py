"""LoRA adapters served: N streams under 4 adapters vs N streams of the base model, and the
unload latency under load, in one run of one `stopline serve` (the default model, SmolLM2).

The adapters are random (rank `--rank`, every target module), written in the PEFT layout for
the served model's shapes, and loaded at start with `--lora`. The phases alternate, base
first, for `rounds` rounds; the fastest of each kind counts. Throughput is completion tokens /
wall time of a phase (all N streams at once, greedy, `ignore_eos`, so every stream runs to
max_tokens). Then, with N adapter streams running, one adapter is unloaded with policy
`abort`: the unload's HTTP round trip, and the time until its last stream has ended `abort`;
then another with policy `wait`: its round trip (the adapter goes when its streams finish).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from stopline.bench import machine
from stopline.bench.grammar import served
from stopline.bench.offline import QUESTIONS

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, config: Any, rank: int, seed: int, std: float = 0.02) -> Path:
    """A random PEFT LoRA directory for a model of `config` (stopline's ModelConfig)."""
    from safetensors.torch import save_file

    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"q_proj": (q, c.hidden_size), "k_proj": (kv, c.hidden_size), "v_proj": (kv, c.hidden_size),
              "o_proj": (c.hidden_size, q), "gate_proj": (c.intermediate_size, c.hidden_size),
              "up_proj": (c.intermediate_size, c.hidden_size), "down_proj": (c.hidden_size, c.intermediate_size)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for li in range(c.num_layers):
        for m in TARGETS:
            out, inp = shapes[m]
            block = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{li}.{block}.{m}"
            tensors[f"{key}.lora_A.weight"] = std * torch.randn(rank, inp, generator=g)
            tensors[f"{key}.lora_B.weight"] = std * torch.randn(out, rank, generator=g)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none", "lora_dropout": 0.0}))
    return path


async def _phase(base: str, models: list[str], prompts: list[str], max_tokens: int) -> tuple[int, float]:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=900)

    async def one(i: int, p: str) -> int:
        r = await client.chat.completions.create(model=models[i % len(models)],
                                                 messages=[{"role": "user", "content": p}],
                                                 max_tokens=max_tokens, temperature=0,
                                                 extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    await client.close()
    return sum(got), time.perf_counter() - t0


async def _unloads(base: str, names: list[str], prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """N streams over the adapters; once each has tokens, unload names[0] (abort), then
    names[1] (wait)."""
    import httpx
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=900)
    ended: dict[int, tuple[str, float]] = {}
    first = [asyncio.Event() for _ in prompts]

    async def one(i: int, p: str) -> None:
        stream = await client.chat.completions.create(
            model=names[i % len(names)], messages=[{"role": "user", "content": p}], max_tokens=max_tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        reason = "?"
        async for chunk in stream:
            first[i].set()
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
        ended[i] = (reason, time.perf_counter())
        first[i].set()

    tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
    await asyncio.gather(*(e.wait() for e in first))
    async with httpx.AsyncClient(timeout=60) as http:
        t0 = time.perf_counter()
        r = await http.post(base + "/v1/unload_lora_adapter", json={"lora_name": names[0], "policy": "abort"})
        abort_rtt = time.perf_counter() - t0
        r.raise_for_status()
        t1 = time.perf_counter()
        r2 = await http.post(base + "/v1/unload_lora_adapter", json={"lora_name": names[1], "policy": "wait"})
        wait_rtt = time.perf_counter() - t1
        r2.raise_for_status()
    await asyncio.gather(*tasks)
    await client.close()
    victims = [i for i in range(len(prompts)) if i % len(names) == 0]
    return {"abort_rtt_s": abort_rtt, "wait_rtt_s": wait_rtt,
            "abort_to_ended_s": max(ended[i][1] for i in victims) - t0,
            "victims": len(victims), "victim_reasons": sorted({ended[i][0] for i in victims}),
            "wait_reasons": sorted({ended[i][0] for i in range(len(prompts)) if i % len(names) == 1})}


def run(streams: int, max_tokens: int, rank: int, adapters: int, serve_args: list[str],
        rounds: int = 2, model: str | None = None) -> dict[str, Any]:
    import httpx

    from stopline.model.loaders.loader import load_model

    config = load_model(model, progress=False).config
    tmp = Path(tempfile.mkdtemp(prefix="stopline-bench-lora-"))
    names = [f"lora{i}" for i in range(adapters)]
    specs = [f"{n}={write_adapter(tmp / n, config, rank, seed=i)}" for i, n in enumerate(names)]
    args = ["--max-lora-rank", str(rank), *(["--model", model] if model else []), "--lora", *specs,
            *serve_args]
    with served(args, models=adapters + 1) as base:
        base_model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        prompts = [f"({i}) {QUESTIONS[i % len(QUESTIONS)]}" for i in range(streams)]
        asyncio.run(_phase(base, [base_model, *names], prompts[:len(names) + 1], 4))  # warm
        plains, loras = [], []
        for _ in range(rounds):
            plains.append(asyncio.run(_phase(base, [base_model], prompts, max_tokens)))
            loras.append(asyncio.run(_phase(base, names, prompts, max_tokens)))
        unload = asyncio.run(_unloads(base, names, prompts, 4 * max_tokens))
    plain = max(plains, key=lambda p: p[0] / p[1])
    lora = max(loras, key=lambda p: p[0] / p[1])
    tps = {"base": plain[0] / plain[1], "lora": lora[0] / lora[1]}
    return {**machine.stamp(), "streams": streams, "max_tokens": max_tokens, "rank": rank,
            "adapters": adapters,
            "base": {"tokens": plain[0], "seconds": plain[1], "tok_s": tps["base"]},
            "lora": {"tokens": lora[0], "seconds": lora[1], "tok_s": tps["lora"]},
            "ratio": tps["lora"] / tps["base"], "unload": unload}


def table(r: dict[str, Any]) -> str:
    u = r["unload"]
    return "\n".join([
        f"| {r['streams']} streams, max_tokens {r['max_tokens']} | tokens | seconds | tok/s |",
        "|---|---|---|---|",
        f"| base model | {r['base']['tokens']} | {r['base']['seconds']:.1f} | {r['base']['tok_s']:.1f} |",
        f"| {r['adapters']} adapters (rank {r['rank']}, all 7 modules) | {r['lora']['tokens']} | "
        f"{r['lora']['seconds']:.1f} | {r['lora']['tok_s']:.1f} |",
        "",
        f"ratio adapters/base: {r['ratio']:.2f}x. Unload under load ({r['streams']} adapter streams): "
        f"abort {u['abort_rtt_s'] * 1e3:.0f} ms round trip, its {u['victims']} streams ended "
        f"{u['victim_reasons']} within {u['abort_to_ended_s'] * 1e3:.0f} ms; wait {u['wait_rtt_s'] * 1e3:.0f} ms "
        f"round trip (its streams ended {u['wait_reasons']})",
    ])


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of both phases (fastest counts)")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
    p.add_argument("--serve-arg", action="append", default=[], help="passed to `stopline serve` (repeat)")


def main(args: argparse.Namespace) -> int:
    if args.adapters < 2:
        raise SystemExit("--adapters: at least 2 (one is unloaded with abort, one with wait)")
    result = run(args.streams, args.max_tokens, args.rank, args.adapters, args.serve_arg, args.rounds,
                 args.model)
    print(f"Host: {machine.summary(result['machine'])}, commit {result['git']}.")
    print("stopline bench lora " + " ".join(sys.argv[3:]))
    print(table(result))
    return 0
