"""Pool use of one long request on sliding-window models against the same weights without
the window: the peak of owned KV blocks, per layer group (docs/sliding-window.md).

    PYTHONPATH=. python tools/window_pool.py

Builds the tests' tiny random Mistral (window 16, block size 4, one layer group) and tiny
Gemma 3 (window 16 on two local layers, one global layer: two groups) in a temporary
directory, and runs a 6-token prompt for 80 and 400 greedy tokens on each.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from stopline import LLM
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


if __name__ == "__main__":
    main()
