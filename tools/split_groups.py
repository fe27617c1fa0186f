"""What the prefill/decode split ships of a model of two KV layer groups: blocks and bytes
per group for one prompt (docs/sliding-window.md, "P/D split").

    PYTHONPATH=. python tools/split_groups.py

Builds the tests' tiny random Gemma 3 (window 16 on two local layers, one global layer;
blocks of 4) in a temporary directory, runs a prefill and a decode core in this process over
a real loopback link (tests/disagg_support.py), and sends prompts of 10, 61 and 201 tokens
through them, each greedy for 2 tokens. "All blocks" is what shipping every local block
would take.
"""

from __future__ import annotations

import shutil
import tempfile

from stopline.model.loaders.loader import load_model
from tests.disagg_support import make_pair
from tests.engine_support import greedy, random_prompts
from tests.tiny_families import make_family_dir


def main() -> None:
    tmp = tempfile.mkdtemp(prefix="split-groups-")
    try:
        pair = make_pair(load_model(str(make_family_dir(tmp, "gemma3")), progress=False))
        kv = pair.d.kv
        # One block's bytes in each group: K and V of its layers.
        per = [2 * len(layers) * kv.k[0][:, :kv.block_size].numel() * kv.k[0].element_size()
               for layers in kv.groups]
        print("| prompt tokens | global blocks | local blocks | bytes shipped | all blocks |")
        print("|---|---|---|---|---|")
        try:
            seen = {0: 0, 1: 0}
            for n in (10, 61, 201):
                pair.add(f"p{n}", random_prompts(1, [n], seed=n)[0], greedy(2))
                pair.settle()
                got = pair.d.lifecycle.stats.transfer_blocks
                blocks = [got["received", g] - seen[g] for g in (0, 1)]
                seen = {g: got["received", g] for g in (0, 1)}
                nbytes = pair.d.role.transfer_log[-1][0]
                print(f"| {n} | {blocks[0]} | {blocks[1]} | {nbytes:,} | {blocks[0] * (per[0] + per[1]):,} |")
        finally:
            pair.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
