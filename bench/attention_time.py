"""Time the C paged attention alone: one layer's call for N decode rows over K keys each.

    python bench/attention_time.py                       # SmolLM2's shape, 64 rows, 32..1000 keys
    python bench/attention_time.py --rows 11 --keys 100 300
    python bench/attention_time.py --against /tmp/old/stopline_kernels-XXXX.so   # A/B two builds
    python bench/attention_time.py --int8 --rows 1 32 --keys 256 2048   # a float32 cache against int8
    python bench/attention_time.py --int8 --prefill --keys 2048   # a 2,048-token prompt's rows, causal

Prints the best of several timings and the K/V bytes read per second: a decode row reads
every key and value of its sequence once, so past a few hundred keys a step's attention is
bound by memory (about 20 GB/s here), not by arithmetic. `--against` loads another build of
the kernels (e.g. one made from an older commit: check it out in a worktree, import stopline
there once, and take the .so from `~/.cache/stopline/native/`), checks that both give the
same bits and times them alternately. `--int8` times this build over an int8 cache (the rows
quantized, kv_cache.quantize_rows) against it over a float32 cache holding the same values
dequantized, alternately, and checks the two give the same bits (docs/numerics.md).
`--prefill`: one prompt of K tokens instead, row i reading keys 0 .. i (--rows unused).
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from stopline.kv.kv_cache import dequantize, quantize_rows
from stopline.model.kernels import native
from stopline.model.kernels.paged_attention import PagedRows


def call(lib: ctypes.CDLL, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, rows: PagedRows,
         bs: int, scale: float) -> torch.Tensor:
    n, heads, d = q.shape
    out = torch.empty(n, heads * d)
    rc = lib.stopline_paged_attention(q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(), out.data_ptr(), n,
                                      heads, kc.shape[0], d, kc.shape[1], bs, rows.nkeys.data_ptr(),
                                      rows.table_at.data_ptr(), rows.tables.data_ptr(), rows.max_keys, scale)
    if rc != 0:
        raise MemoryError("paged attention could not allocate its scratch memory")
    return out


def call_q8(lib: ctypes.CDLL, q: torch.Tensor, kc: tuple[torch.Tensor, torch.Tensor],
            vc: tuple[torch.Tensor, torch.Tensor], rows: PagedRows, bs: int, scale: float) -> torch.Tensor:
    """The int8 cache's call: kc, vc as (quants, scales)."""
    n, heads, d = q.shape
    out = torch.empty(n, heads * d)
    (kq, ks), (vq, vs) = kc, vc
    rc = lib.stopline_paged_attention_q8(q.data_ptr(), q.stride(0), kq.data_ptr(), vq.data_ptr(), ks.data_ptr(),
                                         vs.data_ptr(), out.data_ptr(), n, heads, kq.shape[0], d, kq.shape[1], bs,
                                         rows.nkeys.data_ptr(), rows.table_at.data_ptr(), rows.tables.data_ptr(),
                                         rows.max_keys, scale, 0)
    if rc != 0:
        raise MemoryError("paged attention could not allocate its scratch memory")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64])
    ap.add_argument("--keys", type=int, nargs="+", default=[32, 128, 250, 1000])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--against", metavar="LIB", help="another build of the kernels to compare with")
    ap.add_argument("--int8", action="store_true", help="a float32 cache against an int8 one, this build")
    ap.add_argument("--prefill", action="store_true", help="one prompt's causal rows over K keys instead")
    args = ap.parse_args()
    if args.prefill:
        args.rows = [1]
    if args.int8 and args.against:
        raise SystemExit("--int8 compares two caches on this build; --against, two builds")
    for r in args.rows:
        run(args, r)


def run(args: argparse.Namespace, nrows: int) -> None:
    libs = {"this build": native.kernels()}
    if args.against:
        other = ctypes.CDLL(args.against)
        other.stopline_paged_attention.argtypes = libs["this build"].stopline_paged_attention.argtypes
        other.stopline_paged_attention.restype = libs["this build"].stopline_paged_attention.restype
        libs[args.against] = other
    bs, d = args.block_size, args.head_dim
    per_row = -(-max(args.keys) // bs)
    blocks = per_row * nrows
    gen = torch.Generator().manual_seed(0)
    kc = torch.randn(args.kv_heads, blocks * bs, d, generator=gen)
    vc = torch.randn(args.kv_heads, blocks * bs, d, generator=gen)
    tables = torch.randperm(blocks, generator=gen).tolist()  # scattered, as a pool's blocks are
    q = torch.randn(nrows, args.heads, d, generator=gen)
    caches = {name: (kc, vc, call) for name in libs}
    if args.int8:
        (kq, ks), (vq, vs) = quantize_rows(kc), quantize_rows(vc)
        kc, vc = dequantize(kq, ks), dequantize(vq, vs)  # the float32 cache holds the same values
        lib = libs["this build"]
        libs = {"float32 cache": lib, "int8 cache": lib}
        caches = {"float32 cache": (kc, vc, call), "int8 cache": ((kq, ks), (vq, vs), call_q8)}
    scale = d ** -0.5
    print(f"{nrows} rows, {args.heads} heads over {args.kv_heads} KV heads, head_dim {d}, "
          f"block size {bs}, {torch.get_num_threads()} threads")
    for n in args.keys:
        if args.prefill:  # row i at position i
            rows = PagedRows.build(list(range(1, n + 1)), [0] * n, tables)
            q = torch.randn(n, args.heads, d, generator=gen)
            reads = n * (n + 1) // 2
        else:
            rows = PagedRows.build([n] * nrows, [i * per_row for i in range(nrows)], tables)
            reads = nrows * n
        outs = {name: caches[name][2](lib, q, *caches[name][:2], rows, bs, scale) for name, lib in libs.items()}
        first = next(iter(outs.values()))
        same = all(torch.equal(first, o) for o in outs.values())
        best = dict.fromkeys(libs, float("inf"))
        for _ in range(args.rounds):
            for name, lib in libs.items():
                t = time.perf_counter()
                k_, v_, fn = caches[name]
                for _ in range(10):
                    fn(lib, q, k_, v_, rows, bs, scale)
                best[name] = min(best[name], (time.perf_counter() - t) / 10)
        per_value = {"int8 cache": 1 + 4 / d}  # a quant, and a row's scale over its d values
        gb = {name: 2 * reads * args.kv_heads * d * per_value.get(name, 4) / 1e9 for name in libs}
        line = ", ".join(f"{name} {t * 1e3:.3f} ms ({gb[name] / t:.1f} GB/s)" for name, t in best.items())
        extra = ""
        if len(libs) > 1:
            a, b = best.values()
            extra = f"; ratio {a / b:.3f}, {'same bits' if same else 'DIFFERENT BITS'}"
        print(f"{n} keys{' (a prompt, causal)' if args.prefill else ''}: {line}{extra}")


if __name__ == "__main__":
    main()
