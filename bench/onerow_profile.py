"""Where a fast decode step's time goes (one stream unless --streams), split by what measures it.

    python bench/onerow_profile.py --steps 200
    python bench/onerow_profile.py --streams 32 --temperature 0.8 --sections  # 32 sampled rows
    python bench/onerow_profile.py --threads 1 2 --steps 200   # threads alternated step by step
    python bench/onerow_profile.py --sections     # also the C loop's sections (a build with
                                                  # -DSTOPLINE_PROFILE, its own cached .so)
    python bench/onerow_profile.py --ab old.so    # steps alternate between the engine's kernels
                                                  # and another build's fused decoder (A/B)
    python bench/onerow_profile.py --prefetch 0 4096  # steps alternate between the int8
                                                  # kernel's prefetch distances (int8_few.c)

Per step: the engine's whole step (`eng.step()`), the model's forward, the fused C decoder's
call, the linears inside it (DecoderLoop.linear_s: quantizing the input and the int8 GEMV),
and the LM head's call. What is left: the decoder's attention, norms, rope and glue
(decoder - linears), the forward's embedding, final norm and wrappers (forward - decoder -
head), and the engine's Python around the forward (step - forward). Medians, with the 25th
and 75th percentiles: the host is shared, so only figures from one run compare.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

# stopline first: it sets the OpenMP spin policy before torch loads libgomp.
from stopline import LLM, SamplingParams  # isort: skip
import torch

from stopline.bench.offline import chat_prompts
from stopline.config import EngineConfig


def q(xs: list[float]) -> str:
    xs = sorted(xs)
    n = len(xs)
    return f"{statistics.median(xs) * 1e3:6.3f} [{xs[n // 4] * 1e3:.3f}-{xs[3 * n // 4] * 1e3:.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warm", type=int, default=20)
    ap.add_argument("--threads", type=int, nargs="+", default=[0], help="0: the engine's policy")
    ap.add_argument("--sections", action="store_true")
    ap.add_argument("--prefetch", type=int, nargs="+", default=[-1], help="-1: the engine's choice")
    ap.add_argument("--streams", type=int, default=1, help="requests decoding at once")
    ap.add_argument("--temperature", type=float, default=0.0, help="above 0: sampled, each stream seeded")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "int8"))
    ap.add_argument("--ab", default=None, metavar="SO", help="another build of the kernels to alternate with")
    args = ap.parse_args()
    from stopline.model.kernels import native
    if args.sections:
        native._FLAGS.append("-DSTOPLINE_PROFILE")
    cfg = EngineConfig(numerics="fast", enable_prefix_caching=False, speculative="off",
                       adapt_threads=args.threads == [0], kv_cache_dtype=args.kv_cache_dtype)
    eng = LLM(None, config=cfg, progress=False).engine
    model = eng.runner.model if hasattr(eng, "runner") else eng.model
    dec = model.decoder
    dec.linear_s = torch.zeros(1, dtype=torch.float64)
    fns = {"A": dec._fn}
    other_pf = None
    if args.ab:
        other = ctypes.CDLL(args.ab).stopline_decoder_layers
        other.argtypes, other.restype = dec._fn.argtypes, dec._fn.restype
        fns["B"] = other
        # a build with int8_few.c's prefetch gets A's setting (its own default is none)
        other_pf = getattr(ctypes.CDLL(args.ab), "stopline_int8_prefetch", None)
    names = ["C loop norms", "qkv", "rope+store", "attention", "o", "gate_up", "silu", "down"]
    sec = (ctypes.c_double * len(names))()
    prof = native.kernels().stopline_decoder_profile if args.sections else None
    acc = {"forward": 0.0, "decoder": 0.0, "head": 0.0}

    def timed(obj, name, key):
        fn = getattr(obj, name)

        def wrap(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t
        setattr(obj, name, wrap)

    timed(model, "forward", "forward")
    timed(dec, "run", "decoder")
    orig_head = model.lm_head

    class Head:
        def __getattr__(self, n):
            return getattr(orig_head, n)

        def __call__(self, x):
            t = time.perf_counter()
            try:
                return orig_head(x)
            finally:
                acc["head"] += time.perf_counter() - t
    model.lm_head = Head()
    budget = args.warm + args.steps * len(args.threads) * len(fns) * len(args.prefetch) + 8
    for i, ids in enumerate(chat_prompts(eng.loaded, args.streams)):
        eng.add_request(f"p{i}", ids, SamplingParams(temperature=args.temperature, max_tokens=budget,
                                                     seed=i if args.temperature else None, ignore_eos=True))
    for _ in range(args.warm):
        eng.step()
    combos = [(t, f, p) for t in args.threads for f in fns for p in args.prefetch]
    lib = native.kernels()
    default_pf = lib.stopline_int8_prefetch(0)
    lib.stopline_int8_prefetch(default_pf)
    rows: dict = {c: {k: [] for k in ("step", "forward", "decoder", "linears", "head", *names)} for c in combos}
    full = torch.get_num_threads()
    if prof:
        prof(sec)
    for i in range(args.steps * len(combos)):
        th, f, pf = combos[i % len(combos)]
        dec._fn = fns[f]
        # B's LM head runs on this build's Q8_0 kernel: without prefetch where the other build
        # has none (main's), unless --prefetch names a distance
        bare = f == "B" and pf < 0 and other_pf is None
        lib.stopline_int8_prefetch(0 if bare else default_pf if pf < 0 else pf)
        if args.ab and other_pf is not None:
            other_pf(default_pf if pf < 0 else pf)
        if th:
            torch.set_num_threads(th)
        for k in acc:
            acc[k] = 0.0
        dec.linear_s.zero_()
        t0 = time.perf_counter()
        eng.step()
        r = rows[(th, f, pf)]
        if prof:
            prof(sec)
            for j, name in enumerate(names):
                r[name].append(sec[j])
        r["step"].append(time.perf_counter() - t0)
        r["forward"].append(acc["forward"])
        r["decoder"].append(acc["decoder"])
        r["linears"].append(float(dec.linear_s[0]))
        r["head"].append(acc["head"])
        torch.set_num_threads(full)
    for (th, f, pf), r in rows.items():
        shown = 0 if f == "B" and pf < 0 and other_pf is None else default_pf if pf < 0 else pf
        print(f"threads {th or 'policy'}, build {f}, prefetch {shown}: "
              f"ms median [p25-p75] over {len(r['step'])} steps")
        derived = {
            "step": r["step"],
            "  engine python (step - forward)": [a - b for a, b in zip(r["step"], r["forward"], strict=True)],
            "  forward": r["forward"],
            "    decoder C call": r["decoder"],
            "      linears (quantize + int8 GEMV)": r["linears"],
            "      attention/norm/rope/glue": [a - b for a, b in zip(r["decoder"], r["linears"], strict=True)],
            "    LM head": r["head"],
            "    embed/final norm/wrappers": [a - b - c for a, b, c in zip(r["forward"], r["decoder"], r["head"], strict=True)],
        }
        if prof:
            derived.update({f"      {n}": r[n] for n in names})
        for k, v in derived.items():
            print(f"  {k:40s} {q(v)}")


if __name__ == "__main__":
    main()
