"""Time pure decode steps of the engine at a given number of running requests.

    python bench/step_time.py 11 31        # p50 / min step time at 11, then 31 requests
    python bench/step_time.py 64 --warm 150 --compare-decode-rows   # with and without DecodeRows
    python bench/step_time.py 11 32 64 --compare-linear-backends  # auto against BLAS only
    python bench/step_time.py 1 8 16 --compare-quant 32 # quantized kernel up to 32 rows against none
    python bench/step_time.py 11 31 64 --compare-attention  # the C paged attention against torch's
    python bench/step_time.py 1 11 31 64 --compare-glue  # the layer glue in C against torch's ops
    python bench/step_time.py 1 11 32 --compare-layers  # all layers in one C call against the Python loop
    python bench/step_time.py 32 64 --temperature 1.0   # every row sampled at random, not argmax

Each request is a chat-templated question (the offline benchmark's prompts) generating with
EOS ignored; steps are timed after `--warm` steps, so every request is decoding.
"""

from __future__ import annotations

import argparse
import time

# stopline first: it sets the OpenMP spin policy before torch loads libgomp.
from stopline import LLM, SamplingParams
from stopline.bench.offline import chat_prompts
from stopline.config import EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("requests", type=int, nargs="+")
    ap.add_argument("--warm", type=int, default=40, help="steps before timing")
    ap.add_argument("--steps", type=int, default=40, help="steps timed")
    ap.add_argument("--compare-decode-rows", action="store_true",
                    help="time each count with DecodeRows on, then off (the gathering path)")
    ap.add_argument("--compare-linear-backends", action="store_true",
                    help="time each count with the default linear backends, then BLAS only "
                         "(two engines in this process, run alternately)")
    ap.add_argument("--compare-quant", type=int, metavar="ROWS", default=None,
                    help="time each count with the quantized-weight kernel up to ROWS rows, then "
                         "with float32 weights only (two engines, run alternately)")
    ap.add_argument("--compare-attention", action="store_true",
                    help="time each count with the native paged attention, then torch's (two "
                         "engines, run alternately)")
    ap.add_argument("--compare-glue", action="store_true",
                    help="time each count with the layer glue in C, then in torch ops (both on the C "
                         "attention; two engines, run alternately)")
    ap.add_argument("--compare-layers", action="store_true",
                    help="time each count with every layer in one C call, then with the Python loop "
                         "over the same kernels (two engines, run alternately)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every request (0: greedy)")
    args = ap.parse_args()
    engines = {"": LLM(config=EngineConfig(kv_cache_memory_gb=2.0), progress=False).engine}
    if args.compare_attention:
        engines = {f" {b} attention": LLM(config=EngineConfig(kv_cache_memory_gb=2.0, attention_backend=b),
                                          progress=False).engine for b in ("native", "torch")}
    if args.compare_glue:
        engines = {f" {g} glue": LLM(config=EngineConfig(kv_cache_memory_gb=2.0), progress=False).engine
                   for g in ("C", "torch")}
        engines[" torch glue"].runner.model.c_glue = False
    if args.compare_layers:
        engines = {f" {g} loop": LLM(config=EngineConfig(kv_cache_memory_gb=2.0), progress=False).engine
                   for g in ("C", "Python")}
        engines[" Python loop"].runner.model.c_layers = False
    if args.compare_quant is not None:
        engines = {f" quant<={args.compare_quant}": LLM(config=EngineConfig(
                       kv_cache_memory_gb=2.0, quant_max_rows=args.compare_quant), progress=False).engine,
                   " float32": LLM(config=EngineConfig(kv_cache_memory_gb=2.0, quant_max_rows=0),
                                   progress=False).engine}
    if args.compare_linear_backends:
        engines = {" auto linears": engines[""],
                   " blas linears": LLM(config=EngineConfig(kv_cache_memory_gb=2.0, linear_backend="blas"),
                                        progress=False).engine}
    params = SamplingParams(temperature=args.temperature, max_tokens=args.warm + args.steps + 8, ignore_eos=True)
    rows = {label: eng.runner.rows for label, eng in engines.items()}
    for n in args.requests:
        for on in ((True, False) if args.compare_decode_rows else (True,)):
            _time_side_by_side(engines, rows, on, n, params, args)


def _time_side_by_side(engines: dict, rows: dict, on: bool, n: int, params: SamplingParams,
                       args: argparse.Namespace) -> None:
    """n requests in every engine; their steps alternate, so a slow spell of this noisy host
    lands on all of them alike."""
    import torch

    for label, eng in engines.items():
        eng.runner.rows = rows[label] if on else None
        for i, ids in enumerate(chat_prompts(eng.loaded, n)):
            eng.add_request(f"{n}-{i}", ids, params)
    for _ in range(args.warm):
        for eng in engines.values():
            eng.step()
    times: dict[str, list[float]] = {label: [] for label in engines}
    for _ in range(args.steps):
        for label, eng in engines.items():
            t = time.perf_counter()
            eng.step()
            times[label].append(time.perf_counter() - t)
    for label, eng in engines.items():
        while eng.has_unfinished():
            eng.step()
        ts = sorted(times[label])
        name = label + ("" if not args.compare_decode_rows else (" decode rows" if on else " gathering"))
        print(f"{n} requests{name}: step p50 {ts[len(ts) // 2] * 1e3:.1f} ms, min {ts[0] * 1e3:.1f} ms "
              f"({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
