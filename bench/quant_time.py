"""Time the quantized GEMM kernel alone on SmolLM2's shapes, weights streamed from memory.

    python bench/quant_time.py                              # 1..64 rows
    python bench/quant_time.py --rows 8 11 31 --layers 30
    python bench/quant_time.py --against /tmp/old/stopline_kernels-XXXX.so   # A/B two builds
    python bench/quant_time.py --library --rows 64 128 256 512   # the kernel against float32
    python bench/quant_time.py --amx --rows 1 8 32 --against OTHER.so   # the fast mode's AMX kernels

One "step" is what a decode step's linears do: 30 layers of Q4_1 weights (q|k|v, o, gate|up,
down, each with the block order kc the engine probes for SmolLM2 under MKL/oneDNN) and the
Q8_0 LM head, every weight distinct, so (96 MB in all, against a 32 MB L3) each is read from
memory as in the engine. A microbenchmark that calls one weight over and over times it from
cache and hides what a step of few rows is bound by. Weights are random GGML blocks.
`--against` loads another build of the kernels (check out an older commit in a worktree,
import stopline there once, take the .so from `~/.cache/stopline/native/`), checks that both
give the same bits and times them alternately, so a slow spell of this host lands on both.
`--library` times the float32 GEMM library path the engine takes past `quant_max_rows` (the
same weights dequantized, tiled as `InvariantLinear` tiles them) against the kernel, each
weight summed in the block order the engine probes for it, so the bits must match too.
`--amx` times the fast mode's AMX block kernels instead (bf16 rows, the same blocks in their
layout); only with `--against`, or alone.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np
import torch

from stopline.model.batch_invariant import InvariantLinear
from stopline.model.kernels import native
from stopline.model.kernels.bf16_linear import pack_q4_1, pack_q8_0
from stopline.model.kernels.quant_linear import BLOCK_BYTES, QuantWeight

# name: (out_features, in_features, kc) for SmolLM2-135M
LAYER_SHAPES = {"qkv": (960, 576, 288), "o": (576, 576, 288), "gate_up": (3072, 576, 512),
                "down": (576, 1536, 1536)}
HEAD_SHAPE = (49152, 576, 288)
ENTRIES = ("stopline_q4_1_gemm", "stopline_q8_0_gemm")
AMX_ENTRIES = ("stopline_amx_q4_1_gemm", "stopline_amx_q8_0_gemm")


def random_blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """GGML blocks with random quants and small positive scales (Q4_1: negative minimums)."""
    groups = k // 32
    b = rng.integers(0, 256, size=(n, groups, BLOCK_BYTES[fmt]), dtype=np.uint8)
    b[..., 0:2] = (rng.random((n, groups)) * 0.01 + 0.001).astype(np.float16).view(np.uint8).reshape(n, groups, 2)
    if fmt == "q4_1":
        b[..., 2:4] = (-rng.random((n, groups)) * 0.05).astype(np.float16).view(np.uint8).reshape(n, groups, 2)
    return b.reshape(n, -1)


def load_other(path: str, this: ctypes.CDLL, amx: bool) -> ctypes.CDLL:
    other = ctypes.CDLL(path)
    for name in AMX_ENTRIES if amx else ENTRIES:
        getattr(other, name).argtypes = getattr(this, name).argtypes
        getattr(other, name).restype = getattr(this, name).restype
    return other


def step(lib: ctypes.CDLL, weights: list, xs: dict[int, torch.Tensor], out: list[torch.Tensor]) -> None:
    """Every weight once, in order, as a decode step's linears run."""
    for (_, n, k, kc, w), y in zip(weights, out, strict=True):
        fn = lib.stopline_q4_1_gemm if w.fmt == "q4_1" else lib.stopline_q8_0_gemm
        fn(xs[k].data_ptr(), w.packed.data_ptr(), y.data_ptr(), y.shape[0], k, n, kc)


def amx_step(lib: ctypes.CDLL, weights: list, xs: dict[int, torch.Tensor], out: list[torch.Tensor]) -> None:
    """The same linears through the AMX block kernels (x as bf16)."""
    for (_, n, k, _, (fmt, packed)), y in zip(weights, out, strict=True):
        fn = lib.stopline_amx_q4_1_gemm if fmt == "q4_1" else lib.stopline_amx_q8_0_gemm
        fn(xs[k].data_ptr(), packed.data_ptr(), y.data_ptr(), y.shape[0], k, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 9, 11, 12, 16, 24, 31, 48, 64])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=12, help="timed steps per build (median shown)")
    ap.add_argument("--against", metavar="LIB", help="another build of the kernels to compare with")
    ap.add_argument("--library", action="store_true", help="compare with the float32 GEMM library path")
    ap.add_argument("--amx", action="store_true", help="time the fast mode's AMX block kernels")
    args = ap.parse_args()
    if args.library and (args.against or args.amx):
        ap.error("--library compares the exact kernel with the library: not with --against or --amx")
    if args.amx and not native.amx_ready():
        raise SystemExit("--amx: this CPU or OS gives no AMX tiles")
    this = native.kernels()
    rng = np.random.default_rng(0)
    raws = [(name, *shape, "q4_1", random_blocks("q4_1", shape[0], shape[1], rng))
            for _ in range(args.layers) for name, shape in LAYER_SHAPES.items()]
    raws.append(("head", *HEAD_SHAPE, "q8_0", random_blocks("q8_0", *HEAD_SHAPE[:2], rng)))
    if args.amx:
        amx_pack = {"q4_1": pack_q4_1, "q8_0": pack_q8_0}
        weights = [(name, n, k, kc, (fmt, amx_pack[fmt](raw, k))) for name, n, k, kc, fmt, raw in raws]
        run = amx_step
    else:
        weights = [(name, n, k, kc, QuantWeight.from_raw(fmt, raw, k)) for name, n, k, kc, fmt, raw in raws]
        run = step
    sides = {"this build": lambda xs, out: run(this, weights, xs, out)}
    if args.against:
        other = load_other(args.against, this, args.amx)
        sides["other"] = lambda xs, out: run(other, weights, xs, out)
    if args.library:
        lins, weights = library_linears(weights, max(args.rows))
        sides["library"] = lambda xs, out: library_step(lins, xs, out)
    mb = sum(raw.nbytes for *_, raw in raws) / 1e6
    print(f"{args.layers} layers + LM head, {mb:.0f} MB "
          f"of blocks, {torch.get_num_threads()} threads")
    for m in args.rows:
        xs = {k: torch.randn(m, k) for k in {w[2] for w in weights}}
        if args.amx:
            xs = {k: x.to(torch.bfloat16) for k, x in xs.items()}
        outs = {label: [torch.empty(m, n) for _, n, _, _, _ in weights] for label in sides}
        times: dict[str, list[float]] = {label: [] for label in sides}
        for i in range(args.rounds + 2):
            order = list(sides) if i % 2 else list(sides)[::-1]
            for label in order:
                t = time.perf_counter()
                sides[label](xs, outs[label])
                if i >= 2:  # the first two rounds warm up
                    times[label].append(time.perf_counter() - t)
        p50 = {label: sorted(ts)[len(ts) // 2] for label, ts in times.items()}
        line = f"{m:3d} rows: this build {p50['this build'] * 1e3:6.2f} ms ({p50['this build'] * 1e3 / m:.3f} a row)"
        if len(sides) > 1:
            label = list(sides)[1]
            same = all(torch.equal(a, b) for a, b in zip(*outs.values(), strict=True))
            line += (f", {label} {p50[label] * 1e3:6.2f} ms; ratio {p50['this build'] / p50[label]:.3f}, "
                     f"{'same bits' if same else 'DIFFERENT BITS'}")
        print(line)


def library_linears(weights: list, max_rows: int) -> tuple[list[InvariantLinear], list]:
    """Each weight as the engine's InvariantLinear over its dequantized float32 values, and the
    weights again with the block order each one probed (the engine's kc on this host)."""
    lins, probed = [], []
    for name, n, k, _, w in weights:
        lin = InvariantLinear(w(torch.eye(k), kc=k).t().contiguous(), max_rows=max_rows, quant=w,
                              quant_max_rows=max_rows)
        found = lin.kc()
        if found is None:
            raise SystemExit(f"the kernel matches no block order of the library for {name} ({n} x {k})")
        lins.append(lin)
        probed.append((name, n, k, found, w))
    return lins, probed


def library_step(lins: list[InvariantLinear], xs: dict[int, torch.Tensor], out: list[torch.Tensor]) -> None:
    for lin, y in zip(lins, out, strict=True):
        y.copy_(lin._library(xs[lin.in_features]))


if __name__ == "__main__":
    main()
