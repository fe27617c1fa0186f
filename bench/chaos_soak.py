"""The CI chaos storm over fresh seeds, for as long as asked: a soak of the stop path.

    python bench/chaos_soak.py --minutes 20          # storms of 300 requests, modes in turn
    python bench/chaos_soak.py --minutes 20 --wide   # 64 sequences at once, torch attention:
                                                     # decode rows compact
    python bench/chaos_soak.py --seed 1234 --storms 1 --mode swap   # replay one storm
    python bench/chaos_soak.py --minutes 20 --quant  # Q4_1 GGUF: the quantized kernel and the
                                                     # library in one storm, logprobs compared

Each storm is tests/test_stop_chaos.py's, with its own seed: random aborts aimed at every
state, a pool small enough to preempt, debug mode (the ledger audit after every step, freed
blocks poisoned), each output checked against a reference run. The modes rotate through
recompute, swap, recompute with async scheduling and auto with async scheduling. A failure
prints its traceback and the command that replays it; the exit status is the number of
failed storms (capped at 100).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' storm machinery

from stopline.model.loaders.loader import load_model  # noqa: E402
from tests.chaos_support import (  # noqa: E402
    check_storm,
    make_workload,
    run_async_storm,
    run_reference,
    run_storm,
    storm_config,
)
from tests.tiny_model import make_tiny_gguf, make_tiny_llama_dir  # noqa: E402

MODES = [("recompute", False), ("swap", False), ("recompute", True), ("auto", True)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="stop starting storms after this")
    ap.add_argument("--storms", type=int, default=None, help="stop after this many storms")
    ap.add_argument("--seed", type=int, default=1000, help="the first storm's seed; then +1 each")
    ap.add_argument("--count", type=int, default=300, help="requests per storm")
    modes = ["recompute", "swap", "auto"]
    ap.add_argument("--mode", choices=modes + [m + "-async" for m in modes],
                    help="one mode for every storm (default: in turn)")
    ap.add_argument("--wide", action="store_true",
                    help="64 sequences and a larger pool (with torch attention, the default here, "
                         "decode rows compact as they end)")
    ap.add_argument("--attention", choices=["auto", "native", "torch"], default=None,
                    help="the engines' attention backend (default: auto; torch with --wide)")
    ap.add_argument("--quant", action="store_true",
                    help="the model as a Q4_1 GGUF: steps of up to 8 rows on the quantized kernel, "
                         "larger ones on the float32 library, every output compared with its "
                         "logprobs")
    ap.add_argument("--zmq", action="store_true",
                    help="through the async engine and the core process over ZMQ: aborts land on "
                         "the wall clock, mid-forward included")
    args = ap.parse_args()
    if args.count < 1 or args.minutes <= 0 or (args.storms is not None and args.storms < 1):
        ap.error("--count, --minutes and --storms must be positive")

    # Kept until exit (the finalizer removes it): --zmq's core process loads the model from it.
    tmpdir = tempfile.TemporaryDirectory()
    tmp = tmpdir.name
    model_dir = make_tiny_llama_dir(Path(tmp) / "tiny", seed=7, init_std=0.1, vocab_size=384, layers=2)
    if args.quant:
        model_dir = make_tiny_gguf(model_dir, Path(tmp) / "tiny-q4_1.gguf", qtype="Q4_1")
    loaded = load_model(str(model_dir), progress=False, cache_dir=tmp)
    if args.quant and not loaded.blocks:
        ap.error("--quant: the GGUF has no quantized blocks")
    attention = args.attention or ("torch" if args.wide else "auto")
    deadline = time.monotonic() + args.minutes * 60
    seed, done, failed, requests = args.seed, 0, 0, 0
    while time.monotonic() < deadline and (args.storms is None or done < args.storms):
        mode, asy = _mode(args.mode, seed)
        work = make_workload(seed=seed, count=args.count, vocab=loaded.config.vocab_size)
        config = storm_config(mode, asy, wide=args.wide, attention=attention)
        if args.quant:
            for job in work:
                job.params = dataclasses.replace(job.params, logprobs=0)
            config = dataclasses.replace(config, quant_max_rows=8)
        t = time.monotonic()
        try:
            ref = run_reference(loaded, work, attention)
            if args.zmq:
                work = [j for j in work if not (j.race or j.resubmit)]
                res = run_async_storm(str(model_dir), work, config, seed=seed + 1)
                aborted = check_storm(work, ref, res)
                print(f"seed {seed} {mode}{' async' if asy else ''} (zmq): ok, {len(work)} requests, "
                      f"{aborted} aborted samples, {time.monotonic() - t:.1f} s", flush=True)
            else:
                res = run_storm(loaded, work, config, seed=seed + 1)
                eng = res.engine
                if args.quant and not eng.model.one_row_ok:
                    raise RuntimeError("the quantized kernel is not in use (see the warning above)")
                aborted = check_storm(work, ref, res)
                stats = eng.lifecycle.stats
                rows = eng.runner.rows
                print(f"seed {seed} {mode}{' async' if asy else ''} ({eng.model.attention} attention): "
                      f"ok, {len(work)} requests, "
                      f"{aborted} aborted samples, {sum(stats.preemptions.values())} preemptions, "
                      f"{rows.compactions if rows else 0} compactions, {time.monotonic() - t:.1f} s",
                      flush=True)
        except Exception:  # a failed check or a crash: report, keep soaking
            failed += 1
            traceback.print_exc()
            mode_arg = f"{mode}-async" if asy else mode
            print(f"seed {seed} {mode}{' async' if asy else ''}: FAILED; replay with: python "
                  f"bench/chaos_soak.py --seed {seed} --storms 1 --count {args.count} "
                  f"--mode {mode_arg}{' --wide' if args.wide else ''}{' --quant' if args.quant else ''}"
                  f"{' --zmq' if args.zmq else ''}"
                  f" --attention {attention}",
                  flush=True)
        done += 1
        requests += len(work)
        seed += 1
    print(f"{done} storms, {requests} requests, {failed} failed")
    return min(failed, 100)


def _mode(choice: str | None, seed: int) -> tuple[str, bool]:
    if choice is None:
        return MODES[seed % len(MODES)]
    if choice.endswith("-async"):
        return choice.removesuffix("-async"), True
    return choice, False


if __name__ == "__main__":
    sys.exit(main())
