"""The preemption storm's schedule, priced by a step-cost model instead of a stopwatch.

    python bench/storm_model.py                                   # every mode/policy pair
    python bench/storm_model.py --lookahead 0 8 16 --pairs swap:cost recompute:cost
    python bench/storm_model.py --cost 11 1.78 1.05 0.6  # ms: step, decode row, prefill token, swapped block

`stopline bench stop` times real storms, and one ~5 s storm moves by 10-20% between runs on
this host, which hides a scheduling change of a few percent. This runs the real scheduler
(and lifecycle, prefix cache, preemption) on the same prompts and lengths as the benchmark's
storm, on a tiny random model so it takes seconds, and charges each step
`per_step + per_row * decode rows + per_token * prefill tokens`. The default constants are a
fit of SmolLM2 step times measured in storms on this machine (`bench/step_time.py`, and the
benchmark's own traces: ~30 ms at 11 decode rows, ~68 ms at 32); AUTO chooses with the same
per-token cost and a swap of ~0.6 ms a block (out and back, measured). The same engine runs
the unconstrained pool for the ratio. What it does not charge: the swap copies themselves,
and any kernel getting faster.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.tiny_model

from stopline.bench.stop import make_prompts  # noqa: E402
from stopline.config import EngineConfig, PreemptionMode, VictimPolicy  # noqa: E402
from stopline.engine.core import EngineCore  # noqa: E402
from stopline.model.loaders.loader import LoadedModel, load_model  # noqa: E402
from stopline.request import SamplingParams  # noqa: E402
from tests.tiny_model import make_tiny_llama_dir  # noqa: E402

PAIRS = ["recompute:cost", "recompute:newest", "recompute:fewest-output", "recompute:longest-output",
         "recompute:least-computed", "swap:cost", "auto:cost"]


def priced_run(model: LoadedModel, prompts: list[list[int]], max_tokens: int, num_blocks: int,
               cost: tuple[float, float, float, float], **config) -> dict:
    per_step, per_row, per_token, per_block = cost
    eng = EngineCore(model, EngineConfig(num_blocks=num_blocks, target_step_ms=None, **config))
    total = {"ms": 0.0, "steps": 0, "rows": 0}
    schedule = eng.scheduler.schedule

    def priced():
        # AUTO weighs what SmolLM2 costs, not what the tiny model measures.
        eng.lifecycle.ms_per_recomputed_token, eng.lifecycle.ms_per_swapped_block = per_token, per_block
        plan = schedule()
        if plan.chunks:
            rows = sum(1 for c in plan.chunks if c.num_tokens == 1)
            prefill = sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1)
            total["ms"] += per_step + per_row * rows + per_token * prefill
            total["steps"] += 1
            total["rows"] += rows
        return plan

    eng.scheduler.schedule = priced
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    eng.audit()
    st = eng.lifecycle.stats
    return {**total, "preemptions": sum(st.preemptions.values()), "recomputed": st.recomputed_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--pool-fraction", type=float, default=0.25)
    ap.add_argument("--lookahead", type=int, nargs="+", default=[EngineConfig.admission_lookahead])
    ap.add_argument("--pairs", nargs="+", default=PAIRS, help="mode:policy")
    ap.add_argument("--cost", type=float, nargs=4, default=(11.0, 1.78, 1.05, 0.6),
                    metavar=("STEP_MS", "ROW_MS", "PREFILL_TOKEN_MS", "SWAP_BLOCK_MS"))
    args = ap.parse_args()

    # The benchmark's prompts (SmolLM2's tokenizer), folded into the tiny model's vocabulary:
    # only their lengths and shared prefixes matter to the schedule.
    prompts = make_prompts(load_model(None, progress=False), args.requests, 0, long_every=0)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = load_model(str(make_tiny_llama_dir(Path(tmp) / "tiny", seed=0)), progress=False)
    vocab = tiny.config.vocab_size
    prompts = [[t % vocab for t in p] for p in prompts]
    bs = EngineConfig.block_size
    demand = sum(-(-(len(p) + args.max_tokens) // bs) for p in prompts)
    tight = max(int(demand * args.pool_fraction), max(-(-(len(p) + args.max_tokens) // bs) for p in prompts) + 1)
    cost = tuple(args.cost)
    free = priced_run(tiny, prompts, args.max_tokens, demand + 16, cost)
    print(f"{args.requests} requests x {args.max_tokens} tokens, pool {tight} of {demand} blocks; "
          f"unconstrained {free['ms']:.0f} ms in {free['steps']} steps")
    for la in args.lookahead:
        for pair in args.pairs:
            mode, policy = pair.split(":")
            r = priced_run(tiny, prompts, args.max_tokens, tight, cost, admission_lookahead=la,
                           preemption_mode=PreemptionMode(mode), victim_policy=VictimPolicy(policy))
            print(f"lookahead {la:3d} {pair:26s} {r['ms']:6.0f} ms  ratio {free['ms'] / r['ms']:.3f}  "
                  f"steps {r['steps']}  rows/step {r['rows'] / max(1, r['steps']):.1f}  "
                  f"preemptions {r['preemptions']}  recomputed {r['recomputed']}")


if __name__ == "__main__":
    main()
