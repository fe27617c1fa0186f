"""Pool use of one long request on a sliding-window model against the same weights without
the window: the peak of owned KV blocks (docs/sliding-window.md).

    PYTHONPATH=. python tools/window_pool.py

Builds the tests' tiny random Mistral (window 16, block size 4) in a temporary directory,
and runs a 6-token prompt for 80 and 400 greedy tokens on each.
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


def peak(path: Path, prompt: list[int], new: int) -> tuple[int, int]:
    """(peak owned blocks, blocks given back while running) for one greedy request."""
    e = LLM(model=str(path), progress=False, target_step_ms=None, num_blocks=256, block_size=BLOCK).engine
    e.add_request("long", prompt, greedy(new))
    top = 0
    while e.has_unfinished():
        e.step()
        top = max(top, e.pool.num_used)
    return top, e.lifecycle.stats.window_freed_blocks


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        windowed = make_family_dir(Path(tmp) / "window", "mistral_window")
        plain = Path(tmp) / "plain"
        shutil.copytree(windowed, plain)
        cfg = json.loads((plain / "config.json").read_text())
        cfg["sliding_window"] = None
        (plain / "config.json").write_text(json.dumps(cfg))
        prompt = random_prompts(1, [6], seed=5)[0]
        print("| model | tokens | context blocks | peak blocks owned | given back while running |")
        print("|---|---|---|---|---|")
        for name, path in (("window 16", windowed), ("no window", plain)):
            for new in (80, 400):
                top, freed = peak(path, prompt, new)
                n = len(prompt) + new
                print(f"| {name} | {n} | {-(-n // BLOCK)} | {top} | {freed} |")


if __name__ == "__main__":
    main()
