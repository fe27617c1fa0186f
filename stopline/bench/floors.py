"""`stopline bench floors`: this host's floors, and the engine's decode step against them.

- read bandwidth: a streaming sum over a float32 buffer well above the L3 cache, on torch's
  threads (the engine's), best of N;
- GEMM rates: torch's fp32, bf16 and int8 (`torch._int_mm`) products at the 32-stream step's
  shapes (the model's linears, 32 rows), and stopline's kernels at the same shapes (exact's
  Q4_1, fast's bf16, and fast's int8 against Q4_1 blocks where the CPU has VNNI);
- decode step time at 1 and 32 streams for each numerics mode (engines take turns of
  --turn steps, each turn's first --settle steps untimed, so a slow spell of the host lands
  on all alike and each is timed with its own weights in cache), against the floor: max(bytes of weights
  and KV the step reads / bandwidth, FMAs of the step / GEMM rate of its arithmetic);
- the linears timed inside the step at the most streams, for each mode: the fused decoder's
  kernel calls (bf16 conversion of their inputs included) and the LM head's call, weights and
  caches as a real step leaves them, in GFLOPS over the linears' FMAs;
- prefill: tokens/s over one 512-token prompt for each mode (best of --prefill-reps);
- with --llama-bench (or STOPLINE_LLAMA_BENCH naming the binary): llama.cpp's llama-bench
  pp512 and tg128 on the same GGUF with the same thread count, in the same run, and each
  mode's one-stream decode (1000 / step p50) and prefill rates against them;
- with --accuracy: the fast mode's distance from exact (the fp32 oracle) under teacher
  forcing on a held-out text (stopline/bench/data/heldout.txt): per-token top-1 agreement and perplexity;
- with --served ENGINES: last, once the in-process engines are gone, each engine served alone
  through its OpenAI API (`stopline bench serve`'s throughput workload at --served-streams),
  and stopline's served one-stream rate against tg128 and its served rate at the most streams
  against the best peer's, all from this run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from stopline.bench import machine
from stopline.config import AttentionBackend
from stopline.kv.kv_cache import KVCache
from stopline.request import AbortSource

HELDOUT = Path(__file__).resolve().parent / "data" / "heldout.txt"  # ships in the package
# The engines --modes names: a numerics mode, or fast on an int8 KV cache.
MODES = {"exact": {"numerics": "exact"}, "fast": {"numerics": "fast"},
         "fast-int8": {"numerics": "fast", "kv_cache_dtype": "int8"}}


def bandwidth(mib: int, reps: int) -> float:
    """Bytes per second of a streaming read over `mib` MiB (best of reps)."""
    buf = torch.ones(mib * 2**20 // 4)
    buf.sum()  # faults the pages in
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best


def _best(fn, reps: int) -> float:
    fn()
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def linear_shapes(model) -> list[tuple[int, int, int]]:
    """(in, out, count) of the model's linears: each layer's, then the LM head."""
    first = model.layers[0]
    shapes = [(first[n].in_features, first[n].out_features, len(model.layers)) for n in ("qkv", "o", "gate_up", "down")]
    return shapes + [(model.lm_head.in_features, model.lm_head.out_features, 1)]


def gemm_rates(shapes: list[tuple[int, int, int]], rows: int, reps: int) -> dict[str, float]:
    """FLOP/s (2 per FMA) of each arithmetic over the step's linears, weighted by their count."""
    import gguf

    from stopline.model.kernels.bf16_linear import BF16Weight
    from stopline.model.kernels.int8_linear import Int8Weight, has_vnni
    from stopline.model.kernels.native import amx_ready, has_bf16, try_kernels
    from stopline.model.kernels.quant_linear import QuantWeight

    gen = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    own = try_kernels() is not None
    kinds = ["torch fp32", "torch bf16", "torch int8"] + (["q4_1 fp32 kernel"] if own else []) + \
        (["bf16 kernel"] if has_bf16() and own else []) + \
        (["bf16 avx512 kernel"] if has_bf16() and own and amx_ready() else []) + \
        (["int8 kernel"] if has_vnni() and own else [])
    for kind in kinds:
        flops = secs = 0.0
        for k, n, count in shapes:
            x = torch.randn(rows, k, generator=gen)
            w = torch.randn(n, k, generator=gen)
            if kind == "q4_1 fp32 kernel":  # the exact mode's own kernel, blocks of random weights
                raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1)
                qw = QuantWeight.from_raw("q4_1", raw, k)
                fn = lambda qw=qw, x=x, k=k: qw(x, k)  # noqa: E731
            elif kind == "int8 kernel":  # the fast mode's for block weights, quantizing x included
                raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1)
                iw = Int8Weight.from_raw("q4_1", raw, k)
                fn = lambda iw=iw, x=x: iw(x)  # noqa: E731
            elif kind in ("bf16 kernel", "bf16 avx512 kernel"):  # the fast mode's (AMX where it runs)
                bw = BF16Weight.from_float(w, amx=False if "avx512" in kind else None)
                fn = lambda bw=bw, x=x: bw(x)  # noqa: E731
            elif kind == "torch int8":  # oneDNN's s8 x s8 -> s32
                xt = torch.randint(-127, 128, (rows, k), generator=gen, dtype=torch.int8)
                wt = torch.randint(-127, 128, (k, n), generator=gen, dtype=torch.int8)
                fn = lambda xt=xt, wt=wt: torch._int_mm(xt, wt)  # noqa: E731
            else:
                dt = torch.float32 if kind == "torch fp32" else torch.bfloat16
                xt, wt = x.to(dt), w.t().contiguous().to(dt)
                fn = lambda xt=xt, wt=wt: xt @ wt  # noqa: E731
            secs += _best(fn, reps) * count
            flops += 2.0 * rows * k * n * count
        out[kind] = flops / secs
    return out


def _weight_bytes(model, rows: int) -> int:
    """Bytes of linear weights a step of `rows` rows reads (the path each linear takes)."""
    total = 0
    for lin in [model.lm_head, *(v for layer in model.layers for v in layer.values() if hasattr(v, "fast"))]:
        if lin.fast is not None:
            total += lin.fast.bytes_read(rows)
        elif lin.quant is not None and rows <= lin.quant_max_rows and lin.kc() is not None:
            total += lin.quant.packed.numel()
        else:
            total += lin.in_features * lin.out_features * 4
    return total


def arithmetic(model) -> str:
    """What a model's layers multiply in: "fp32" (exact), "bf16" or "int8" (fast)."""
    from stopline.model.kernels.int8_linear import Int8Weight

    fast = model.layers[0]["gate_up"].fast
    return "fp32" if fast is None else "int8" if isinstance(fast, Int8Weight) else "bf16"


def best_rate(rates: dict[str, float], kind: str) -> float:
    """The fastest rate measured for an arithmetic ("fp32", "bf16" or "int8")."""
    return max(v for k, v in rates.items() if kind in k)


def step_floor(engine, rows: int, mean_ctx: float, bw: float, rates: dict[str, float]) -> dict[str, float]:
    model, kv = engine.runner.model, engine.kv
    c = model.config
    per_token = KVCache.bytes_per_block(c.num_layers, 1, c.num_kv_heads, c.head_dim, kv.k[0].dtype)
    kv_bytes = rows * mean_ctx * per_token
    wbytes = _weight_bytes(model, rows)
    fmas = rows * sum(k * n * count for k, n, count in linear_shapes(model))
    fmas += rows * mean_ctx * c.num_layers * c.num_heads * c.head_dim * 2  # q.k and p.v
    rate = best_rate(rates, arithmetic(model))
    return {"weight_bytes": wbytes, "kv_bytes": kv_bytes, "bandwidth_floor_ms": (wbytes + kv_bytes) / bw * 1e3,
            "fma_floor_ms": 2 * fmas / rate * 1e3}


def step_times(engines: dict[str, object], n: int, warm: int, steps: int,
               turn: int = 10, settle: int = 2) -> dict[str, dict]:
    """p50 and min decode step of n streams in each engine. The engines take turns of `turn`
    timed steps, so a slow spell of the host lands on all alike; each turn starts with
    `settle` untimed steps, which bring that engine's weights back into the cache the other
    engines' turns filled (stepped one by one, every step read its weights from memory,
    which an engine serving alone does not)."""
    from stopline.bench.offline import chat_prompts
    from stopline.request import SamplingParams

    turns = -(-steps // turn)
    params = SamplingParams(temperature=0.0, max_tokens=warm + turns * (turn + settle) + 8, ignore_eos=True)
    plens = {}
    for label, eng in engines.items():
        ids = chat_prompts(eng.loaded, n)
        plens[label] = sum(map(len, ids)) / n
        for i, p in enumerate(ids):
            eng.add_request(f"floors-{n}-{i}", p, params)
    for _ in range(warm):
        for eng in engines.values():
            eng.step()
    times: dict[str, list[float]] = {label: [] for label in engines}
    for t in range(turns):
        for label, eng in engines.items():
            for _ in range(settle):
                eng.step()
            for _ in range(min(turn, steps - t * turn)):
                t0 = time.perf_counter()
                eng.step()
                times[label].append(time.perf_counter() - t0)
    for eng in engines.values():
        while eng.has_unfinished():
            eng.step()
    out = {}
    for label, ts in times.items():
        ts.sort()
        out[label] = {"p50_ms": ts[len(ts) // 2] * 1e3, "min_ms": ts[0] * 1e3,
                      "mean_ctx": plens[label] + warm + turns * (turn + settle) / 2}
    return out


class _Timed:
    """A callable whose calls add their seconds to `seconds[0]`; its other attributes are the
    callable's (the LM head, while its step is timed)."""

    def __init__(self, fn, seconds: list[float]) -> None:
        self._fn, self._seconds = fn, seconds

    def __getattr__(self, name: str):
        return getattr(self._fn, name)

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self._fn(*args, **kwargs)
        finally:
            self._seconds[0] += time.perf_counter() - t


def linears_in_step(engine, n: int, warm: int, steps: int) -> dict:
    """GFLOPS of an n-stream decode step's linears, timed inside `steps` real steps: the fused
    decoder's kernel calls (DecoderLoop.linear_s) plus the LM head's call, so the weights come
    from wherever the rest of the step left them. An error instead where the step's layers do
    not run in the fused decoder."""
    from stopline.bench.offline import chat_prompts
    from stopline.request import SamplingParams

    model = engine.runner.model
    decoder = model.decoder
    if decoder is None or not (model.c_glue and model.c_layers) or not decoder.can_run(n, None):
        return {"streams": n, "error": "this model's layers do not run in the fused C decoder"}
    params = SamplingParams(temperature=0.0, max_tokens=warm + steps + 1000, ignore_eos=True)
    for i, ids in enumerate(chat_prompts(engine.loaded, n)):
        engine.add_request(f"linears-{n}-{i}", ids, params)
    for _ in range(warm):
        engine.step()
    for _ in range(1000):  # every step timed below is n decode rows
        if not any(engine.kv_manager.prefilling(r) for r in engine.live_requests()):
            break
        engine.step()
    head, head_s = model.lm_head, [0.0]
    decoder.linear_s = torch.zeros(1, dtype=torch.float64)
    model.lm_head = _Timed(head, head_s)
    try:
        for _ in range(steps):
            engine.step()
        layers_s = float(decoder.linear_s[0])
    finally:
        model.lm_head, decoder.linear_s = head, None
    live = len(engine.live_requests())
    engine.abort([r.incarnation for r in engine.live_requests()], AbortSource.CANCEL, time.monotonic())
    while engine.has_unfinished():
        engine.step()
    if live != n:
        return {"streams": n, "error": f"{live} of {n} streams were still decoding after the timed steps"}
    if layers_s <= 0 or head_s[0] <= 0:
        return {"streams": n, "error": "the timed steps did not run the fused decoder and the head"}
    fmas = n * steps * sum(k * out * count for k, out, count in linear_shapes(model))
    return {"streams": n, "steps": steps, "arithmetic": arithmetic(model),
            "layers_ms": layers_s / steps * 1e3, "head_ms": head_s[0] / steps * 1e3,
            "gflops": 2 * fmas / (layers_s + head_s[0]) / 1e9}


def prefill_rate(engine, tokens: int, reps: int) -> float:
    """Tokens/s of one `tokens`-token prompt's prefill (to its first token), best of reps."""
    from stopline.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = engine.runner.model.config.vocab_size
    best = math.inf
    for r in range(reps + 1):  # the first is a warm-up
        ids = [(7919 * (i + 13 * r)) % (vocab - 300) + 256 for i in range(tokens)]
        engine.add_request(f"prefill-{r}", ids, params)
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        if r:
            best = min(best, time.perf_counter() - t)
    return tokens / best


def gguf_of(model: str | None) -> Path | None:
    """The GGUF file llama-bench can read for --model (None: the default model; a package that
    carries one: its file)."""
    from stopline.model.loaders.loader import default_model_path, package_model_path

    if model is None:
        return default_model_path()
    if not Path(model).exists():
        with contextlib.suppress(FileNotFoundError):
            return package_model_path(model, progress=False)
    return Path(model) if str(model).endswith(".gguf") and Path(model).is_file() else None


def peer_llama_bench(args: argparse.Namespace, threads: int, build: str = "llama.cpp") -> dict:
    """`build`'s llama-bench row, or the reason there is none."""
    from stopline.bench import llama_bench

    named = args.llama_bench not in (None, "auto") and build == "llama.cpp"
    binary = Path(args.llama_bench) if named else None
    gguf = gguf_of(args.model)
    if gguf is None:
        return {"error": f"llama-bench needs a GGUF model, not {args.model}"}
    try:
        return llama_bench.run(gguf, threads, reps=args.reps_llama_bench, binary=binary, build=build).row()
    except (FileNotFoundError, RuntimeError, ValueError, OSError) as e:
        return {"error": str(e)}


@torch.inference_mode()
def teacher_forced(engine, ids: list[int]) -> torch.Tensor:
    """Log-probabilities of every next token of `ids` ([len - 1]) and the argmax at each
    position, from one prefill written into blocks 0.. of the engine's (idle) KV cache."""
    from stopline.model.kernels.paged_attention import PagedRows
    from stopline.model.llama import StepInputs

    model, kv = engine.runner.model, engine.kv
    if model.attention is not AttentionBackend.NATIVE:
        raise RuntimeError("teacher forcing here needs the native paged attention")
    n, bs = len(ids), kv.block_size
    if (n + bs - 1) // bs > min(kv.group_blocks):  # every layer writes blocks 0 .. of its group
        raise ValueError(f"a text of {n} tokens does not fit the KV pool")
    tables = list(range((n + bs - 1) // bs))
    inp = StepInputs(token_ids=torch.tensor(ids), positions=torch.arange(n), write_slots=torch.arange(n),
                     prefills=[], decode=None, logit_rows=torch.arange(n - 1),
                     paged=PagedRows.build(list(range(1, n + 1)), [0] * n, tables))
    logits = model.forward(inp, kv).float()
    return torch.log_softmax(logits, dim=-1)


def accuracy(exact, fast, texts: list[str]) -> dict[str, float]:
    """Top-1 agreement of fast with exact at every position of every text (teacher forced),
    and each mode's perplexity of the texts."""
    agree = total = 0
    nll = {"exact": 0.0, "fast": 0.0}
    for text in texts:
        ids = exact.tokenizer.encode(text, add_special_tokens=False)[:500]
        if len(ids) < 2:
            continue
        target = torch.tensor(ids[1:])
        lp = {"exact": teacher_forced(exact, ids), "fast": teacher_forced(fast, ids)}
        agree += int((lp["exact"].argmax(-1) == lp["fast"].argmax(-1)).sum())
        total += len(target)
        for k, v in lp.items():
            nll[k] -= float(v.gather(1, target[:, None]).sum())
    ppl = {k: math.exp(v / total) for k, v in nll.items()}
    return {"tokens": total, "texts": len(texts), "top1_agreement": agree / total,
            "ppl_exact": ppl["exact"], "ppl_fast": ppl["fast"], "ppl_ratio": ppl["fast"] / ppl["exact"]}


def configure(p: argparse.ArgumentParser) -> None:
    from stopline.args import add_engine_args

    p.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    p.add_argument("--modes", nargs="+", default=["exact", "fast"], choices=list(MODES),
                   help="numerics modes whose step times are measured (one engine each); fast-int8: "
                        "fast on an int8 KV cache")
    p.add_argument("--buffer-mib", type=int, default=1024, help="bandwidth probe buffer (well above L3)")
    p.add_argument("--reps", type=int, default=10, help="best of this many for the probes")
    p.add_argument("--warm", type=int, default=20, help="decode steps before timing")
    p.add_argument("--steps", type=int, default=40, help="decode steps timed per engine")
    p.add_argument("--turn", type=int, default=10, help="timed steps an engine takes in a row")
    p.add_argument("--settle", type=int, default=2,
                   help="untimed steps that start each turn (its weights back in cache)")
    p.add_argument("--accuracy", action="store_true",
                   help="also measure fast against exact under teacher forcing on --texts")
    p.add_argument("--texts", default=str(HELDOUT), help="held-out paragraphs, separated by blank lines")
    p.add_argument("--prefill-tokens", type=int, default=512, help="prompt length of the prefill rate")
    p.add_argument("--prefill-reps", type=int, default=3, help="best of this many prefills")
    p.add_argument("--llama-bench", nargs="?", const="auto", default=None, metavar="PATH",
                   help="also run llama.cpp's llama-bench (pp512, tg128) on the same GGUF; PATH or "
                        "STOPLINE_LLAMA_BENCH names the binary (default: bench/peers' build)")
    p.add_argument("--reps-llama-bench", type=int, default=3, help="llama-bench's -r")
    p.add_argument("--served", default="", metavar="ENGINES",
                   help="also serve these engines one at a time, last (comma-separated: stopline, "
                        "stopline-fast, llamacpp, ikllamacpp, vllm, hf; peers set up by bench/peers/setup_*.sh)")
    p.add_argument("--served-streams", type=int, nargs="+", default=[1, 32],
                   help="concurrent streams of the served throughput levels")
    p.add_argument("--served-tokens", type=int, default=256, help="output tokens of each served request")
    p.add_argument("--served-prompt-tokens", type=int, default=128, help="prompt tokens of each served request")
    p.add_argument("--served-temperature", type=float, default=0.8,
                   help="sampling temperature of the served requests, each seeded (0: greedy, where "
                        "stopline's speculation pays on repetitive text and the peers' does not run)")
    p.add_argument("--out", default="bench-results/floors.json")
    add_engine_args(p)


def run(args: argparse.Namespace) -> dict:
    from dataclasses import replace

    from stopline.args import engine_config
    from stopline.engine.llm import LLM

    if args.turn < 1 or args.settle < 0 or args.steps < 1:
        raise SystemExit(f"--steps and --turn must be >= 1 and --settle >= 0, got "
                         f"{args.steps}, {args.turn}, {args.settle}")
    base = engine_config(args)
    # Speculation off: a timed step is one token per stream, as the floors and tg128 count.
    engines = {m: LLM(args.model, config=replace(base, **MODES[m], enable_prefix_caching=False,
                                                 speculative="off"),
                      progress=False).engine for m in args.modes}
    bw = bandwidth(args.buffer_mib, args.reps)
    first = next(iter(engines.values()))
    shapes = linear_shapes(first.runner.model)
    rates = gemm_rates(shapes, 32, args.reps)
    # The libraries' peak, at 512 rows: the floor takes the best rate either way.
    peak = {f"{k} @512": v for k, v in gemm_rates(shapes, 512, max(2, args.reps // 3)).items() if "q4_1" not in k}
    result: dict = {**machine.stamp(), "threads": torch.get_num_threads(), "read_bandwidth_gbs": bw / 1e9,
                    "gemm_gflops_32_rows": {k: v / 1e9 for k, v in rates.items()},
                    "gemm_gflops_512_rows": {k: v / 1e9 for k, v in peak.items()},
                    "numerics": {m: e.runner.model.numerics for m, e in engines.items()}, "steps": []}
    for n in args.streams:
        timed = step_times(engines, n, args.warm, args.steps, args.turn, args.settle)
        for mode, t in timed.items():
            floor = step_floor(engines[mode], n, t["mean_ctx"], bw, rates | peak)
            best = max(floor["bandwidth_floor_ms"], floor["fma_floor_ms"])
            result["steps"].append({"streams": n, "mode": mode, **t, **floor, "floor_ms": best,
                                    "x_floor": t["p50_ms"] / best})
    most = max(args.streams)
    result["linears_in_step"] = {m: linears_in_step(e, most, args.warm, args.steps) for m, e in engines.items()}
    if args.prefill_tokens > 0:
        result["prefill"] = [{"mode": m, "tokens": args.prefill_tokens,
                              "tok_s": prefill_rate(e, args.prefill_tokens, args.prefill_reps)}
                             for m, e in engines.items()]
    if args.llama_bench is not None or os.environ.get("STOPLINE_LLAMA_BENCH"):
        from stopline.bench.llama_bench import find_binary

        peer = result["llama_bench"] = peer_llama_bench(args, torch.get_num_threads())
        if "error" not in peer:
            result["vs_llama_bench"] = vs_peer(result, peer)
        if find_binary("ik_llama.cpp") is not None:  # built by bench/peers/setup_ikllamacpp.sh
            ik = result["ik_llama_bench"] = peer_llama_bench(args, torch.get_num_threads(), "ik_llama.cpp")
            if "error" not in ik:
                result["vs_ik_llama_bench"] = vs_peer(result, ik)
    if args.accuracy:
        if not {"exact", "fast"} <= set(engines):
            raise SystemExit("--accuracy needs --modes exact fast")
        texts = [t.strip() for t in Path(args.texts).read_text().split("\n\n") if t.strip()]
        result["accuracy"] = accuracy(engines["exact"], engines["fast"], texts)
        if "fast-int8" in engines:  # against the oracle, and against fast (the cache's own share)
            result["accuracy_int8"] = accuracy(engines["exact"], engines["fast-int8"], texts)
            result["accuracy_int8_vs_fast"] = accuracy(engines["fast"], engines["fast-int8"], texts)
    if args.served:
        engines.clear()  # the served engines get the machine to themselves
        gc.collect()
        result["served"] = served(args, [e for e in args.served.split(",") if e])
        result["served_ratios"] = served_ratios(result)
    return result


def served(args: argparse.Namespace, names: list[str]) -> dict:
    """Served output tok/s of each engine at each of --served-streams, one engine at a time
    (`stopline bench serve`'s throughput workload; its results file is kept beside --out)."""
    from dataclasses import replace

    from stopline.bench.serve import new_run_dir, run_bench
    from stopline.bench.serve_cli import ENGINES
    from stopline.bench.workloads.config import BenchConfig

    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        raise SystemExit(f"--served: unknown engine(s) {', '.join(unknown)}; known: {', '.join(ENGINES)}")
    cfg = replace(BenchConfig(), workloads=("throughput",), concurrencies=tuple(args.served_streams),
                  output_tokens=args.served_tokens, prompt_tokens=args.served_prompt_tokens, waves=1,
                  temperature=args.served_temperature)
    path = run_bench(names, cfg, new_run_dir(Path(args.out).parent / "floors-served"), model=args.model,
                     progress=False, command="stopline bench floors --served " + args.served
                     + f" --served-temperature {args.served_temperature}")
    out: dict = {"results": str(path), "tokens": args.served_tokens,
                 "temperature": args.served_temperature, "engines": {}}
    for name, e in json.loads(path.read_text())["engines"].items():
        levels = e.get("workloads", {}).get("throughput", {}).get("levels")
        if e.get("status") != "ok" or not levels:
            why = e.get("error") or e.get("workloads", {}).get("throughput", {}).get("error") or e.get("status")
            out["engines"][name] = {"error": str(why).splitlines()[0] if why else "no result"}
            continue
        out["engines"][name] = {"tok_s": {str(lv["concurrency"]): lv["output_tok_s"] for lv in levels},
                                "itl_p50_ms": {str(lv["concurrency"]): _ms_of(lv["itl"].get("p50"))
                                               for lv in levels},
                                "errors": sum(lv["requests"] - lv["ok"] for lv in levels)}
    return out


def served_ratios(r: dict) -> list[dict]:
    """Each served stopline engine's one-stream rate over tg128 (when llama-bench ran) and over
    the best peer's served stream, and its rate at the most streams over the best peer's there."""
    engines = {n: e["tok_s"] for n, e in r["served"]["engines"].items() if "tok_s" in e}
    peers = {n: t for n, t in engines.items() if not n.startswith("stopline")}
    # the best raw decode any peer's llama-bench reached in this run
    tg128 = max((r.get(k, {}).get("tg128_tok_s") or 0 for k in ("llama_bench", "ik_llama_bench")), default=0)
    out = []
    for name, tok_s in engines.items():
        if not name.startswith("stopline"):
            continue
        row: dict = {"engine": name}
        if tok_s.get("1"):
            row["one_stream_tok_s"] = tok_s["1"]
            if tg128:
                row["one_stream_x_tg128"] = tok_s["1"] / tg128
            one = max(((n, t["1"]) for n, t in peers.items() if t.get("1")), key=lambda p: p[1], default=None)
            if one:
                row.update(one_stream_best_peer=one[0], one_stream_x_best_peer=tok_s["1"] / one[1])
        most = max(tok_s, key=int)
        best = max(((n, t[most]) for n, t in peers.items() if t.get(most)), key=lambda p: p[1], default=None)
        if best and tok_s[most]:
            row.update(streams=int(most), tok_s=tok_s[most], best_peer=best[0], x_best_peer=tok_s[most] / best[1])
        out.append(row)
    return out


def vs_peer(r: dict, peer: dict) -> list[dict]:
    """Each mode's one-stream decode (1000 / step p50) and prefill rates over llama-bench's."""
    out = []
    for mode in r["numerics"]:
        one = [s for s in r["steps"] if s["mode"] == mode and s["streams"] == 1]
        pre = [p for p in r.get("prefill", []) if p["mode"] == mode]
        row: dict = {"mode": mode}
        if one:
            row["decode_tok_s"] = 1e3 / one[0]["p50_ms"]
            row["decode_x_tg128"] = row["decode_tok_s"] / peer["tg128_tok_s"]
        if pre:
            row["prefill_tok_s"] = pre[0]["tok_s"]
            row["prefill_x_pp512"] = pre[0]["tok_s"] / peer["pp512_tok_s"]
        out.append(row)
    return out


def summary(r: dict) -> str:
    g = r["gemm_gflops_32_rows"] | r["gemm_gflops_512_rows"]
    lines = [f"read bandwidth {r['read_bandwidth_gbs']:.1f} GB/s ({r['threads']} threads); GEMM at 32 rows "
             f"(@512: at 512): " + ", ".join(f"{k} {v:.0f}" for k, v in g.items()) + " GFLOPS",
             f"{'streams':>7} {'mode':>9} {'p50 ms':>8} {'min ms':>8} {'MiB read':>9} {'bw floor':>9} "
             f"{'fma floor':>9} {'x floor':>7}"]
    for s in r["steps"]:
        lines.append(f"{s['streams']:>7} {s['mode']:>9} {s['p50_ms']:>8.2f} {s['min_ms']:>8.2f} "
                     f"{(s['weight_bytes'] + s['kv_bytes']) / 2**20:>9.1f} {s['bandwidth_floor_ms']:>9.2f} "
                     f"{s['fma_floor_ms']:>9.2f} {s['x_floor']:>7.2f}")
    for kind in ("bf16", "int8"):
        own = r["gemm_gflops_32_rows"].get(f"{kind} kernel")
        if own:
            best = best_rate(g, kind)
            lines.append(f"the {kind} kernel alone, each shape from cache through its Python wrapper, at 32 rows: "
                         f"{own:.0f} GFLOPS = {own / best * 100:.0f}% of the best {kind} rate measured ({best:.0f})")
    for mode, li in r.get("linears_in_step", {}).items():
        if "error" in li:
            lines.append(f"{mode} linears inside the {li['streams']}-stream step: not timed ({li['error']})")
            continue
        kind = li["arithmetic"]
        best = best_rate(g, kind)
        lines.append(f"{mode} linears inside the {li['streams']}-stream step: {li['gflops']:.0f} GFLOPS (layers "
                     f"{li['layers_ms']:.2f} ms + head {li['head_ms']:.2f} ms a step) = {li['gflops'] / best * 100:.0f}% "
                     f"of the best {kind} rate measured ({best:.0f})")
    modes = {s["mode"] for s in r["steps"]}
    if {"exact", "fast"} <= modes:
        for n in sorted({s["streams"] for s in r["steps"]}):
            t = {s["mode"]: s["p50_ms"] for s in r["steps"] if s["streams"] == n}
            lines.append(f"{n} streams: fast / exact step time {t['fast'] / t['exact']:.2f}"
                         + (f", fast-int8 / fast {t['fast-int8'] / t['fast']:.2f}" if "fast-int8" in t else ""))
    for p in r.get("prefill", []):
        lines.append(f"prefill {p['mode']}: {p['tok_s']:.0f} tok/s over a {p['tokens']}-token prompt")
    for key, build in (("llama_bench", "llama.cpp"), ("ik_llama_bench", "ik_llama.cpp")):
        if key not in r:
            continue
        peer = r[key]
        if "error" in peer:
            lines.append(f"{build} llama-bench: not run ({peer['error']})")
        else:
            lines.append(f"{build} llama-bench ({peer['threads']} threads, build {peer['build']}): "
                         f"pp512 {peer['pp512_tok_s']:.1f} tok/s, tg128 {peer['tg128_tok_s']:.1f} tok/s")
            for v in r.get(f"vs_{key}", []):
                parts = []
                if "decode_tok_s" in v:
                    parts.append(f"1-stream decode {v['decode_tok_s']:.0f} tok/s = {v['decode_x_tg128']:.2f}x tg128")
                if "prefill_tok_s" in v:
                    parts.append(f"prefill {v['prefill_tok_s']:.0f} tok/s = {v['prefill_x_pp512']:.2f}x pp512")
                lines.append(f"  {v['mode']}: " + ", ".join(parts))
    for key, label, base in (("accuracy", "fast", "exact"), ("accuracy_int8", "fast-int8", "exact"),
                             ("accuracy_int8_vs_fast", "fast-int8", "fast")):
        if key not in r:
            continue
        a = r[key]
        lines.append(f"{label} vs {base}, teacher forced over {a['tokens']} tokens of {a['texts']} texts: "
                     f"top-1 agreement {a['top1_agreement'] * 100:.2f}%, perplexity {a['ppl_fast']:.3f} "
                     f"vs {a['ppl_exact']:.3f} (ratio {a['ppl_ratio']:.4f})")
    if "served" in r:
        sv = r["served"]
        how = f"temperature {sv['temperature']}, seeded" if sv.get("temperature") else "greedy"
        lines.append(f"served ({sv['tokens']} output tokens a request, {how}; {sv['results']}):")
        for name, e in sv["engines"].items():
            lines.append(f"  {name}: " + (f"not run ({e['error']})" if "error" in e else ", ".join(
                f"{n} streams {t:.0f} tok/s (ITL p50 {_ms(e.get('itl_p50_ms', {}).get(n))})"
                for n, t in e["tok_s"].items())))
        for v in r.get("served_ratios", []):
            parts = []
            if "one_stream_x_tg128" in v:
                parts.append(f"1 stream {v['one_stream_x_tg128']:.2f}x tg128")
            if "one_stream_x_best_peer" in v:
                parts.append(f"1 stream {v['one_stream_x_best_peer']:.2f}x {v['one_stream_best_peer']}")
            if "x_best_peer" in v:
                parts.append(f"{v['streams']} streams {v['x_best_peer']:.2f}x {v['best_peer']}")
            lines.append(f"  {v['engine']}: " + (", ".join(parts) or "no peer or tg128 to compare with"))
    return "\n".join(lines)


def _ms_of(seconds: float | None) -> float | None:
    """Milliseconds, None kept: a level with no gap between chunks has no ITL to report."""
    return None if seconds is None else seconds * 1e3


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f} ms"


def write(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def main(args: argparse.Namespace) -> int:
    if args.served:
        import signal

        # SIGTERM unwinds like Ctrl-C, so an engine --served started is stopped on the way out.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(args)
    result["command"] = "stopline bench floors " + " ".join(sys.argv[3:])
    write(result, Path(args.out))
    print(summary(result))
    print(f"results: {args.out}")
    return 0
