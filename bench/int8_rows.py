"""The int8 kernel (csrc/int8_gemm.c) at many rows against torch._int_mm and against the
kernel of another commit, interleaved in one process: GFLOPS over SmolLM2's linears.

    python bench/int8_rows.py --against main --rows 1 32 128 512 --rounds 7
    python bench/int8_rows.py --against OLD.so --rows 1 32 --rounds 5

Each arm's library is int8_gemm.c (with amx_i8_gemm.c, int8_rows.c and int8_few.c where they
exist), built with native.py's flags (the "before" from `git show REF:...`). Against a whole
kernels library already built (a copy of native.py's cached .so from before a change), the
"after" arms are the work tree's whole library as the engine loads it. Shapes: SmolLM2-135M's
qkv, o, gate_up, down (Q4_1, 30 each) and the head (Q8_0, once), weighted by count as
`stopline bench floors` weights them; x's quantization is in each call. A round times every
arm once per shape (best of `--reps` calls), the arms' order reversed every other round; the
figure is the median over rounds, with the min-max spread. Every arm's output is checked
equal to the first's, bit for bit.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import gguf
import torch

from stopline.model.kernels import native
from stopline.model.kernels.int8_linear import Int8Weight

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "stopline/model/kernels/csrc"
SHAPES = [(576, 960, 30, "q4_1"), (576, 576, 30, "q4_1"), (576, 3072, 30, "q4_1"), (1536, 576, 30, "q4_1"),
          (576, 49152, 1, "q8_0")]


def build(sources: dict[str, str], out: Path) -> ctypes.CDLL:
    """One library of the given C sources and headers (name -> text), built with native.py's flags."""
    files = []
    inc = out.parent / f"{out.stem}-include"  # the arm's own headers, not the work tree's
    inc.mkdir(exist_ok=True)
    for name, text in sources.items():
        f = (inc / name) if name.endswith(".h") else out.parent / f"{out.stem}-{name}"
        f.write_text(text)
        if not name.endswith(".h"):
            files.append(str(f))
    subprocess.run([native._compiler(), *native._FLAGS, f"-I{inc}", *files, "-o", str(out), "-lm"], check=True)
    return typed(ctypes.CDLL(str(out)))


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.stopline_quantize_rows.argtypes = [p, i, i, p, p, p, p]
    for fmt in ("q4_1", "q8_0"):
        getattr(lib, f"stopline_{fmt}_i8_gemm").argtypes = [p, p, p, p, p, p, i, i, i]
    if hasattr(lib, "stopline_int8_prefetch"):  # the few-row panels' prefetch, as the engine sets it
        lib.stopline_int8_prefetch.argtypes = [i]
        lib.stopline_int8_prefetch(native.int8_prefetch())
    return lib


def sources(ref: str | None) -> dict[str, str]:
    """int8_gemm.c and, where they exist, amx_i8_gemm.c, int8_rows.c and int8_few.c (int8_gemm.c calls
    its panels where it exists), and every header, at a git ref (None: the work tree)."""
    out = {}
    if ref is None:
        headers = [f.name for f in CSRC.glob("*.h")]
    else:
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{ref}:stopline/model/kernels/csrc"],
                                capture_output=True, text=True, check=True).stdout.split()
        headers = [n for n in listed if n.endswith(".h")]
    for name in ("int8_gemm.c", "amx_i8_gemm.c", "int8_rows.c", "int8_few.c", *headers):
        if ref is None:
            f = CSRC / name
            if f.exists():
                out[name] = f.read_text()
            continue
        got = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:stopline/model/kernels/csrc/{name}"],
                             capture_output=True, text=True)
        if got.returncode == 0:
            out[name] = got.stdout
    return out


def amx_granted() -> bool:
    """The OS grants this process AMX tile state (the kernels library asks for it)."""
    from stopline.model.kernels.native import _cpu_flags, kernels
    return "amx_int8" in _cpu_flags() and kernels().stopline_amx_init() == 0


# (split, amx) of each arm of the work tree's library
PATHS = {"after panels": (0, 0), "after split": (1, 0), "after amx": (1, 1)}


def switches(lib: ctypes.CDLL) -> tuple[int, int] | None:
    """The before arm's paths: its defaults (split on, tiles off), set before each call as the
    after arms' are, where it has the switches, so every arm pays for the same ctypes calls
    (the two cost 0.5-0.9 us, against 8.5 us for a one-row 576x960 call)."""
    return (1, 0) if hasattr(lib, "stopline_i8_split") and hasattr(lib, "stopline_i8_amx") else None


def kernel_call(lib: ctypes.CDLL, w: Int8Weight, x: torch.Tensor, y: torch.Tensor,
                paths: tuple[int, int] | None = None):
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d, ds = torch.empty(m, k // 32), torch.empty(m, k // 32)
    s = torch.empty(m, k // 32, dtype=torch.int32)
    fn = getattr(lib, f"stopline_{w.fmt}_i8_gemm")
    args = (q.data_ptr(), d.data_ptr(), ds.data_ptr(), s.data_ptr(), w.packed.data_ptr(), y.data_ptr(), m, k,
            w.out_features)

    def call(keep=(q, d, ds, s, y, w)) -> None:  # keep: the buffers live as long as the call
        if paths is not None:
            lib.stopline_i8_split(paths[0])
            lib.stopline_i8_amx(paths[1])
        lib.stopline_quantize_rows(x.data_ptr(), m, k, *args[:4])
        fn(*args)
    return call


def best(fn, reps: int) -> float:
    fn()
    out = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", default="main",
                    help="the 'before' arm: a git ref whose int8 kernels are built, or a built .so")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128, 512])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="int8rows-"))
    if args.against.endswith(".so"):  # a copy, so dlopen never takes it for a library it already has
        shutil.copy(args.against, tmp / "before.so")
        arms = {"before": typed(ctypes.CDLL(str(tmp / "before.so")))}
    else:
        arms = {"before": build(sources(args.against), tmp / "before.so")}
    # against a whole library: the whole work-tree library, as the engine loads it, so that both
    # arms are linked alike
    after = typed(native.kernels()) if args.against.endswith(".so") else build(sources(None), tmp / "after.so")
    if hasattr(after, "stopline_i8_amx"):  # the same library, its paths switched around its calls
        arms["after panels"] = after
        arms["after split"] = after
        if amx_granted():
            arms["after amx"] = after
    else:
        arms["after"] = after
    gen = torch.Generator().manual_seed(0)
    weights = []
    for k, n, count, fmt in SHAPES:
        w = torch.randn(n, k, generator=gen)
        raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[fmt.upper()])
        weights.append((Int8Weight.from_raw(fmt, raw, k), count))
    print(f"threads {torch.get_num_threads()}, rounds {args.rounds}, against {args.against}", flush=True)
    for rows in args.rows:
        calls: dict[str, list] = {a: [] for a in arms}
        if not args.no_torch:
            calls["torch._int_mm"] = []
        flops = 0.0
        for w, count in weights:
            k, n = w.in_features, w.out_features
            x = torch.randn(rows, k, generator=gen)
            ys = {}
            for a, lib in arms.items():
                ys[a] = torch.empty(rows, n)
                calls[a].append((kernel_call(lib, w, x, ys[a], PATHS.get(a, switches(lib))), count))
            if not args.no_torch:
                xt = torch.randint(-127, 128, (rows, k), generator=gen, dtype=torch.int8)
                wt = torch.randint(-127, 128, (k, n), generator=gen, dtype=torch.int8)
                calls["torch._int_mm"].append((lambda xt=xt, wt=wt: torch._int_mm(xt, wt), count))
            for a in arms:
                calls[a][-1][0]()
            ref = ys["before"]
            for a in arms:
                if not torch.equal(ys[a].view(torch.int32), ref.view(torch.int32)):
                    raise SystemExit(f"{a} differs from before at {rows} rows, {k}x{n}")
            flops += 2.0 * rows * k * n * count
        rates: dict[str, list[float]] = {a: [] for a in calls}
        for r in range(args.rounds):  # every other round in reverse: no arm always goes first
            for a, todo in (calls.items() if r % 2 == 0 else reversed(calls.items())):
                secs = sum(best(fn, args.reps) * count for fn, count in todo)
                rates[a].append(flops / secs / 1e9)
        line = ", ".join(f"{a} {statistics.median(r):.0f} ({min(r):.0f}-{max(r):.0f})" for a, r in rates.items())
        print(f"{rows} rows GFLOPS: {line}", flush=True)


if __name__ == "__main__":
    main()
